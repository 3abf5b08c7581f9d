"""``pip install exactspec`` without extras: the library generates with none of the tools'
dependencies, the command line starts without PyTorch, and a tool whose extra is missing
says which extra to install (docs/design.md, "Extras")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import exactspec
from exactspec.cli import COMMANDS, build_parser, main
from exactspec.extras import EXTRAS

TESTS = Path(__file__).resolve().parent
SOURCE = Path(exactspec.__file__).resolve().parents[1]
"""Where this exactspec was imported from: the subprocesses import the same."""
TOOLS = ("fastapi", "uvicorn", "openai", "scipy", "matplotlib", "prometheus_client",
         "starlette", "pydantic")
"""The tools' dependencies (and theirs: FastAPI's starlette and pydantic), blocked below."""

BLOCKER = textwrap.dedent("""
    import sys

    BLOCKED = set(sys.argv[1].split(","))
    for name in BLOCKED:  # import fails, importlib.util.find_spec says None: not installed
        sys.modules[name] = None
    sys.argv[1:2] = []
""")


def run_python(code: str, blocked: tuple[str, ...] = TOOLS) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where importing any of ``blocked`` fails, as if they
    were not installed (tests/ on the path for the tiny models)."""
    path = os.pathsep.join(filter(None, [str(SOURCE), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code),
                           ",".join(blocked)], capture_output=True, text=True, timeout=300,
                          cwd=TESTS, env={**os.environ, "PYTHONPATH": path})


def test_the_blocker_blocks():
    """The control: a blocked module cannot be imported."""
    run = run_python("import scipy")
    assert run.returncode == 1 and "ModuleNotFoundError: import of scipy halted" in run.stderr


def test_the_library_generates_without_the_tools_dependencies():
    run = run_python("""
        import sys

        from conftest import tiny_backend
        import exactspec
        from exactspec import (PromptLookupProposer, SamplingParams, SpeculativeGenerator,
                               SuffixProposer, BatchedGenerator)

        target = tiny_backend(0)
        generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3, "constant")
        result = generator.generate("abcabcabc", SamplingParams(max_new_tokens=12))
        assert len(result.token_ids) == 12, result
        sampled = SpeculativeGenerator(target, SuffixProposer(), 3, "auto").generate(
            "abcabc", SamplingParams(temperature=0.8, seed=1, max_new_tokens=8))
        assert len(sampled.token_ids) == 8
        assert result.stats.cycles > 0 and result.stats.drafted_tokens > 0
        loaded = sorted({name.partition(".")[0] for name, module in sys.modules.items()
                         if module is not None} & BLOCKED)
        assert not loaded, loaded
        print("generated", repr(result.text), exactspec.__file__)
    """)
    assert run.returncode == 0, run.stderr
    assert "generated" in run.stdout and str(SOURCE) in run.stdout


def test_help_loads_neither_torch_nor_a_command():
    """``exactspec --help`` and ``exactspec generate --help`` import no PyTorch (they start
    in well under a second; docs/design.md, "Extras")."""
    for argv in (["--help"], ["generate", "--help"], ["bench", "--help"],
                 ["train-draft", "--help"]):
        run = run_python(f"""
            import sys

            import exactspec
            from exactspec.cli import main

            assert exactspec.__file__ == {exactspec.__file__!r}
            try:
                main({argv!r})
            except SystemExit as exit_:
                assert exit_.code == 0
            heavy = sorted({{"torch", "transformers", "exactspec.generator"}} & set(sys.modules))
            assert not heavy, heavy
        """)
        assert run.returncode == 0, (argv, run.stderr)
        assert "usage: exactspec" in run.stdout


@pytest.mark.parametrize("command", ["serve", "audit", "bench", "train-draft", "generate"])
def test_every_command_builds_its_parser_with_the_tools_dependencies_available(command):
    """Each command's --help in this (full) environment: the lazy dispatch finds every
    command module and its parser."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0


@pytest.mark.parametrize("command", ["serve", "audit"])
def test_help_needs_no_extra(command):
    run = run_python(f"""
        import sys
        from exactspec.cli import main
        try:
            main(["{command}", "--help"])
        except SystemExit as exit_:
            assert exit_.code == 0
        assert "torch" not in sys.modules
    """)
    assert run.returncode == 0, run.stderr
    assert f"usage: exactspec {command}" in run.stdout


def test_a_tool_without_its_extra_names_it():
    run = run_python("""
        from exactspec.cli import main
        assert main(["serve", "--model", "nothing-here"]) == 1
    """)
    assert run.returncode == 0, run.stderr
    assert "exactspec serve needs fastapi: pip install 'exactspec[server]'" in run.stderr
    run = run_python("""
        from exactspec.cli import main
        assert main(["bench", "--quick"]) == 1
    """)
    assert run.returncode == 0, run.stderr
    assert "exactspec bench needs matplotlib: pip install 'exactspec[bench]'" in run.stderr
    run = run_python("import exactspec.server")
    assert "exactspec.server needs fastapi: pip install 'exactspec[server]'" in run.stderr
    run = run_python("""
        from exactspec.cli import main
        assert main(["audit", "--quick"]) == 1
    """)
    assert run.returncode == 0, run.stderr
    assert "exactspec audit needs scipy: pip install 'exactspec[audit]'" in run.stderr
    run = run_python("""
        import sys
        from exactspec.cli import main
        assert main(["generate", "hello", "--trace", "out.html"]) == 1
        assert "torch" not in sys.modules  # refused before loading anything
    """)
    assert run.returncode == 0, run.stderr
    assert ("exactspec generate --trace needs matplotlib: pip install 'exactspec[plots]'"
            in run.stderr)


def test_the_command_table_matches_each_command():
    """``exactspec --help`` lists the commands from :data:`COMMANDS` without importing
    them: each one-line help there is the command's own."""
    full = build_parser()
    commands = next(a for a in full._actions if a.dest == "command")
    assert {c.dest: c.help for c in commands._choices_actions} == {
        name: help for name, (_, help) in COMMANDS.items()}


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_every_extra_is_in_pyproject(extra):
    import tomllib

    project = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]
    assert not {"fastapi", "uvicorn", "openai", "scipy", "matplotlib", "prometheus-client"} & {
        requirement.split(">")[0].split("=")[0] for requirement in project["dependencies"]}
    listed = {r.split(">")[0].split("=")[0] for r in project["optional-dependencies"][extra]}
    assert {module.replace("_", "-") for module in EXTRAS[extra]} == listed


def test_unknown_command_still_fails_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nonsense"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err

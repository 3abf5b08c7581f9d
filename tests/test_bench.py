"""The benchmark on a tiny model: records, summary figures, identity failures flagged,
report and plots written."""

import importlib.util
import json

import pytest

from exactspec import SamplingParams
from exactspec.bench import GROUPS, load_questions, parse_method, run_bench, write_report
from exactspec.bench.methods import Method, Outcome

from conftest import tiny_backend

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["abc abc abd abc"]},
    {"question_id": 2, "category": "coding", "turns": ["def def deg def"]},
    {"question_id": 3, "category": "summarization", "turns": ["the cat sat, the cat sat."]},
    {"question_id": 4, "category": "rag", "turns": ["one two one two one"]},
]


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    return path


def test_load_questions_groups_and_errors(questions_file, tmp_path):
    questions = load_questions(questions_file)
    assert [q.group for q in questions] == ["multi-turn conversation"] * 2 + ["summarization", "rag"]
    assert len(load_questions(questions_file, ["multi-turn conversation"], 1)) == 1
    with pytest.raises(ValueError, match="unknown categories"):
        load_questions(questions_file, ["poetry"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    with pytest.raises(ValueError, match="not a Spec-Bench question"):
        load_questions(bad)
    with pytest.raises(FileNotFoundError):
        load_questions(tmp_path / "none.jsonl")


def test_shipped_prompt_set_covers_every_group():
    from importlib.resources import files

    questions = load_questions(files("exactspec.bench") / "prompts.jsonl")
    assert {q.group for q in questions} == set(GROUPS)


def test_parse_method_errors():
    target = tiny_backend(0)
    for spec in ("magic", "draft", "prompt-lookup:k=x", "plain:extra", "hf-plain:k=4:zzz=1"):
        with pytest.raises(ValueError, match="is invalid"):
            parse_method(spec, target, lambda name: target)


def test_bench_end_to_end_flags_mismatches_and_writes_report(questions_file, tmp_path):
    target = tiny_backend(21)
    methods = [parse_method(spec, target, lambda name: tiny_backend(model=target.model))
               for spec in ("plain", "prompt-lookup:k=3:ngram=1-2", "draft:same:k=2", "hf-plain",
                            "hf-prompt-lookup:k=4")]
    plain = methods[0]

    def broken_run(prompt_ids, params):  # a "speculative method" that changes the output
        outcome = plain.run(prompt_ids, params)
        return Outcome(outcome.token_ids[:-1] + [(outcome.token_ids[-1] + 1) % 64],
                       outcome.seconds, outcome.stats)

    methods.append(Method("broken", "prompt-lookup", 3, broken_run))
    results = run_bench(target, load_questions(questions_file), methods,
                        params=SamplingParams(max_new_tokens=12), repetitions=2, chat=False,
                        config={"test": True}, show_progress=False)
    assert len(results.records) == 4 * 2 * 6
    assert set(results.forward_seconds) == {1, 2, 3, 4, 5}
    by_method = {}
    for record in results.records:
        by_method.setdefault(record.method, []).append(record)
    for name in ("plain", "prompt-lookup:k=3:ngram=1-2", "draft:same:k=2", "hf-plain"):
        assert all(r.matches_plain for r in by_method[name]), name  # exact, and transformers agrees
    assert not any(r.matches_plain for r in by_method["broken"])

    summary = write_report(results, tmp_path / "out")
    overall = summary["overall"]
    assert overall["broken"]["mismatches"] == 8 and overall["plain"]["mismatches"] == 0
    assert overall["plain"]["speedup"] == 1.0
    lookup = overall["prompt-lookup:k=3:ngram=1-2"]
    assert 0 <= lookup["acceptance_rate"] <= 1 and 1 <= lookup["mean_acceptance_length"] <= 4
    assert lookup["speedup_min"] <= lookup["speedup"] <= lookup["speedup_max"] or \
        lookup["speedup_min"] == lookup["speedup_max"]
    assert lookup["speedup_bound"] > 0 and lookup["speedup_leviathan"] > 0 and overall["draft:same:k=2"]["acceptance_rate"] == 1.0
    assert overall["hf-plain"]["tokens_per_second"] > 0
    assert 0 < overall["plain"]["overhead_share"] < 1 and overall["plain"]["cycles"] == 8 * 12
    assert "overhead_share" not in overall["hf-plain"]  # a peer's time cannot be split
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Host-side overhead" in report and "## Decoding speedup, prefill excluded" in report
    assert overall["plain"]["decode_speedup"] == 1.0 and "decode_speedup" not in overall["hf-plain"]
    assert "Greedy identity failures: 8" in report and "broken" in report
    assert "| summarization |" in report and "| overall |" in report
    stored = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(stored["records"]) == len(results.records) and "summary" in stored
    for name in ("speedup_by_group.png", "committed_per_cycle.png", "acceptance_by_position.png"):
        path = tmp_path / "out" / name
        assert path.stat().st_size > 5000, name  # a real picture, not an empty canvas


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed")
def test_bench_on_llama_cpp_with_its_peers(questions_file, tmp_path):
    from conftest import BackendFactory

    target = BackendFactory("llama_cpp", tmp_path)(21)
    methods = [parse_method(spec, target, None) for spec in
               ("plain", "prompt-lookup:k=3:ngram=1-2", "prompt-lookup:k=4:policy=auto",
                "llama-plain", "llama-prompt-lookup:k=4")]
    results = run_bench(target, load_questions(questions_file), methods,
                        params=SamplingParams(max_new_tokens=12), repetitions=1, chat=False,
                        config={"test": True}, show_progress=False)
    assert all(r.matches_plain for r in results.records)  # ours exact; llama-cpp-python agrees
    summary = write_report(results, tmp_path / "out")
    assert summary["overall"]["llama-prompt-lookup:k=4"]["tokens_per_second"] > 0
    assert summary["overall"]["prompt-lookup:k=4:policy=auto"]["policy"] == "auto"
    with pytest.raises(ValueError, match="needs the llama_cpp backend"):
        parse_method("llama-plain", tiny_backend(0), None)

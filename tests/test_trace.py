"""Per-cycle traces: the recorded numbers agree with a replay of the verifier on the
recorded logits (and a tampered trace is caught); greedy traces show argmax matches; the
terminal view on a pseudo-terminal and a pipe; the page is self-contained and renders in
headless Chromium without script errors."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import perturbed_backend, tiny_backend
from exactspec import DraftModelProposer, PromptLookupProposer, SamplingParams, SpeculativeGenerator
from exactspec.cycle_trace import CycleTrace, DraftVerdict, token_kinds
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.sampling import make_rng
from exactspec.trace.page import write_trace
from exactspec.trace.terminal import marked_text
from exactspec.verification import rejection_sample

PROMPT = "abcabcabcabcab"


class Recorder:
    """Records every target forward's logits and every proposal (wraps the instances)."""

    def __init__(self, generator: SpeculativeGenerator) -> None:
        self.logits: list[torch.Tensor] = []
        self.proposals = []
        forward, propose = generator.target.forward, generator.proposer.propose

        def recorded_forward(rows, num_logits=None):
            (logits,) = forward(rows, num_logits)  # one sequence
            self.logits.append(logits.clone())
            return [self.logits[-1]]

        def recorded_propose(*args, **kwargs):
            self.proposals.append(propose(*args, **kwargs))
            return self.proposals[-1]

        generator.target.forward = recorded_forward
        generator.proposer.propose = recorded_propose


def replay_mismatches(trace: list[CycleTrace], recorder: Recorder, prompt_ids: list[int],
                      params: SamplingParams, vocab: int, replay_rng: bool) -> list[str]:
    """Recompute each cycle from the recorded logits and proposals: p, q, min(1, p/q),
    verdicts (u·q < p), committed tokens and kinds, the residual's top tokens; with
    ``replay_rng`` (proposers that draw no random numbers) also the uniforms and the final
    token, by running the verifier again with a fresh rng of the same seed."""
    problems = []
    pipeline = LogitsPipeline(params, prompt_ids, vocab)
    rng = make_rng(params.seed)
    history = list(prompt_ids)
    proposals = iter(p for p in recorder.proposals)
    if len(trace) != len(recorder.logits):
        problems.append(f"{len(trace)} cycles traced, {len(recorder.logits)} forwards")
    for cycle, logits in zip(trace, recorder.logits):
        drafts = [d.token_id for d in cycle.drafts]
        proposal = next(proposals) if cycle.chosen_k else None  # constant policy: no peeks
        if proposal is not None and list(proposal.token_ids) != drafts:
            problems.append(f"cycle {cycle.index}: drafts {drafts} ≠ proposed "
                            f"{proposal.token_ids}")
        k = len(drafts)
        processed = pipeline.process(logits, history, drafts)
        p = pipeline.probs(processed).double()
        q = (torch.ones(k, dtype=torch.float64) if proposal is None or proposal.probs is None
             else proposal.probs.double()[torch.arange(k), drafts])
        num_accepted = 0
        for i, draft in enumerate(cycle.drafts):
            if draft.p != float(p[i, draft.token_id]) or draft.q != float(q[i]):
                problems.append(f"cycle {cycle.index} draft {i}: p, q = {draft.p}, {draft.q}; "
                                f"replay {float(p[i, draft.token_id])}, {float(q[i])}")
            expected_ratio = min(1.0, float(p[i, draft.token_id] / q[i])) if q[i] > 0 else 0.0
            if abs(draft.acceptance_probability - expected_ratio) > 1e-12:
                problems.append(f"cycle {cycle.index} draft {i}: min(1, p/q) wrong")
            passes = draft.uniform * draft.q < draft.p
            expected = ("accepted" if passes and num_accepted == i else
                        "rejected" if num_accepted == i else "not reached")
            if draft.verdict != expected:
                problems.append(f"cycle {cycle.index} draft {i}: verdict {draft.verdict}, "
                                f"u·q < p says {expected}")
            num_accepted += expected == "accepted"
        committed = [token for token, _ in cycle.committed]
        if committed[:num_accepted] != drafts[:num_accepted]:
            problems.append(f"cycle {cycle.index}: committed {committed} do not start with "
                            f"the accepted drafts")
        kinds = token_kinds(k, num_accepted, len(committed))
        if [kind for _, kind in cycle.committed] != kinds:
            problems.append(f"cycle {cycle.index}: kinds {cycle.committed} ≠ {kinds}")
        final = p[num_accepted]
        if num_accepted < k:
            q_row = torch.zeros_like(final)
            q_row[drafts[num_accepted]] = 1.0
            if proposal is not None and proposal.probs is not None:
                q_row = proposal.probs[num_accepted].double()
            if (final - q_row).clamp(min=0).sum() > 0:
                final = (final - q_row).clamp(min=0)
        top_ids = final.topk(len(cycle.final_top)).indices.tolist()
        if [t for t, _ in cycle.final_top] != top_ids:
            problems.append(f"cycle {cycle.index}: final_top {cycle.final_top} ≠ replay "
                            f"{top_ids}")
        if replay_rng:
            draft_probs = None
            result = rejection_sample(torch.tensor([drafts], dtype=torch.long).view(1, k),
                                      draft_probs, p.unsqueeze(0).float(), rng)
            replayed = [t for t in result.output_token_ids[0].tolist() if t >= 0]
            if [d.uniform for d in cycle.drafts] != result.uniforms[0].tolist():
                problems.append(f"cycle {cycle.index}: uniforms differ from the replay")
            if replayed[: len(committed)] != committed:
                problems.append(f"cycle {cycle.index}: committed {committed}, replay {replayed}")
        history += committed
    return problems


def sampled_run(proposer_kind: str):
    target = tiny_backend(2)
    proposer = (PromptLookupProposer(1, 3) if proposer_kind == "prompt lookup"
                else DraftModelProposer(perturbed_backend(target, 0.1), target))
    generator = SpeculativeGenerator(target, proposer, 2, "constant")
    recorder = Recorder(generator)
    params = SamplingParams(temperature=0.9, seed=4, max_new_tokens=80)
    result = generator.generate(PROMPT, params, trace=True)
    return result, recorder, params, target


@pytest.mark.parametrize("proposer_kind", ["prompt lookup", "draft model"])
def test_sampled_trace_agrees_with_a_replay_of_the_verifier(proposer_kind):
    result, recorder, params, target = sampled_run(proposer_kind)
    trace = result.trace
    stats = result.stats
    assert len(trace) == stats.cycles
    assert sum(len(c.committed) for c in trace) == len(result.token_ids)
    assert [t for c in trace for t, _ in c.committed] == result.token_ids
    verdicts = [d.verdict for c in trace for d in c.drafts]
    # the run exercises what the test checks: acceptances, rejections, bonus tokens
    assert verdicts.count("accepted") == stats.accepted_tokens > 0
    assert verdicts.count("rejected") > 0
    assert any(kind == "bonus" for c in trace for _, kind in c.committed)
    if proposer_kind == "draft model":
        assert any(d.q < 1 for c in trace for d in c.drafts)  # a real q, not point masses
    assert replay_mismatches(trace, recorder, result.prompt_token_ids, params,
                             target.vocab_size, replay_rng=proposer_kind == "prompt lookup") == []


def test_a_tampered_trace_fails_the_replay():
    result, recorder, params, target = sampled_run("prompt lookup")
    check = lambda: replay_mismatches(result.trace, recorder, result.prompt_token_ids, params,
                                      target.vocab_size, replay_rng=True)
    cycle = next(c for c in result.trace if any(d.verdict == "rejected" for d in c.drafts))
    rejected = next(d for d in cycle.drafts if d.verdict == "rejected")
    original = rejected.uniform
    rejected.uniform = 0.0  # u = 0 would have accepted it
    assert any("verdict" in problem for problem in check())
    rejected.uniform = original
    cycle.committed[-1] = (cycle.committed[-1][0], "bonus")
    assert any("kinds" in problem for problem in check())


def test_greedy_trace_shows_argmax_matches():
    target = tiny_backend(2)
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 4, "constant")
    recorder = Recorder(generator)
    params = SamplingParams(max_new_tokens=60)
    result = generator.generate(PROMPT, params, trace=True)
    pipeline = LogitsPipeline(params, result.prompt_token_ids, target.vocab_size)
    history = list(result.prompt_token_ids)
    seen = set()
    for cycle, logits in zip(result.trace, recorder.logits, strict=True):
        assert cycle.greedy
        argmax = pipeline.process(logits, history, [d.token_id for d in cycle.drafts]
                                  ).argmax(-1).tolist()
        for i, draft in enumerate(cycle.drafts):
            assert draft.p is draft.q is draft.uniform is None
            assert draft.target_token_id == argmax[i]
            seen.add(draft.verdict)
        matched = 0
        while matched < len(cycle.drafts) and cycle.drafts[matched].target_token_id == \
                cycle.drafts[matched].token_id:
            matched += 1
        assert [t for t, _ in cycle.committed] == argmax[: matched + 1][: len(cycle.committed)]
        history += [t for t, _ in cycle.committed]
    assert {"accepted", "rejected"} <= seen
    assert result.token_ids == SpeculativeGenerator(tiny_backend(2), None).generate(
        PROMPT, params).token_ids
    # each cycle's timings, which add up to the generation's
    assert all(c.verify_seconds > 0 and c.draft_seconds >= 0 for c in result.trace)
    assert sum(c.verify_seconds for c in result.trace) == pytest.approx(
        result.stats.verify_seconds, rel=1e-9)
    assert sum(c.draft_seconds for c in result.trace) == pytest.approx(
        result.stats.draft_seconds, rel=1e-9)


def test_drafts_past_a_stop_are_marked_so_and_an_empty_draft_says_so(tmp_path):
    """A stop string ends generation inside a block of accepted drafts: the drafts after
    it are neither committed nor called accepted; a cycle whose proposer found nothing keeps
    the k its policy chose and says that nothing was drafted."""
    target = tiny_backend(2)
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 4, "constant")
    free = generator.generate(PROMPT, SamplingParams(max_new_tokens=60), trace=True)
    cycle = next(c for c in free.trace if sum(d.verdict == "accepted" for d in c.drafts) >= 2)
    before = sum(len(c.committed) for c in free.trace[:cycle.index])
    stop_text = target.tokenizer.decode(free.token_ids[:before + 1])  # ends at the first draft
    params = SamplingParams(max_new_tokens=60, stop=(stop_text,))
    result = generator.generate(PROMPT, params, trace=True)
    last = result.trace[-1]
    assert result.finish_reason == "stop" and last.index == cycle.index
    assert [d.verdict for d in last.drafts][:2] == ["accepted", "past the stop"]
    assert len(last.committed) == 1
    assert "past the stop" not in {d.verdict for c in free.trace for d in c.drafts}
    free.trace[0] = CycleTrace(0, 0, 3, [], free.trace[0].committed)  # k = 3, none drafted
    page, _ = write_trace(tmp_path / "trace.html", [free, result], target.tokenizer.decode, {})
    html = page.read_text()
    assert "3, 0 drafted" in html and "the proposer found nothing to draft" in html
    assert "past the stop" in html


def test_no_trace_unless_asked():
    result = SpeculativeGenerator(tiny_backend(0), PromptLookupProposer(1, 3)).generate(
        PROMPT, SamplingParams(max_new_tokens=8))
    assert result.trace is None and result.to_dict()["trace"] is None


# --- the terminal view ------------------------------------------------------------------

def synthetic_trace() -> list[CycleTrace]:
    draft = lambda token, verdict: DraftVerdict(token, None, None, None, None, token, verdict)
    return [CycleTrace(0, 0, 0, [], [(0, "plain")]),
            CycleTrace(1, 1, 2, [draft(1, "accepted"), draft(2, "rejected")],
                       [(1, "accepted"), (3, "recovered")]),
            CycleTrace(2, 3, 1, [draft(4, "accepted")], [(4, "accepted"), (5, "bonus")]),
            CycleTrace(3, 5, 0, [], [(6, "plain")]), CycleTrace(4, 6, 0, [], [(7, "plain")])]


def test_plain_markers_without_colour():
    decode = lambda ids: "".join("abcdefgh"[t] for t in ids)
    assert marked_text(synthetic_trace(), decode, colour=False).plain == "a|[b]{d}|[e]<f>|gh"
    no_text = lambda ids: "".join("abcdefg"[t] if t < 7 else "" for t in ids)  # 7: EOS
    assert marked_text(synthetic_trace(), no_text, colour=False).plain == "a|[b]{d}|[e]<f>|g∅"
    coloured = marked_text(synthetic_trace(), decode, colour=True)
    assert coloured.plain == "a▏bd▏ef▏gh"
    styles = {coloured.plain[span.start:span.end]: str(span.style) for span in coloured.spans}
    assert styles["b"] == "green" and styles["d"] == "bold yellow" and styles["f"] == "cyan"


def test_a_recovered_token_after_a_forbidden_draft_is_marked_so():
    """Under a constraint, a draft it forbids is rejected with certainty; the token
    recovered in its place is marked apart from an ordinary recovery, and the legend names
    the mark only when the output has one."""
    from exactspec.trace.terminal import legend

    trace = synthetic_trace()
    trace[1].drafts[1].verdict = "forbidden"
    decode = lambda ids: "".join("abcdefgh"[t] for t in ids)
    assert marked_text(trace, decode, colour=False).plain == "a|[b]{!d}|[e]<f>|gh"
    coloured = marked_text(trace, decode, colour=True)
    styles = {coloured.plain[span.start:span.end]: str(span.style) for span in coloured.spans}
    assert styles["d"] == "bold red"
    assert "{!recovered after a draft the constraint forbids}" in legend(False, True).plain
    assert "forbids" not in legend(False).plain


def test_tokens_without_text_and_split_characters_are_marked_apart():
    from exactspec.trace.view import NO_TEXT, PARTIAL, shown_pieces

    table = {0: b"\xc3", 1: b"\xa9", 2: b"x", 3: b""}  # "é" split in two; 3: EOS
    decode = lambda ids: b"".join(table[t] for t in ids).decode("utf-8", "replace")
    assert shown_pieces([2, 0, 1, 3], decode) == ["x", PARTIAL, "é", NO_TEXT]


def test_trace_file_that_cannot_be_written_is_one_error_line(model_folder, tmp_path, capsys):
    from exactspec import cli

    (tmp_path / "file").write_text("")
    args = ["generate", PROMPT, "--model", str(model_folder), "--no-chat", "--max-new-tokens",
            "4", "--trace"]
    with pytest.raises(SystemExit) as raised:  # found before loading the model
        cli.main(args + [str(tmp_path / "file" / "x.HTML")])
    assert raised.value.code == 2 and "is not a folder" in capsys.readouterr().err
    (tmp_path / "taken.html").mkdir()  # found only when writing
    assert cli.main(args + [str(tmp_path / "taken.html")]) == 1
    err = capsys.readouterr().err
    assert "could not write the trace" in err and "Traceback" not in err


def run_cli_show(model_folder, use_pty: bool, no_color: bool = False) -> str:
    """``exactspec generate --show`` in a subprocess, its stdout a pseudo-terminal or a pipe."""
    command = [sys.executable, "-c", "import sys; from exactspec.cli import main; sys.exit(main())",
               "generate", PROMPT, "--model", str(model_folder), "--show", "--max-new-tokens",
               "30", "--policy", "constant", "--prompt-lookup", "1-3", "--no-chat"]
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    env["TERM"] = "xterm-256color"
    if no_color:
        env["NO_COLOR"] = "1"
    if not use_pty:
        return subprocess.run(command, capture_output=True, text=True, env=env,
                              check=True).stdout
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, stdout=follower, stderr=subprocess.DEVNULL, env=env)
    os.close(follower)
    output = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            process.kill()
            break
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    assert process.wait(timeout=60) == 0
    os.close(leader)
    return output.decode("utf-8", "replace")


def test_show_in_a_pseudo_terminal_uses_colours(model_folder):
    output = run_cli_show(model_folder, use_pty=True)
    assert "\x1b[32m" in output  # accepted drafts in green
    assert "legend:" in output and "▏" in output


@pytest.mark.parametrize("use_pty, no_color", [(False, False), (True, True)])
def test_show_without_colours_uses_markers(model_folder, use_pty, no_color):
    output = run_cli_show(model_folder, use_pty, no_color)
    assert "\x1b[" not in output
    assert "[" in output and "|" in output
    assert "legend: [accepted draft]  {recovered after a rejection}  <bonus token>" in output


# --- the page ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(tmp_path_factory):
    results = sampled_run("draft model")[0:1]
    greedy_generator = SpeculativeGenerator(tiny_backend(2), PromptLookupProposer(1, 3), 4,
                                            "constant")
    greedy = greedy_generator.generate_samples(PROMPT, SamplingParams(max_new_tokens=40),
                                               n=2, trace=True)
    folder = tmp_path_factory.mktemp("trace")
    decode = greedy_generator.target.tokenizer.decode
    sampled_page, sampled_json = write_trace(folder / "sampled.html", results, decode,
                                             {"method": "draft model", "prompt": PROMPT})
    greedy_page, greedy_json = write_trace(folder / "greedy.html", greedy, decode,
                                           {"method": "prompt lookup", "prompt": "<b>"})
    return {"sampled": (sampled_page, sampled_json, results),
            "greedy": (greedy_page, greedy_json, greedy)}


def test_page_is_self_contained_and_holds_every_cycle(page):
    import html.parser

    for name, (html_path, json_path, results) in page.items():
        text = html_path.read_text()
        attributes = []

        class Collect(html.parser.HTMLParser):
            def handle_starttag(self, tag, attrs):
                attributes.extend((tag, key, value or "") for key, value in attrs)

        Collect().feed(text)
        assert not [a for a in attributes if a[1] in ("src", "href")
                    and a[2].startswith(("http:", "https:", "//"))]
        assert not [a for a in attributes if a[0] in ("link", "iframe")]
        rows = [a for a in attributes if a[0] == "tr" and a[1] == "id"]
        assert len(rows) == sum(r.stats.cycles for r in results)
        assert text.count("<svg") == 2 * len(results)
        data = json.loads(json_path.read_text())
        assert [len(s["cycles"]) for s in data["samples"]] == [r.stats.cycles for r in results]
    assert "&lt;b&gt;" in page["greedy"][0].read_text()  # the prompt is escaped
    assert "min(1,p/q)=" in page["sampled"][0].read_text()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                             "(Debian: apt-get install chromium)")
@pytest.mark.parametrize("name", ["sampled", "greedy"])
def test_page_renders_in_headless_chromium(page, name, tmp_path):
    import matplotlib.image

    html_path = page[name][0]
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(flags + ["--dump-dom", html_path.as_uri()], capture_output=True,
                         text=True, timeout=120)
    assert 'data-rendered="ok"' in dom.stdout  # the page's script ran to its end
    assert "Uncaught" not in dom.stderr
    shot = tmp_path / "shot.png"
    subprocess.run(flags + ["--window-size=1200,1600", f"--screenshot={shot}",
                            html_path.as_uri()], capture_output=True, timeout=120)
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (1600, 1200) and pixels.std() > 0.05  # not a blank page

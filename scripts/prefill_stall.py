"""How much a long prompt's prefill slows the streams decoding beside it (issue 40, item 5).

On the embedded model with batched decoding (the server's engine), three requests:

1. a *stream* (a chat prompt, greedy, ``--stream-tokens`` tokens) starts first; its time per
   output token before the long prompt arrives is its *idle* TPOT;
2. a *long* prompt of about ``--long-prompt-tokens`` tokens arrives once the stream has
   committed ``--idle-tokens`` tokens; the stream's TPOT while the long prompt prefills is
   compared with its idle TPOT;
3. a *short* request (5 tokens) arrives 1 s into the long prompt's prefill; its completion
   time is compared with the long request's.

Prints one JSON object and writes it to ``--output`` when given. Run it on idle cores:
it measures time.

    python scripts/prefill_stall.py --output results/.../prefill-stall.json
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--backend", default="transformers")
    parser.add_argument("--long-prompt-tokens", type=int, default=7000)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--idle-tokens", type=int, default=40)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    from exactspec import SamplingParams, SpeculativeGenerator, load_model
    from exactspec.batching import BatchedGenerator

    target = load_model(args.model, backend=args.backend)
    words = ("The committee reviewed the quarterly figures and noted that revenue rose "
             "while costs in logistics and staffing fell slightly over the period. ")
    text = words * (args.long_prompt_tokens // len(target.tokenizer.encode(words)) + 1)
    long_ids = target.tokenizer.encode(text)[:args.long_prompt_tokens]
    stream_ids = target.tokenizer.apply_chat_template("Write a long story about a lighthouse.")
    short_ids = target.tokenizer.apply_chat_template("Name a colour.")
    batched = BatchedGenerator(SpeculativeGenerator(target, None), max_batch_size=4)
    batched.generate([short_ids], SamplingParams(max_new_tokens=4))  # warm-up

    times: dict[str, list[float]] = {"stream": [], "long": [], "short": []}

    def recorder(name):
        return lambda sample, tokens: times[name].extend([time.perf_counter()] * len(tokens))

    start = time.perf_counter()
    batched.submit(stream_ids, SamplingParams(max_new_tokens=args.stream_tokens,
                                              ignore_eos=True), on_commit=recorder("stream"))
    submitted: dict[str, float] = {}
    finished: dict[str, float] = {}
    ids: dict[int, str] = {}
    while batched.num_active or batched.num_waiting:
        now = time.perf_counter()
        if "long" not in submitted and len(times["stream"]) >= args.idle_tokens:
            submitted["long"] = now
            ids[batched.submit(long_ids, SamplingParams(max_new_tokens=5),
                               on_commit=recorder("long"))] = "long"
        if "long" in submitted and "short" not in submitted and now - submitted["long"] >= 1.0:
            submitted["short"] = now
            ids[batched.submit(short_ids, SamplingParams(max_new_tokens=5, ignore_eos=True),
                               on_commit=recorder("short"))] = "short"
        for request_id in batched.step():
            if request_id in ids:
                finished[ids[request_id]] = time.perf_counter()
    long_first = times["long"][0]
    stream = times["stream"]
    before = [t for t in stream if t < submitted["long"]]
    during = [t for t in stream if submitted["long"] <= t <= long_first]
    idle_tpot = (before[-1] - before[1]) / (len(before) - 2)
    during_tpot = (during[-1] - before[-1]) / len(during)
    report = {
        "model": args.model, "backend": args.backend, "long_prompt_tokens": len(long_ids),
        "long_request_seconds": finished["long"] - submitted["long"],
        "long_ttft_seconds": long_first - submitted["long"],
        "short_request_seconds": finished["short"] - submitted["short"],
        "short_over_long": (finished["short"] - submitted["short"])
        / (finished["long"] - submitted["long"]),
        "stream_idle_tpot_seconds": idle_tpot,
        "stream_tpot_during_prefill_seconds": during_tpot,
        "stream_tokens_during_prefill": len(during),
        "tpot_ratio": during_tpot / idle_tpot,
        "stream_longest_gap_during_prefill_seconds": max(
            b - a for a, b in zip([before[-1], *during], during)) if during else None,
        "prefill_chunk_size": target.prefill_chunk_size,
        "wall_seconds": time.perf_counter() - start,
    }
    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()

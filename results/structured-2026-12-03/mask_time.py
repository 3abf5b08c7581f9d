"""Mask time per token on the embedded model's vocabulary: llguidance (exactspec's
ConstraintMask, and the raw bitmask) and xgrammar, over the tokens of fixed JSON outputs."""
import json, statistics, sys, time
from pathlib import Path
sys.path.append("/tmp/xg")  # pip install --no-deps --target /tmp/xg xgrammar==0.2.9 apache-tvm-ffi
from exactspec import load_model
from exactspec.constraints import Constraint

target = load_model()
tok = target.tokenizer
schema = json.load(open(Path(__file__).with_name("person.json")))
from exactspec import SamplingParams, SpeculativeGenerator
prompts = ["Extract the person as JSON: Maria Lopez is 34 and lives in Seville, Spain.",
           "Extract the person as JSON: Tom, 61, from Leeds, retired teacher.",
           "Who is this, as JSON? 'Ana Silva (27) moved to Porto last year.'"]
outputs = [SpeculativeGenerator(target, None).generate(p, SamplingParams(
    max_new_tokens=96, constraint=Constraint.json_schema(schema)), chat=True).token_ids[:-1]
    for p in prompts]
import llguidance.hf
t0 = time.perf_counter()
llguidance.hf.from_tokenizer(tok.hf_tokenizer, n_vocab=target.vocab_size)
print(f"llguidance tokenizer built in {time.perf_counter() - t0:.2f} s (first time)")
lltok = tok.constraint_tokenizer(target.vocab_size, tuple(target.eos_token_ids))
print(f"llguidance tokenizer built in {time.perf_counter() - t0:.2f} s")
constraint = Constraint.json_schema(schema)
rows = {}
for ids in outputs:
    for name in ("exactspec ConstraintMask.allowed", "llguidance compute_bitmask"):
        mask = constraint.mask(lltok, target.vocab_size)
        times = []
        for i in range(len(ids) + 1):
            if name.startswith("exactspec"):
                s = time.perf_counter(); mask.allowed(ids[:i], (), 1); times.append(time.perf_counter() - s)
            else:
                m = mask._matcher
                s = time.perf_counter(); m.compute_bitmask(); times.append(time.perf_counter() - s)
                if i < len(ids): m.consume_token(ids[i])
        rows.setdefault(name, []).extend(times)
try:
    import xgrammar as xgr
    from transformers import AutoTokenizer
    hf = tok.hf_tokenizer
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=target.vocab_size)
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=True)
    print(f"xgrammar grammar compiled in {time.perf_counter() - t0:.2f} s")
    import torch
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for ids in outputs:
        matcher = xgr.GrammarMatcher(compiled)
        for i in range(len(ids) + 1):
            s = time.perf_counter(); matcher.fill_next_token_bitmask(bitmask); rows.setdefault("xgrammar fill_next_token_bitmask", []).append(time.perf_counter() - s)
            if i < len(ids) and not matcher.accept_token(ids[i]):  # its own JSON whitespace
                words = bitmask[0].tolist()
                first = next(w * 32 + b for w, word in enumerate(words) for b in range(32) if word >> b & 1)
                assert matcher.accept_token(first)
except Exception as error:
    print("xgrammar:", type(error).__name__, error)
for name, times in rows.items():
    print(f"{name}: mean {statistics.mean(times) * 1e6:.0f} µs, median {statistics.median(times) * 1e6:.0f} µs, max {max(times) * 1e6:.0f} µs over {len(times)} tokens")

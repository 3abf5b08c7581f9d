"""Drafting cost of the draft head on the native backend, per drafted token against the
plain step, interleaved round by round: PyTorch bf16 head, NativeHead bf16 / q8_0 weights."""
import sys, statistics, torch
import exactspec.proposers.head as head_module
from exactspec.backends import native
from exactspec.draft_head.kernels import NativeHead
from exactspec.draft_head.model import load_head, shipped_head
from exactspec.models import load_model
from exactspec.generator import SpeculativeGenerator
from exactspec.proposers.head import HeadProposer
from exactspec.sampling import SamplingParams

target = load_model("smollm2-135m-instruct")
prompts = ["Explain how a refrigerator keeps food cold, step by step.",
           "Write a letter to a friend about a trip to the mountains.",
           "What are three ways to save energy at home? Answer briefly.",
           "Summarize the plot of a detective story in five sentences."]
chat = [target.tokenizer.apply_chat_template(p) for p in prompts]
params = SamplingParams(max_new_tokens=128)
tensors = target.target_tensors()
def proposer(kind, threads):
    p = HeadProposer(target, threads=threads)
    if kind != "q8_0":
        head = load_head(shipped_head(tensors), tensors).to_dtype(torch.bfloat16)
        p.head = head if kind == "torch" else NativeHead(head, native.load(), threads, kind)
    return p
kinds = [("torch", 2), ("bf16", 2), ("q8_0", 1), ("q8_0", 2)]
gens = {f"{k}-{t}": SpeculativeGenerator(target, proposer(k, t), 4, "constant") for k, t in kinds}
gens["plain"] = SpeculativeGenerator(target, None)
res = {k: [] for k in gens}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for name, g in gens.items():
        for p in chat:
            r = g.generate(p, params)
            s = r.stats
            res[name].append((s.draft_seconds / max(s.drafted_tokens, 1) * 1e3,
                              s.target_forward_seconds / s.cycles * 1e3,
                              s.accepted_tokens / s.cycles + 1,
                              len(r.token_ids) / (s.total_seconds - s.prefill_seconds)))
med = lambda name, i: statistics.median(x[i] for x in res[name])
plain = med("plain", 1)
print(f"plain: step {plain:.2f} ms, {med('plain', 3):.0f} tok/s decoding (median of {len(res['plain'])} runs)")
for name in gens:
    if name == "plain": continue
    d = med(name, 0)
    print(f"{name:8s} drafting {d:.2f} ms per drafted token = {d / plain:.1%} of a plain step; "
          f"verification forward {med(name, 1):.2f} ms; mean acceptance length {med(name, 2):.2f}; "
          f"{med(name, 3):.0f} tok/s decoding")

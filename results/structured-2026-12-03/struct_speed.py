"""Decoding speed under a JSON schema on the embedded model (native backend), interleaved:
plain without and with the constraint, and speculative methods with it (forced tokens
drafted first by every proposer)."""
import json, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
from test_structured_real_model import SCHEMAS
from exactspec import SamplingParams, SpeculativeGenerator, load_model
from exactspec.constraints import Constraint
from exactspec.proposers import PromptLookupProposer, SuffixProposer

target = load_model(backend="native")
methods = {"plain, no constraint": (None, 0, None), "plain": (None, 0, "c"),
           "prompt-lookup k=4 constant": (PromptLookupProposer, 4, "c"),
           "prompt-lookup k=4 auto": (PromptLookupProposer, 4, "auto"),
           "suffix k=4 constant": (SuffixProposer, 4, "c")}
rows = {m: [] for m in methods}
for rep in range(3):
    for name, (prompt, schema) in SCHEMAS.items():
        for method, (make, k, policy) in methods.items():
            constraint = None if method.endswith("no constraint") else Constraint.json_schema(schema)
            params = SamplingParams(max_new_tokens=96, constraint=constraint)
            generator = SpeculativeGenerator(target, make() if make else None, k,
                                             "auto" if policy == "auto" else "constant")
            result = generator.generate(prompt, params, chat=True)
            s = result.stats
            rows[method].append((s.num_generated_tokens, s.total_seconds - s.prefill_seconds,
                                 s.cycles, s.drafted_tokens, s.accepted_tokens))
for method, r in rows.items():
    tokens = sum(x[0] for x in r); seconds = sum(x[1] for x in r)
    cycles = sum(x[2] for x in r); drafted = sum(x[3] for x in r); accepted = sum(x[4] for x in r)
    print(f"{method:28s} {tokens / seconds:6.1f} tok/s (decode)  mean acceptance length {tokens / cycles:.2f}  acceptance {accepted / max(drafted, 1):.2f}  tokens {tokens}")

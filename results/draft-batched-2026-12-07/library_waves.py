import time
from exactspec import SpeculationSpec, ModelSpec, SamplingParams
from exactspec.bench.questions import load_humaneval
from exactspec.speculation import SpeculationSettings
spec = SpeculationSpec(ModelSpec("qwen2.5-coder-1.5b-instruct"), "draft:qwen2.5-coder-0.5b-instruct", 3, "constant")
s = spec.load()
gens = {"plain": s.batched_generator(4, s.generator(SpeculationSettings(0, "constant"))),
        "k3": s.batched_generator(4, s.generator(SpeculationSettings(3, "constant"))),
        "auto": s.batched_generator(4, s.generator(SpeculationSettings(4, "auto")))}
qs = load_humaneval(12)
prompts = [s.prompt_ids(q.prompt, True) for q in qs]
tot = {k: [0, 0.0] for k in gens}
for w in range(3):
    wave = prompts[4*w:4*w+4]
    for name, b in gens.items():
        t0 = time.perf_counter()
        res = b.generate(wave, SamplingParams(max_new_tokens=192))
        dt = time.perf_counter() - t0
        n = sum(len(r.token_ids) for r in res)
        tot[name][0] += n; tot[name][1] += dt
        print(w, name, round(n/dt, 1), flush=True)
for name, (n, dt) in tot.items():
    print(name, round(n/dt, 1), round((n/dt)/(tot['plain'][0]/tot['plain'][1]), 3))

"""Does a long context dilute head v3's attention? Its teacher-forced Spec-Bench agreement (the
examples vocabulary.py cached in /tmp) with its attention over the real rows limited to the
last W positions (None: all). Measurement only. Output: window.txt.

    python results/draft-head-v4-2026-12-06/window.py
"""
import torch, types
from exactspec.draft_head.model import load_head
from exactspec.models import load_model
from exactspec.training.train import evaluate
examples, groups = torch.load("/tmp/specbench_examples.pt", weights_only=False)
t = load_model("smollm2-135m-instruct", backend="transformers").target_tensors()
head = load_head("training/smollm2-135m-instruct/heads/head-v3.safetensors", t)
def make(window):
    def unrolled(self, features, token_ids, num_steps):
        length = features.shape[1]
        positions = torch.arange(length)
        hidden = self.fc(features)
        keys, values, outputs = [], [], []
        i = torch.arange(length)
        causal = (i[None, :] <= i[:, None])
        if window: causal &= (i[:, None] - i[None, :] < window)
        for step in range(num_steps):
            q, k, v = self.project(hidden, token_ids[:, step:step + length], positions + step)
            keys.append(k); values.append(v)
            hidden = self.finish(hidden, self._attend_unrolled(q, keys, values, causal))
            outputs.append(hidden)
        return outputs
    return unrolled
gs = list(dict.fromkeys(groups))
for w in (None, 1024, 256, 64, 16, 4, 1):
    head.unrolled = types.MethodType(make(w), head)
    _, a, c = evaluate(head, examples, 2, bfloat16=True)
    by = {g[:6]: round(evaluate(head, [e for e, gg in zip(examples, groups) if gg == g], 1, bfloat16=True)[1][0], 3) for g in gs}
    print(w, [round(x, 3) for x in a], by, flush=True)

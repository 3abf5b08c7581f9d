"""The draft head (exactspec.draft_head) and its proposer: the backend's hidden features, the
head's training-time forward against its drafting, greedy identity (alone and batched),
checkpoints that resume, the file format, and refusals. Its exactness under sampling is
audited with the other proposers in test_audit.py."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random

import pytest
import torch
from torch.nn import functional as F

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.backends.base import UnsupportedModelError
from exactspec.batching import BatchedGenerator
from exactspec.training.data import Conversation
from exactspec.draft_head.model import (HeadCache, _rms_norm, head_metadata, load_head, new_head,
                                        save_head, shipped_head)
from exactspec.training.train import TrainingConfig, chained_acceptance, train
from exactspec.proposers.fallback import FallbackProposer
from exactspec.proposers.head import HeadProposer
from exactspec.proposers.suffix import SuffixProposer
from exactspec.proposers.spec import parse_proposer

from conftest import CharTokenizer, tiny_backend


@pytest.fixture(scope="module")
def target():
    return tiny_backend(0)


def test_hidden_features_are_the_layer_outputs_of_the_positions_cached(target):
    target.record_hidden_features((0, 1))
    ids = [5, 9, 2, 7, 7, 1, 3]
    target.prefill(101, ids[:3])
    target.forward([(101, ids[3:5])])
    target.forward([(101, ids[5:])])
    features = target.hidden_features(101, 0)
    with torch.no_grad():
        states = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert features.shape == (len(ids), 64)
    torch.testing.assert_close(features[:, :32], states[1][0], atol=1e-4, rtol=1e-4)
    # the last layer's hidden state in transformers' tuple has the final norm applied
    torch.testing.assert_close(target.model.model.norm(features[:, 32:]), states[2][0],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(target.hidden_features(101, 4), features[4:])
    target.rollback(101, 3)
    assert target.hidden_features(101, 0).shape[0] == 4
    torch.testing.assert_close(target.hidden_features(101, 2), features[2:4])
    assert target.hidden_features(101, 4).shape == (0, 64)
    with pytest.raises(ValueError, match="start = 5 is invalid"):
        target.hidden_features(101, 5)
    target.release(101)
    with pytest.raises(ValueError, match="is not held"):
        target.hidden_features(101, 0)
    with pytest.raises(ValueError, match="records layers \\[0, 1\\] already"):
        target.record_hidden_features((1,))
    with pytest.raises(ValueError, match="decoder layers are 0 .. 1"):
        tiny_backend(0).record_hidden_features((2,))


def test_a_sequence_cached_before_recording_has_no_features():
    backend = tiny_backend(0)
    backend.prefill(7, [1, 2, 3])
    backend.record_hidden_features((1,))
    with pytest.raises(ValueError, match="before its hidden features were recorded"):
        backend.hidden_features(7, 0)


def test_packed_rows_get_their_own_features(target):
    target.record_hidden_features((0, 1))
    rows = {201: [4, 8, 15, 16], 202: [23, 42, 1]}
    for sequence, ids in rows.items():
        target.prefill(sequence, ids[:2])
    target.forward([(sequence, ids[2:]) for sequence, ids in rows.items()])
    for sequence, ids in rows.items():
        alone = tiny_backend(0)
        alone.record_hidden_features((0, 1))
        alone.prefill(1, ids[:2])
        alone.forward([(1, ids[2:])])
        torch.testing.assert_close(target.hidden_features(sequence, 0),
                                   alone.hidden_features(1, 0), atol=1e-5, rtol=1e-5)
        target.release(sequence)


@pytest.mark.parametrize("root", [0, 5, 10])
def test_training_time_test_forward_equals_drafting(target, root):
    """Step j of :meth:`DraftHead.unrolled` at row t is what drafting computes after
    feeding rows 0..t and chaining j steps on its own outputs (same attention, positions)."""
    head = new_head(target.model, torch.arange(40), "tiny", (0, 1), seed=3)
    steps, length = 4, 11
    generator = torch.Generator().manual_seed(root)
    features = torch.randn(1, length, head.config.feature_size, generator=generator)
    tokens = torch.randint(64, (1, length + steps - 1), generator=generator)
    with torch.no_grad():
        unrolled = head.unrolled(features, tokens, steps)
        cache = HeadCache()
        hidden = head.extend(cache, head.fc(features[0, :root + 1]), tokens[0, :root + 1])[-1:]
        torch.testing.assert_close(hidden[0], unrolled[0][0, root], atol=1e-5, rtol=1e-5)
        for step in range(1, steps):
            hidden = head.extend(cache, hidden, tokens[0, root + step:root + step + 1])
            torch.testing.assert_close(hidden[0], unrolled[step][0, root], atol=1e-5, rtol=1e-5)


class ConcatenatedCache(HeadCache):
    """A :class:`HeadCache` that concatenates instead of writing into its buffers, so that
    autograd can differentiate through it."""

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._keys = keys if self._keys is None else torch.cat([self.keys, keys])
        self._values = values if self._values is None else torch.cat([self.values, values])
        self._length = self._keys.shape[0]


def run_layer(layer, features: torch.Tensor, cache: HeadCache | None = None) -> list[torch.Tensor]:
    """The layer tests' sequence: a prefill of 7 rows (``features [7, F]``), a chain step, a
    tree level of two children of the prefill's last row, and the logits of all ten rows."""
    cache = HeadCache() if cache is None else cache
    rows = layer.extend(cache, layer.fc(features), torch.tensor([3, 9, 4, 1, 5, 9, 2]))
    step = layer.extend(cache, rows[-1:], torch.tensor([6]))
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, :7] = True
    mask[0, 8] = mask[1, 9] = True  # two children of the prefill's last row
    tree = layer.extend(cache, rows[-1:].expand(2, -1), torch.tensor([6, 7]),
                        torch.tensor([7, 7]), mask)
    return [rows, step, tree, layer.logits(torch.cat([rows, step, tree]))]


Q8_WEIGHT_ERROR = 0.5 + 127 * 2.0 ** -11
"""|w − q·d| ≤ Q8_WEIGHT_ERROR · max|w| / 127 for a Q8_0 block: rounding to the nearest step
(half a step), plus the step d's rounding to float16 (relative 2^-11) times |q| ≤ 127."""
Q8_ACTIVATION_ERROR = 0.5 + 2.0 ** -16
"""|x − xq·dx| ≤ Q8_ACTIVATION_ERROR · dx for the kernels' int8 activations (dx = the block's
max|x| / 127): half a step, plus the float32 roundings of 1/dx and x·(1/dx), each relative
2^-24 of at most 127 steps."""


def int8_rounding_bound(head, features: torch.Tensor) -> list[torch.Tensor]:
    """The bound on how far Q8_0 weights and int8 activations (per block of 32) move each of
    :func:`run_layer`'s outputs, to first order: Σ |∂output / ∂v| · (v's rounding bound)
    over every weight and every product input v, the derivatives taken in float64 on the
    head's own values (the roundings' signs taken as the worst)."""
    import copy

    reference = copy.deepcopy(head).to_dtype(torch.float64)
    perturbations, bounds = [], []  # a zero leaf per rounded tensor, and its bound

    def rounded(value: torch.Tensor, error: float) -> torch.Tensor:
        steps = value.detach().abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True) / 127
        delta = torch.zeros_like(value, requires_grad=True)
        perturbations.append(delta)
        bounds.append((error * steps).expand(*steps.shape[:-1], 32).flatten(-2))
        return value + delta

    def product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rounded(x, Q8_ACTIVATION_ERROR), weights[id(weight)])

    weights = {id(m.weight): rounded(m.weight, Q8_WEIGHT_ERROR) for m in reference.modules()
               if isinstance(m, torch.nn.Linear)}
    weights[id(reference.lm_head)] = rounded(reference.lm_head, Q8_WEIGHT_ERROR)
    for module in reference.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = lambda x, w=module.weight: product(w, x)
    reference.logits = lambda hidden: product(reference.lm_head, _rms_norm(
        hidden, reference.final_norm_weight.double(), reference.config.rms_norm_eps))
    outputs = run_layer(reference, features.double(), ConcatenatedCache())
    flat = torch.cat([output.flatten() for output in outputs])
    rows = []
    for element in flat:  # one backward pass per output element (a few hundred)
        grads = torch.autograd.grad(element, perturbations, retain_graph=True,
                                    allow_unused=True)
        rows.append(sum(float((g.abs() * b).sum()) for g, b in zip(grads, bounds)
                        if g is not None))
    bound, at = torch.tensor(rows), 0
    shaped = []
    for output in outputs:
        shaped.append(bound[at:at + output.numel()].view(output.shape).float())
        at += output.numel()
    return shaped


@pytest.mark.parametrize("weights", ["bf16", "q8_0"])
def test_the_native_head_computes_the_heads_layer(target, tiny_head_file, weights):
    """NativeHead against DraftHead in float32 over the same bfloat16 values (its LM head
    rows rounded as NativeHead stores them): a prefill of 7 rows, a chain step and a tree
    level with its mask; up to float32 rounding with bf16 weights; with q8_0, within the
    first-order bound of the int8 roundings (:func:`int8_rounding_bound`, ×1.1 for the
    second-order terms, each at most 2/254 of a first-order one, and the curvature of the
    norms, SiLU and softmax over so small a step), plus float32 rounding."""
    from exactspec.backends import native
    from exactspec.draft_head.kernels import NativeHead

    kernels = native.load()
    if kernels is None:
        pytest.skip("the native kernels do not build here")
    head = load_head(tiny_head_file, target.target_tensors())
    head.lm_head = head.lm_head.bfloat16().float()
    fast = NativeHead(head, kernels, threads=2, weights=weights)
    features = torch.randn(7, head.config.feature_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected_outputs = run_layer(head, features)
    bounds = (int8_rounding_bound(head, features) if weights == "q8_0"
              else [torch.zeros_like(e) for e in expected_outputs])
    try:
        for isa in kernels.paths:
            kernels.isa = isa
            with torch.inference_mode():
                outputs = run_layer(fast, features)
            for got, expected, bound in zip(outputs, expected_outputs, bounds):
                allowed = 1.1 * bound + 2e-4
                assert (got - expected).abs().le(allowed).all(), (
                    weights, isa, float(((got - expected).abs() - allowed).max()))
                assert weights == "bf16" or not torch.equal(got, expected)
            assert outputs[2][0].sub(outputs[1][0]).abs().max() < 1e-5  # node 0's path = the step
    finally:
        kernels.isa = kernels.best_isa
    with pytest.raises(ValueError, match="weights = 'q4' is invalid: choose one of q8_0, q4_0, bf16"):
        NativeHead(head, kernels, threads=1, weights="q4")


@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
def test_the_native_heads_one_call_step_is_its_layer_and_lm_head(target, tiny_head_file,
                                                                 weights):
    """``es_head_step`` (NativeHead.draft_step, one C call; feature_step, fc inside it)
    against the same head's product-by-product path (explicit positions take it), on each
    instruction-set path the machine has: a prefill of 7 rows then two chain steps, the
    outputs, the cached keys and values and the last row's draft logits equal up to float32
    rounding (the same int8 products; only the norms' and RoPE's order of operations
    differs), and the drafted token is the same."""
    from exactspec.backends import native
    from exactspec.draft_head.kernels import NativeHead

    kernels = native.load()
    if kernels is None:
        pytest.skip("the native kernels do not build here")
    fast = NativeHead(load_head(tiny_head_file, target.target_tensors()), kernels, threads=2,
                      weights=weights)
    features = torch.randn(7, fast.config.feature_size, generator=torch.Generator().manual_seed(1))
    prompt = torch.tensor([3, 9, 4, 1, 5, 9, 2])
    try:
        for isa in kernels.paths:
            kernels.isa = isa
            one_call, by_products, projected = HeadCache(), HeadCache(), HeadCache()
            with torch.inference_mode():
                rows, logits = fast.draft_step(one_call, fast.fc(features), prompt)
                expected = fast.extend(by_products, fast.fc(features), prompt, torch.arange(7))
                # fc inside the call: the same int8 product as fc's, so the same values
                assert all(torch.equal(a, b) for a, b in zip(
                    fast.feature_step(projected, features, prompt), (rows, logits)))
                assert torch.equal(projected.keys, one_call.keys)
                for position, token in ((7, 6), (8, int(logits.argmax()))):
                    close(rows, expected)
                    expected_logits = fast.logits(expected[-1:])
                    close(logits, expected_logits)
                    assert int(logits.argmax()) == int(expected_logits.argmax())
                    rows, logits = fast.draft_step(one_call, rows[-1:], torch.tensor([token]))
                    expected = fast.extend(by_products, expected[-1:], torch.tensor([token]),
                                           torch.tensor([position]))
            assert len(one_call) == len(by_products) == 9
            close(one_call.keys, by_products.keys)
            close(one_call.values, by_products.values)
    finally:
        kernels.isa = kernels.best_isa
    with pytest.raises(ValueError, match="token ids must lie in"):
        fast.draft_step(HeadCache(), rows[-1:], torch.tensor([10 ** 6]))
    with pytest.raises(ValueError, match=f"rows of {fast.config.feature_size} features "
                                         "expected; got a tensor of shape"):
        fast.feature_step(HeadCache(), rows[-1:], torch.tensor([1]))


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding: 1e-3 of the largest magnitude."""
    torch.testing.assert_close(got, expected, atol=1e-3 * float(expected.abs().max()), rtol=0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.2)])
def test_a_sampled_draft_over_the_draft_vocabulary_is_the_full_vocabularys(params):
    """Without history-dependent steps, the head's q computed over its draft vocabulary
    (``_sampled_draw``) is the q of the full-vocabulary path (``draw_draft_token`` over the
    target's vocabulary, −inf outside the draft vocabulary): the same values, the same
    confidence, and a drawn token with q > 0. A broken control (q scattered to shuffled ids)
    differs."""
    from exactspec.logits_pipeline import LogitsPipeline
    from exactspec.proposers.base import draw_draft_token
    from exactspec.proposers.head import _sampled_draw

    vocab, generator = 300, torch.Generator().manual_seed(0)
    ids = torch.randperm(vocab, generator=generator)[:40]  # most frequent first, unsorted
    draft_logits = 3 * torch.randn(40, generator=generator)
    pipeline = LogitsPipeline(params, [1, 2, 3], vocab)
    assert pipeline.is_identity
    full_logits = torch.full((1, vocab), float("-inf"))
    full_logits[0, ids] = draft_logits
    expected = draw_draft_token(full_logits, [1, 2, 3], pipeline, torch.Generator().manual_seed(1), 1e-9)
    got = _sampled_draw(draft_logits, ids, pipeline, torch.Generator().manual_seed(1), vocab, 1e-9)
    torch.testing.assert_close(got.q, expected.q, atol=1e-6, rtol=0)
    assert got.confidence == pytest.approx(expected.confidence) and got.q[got.token] > 0
    assert float(got.q.sum()) == pytest.approx(1.0)
    shuffled = torch.zeros(vocab)
    shuffled[ids.flip(0)] = got.q[ids]
    assert not torch.allclose(shuffled, expected.q, atol=1e-6)
    assert _sampled_draw(draft_logits, ids, pipeline, generator, vocab, 0.999) is None


PROMPTS = [[1, 2, 3, 4, 5], [9, 9, 8], [30, 31, 2, 2, 40, 41, 7, 1]]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_equals_plain_decoding(target, tiny_head_file, k):
    proposer = HeadProposer(target, tiny_head_file)
    speculative = SpeculativeGenerator(target, proposer, k, "constant")
    plain = SpeculativeGenerator(target, None, 0)
    params = SamplingParams(max_new_tokens=40)
    for prompt in PROMPTS:
        result = speculative.generate(prompt, params)
        assert result.token_ids == plain.generate(prompt, params).token_ids
        assert all(n > 0 for n in result.stats.drafted_per_position[:k])


@pytest.mark.parametrize("tree", [None, 6])
def test_suffix_then_head_drafts_with_each_and_keeps_the_greedy_output(target, tiny_head_file,
                                                                        tree):
    """``suffix+head``: the head drafts (its chain or tree) in the cycles suffix has no match
    for, from features of positions suffix's drafts committed (its cache catches up)."""
    suffix = SuffixProposer(2, 8, 0.0)  # 2-grams: suffix has no match in many cycles
    proposer = FallbackProposer(suffix, HeadProposer(target, tiny_head_file, tree_nodes=tree))
    drafted, drafters = [], []
    propose = proposer.propose

    def counting(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        drafted.append(len(proposal))
        drafters.append(proposer.last_proposer is suffix)
        return proposal

    proposer.propose = counting
    speculative = SpeculativeGenerator(target, proposer, 3, "constant")
    plain = SpeculativeGenerator(target, None, 0)
    params = SamplingParams(max_new_tokens=40)
    for prompt in PROMPTS:
        assert speculative.generate(prompt, params).token_ids == plain.generate(
            prompt, params).token_ids
    by_suffix = sum(n for n, s in zip(drafted, drafters) if s)
    by_head = sum(n for n, s in zip(drafted, drafters) if not s)
    assert by_suffix >= 5 and by_head >= 50, (by_suffix, by_head)


@pytest.mark.parametrize("tree", [None, 6, "suffix+head"])
def test_batched_rows_each_keep_their_own_head_cache(target, tiny_head_file, tree):
    """Chains, token trees (each row its own, Backend.forward_trees), and a head behind
    suffix drafting (each row its own suffix index and head cache)."""
    proposer = (FallbackProposer(SuffixProposer(2, 8, 0.0), HeadProposer(target, tiny_head_file))
                if tree == "suffix+head" else HeadProposer(target, tiny_head_file, tree_nodes=tree))
    generator = SpeculativeGenerator(target, proposer, 3, "constant")
    plain = SpeculativeGenerator(target, None, 0)
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=20),
              SamplingParams(temperature=0.9, seed=4, max_new_tokens=25)]
    batched = BatchedGenerator(generator, 3).generate(PROMPTS, params)
    for prompt, param, result in zip(PROMPTS, params, batched):
        assert result.token_ids == generator.generate(prompt, param).token_ids
        if param.greedy:
            assert result.token_ids == plain.generate(prompt, param).token_ids
        assert result.stats.drafted_tokens > 0


def test_samples_after_the_first_restart_from_the_prompt(target, tiny_head_file):
    generator = SpeculativeGenerator(target, HeadProposer(target, tiny_head_file), 3, "constant")
    params = SamplingParams(temperature=1.0, seed=11, max_new_tokens=20)
    together = generator.generate_samples(PROMPTS[0], params, n=3)
    assert len({tuple(r.token_ids) for r in together}) > 1
    again = generator.generate_samples(PROMPTS[0], params, n=3)
    assert [r.token_ids for r in together] == [r.token_ids for r in again]


def _conversations(count: int = 40) -> list[Conversation]:
    rng = random.Random(0)
    return [Conversation(i, "", [rng.randrange(64) for _ in range(4)],
                         [rng.randrange(64) for _ in range(rng.randrange(8, 30))], "length")
            for i in range(count)]


def test_a_run_starts_from_an_initial_head(target, tiny_head_file, tmp_path):
    """initial_head: its weights, not a fresh head's (one update at a learning rate of
    1e-12 leaves them as they were), with this data's draft vocabulary; a head fusing
    other layers is refused."""
    initial = load_head(tiny_head_file, target.target_tensors())
    config = TrainingConfig(draft_vocab_size=40, total_updates=1, batch_tokens=256,
                            learning_rate=1e-12, eval_every=1, eval_conversations=4,
                            held_out_every=5, feature_layers=(0, 1))
    heads = {}
    for name, initial_head in (("continued", tiny_head_file), ("fresh", None)):
        path = train(target.model, _conversations(), tmp_path / name,
                     dataclasses.replace(config, initial_head=initial_head),
                     show_progress=False)
        heads[name] = load_head(path, target.target_tensors())
    assert torch.equal(heads["continued"].draft_token_ids, heads["fresh"].draft_token_ids)
    assert len(heads["continued"].draft_token_ids) == 40 != len(initial.draft_token_ids)
    for name, value in initial.named_parameters():
        assert torch.equal(dict(heads["continued"].named_parameters())[name], value), name
        assert not torch.allclose(dict(heads["fresh"].named_parameters())[name], value,
                                  atol=1e-2, rtol=1e-2), name
    with pytest.raises(ValueError, match="fuses the target's layers \\[0, 1\\]; this run "
                                         "fuses \\[1\\]"):
        train(target.model, _conversations(), tmp_path / "other",
              dataclasses.replace(config, feature_layers=(1,), initial_head=tiny_head_file),
              show_progress=False)


def test_a_run_trains_on_the_native_backends_features(target, tmp_path):
    """features = native: the features are a native backend's (the F32 file's agree with
    transformers' to rounding: the held-out agreement is the same to 2 decimals), kept
    apart from transformers' features; a backend other than the config's is refused."""
    native = pytest.importorskip("exactspec.backends.native_backend")
    from exactspec.backends import native as kernels
    from tiny_gguf import write_tiny_gguf

    if kernels.load() is None:
        pytest.skip("the native kernels do not build here")
    backend = native.NativeBackend(native.GGUFModel(write_tiny_gguf(target.model,
                                                                    tmp_path / "t.gguf")),
                                   CharTokenizer())
    config = TrainingConfig(draft_vocab_size=40, total_updates=4, batch_tokens=256,
                            eval_every=4, eval_conversations=8, held_out_every=5,
                            feature_layers=(0, 1))
    heads = {}
    for name, source in (("native", backend), ("transformers", None)):
        path = train(target.model, _conversations(), tmp_path / name,
                     dataclasses.replace(config, features=name), backend=source,
                     show_progress=False)
        heads[name] = head_metadata(path)["held_out_agreement"]
        assert (path.parent / ("features-native" if source else "features")).is_dir()
    assert heads["native"] == pytest.approx(heads["transformers"], abs=0.01)
    with pytest.raises(ValueError, match="trains on the native backend's features; "
                                         "the transformers backend's were given"):
        train(target.model, _conversations(), tmp_path / "other",
              dataclasses.replace(config, features="native"), show_progress=False)
    # resuming the native run with transformers' features says which backend resumes it
    with pytest.raises(ValueError, match="features = 'transformers' \\(the run's: 'native'\\) "
                                         "\\(its features are the native backend's: resume it "
                                         "on that backend, --backend native\\)"):
        train(target.model, _conversations(), tmp_path / "native",
              dataclasses.replace(config, features="transformers"), show_progress=False)


def test_a_resumed_run_trains_the_same_head_as_an_uninterrupted_one(target, tmp_path):
    config = TrainingConfig(draft_vocab_size=40, total_updates=8, batch_tokens=256,
                            eval_every=4, eval_conversations=4, held_out_every=5,
                            feature_layers=(0, 1))
    whole = train(target.model, _conversations(), tmp_path / "whole", config, show_progress=False)
    halves = tmp_path / "halves"
    train(target.model, _conversations(), halves, config, max_minutes=1e-9,
          show_progress=False)  # stops after its first update
    assert json.loads((halves / "history.json").read_text())["updates"] == [1]
    resumed = train(target.model, _conversations(), halves, None, show_progress=False)
    one, other = load_head(whole, target.target_tensors()), load_head(resumed, target.target_tensors())
    for (name, a), (_, b) in zip(one.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    history = json.loads((halves / "history.json").read_text())
    assert history["updates"] == [1, 4, 8]
    assert len(history["held_out_agreement"][-1]) == config.eval_steps
    assert (halves / "training.png").stat().st_size > 0
    assert head_metadata(resumed)["updates"] == 8


def test_a_head_file_holds_bf16_weights_loaded_exactly(target, tmp_path):
    head = new_head(target.model, torch.arange(50).flip(0), "tiny", (0, 1), seed=5)
    save_head(head, tmp_path / "h.safetensors", {"note": "test"})
    loaded = load_head(tmp_path / "h.safetensors", target.target_tensors())
    for name, parameter in head.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name],
                           parameter.detach().bfloat16().float()), name
    assert torch.equal(loaded.draft_token_ids, torch.arange(50).flip(0))
    assert head_metadata(tmp_path / "h.safetensors") == {"note": "test"}
    other = tiny_backend(0, model=None, vocab=64)
    other.model.config.num_hidden_layers = 3
    with pytest.raises(ValueError, match="trained for a target of 2 layers"):
        load_head(tmp_path / "h.safetensors", other.target_tensors())
    (tmp_path / "bad.safetensors").write_bytes(b"not a head")
    with pytest.raises(ValueError, match="is not a draft head file"):
        load_head(tmp_path / "bad.safetensors", target.target_tensors())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_head(tmp_path / "missing.safetensors", target.target_tensors())


def test_refusals(target):
    class NoFeatures:
        name = "llama_cpp"
        provides_hidden_features = False

    with pytest.raises(UnsupportedModelError, match="the llama_cpp backend cannot give; use "
                                                    "the native \\(a GGUF file\\) or transformers"):
        HeadProposer(NoFeatures())
    with pytest.raises(UnsupportedModelError, match="no draft head is shipped for this target"):
        shipped_head(target.target_tensors())
    spec = parse_proposer("head:/some/where.safetensors")
    assert (spec.kind, spec.head) == ("head", "/some/where.safetensors")
    assert parse_proposer("head").head is None


def test_chained_acceptance_stops_each_chain_at_its_first_miss():
    flags = [torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 1.0]),
             torch.tensor([1.0, 1.0])]
    roots = [torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2]), torch.tensor([0, 2])]
    # step 0: 3 of 4; step 1: roots 0..2 → 0 ok, 1 miss, 2 missed before → 1 of 3;
    # step 2: roots 0, 2 → root 0 ok → 1 of 2
    assert chained_acceptance(flags, roots) == [0.75, 1 / 3, 0.5]


def test_train_draft_command_trains_a_head_that_generate_uses(model_folder, tmp_path, capsys):
    from exactspec import cli, load_model
    from exactspec.training.data import synthesize

    data = tmp_path / "conversations.jsonl"
    synthesize(load_model(str(model_folder), backend="transformers"), data, 8,
               topics=["cats", "maps"], question_tokens=6, answer_tokens=24, show_progress=False)
    run = tmp_path / "run"
    args = ["train-draft", "--model", str(model_folder), "--data", str(data), "--output", str(run),
            "--updates", "4", "--batch-tokens", "256", "--eval-every", "2",
            "--draft-vocab-size", "40"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert f"head: {run / 'head.safetensors'} (4 of 4 steps" in err
    assert "held-out greedy acceptance per drafted position" in err
    assert json.loads((run / "history.json").read_text())["updates"] == [2, 4]
    assert cli.main(args) == 0  # resumes: nothing left to do, the same head
    assert "resuming the run" in capsys.readouterr().err
    # resuming with other targets is refused (it trained nothing, exited 0 and printed
    # "4 of 8 steps"), naming each changed setting
    assert cli.main([*args[:-7], "8", *args[-6:]]) == 1
    err = capsys.readouterr().err
    assert "total_updates = 8 (the run's: 4)" in err and "another folder" in err
    assert json.loads((run / "history.json").read_text())["updates"] == [2, 4]
    outputs = []
    for proposer in (f"head:{run / 'head.safetensors'}", "plain"):
        assert cli.main(["generate", "tell me", "--model", str(model_folder), "--proposer",
                         proposer, "--max-new-tokens", "30", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    assert outputs[0]["stats"]["drafted_tokens"] > 0
    assert outputs[0]["method"] == f"draft head {run / 'head.safetensors'}"


def test_train_draft_reads_several_data_files_in_order(model_folder, tmp_path, capsys):
    from exactspec import cli, load_model
    from exactspec.training.data import synthesize

    first, again = tmp_path / "first.jsonl", tmp_path / "again.jsonl.gz"
    synthesize(load_model(str(model_folder), backend="transformers"), first, 6,
               topics=["cats", "maps"], question_tokens=6, answer_tokens=16, show_progress=False)
    again.write_bytes(gzip.compress(first.read_bytes()))  # the same conversations again
    run = tmp_path / "run"
    assert cli.main(["train-draft", "--model", str(model_folder), "--data", str(first),
                     "--data", str(again), "--output", str(run), "--updates", "2",
                     "--batch-tokens", "128", "--eval-every", "2",
                     "--draft-vocab-size", "40"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "6 conversations repeat an earlier prompt: left out" in err
    assert "(2 of 2 steps" in err


@pytest.mark.parametrize("args, message", [
    (["--data", "/nowhere.jsonl"], "--data /nowhere.jsonl: no such file (add --synthesize N"),
    (["--data", "x.jsonl", "--backend", "llama_cpp"], "a draft head is trained on the hidden "
                                                      "features of the native or the transformers"),
    (["--data", "x.jsonl", "--minutes", "0"], "--minutes 0.0 is invalid"),
    (["--data", "x.jsonl", "--data", "y.jsonl", "--synthesize", "2"],
     "--synthesize extends one --data file: give one"),
    (["--data", "x.jsonl", "--initial-head", "/nowhere.safetensors"],
     "--initial-head /nowhere.safetensors: no such file"),
    (["--data", "x.jsonl", "--tasks", "math"], "--tasks chooses what --synthesize writes"),
    (["--data", "x.jsonl", "--passages", "written"],
     "--passages chooses what --synthesize writes"),
    (["--data", "x.jsonl", "--synthesize", "2", "--passages", "wiki"],
     "argument --passages: invalid choice: 'wiki'"),
    (["--data", "x.jsonl", "--synthesize", "2", "--exclude-questions", "q.jsonl"],
     "--corpus-wheel and --exclude-questions are for --passages corpus"),
    (["--data", "x.jsonl", "--synthesize", "2", "--passages", "corpus", "--corpus-wheel",
      "/nowhere.whl"], "--passages corpus: /nowhere.whl is not gensim's wheel with its test data"),
    (["--data", "x.jsonl", "--synthesize", "2", "--tasks", "math,poems"],
     "argument --tasks: poems is not a task: choose from question, writing"),
])
def test_train_draft_refuses_bad_arguments(model_folder, capsys, args, message):
    from exactspec import cli

    with pytest.raises(SystemExit) as exit:
        cli.main(["train-draft", "--model", str(model_folder), *args])
    assert exit.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_train_draft_corpus_passages_leave_out_the_questions_to_exclude(tmp_path):
    """--passages corpus: the wheel's passages, less those sharing 13 words in a row with a
    prompt of an --exclude-questions file."""
    from exactspec import cli
    from exactspec.cli.train_draft import _corpus_passages

    from conftest import write_corpus_wheel

    kept, benchmarked = (" ".join(f"{word}{i}" for i in range(150)) for word in ("a", "b"))
    wheel = write_corpus_wheel(tmp_path / "gensim.whl", [kept, benchmarked], [])
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "summarization", "turns": [
        "Summarize: " + " ".join(f"b{i}" for i in range(100, 113))]}) + "\n")
    base = ["train-draft", "--model", "m", "--data", "x.jsonl", "--synthesize", "2",
            "--passages", "corpus", "--corpus-wheel", str(wheel)]
    parser = cli.build_parser(base)
    assert _corpus_passages(parser.parse_args(base)) == [kept, benchmarked]
    excluded = parser.parse_args([*base, "--exclude-questions", str(questions)])
    assert _corpus_passages(excluded) == [kept]


def test_generate_refuses_a_missing_head_file_before_loading(model_folder, capsys):
    from exactspec import cli

    assert cli.main(["generate", "hi", "--model", str(model_folder), "--proposer",
                     "head:/no/such.safetensors"]) == 1
    assert "--proposer head:/no/such.safetensors: draft head '/no/such.safetensors' does not " \
           "exist" in " ".join(capsys.readouterr().err.split())


def test_the_head_stops_where_its_drafts_cumulative_probability_falls_below_the_threshold(
        target, tiny_head_file):
    from exactspec.logits_pipeline import LogitsPipeline

    proposer = HeadProposer(target, tiny_head_file)
    proposer.follow(301)
    prompt = PROMPTS[2]
    target.prefill(301, prompt[:-1])
    pipeline = LogitsPipeline(SamplingParams(), prompt, target.vocab_size)
    rng = torch.Generator()
    full = proposer.propose(prompt, 6, pipeline, rng)
    assert len(full) == 6
    # the product of the top probabilities along the full draft, step by step
    products, product = [], 1.0
    for i in range(6):
        proposer.reset()
        logits = _head_logits(proposer, prompt, full.token_ids[:i])
        product *= float(pipeline.process(logits, [*prompt, *full.token_ids[:i]])
                         .softmax(-1).max())
        products.append(product)
    for threshold in (products[1] * 1.001, products[3] * 0.999):
        proposer.reset()
        stopped = proposer.propose(prompt, 6, pipeline, rng, min_confidence=threshold)
        assert stopped.token_ids == full.token_ids[:sum(p >= threshold for p in products)]
    target.release(301)


def _head_logits(proposer, prompt, drafted):
    """The target-vocabulary logits the head gives for the token after prompt + drafted."""
    head = proposer.head
    with torch.inference_mode():
        hidden, draft_logits = proposer._sync(prompt)
        cache_rows = len(proposer._state.cache)
        for token in drafted:
            hidden, draft_logits = head.draft_step(proposer._state.cache, hidden,
                                                   torch.tensor([token]))
        proposer._state.cache.crop(cache_rows)
        logits = torch.full((1, proposer.target.vocab_size), float("-inf"))
        logits[0, head.draft_token_ids] = draft_logits[0]
    return logits


class _RecordingHeadProposer(HeadProposer):
    """The head's proposer, keeping every cycle's context and proposal."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], object]] = []

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
        proposal = super().propose(token_ids, k, pipeline, rng, min_confidence)
        self.calls.append((list(token_ids), proposal))
        return proposal


ALIGNMENT_PROMPTS = PROMPTS + [[random.Random(n).randrange(64) for _ in range(2 + n % 5)]
                               for n in range(9)]


def _drafts_against_teacher_forcing(target, head_file, tmp_path, tree_nodes=None,
                                    features=None, model=None):
    """Greedy generations drafted by the head inside the engine (k = 2, a chain or a tree),
    and the training code's teacher-forced drafts (its own features by prefill on
    ``features``, a backend of their own, or None: the transformers ``model``'s, by default
    the target's; then ``DraftHead.unrolled``) on the same conversations: per cycle, (first
    cycle?, the engine's depth-1 draft, the teacher-forced one, and at depth 2 — where the
    depth-1 draft was the target's next token — the engine's and the teacher-forced one)."""
    from exactspec.training.train import extract_features, make_batch

    proposer = _RecordingHeadProposer(target, head_file, dtype=torch.float32,
                                      tree_nodes=tree_nodes)
    generator = SpeculativeGenerator(target, proposer, 2, "constant")
    conversations, calls = [], []
    for index, prompt in enumerate(ALIGNMENT_PROMPTS):
        proposer.calls = []
        result = generator.generate(prompt, SamplingParams(max_new_tokens=30))
        conversations.append(Conversation(index, "", list(prompt), result.token_ids, "length"))
        calls.append(proposer.calls)
    head = proposer.head
    examples = extract_features(model or target.model, conversations, tmp_path,
                                head.config.feature_layers, backend=features,
                                show_progress=False)
    rows = []
    with torch.no_grad():
        for example, cycles in zip(examples, calls):
            outputs = head.unrolled(make_batch([example], 2).features,
                                    make_batch([example], 2).token_ids, 2)
            forced = [head.draft_token_ids[head.logits(output[0]).argmax(-1)].tolist()
                      for output in outputs]
            full = example.tokens.tolist()
            for context, proposal in cycles:
                at = len(context)  # drafts tokens at, at + 1 from row at − 2
                if at + 1 >= len(full) or not proposal.token_ids:
                    continue
                tokens, parents = proposal.token_ids, proposal.parents or [
                    i - 1 for i in range(len(proposal.token_ids))]
                depth1 = tokens[parents.index(-1)]  # a tree's first root child: its best
                children = [t for t, p in zip(tokens, parents)
                            if p >= 0 and tokens[p] == full[at] and parents[p] == -1]
                rows.append((at == example.prompt_length, depth1, forced[0][at - 2],
                             children[0] if children else None, forced[1][at - 2]))
    return rows


@pytest.mark.parametrize("backend", ["transformers", "native"])
@pytest.mark.parametrize("tree_nodes", [None, 6])
def test_the_engines_drafts_are_the_training_codes_teacher_forced_drafts(
        target, tiny_head_file, tmp_path, tree_nodes, backend):
    """Issue 43's alignment check: drafting inside the engine (features from the target's
    prefill and verification forwards, the head's cache across cycles, a tree's parent
    links) proposes at every cycle, the first included, what the training code's
    teacher-forced forward drafts at the same position: any misalignment between the
    features training saw and those drafting reads would show as a difference. On the
    native backend training reads the features of a native backend of its own (packed
    chunks), drafting those of the target's prefill and verification blocks."""
    features = None
    if backend == "native":
        native = pytest.importorskip("exactspec.backends.native_backend")
        from exactspec.backends import native as kernels
        from tiny_gguf import write_tiny_gguf

        if kernels.load() is None:
            pytest.skip("the native kernels do not build here")
        path = write_tiny_gguf(target.model, tmp_path / "tiny.gguf")
        target, features = (native.NativeBackend(native.GGUFModel(path), CharTokenizer())
                            for _ in range(2))
    rows = _drafts_against_teacher_forcing(target, tiny_head_file, tmp_path / "features",
                                           tree_nodes, features, model=tiny_backend(0).model)
    first = [row for row in rows if row[0]]
    assert len(first) == len(ALIGNMENT_PROMPTS)
    assert sum(row[3] is not None for row in rows) >= 5  # depth 2 compared, first cycles too
    assert any(row[3] is not None for row in first)
    assert all(row[1] == row[2] for row in rows)
    assert all(row[3] == row[4] for row in rows if row[3] is not None)


def test_features_one_position_off_are_caught(tiny_head_file, tmp_path):
    """Control: a target whose features are one position late (row s reads s − 1's) drafts
    other tokens than teacher forcing at some cycle."""
    shifted = tiny_backend(0)
    features = shifted.hidden_features

    def one_late(sequence, start):
        every = features(sequence, 0)
        return torch.cat([every[:1], every[:-1]])[start:]

    shifted.hidden_features = one_late
    rows = _drafts_against_teacher_forcing(shifted, tiny_head_file, tmp_path)
    assert any(row[1] != row[2] or (row[3] is not None and row[3] != row[4]) for row in rows)

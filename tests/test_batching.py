"""Batched decoding (exactspec.batching): every row exact whatever its companions.

Greedy rows equal decoding them alone token for token, a seeded row gives what
``generate`` gives, rows join and leave between cycles, the packed forward scores each
sequence bit for bit as alone on both backends, the batch-level ``auto`` policy gives way
to batching as the batch fills, and the per-position distribution test passes under
batched decoding with the batch choosing k (with broken controls that must fail).
"""

from __future__ import annotations

import pytest
import torch

from conftest import one, perturbed_backend, tiny_backend
from exactspec import (BatchedGenerator, DraftModelProposer, EarlyExitProposer,
                       PromptLookupProposer, SamplingParams, SpeculativeGenerator, SuffixProposer)
from exactspec.audit import BatchedEngine, audit_distribution
from exactspec.audit.broken import BROKEN_VERIFIERS, BrokenGenerator
from exactspec.backends.base import check_sequence_invariance
from exactspec.proposers.base import Proposal, Proposer
from exactspec.proposers.fallback import FallbackProposer
from exactspec.speculation_length import ForwardCost, batch_speculation_lengths

PROMPTS = [[1, 5, 9, 3, 1, 5, 9], [2, 7], [4, 4, 4, 8, 1, 2, 3, 4, 4], [3] * 5,
           [9, 8, 7, 9, 8, 7, 9, 8], [6, 1, 6, 1, 6]]


def proposers():
    return {"plain": None, "prompt-lookup": PromptLookupProposer(1, 3), "suffix": SuffixProposer()}


def test_the_packed_forward_scores_each_sequence_as_alone(make_backend):
    target = make_backend(0)
    target.reserve(4)  # three sequences, and one to score each alone
    assert check_sequence_invariance(target) and target.sequences_invariant
    prompts = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 2, 3]]
    for i, prompt in enumerate(prompts):
        target.prefill(i, prompt[:-1])
    rows = [(0, [3, 10, 11]), (1, [7]), (2, [3, 20, 21, 22, 23])]
    together = target.forward(rows)
    target.rollback(2, 2)
    assert target.num_cached_tokens(2) == 9
    again = target.forward([(2, [22, 23]), (0, [12])])
    for (i, tokens), logits in zip(rows, together):
        one(target).prefill(prompts[i][:-1])
        alone = torch.cat([one(target).forward([t]) for t in tokens])
        assert torch.equal(alone, logits)
        if i == 2:
            assert torch.equal(alone[3:], again[0])
    with pytest.raises(ValueError, match="not held"):
        target.forward([(7, [1])])
    with pytest.raises(ValueError, match="at least one row"):
        target.forward([(0, [])])
    with pytest.raises(ValueError, match="rollback"):
        target.rollback(1, 5)
    target.release(1)
    with pytest.raises(ValueError, match="not held"):
        target.num_cached_tokens(1)


def test_a_prefill_continued_in_chunks_is_bit_identical_to_one_call(make_backend):
    target = make_backend(0, max_context=2048)
    target.reserve(3)
    chunk = target.prefill_chunk_size
    prompt = [(7 * i + 3) % 64 for i in range(2 * chunk + 40)]
    target.prefill(0, prompt[:chunk])
    target.prefill(0, prompt[chunk:2 * chunk])
    target.prefill(0, prompt[2 * chunk:])
    assert target.num_cached_tokens(0) == len(prompt)
    chunked = target.forward([(0, [5, 9, 1])])[0]
    one(target).prefill(prompt)
    assert torch.equal(chunked, one(target).forward([5, 9, 1]))
    target.prefill(1, [1])  # a sequence not held is held from its first prefill
    assert target.num_cached_tokens(1) == 1
    target.release(1)
    with pytest.raises(ValueError, match="exceed"):
        target.prefill(0, [1] * 2048)


class FakeClock:
    """The batch's, engine's and requests' ``time.perf_counter`` on a clock the test moves:
    a forward costs ``forward`` seconds, a prefill ``per_token`` seconds per token; host
    work costs nothing."""

    def __init__(self, monkeypatch, target, forward=0.010, per_token=0.001) -> None:
        import types

        import exactspec.batching
        import exactspec.generator
        import exactspec.request

        self.now = 0.0
        fake = types.SimpleNamespace(perf_counter=lambda: self.now)
        for module in (exactspec.batching, exactspec.generator, exactspec.request):
            monkeypatch.setattr(module, "time", fake)
        real_forward, real_prefill = target.forward, target.prefill

        def timed_forward(rows, num_logits=None):
            self.now += forward
            return real_forward(rows, num_logits)

        def timed_prefill(sequence_id, token_ids):
            self.now += per_token * len(token_ids)
            return real_prefill(sequence_id, token_ids)

        monkeypatch.setattr(target, "forward", timed_forward)
        monkeypatch.setattr(target, "prefill", timed_prefill)


def test_a_long_prompt_joins_in_chunks_while_the_others_decode(make_backend, monkeypatch):
    """A prompt of three prefill chunks joins a batch that is decoding (issue 40): its
    chunks take the time the decoding row can spare, so that row's time per token during
    the prefill stays within 2× its time per token alone (a chunk costs 3 decoding cycles
    here, so it waits for the credit of about 4); both outputs equal decoding alone."""
    target = make_backend(0, max_context=2048)
    target.reserve(3)
    chunk = target.prefill_chunk_size
    clock = FakeClock(monkeypatch, target, forward=0.010, per_token=0.030 / chunk)
    long_prompt = [(5 * i + 1) % 64 for i in range(2 * chunk + 30)]
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 4, "constant")
    batched = BatchedGenerator(generator, max_batch_size=2)
    events = []
    params = SamplingParams(max_new_tokens=40)
    short = batched.submit(PROMPTS[0], params, on_commit=lambda sample, tokens: events.append(
        ("short", len(tokens), clock.now)))
    for _ in range(3):
        batched.step()
    long = batched.submit(long_prompt, SamplingParams(max_new_tokens=5), on_commit=lambda
                          sample, tokens: events.append(("long", len(tokens), clock.now)))
    outputs = {}
    while batched.num_active or batched.num_waiting:
        outputs.update(batched.step())
    first_long = [name for name, _, _ in events].index("long")
    idle = (events[2][2] - events[1][2]) / events[2][1]  # seconds per token, no prefill
    during = events[3:first_long + 1]
    per_token = (during[-1][2] - events[2][2]) / sum(n for name, n, _ in during if name == "short")
    assert idle == pytest.approx(0.010) and per_token <= 2 * idle, (idle, per_token)
    assert len(during) >= 6  # the short row kept committing between the three chunks
    plain = SpeculativeGenerator(make_backend(0, max_context=2048), None)
    assert outputs[short][0].token_ids == plain.generate(PROMPTS[0], params).token_ids
    assert (outputs[long][0].token_ids
            == plain.generate(long_prompt, SamplingParams(max_new_tokens=5)).token_ids)
    assert outputs[long][0].stats.prefill_seconds > 0


def test_a_short_prompt_arriving_during_a_long_prefill_is_not_blocked_behind_it(make_backend,
                                                                                monkeypatch):
    """No row decodes: a long prompt is prefilled PREFILL_SECONDS_ALONE at a time (here a
    chunk costs 0.2 s: one chunk per cycle), so a short one submitted after its first chunk
    joins at the next cycle, is prefilled first, and emits its first token while the long
    one is still being prefilled; both outputs equal decoding alone."""
    target = make_backend(0, max_context=4096)
    chunk = target.prefill_chunk_size
    FakeClock(monkeypatch, target, forward=0.010, per_token=0.2 / chunk)
    long_prompt = [(5 * i + 1) % 64 for i in range(4 * chunk + 30)]
    batched = BatchedGenerator(SpeculativeGenerator(target, PromptLookupProposer(1, 3), 4,
                                                    "constant"), max_batch_size=2)
    events = []
    params = SamplingParams(max_new_tokens=5)
    long = batched.submit(long_prompt, params,
                          on_commit=lambda sample, tokens: events.append("long"))
    outputs = batched.step()  # the long prompt's first chunk
    short = batched.submit(PROMPTS[0], params,
                           on_commit=lambda sample, tokens: events.append("short"))
    cycles_to_first_short = None
    cycles = 0
    while batched.num_active or batched.num_waiting:
        outputs.update(batched.step())
        cycles += 1
        if "short" in events and cycles_to_first_short is None:
            cycles_to_first_short = cycles
    assert cycles_to_first_short <= 2  # one cycle to prefill, one to decode its first token
    assert events[0] == "short"  # before the long prompt's first token
    plain = SpeculativeGenerator(make_backend(0, max_context=4096), None)
    assert outputs[short][0].token_ids == plain.generate(PROMPTS[0], params).token_ids
    assert outputs[long][0].token_ids == plain.generate(long_prompt, params).token_ids


@pytest.mark.parametrize("max_wait", [None, float("inf")])
def test_a_long_prompt_is_not_starved_by_short_ones_arriving_behind_it(make_backend,
                                                                       monkeypatch, max_wait):
    """Two rows decode; a long prompt (two chunks of 0.2 s each) joins, and short prompts
    (0.05 s of prefill each) keep arriving behind it, one always waiting. Fewest tokens
    first alone (the control: PREFILL_MAX_WAIT infinite) prefills every short one first and
    the decoding rows' credit never reaches a long chunk's cost, so the long prompt never
    starts within 12 s; with PREFILL_MAX_WAIT (2 s) it goes first once it has waited that
    long and emits its first token within about a second after."""
    import exactspec.batching

    if max_wait is not None:
        monkeypatch.setattr(exactspec.batching, "PREFILL_MAX_WAIT", max_wait)
    target = make_backend(0, max_context=4096)
    chunk = target.prefill_chunk_size
    clock = FakeClock(monkeypatch, target, forward=0.010, per_token=0.2 / chunk)
    batched = BatchedGenerator(SpeculativeGenerator(target, None), max_batch_size=4)
    for prompt in PROMPTS[:2]:
        batched.submit(prompt, SamplingParams(max_new_tokens=4000, ignore_eos=True))
    batched.step()
    first_long = []
    batched.submit([(5 * i + 1) % 64 for i in range(chunk + 30)], SamplingParams(max_new_tokens=2),
                   on_commit=lambda sample, tokens: first_long.append(clock.now))
    short_prompt = [(3 * i + 2) % 64 for i in range(chunk // 4)]
    shorts = 0
    while not first_long and clock.now < 12.0:
        if not batched.num_waiting:
            batched.submit(short_prompt, SamplingParams(max_new_tokens=2))
            shorts += 1
        batched.step()
    if max_wait is None:
        assert first_long and first_long[0] < exactspec.batching.PREFILL_MAX_WAIT + 1.5
    else:
        assert not first_long and shorts > 50  # starved


@pytest.mark.parametrize("policy", ["constant", "auto"])
@pytest.mark.parametrize("proposer_name", ["plain", "prompt-lookup", "suffix"])
def test_greedy_rows_equal_decoding_them_alone(proposer_name, policy, make_backend):
    """Six requests of different prompts and lengths, three at a time (rows join as others
    finish), equal plain decoding of each alone; the same request in another batch too."""
    target = make_backend(0)
    generator = SpeculativeGenerator(target, proposers()[proposer_name], 4, policy)
    params = [SamplingParams(max_new_tokens=10 + 7 * i) for i in range(len(PROMPTS))]
    batched = BatchedGenerator(generator, max_batch_size=3)
    results = batched.generate(PROMPTS, params)
    plain = SpeculativeGenerator(make_backend(0), None)
    expected = [plain.generate(p, q).token_ids for p, q in zip(PROMPTS, params)]
    assert [r.token_ids for r in results] == expected
    assert [len(r.token_ids) for r in results] == [p.max_new_tokens for p in params]
    assert batched.num_active == batched.num_waiting == 0
    if proposer_name != "plain" and policy == "constant":  # under auto, drafting follows timings
        assert sum(r.stats.accepted_tokens for r in results) > 0
    other = BatchedGenerator(generator, max_batch_size=2).generate(PROMPTS[::-1], params[::-1])
    assert [r.token_ids for r in other] == expected[::-1]


@pytest.mark.parametrize("policy", ["constant", "auto", "heuristic"])
def test_a_seeded_row_samples_what_it_samples_alone(policy, make_backend):
    target = make_backend(0)
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3, policy)
    params = [SamplingParams(temperature=0.9, top_k=10, seed=i, max_new_tokens=12 + i)
              for i in range(len(PROMPTS))]
    alone = [generator.generate(p, q).token_ids for p, q in zip(PROMPTS, params)]
    for size in (1, 2, 4):
        results = BatchedGenerator(generator, max_batch_size=size).generate(PROMPTS, params)
        assert [r.token_ids for r in results] == alone


@pytest.mark.parametrize("policy", ["constant", "auto"])
def test_rows_keep_their_own_parameters_stops_and_logprobs(policy):
    """Greedy rows (k from the batch under auto) beside seeded ones (k their own): each
    as alone, with stop token ids, a stop string, logprobs, penalties, min_new_tokens."""
    target = tiny_backend(0)
    generator = SpeculativeGenerator(target, SuffixProposer(), 4, policy)
    plain = SpeculativeGenerator(tiny_backend(0), None)
    first = plain.generate(PROMPTS[0], SamplingParams(max_new_tokens=12))
    stop_token = first.token_ids[5]
    params = [SamplingParams(max_new_tokens=12, stop_token_ids=(stop_token,)),
              SamplingParams(max_new_tokens=9, logprobs=2),
              SamplingParams(max_new_tokens=15, frequency_penalty=0.7, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=10, temperature=0.7, seed=5, min_new_tokens=4),
              SamplingParams(max_new_tokens=20, stop=(target.tokenizer.decode(first.token_ids[3:5]),)),
              SamplingParams(max_new_tokens=14, temperature=1.0, seed=8, top_k=12)]
    prompts = [*PROMPTS[:4], PROMPTS[0], PROMPTS[4]]
    results = BatchedGenerator(generator, 6).generate(prompts, params)
    for prompt, p, result in zip(prompts, params, results):
        alone = generator.generate(prompt, p)  # the same proposer and k: the same draws
        if p.greedy:
            assert alone.token_ids == plain.generate(prompt, p).token_ids
        assert result.token_ids == alone.token_ids
        assert result.finish_reason == alone.finish_reason
        assert result.stop_reason == alone.stop_reason
        if p.logprobs:
            assert [lp.token_id for lp in result.logprobs] == result.token_ids
            assert result.logprobs == alone.logprobs  # bit for bit
    assert results[0].finish_reason == "stop" and results[0].token_ids[-1] == stop_token
    assert results[4].finish_reason == "stop" and results[4].stop_reason == params[4].stop[0]


def test_streaming_callbacks_get_every_token_in_order():
    generator = SpeculativeGenerator(tiny_backend(0), PromptLookupProposer(1, 3), 4, "constant")
    batched = BatchedGenerator(generator, 2)
    streamed: dict[tuple[int, int], list[int]] = {}
    ids = [batched.submit(p, SamplingParams(max_new_tokens=15), n=1 + i % 2,
                          on_commit=lambda sample, tokens, i=i:
                          streamed.setdefault((i, sample), []).extend(tokens))
           for i, p in enumerate(PROMPTS[:3])]
    assert batched.num_waiting == 3
    outputs = {}
    while len(outputs) < 3:
        outputs.update(batched.step())
        assert batched.num_active <= 2
    for i, request_id in enumerate(ids):
        assert [streamed[i, s] for s in range(1 + i % 2)] == [
            r.token_ids for r in outputs[request_id]]


@pytest.mark.parametrize("policy", ["constant", "auto"])
def test_n_samples_of_a_seeded_request_equal_generate_samples(policy, make_backend):
    """n samples of one prompt decode one after another in the request's row on one rng,
    so a seeded request gives what generate_samples gives, beside other requests."""
    target = make_backend(0)
    generator = SpeculativeGenerator(target, SuffixProposer(), 3, policy)
    params = SamplingParams(temperature=1.0, seed=11, max_new_tokens=9)
    expected = generator.generate_samples(PROMPTS[0], params, n=3)
    batched = BatchedGenerator(generator, 3)
    ids = [batched.submit(PROMPTS[0], params, n=3), batched.submit(PROMPTS[1]),
           batched.submit(PROMPTS[2], params, n=2)]
    outputs = {}
    while len(outputs) < 3:
        outputs.update(batched.step())
    assert [r.token_ids for r in outputs[ids[0]]] == [r.token_ids for r in expected]
    assert len({tuple(r.token_ids) for r in outputs[ids[0]]}) > 1
    assert outputs[ids[0]][0].stats.prefill_seconds > 0 == outputs[ids[0]][1].stats.prefill_seconds


def test_a_failing_request_ends_alone_and_cancel_drops_one(make_backend):
    """A request whose parameters leave nothing to sample, one whose prefill fails, and one
    cancelled from a streaming callback of another end alone: the others' tokens are those
    of decoding them alone, and every sequence is released."""
    target = make_backend(0)
    generator = SpeculativeGenerator(target, SuffixProposer(), 3, "constant")
    batched = BatchedGenerator(generator, 4)
    params = SamplingParams(max_new_tokens=12)
    alone = [generator.generate(p, params).token_ids for p in PROMPTS[:2]]
    holder = {}
    good = batched.submit(PROMPTS[0], params,
                          on_commit=lambda sample, tokens: batched.cancel(holder["dropped"]))
    banned = SamplingParams(max_new_tokens=6, banned_token_ids=tuple(range(target.vocab_size)))
    bad = batched.submit(PROMPTS[1], banned)
    holder["dropped"] = batched.submit(PROMPTS[2], params)
    extend = target.prefill

    def failing_prefill(sequence_id, token_ids):  # e.g. out of memory on a long prompt
        if len(token_ids) == 29:
            raise RuntimeError("out of memory")
        extend(sequence_id, token_ids)

    target.prefill = failing_prefill
    too_long = batched.submit(list(range(1, 31)), params)
    other = batched.submit(PROMPTS[1], params)
    outputs = batched.step()
    assert isinstance(outputs[bad], ValueError) and "every token is banned" in str(outputs[bad])
    assert isinstance(outputs[too_long], RuntimeError), outputs[too_long]
    while not (good in outputs and other in outputs):
        outputs.update(batched.step())
    assert holder["dropped"] not in outputs and batched.num_active == batched.num_waiting == 0
    assert outputs[good][0].token_ids == alone[0] and outputs[other][0].token_ids == alone[1]
    for request_id in (good, bad, holder["dropped"], too_long, other):
        with pytest.raises(ValueError, match="not held"):
            target.num_cached_tokens(request_id)


def test_two_batches_on_one_target_never_share_a_sequence():
    target = tiny_backend(0)
    params = SamplingParams(max_new_tokens=15)
    alone = [SpeculativeGenerator(target, None).generate(p, params).token_ids for p in PROMPTS[:2]]
    first = BatchedGenerator(SpeculativeGenerator(target, None), 2)
    second = BatchedGenerator(SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3), 2)
    a = first.submit(PROMPTS[0], params)
    first.step()
    b = second.submit(PROMPTS[1], params)
    outputs = {}
    while a not in outputs or b not in outputs:
        outputs.update(first.step())
        outputs.update(second.step())
    assert [outputs[a][0].token_ids, outputs[b][0].token_ids] == alone


class OneSequenceDraft(DraftModelProposer):
    """A draft model that says it is not batchable (as a proposer of a user's own may)."""

    batchable = False


def test_what_cannot_be_batched_is_refused():
    target = tiny_backend(0)
    one_sequence = OneSequenceDraft(tiny_backend(1), target)
    with pytest.raises(ValueError, match="not batchable.*max_batch_size = 1"):
        BatchedGenerator(SpeculativeGenerator(target, one_sequence, 4))
    one_by_one = BatchedGenerator(SpeculativeGenerator(target, one_sequence, 4, "constant"), 1)
    seeded = SamplingParams(temperature=1.0, seed=4, max_new_tokens=8)
    assert [r.token_ids for r in one_by_one.generate(PROMPTS[:3], seeded)] == [
        SpeculativeGenerator(target, one_sequence, 4, "constant").generate(p, seeded).token_ids
        for p in PROMPTS[:3]]
    with pytest.raises(ValueError, match="max_batch_size = 0"):
        BatchedGenerator(SpeculativeGenerator(target, None), 0)


def held_sequences(backend) -> int:
    """Sequences a tiny backend holds now (its caches)."""
    return len(backend._caches if hasattr(backend, "_caches") else backend._sequences)


def recording_forwards(backend) -> list[int]:
    """Record the number of rows of every ``forward`` of ``backend`` (in the list returned)."""
    rows, forward = [], backend.forward

    def recorded(items, num_logits=None):
        rows.append(len(items))
        return forward(items, num_logits)

    backend.forward = recorded
    return rows


@pytest.mark.parametrize("make_backend", ["transformers", "native"], indirect=True)
@pytest.mark.parametrize("draft_seed", ["same", 3, "suffix+3"])
def test_draft_model_rows_share_packed_draft_forwards_and_equal_decoding_alone(
        draft_seed, make_backend):
    """A draft model in a batch of 3 (alone, or behind suffix matching): each row drafts in
    a sequence of its own in the one draft model, the rows' draft forwards packed (forwards
    of 2 or more rows, at least one per drafted position); greedy rows equal plain decoding
    alone, seeded ones what ``generate`` gives alone, with drafts accepted (the draft on the
    target's own weights) or rejected and rolled back (another draft); no draft sequence is
    left held."""
    target = make_backend(0)
    draft = make_backend(same_as=target) if draft_seed == "same" else make_backend(3)
    rows = recording_forwards(draft)
    proposer = DraftModelProposer(draft, target)
    if draft_seed == "suffix+3":
        proposer = FallbackProposer(SuffixProposer(), proposer)
    generator = SpeculativeGenerator(target, proposer, 3, "constant")
    greedy = [SamplingParams(max_new_tokens=10 + 3 * i) for i in range(len(PROMPTS))]
    seeded = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=12)
              for i in range(len(PROMPTS))]
    plain = SpeculativeGenerator(target, None)
    for params, reference in ((greedy, plain), (seeded, generator)):
        expected = [reference.generate(p, q).token_ids for p, q in zip(PROMPTS, params)]
        rows.clear()
        results = BatchedGenerator(generator, max_batch_size=3).generate(PROMPTS, params)
        assert [r.token_ids for r in results] == expected
        drafted = sum(r.stats.drafted_tokens for r in results)
        packed = [n for n in rows if n > 1]
        assert drafted > 0 and packed and max(rows) <= 3, rows
        if draft_seed != "suffix+3":  # every drafted token came from a draft forward
            assert sum(rows) >= drafted
        if draft_seed == "same" and params is greedy:
            assert sum(r.stats.accepted_tokens for r in results) == drafted
        assert held_sequences(draft) == 0


def test_early_exit_rows_are_batched_and_equal_decoding_alone():
    """Early exit is a draft model over the target's first layers: batched, its rows equal
    plain decoding alone, its draft forwards packed."""
    target = tiny_backend(0)
    proposer = EarlyExitProposer(target, 1)
    rows = recording_forwards(proposer.draft)
    params = SamplingParams(max_new_tokens=12)
    results = BatchedGenerator(SpeculativeGenerator(target, proposer, 3, "constant"),
                               3).generate(PROMPTS, params)
    plain = SpeculativeGenerator(target, None)
    assert [r.token_ids for r in results] == [plain.generate(p, params).token_ids
                                              for p in PROMPTS]
    assert max(rows) == 3 and sum(r.stats.drafted_tokens for r in results) > 0


def test_a_cancelled_or_failed_row_frees_its_draft_sequence():
    target, draft = tiny_backend(0), tiny_backend(2)
    generator = SpeculativeGenerator(target, DraftModelProposer(draft, target), 3, "constant")
    batched = BatchedGenerator(generator, 3)
    params = SamplingParams(max_new_tokens=20)
    ids = [batched.submit(prompt, params) for prompt in PROMPTS[:3]]
    batched.step()
    batched.step()
    assert held_sequences(draft) == 3
    batched.cancel(ids[1])
    assert held_sequences(draft) == 2
    forward = draft.forward
    draft.forward = lambda items, num_logits=None: (_ for _ in ()).throw(RuntimeError("draft down"))
    outputs = batched.step()  # a packed draft forward fails: every row in it ends with it
    assert [type(outputs[i]) for i in (ids[0], ids[2])] == [RuntimeError] * 2
    assert held_sequences(draft) == 0 and batched.num_active == 0
    draft.forward = forward
    assert batched.generate(PROMPTS[:2], params)[0].token_ids == SpeculativeGenerator(
        target, None).generate(PROMPTS[0], params).token_ids


def test_llama_cpp_slots_are_reserved_and_run_out_with_a_clear_error(make_backend):
    target = make_backend(0)
    if make_backend.kind != "llama_cpp":
        pytest.skip("slots are llama.cpp's (the transformers backend holds up to 256)")
    assert target.max_sequences == 1  # the Llama's own context until batching reserves more
    BatchedGenerator(SpeculativeGenerator(target, None), 2)
    assert target.max_sequences == 2 and target.sequences_invariant
    for i in range(2):
        target.prefill(i, [1, 2])
    with pytest.raises(ValueError, match="all 2 sequence slots are in use"):
        target.prefill(99, [1, 2])
    with pytest.raises(ValueError, match="cannot grow from 2 to 4 sequence slots while 2 are held"):
        BatchedGenerator(SpeculativeGenerator(target, None), 4)
    target.release(0)
    target.prefill(99, [1, 2])
    assert target.num_cached_tokens(99) == 2
    target.release(1)
    target.release(99)
    batched = BatchedGenerator(SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3), 4)
    assert target.max_sequences == 4
    params = SamplingParams(max_new_tokens=12)
    assert [r.token_ids for r in batched.generate(PROMPTS[:4], params)] == [
        SpeculativeGenerator(target, None).generate(p, params).token_ids for p in PROMPTS[:4]]
    with pytest.raises(ValueError, match="cannot be reserved: llama.cpp holds 1 to"):
        target.reserve(100_000)


def test_batch_level_auto_gives_way_to_batching_as_the_batch_fills():
    """A transformers-like cost (a forward over N tokens costs a + b·N) and rows with α = 0.6:
    a lone row drafts several tokens, eight rows draft fewer each, and a cost line as steep
    as a plain step per token stops drafting altogether."""
    cost = lambda n: 0.030 + 0.004 * n
    alone = batch_speculation_lengths([[0.6] * 4], [4], cost)
    eight = batch_speculation_lengths([[0.6] * 4] * 8, [4] * 8, cost)
    assert alone[0] >= 2 and max(eight) < alone[0] and sum(eight) < 8 * alone[0]
    steep = lambda n: 0.010 * n
    assert batch_speculation_lengths([[0.6] * 4] * 4, [4] * 4, steep) == [0, 0, 0, 0]
    # A row whose drafts are never accepted never drafts; caps are kept.
    assert batch_speculation_lengths([[0.0] * 4, [0.99] * 4], [4, 2],
                                     lambda n: 1.0) == [0, 2]
    # Rows chosen elsewhere count in the cost: with many fixed tokens, drafting stops.
    assert batch_speculation_lengths([[0.6] * 4], [4], steep, fixed_tokens=10,
                                     fixed_expected=10) == [0]
    # A proposer's drafting seconds count: dear drafts (a draft head's, per row) draft less.
    free = batch_speculation_lengths([[0.6] * 4] * 4, [4] * 4, cost)
    dear = batch_speculation_lengths([[0.6] * 4] * 4, [4] * 4, cost,
                                     draft_costs=[lambda k: 0.002 + 0.004 * k if k else 0.0] * 4)
    assert sum(free) > 0 and sum(dear) < sum(free)
    assert batch_speculation_lengths([[0.6] * 4] * 4, [4] * 4, cost,
                                     draft_costs=[lambda k: 0.1 * k] * 4) == [0, 0, 0, 0]
    # Drafting the rows share (a draft model's forwards, packed: S(longest draft)) counts
    # once per drafted position, not per row: it costs less than the same per row, and
    # enough of it stops drafting.
    per_row = batch_speculation_lengths([[0.9] * 4] * 4, [4] * 4, cost,
                                        draft_costs=[lambda k: 0.015 * k] * 4)
    shared = batch_speculation_lengths([[0.9] * 4] * 4, [4] * 4, cost,
                                       shared_draft_cost=lambda k: 0.015 * k)
    assert sum(per_row) < sum(shared) < sum(batch_speculation_lengths([[0.9] * 4] * 4, [4] * 4,
                                                                      cost))
    assert batch_speculation_lengths([[0.9] * 4] * 4, [4] * 4, cost,
                                     shared_draft_cost=lambda k: 0.5 * k) == [0, 0, 0, 0]
    assert batch_speculation_lengths([[0.9] * 4] * 2, [4] * 2, cost, fixed_longest=4,
                                     shared_draft_cost=lambda k: 0.5 * k) == [4, 4]  # paid for
    measured = ForwardCost(16)
    measured.observe(1, 0.03)
    measured.observe(8, 0.06)
    assert measured(4) == pytest.approx(0.03 + 3 * 0.03 / 7)


class ArgmaxProposer(Proposer):
    """Drafts the target's own greedy continuation (point mass), scored on a separate backend
    from scratch every call: no state between calls, so batchable. At a temperature its
    drafts are accepted with probability p(argmax) < 1 at every position."""

    batchable = True

    def __init__(self, backend):
        self.backend = backend

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
        one(self.backend).prefill(list(token_ids[:-1]))
        context, drafted = list(token_ids), []
        for _ in range(k):
            logits = pipeline.process(one(self.backend).forward([context[-1]]), context)
            drafted.append(int(logits[0].argmax()))
            context.append(drafted[-1])
        return Proposal(drafted)


@pytest.mark.parametrize("policy", ["constant", "auto"])
@pytest.mark.parametrize("broken", [None, *BROKEN_VERIFIERS])
def test_batched_sampling_follows_the_target_at_every_block_position(broken, policy):
    """Unseeded requests (each with its own reproducible generator), eight at a time: every
    position of the continuation follows the target's conditional (the audit's per-position
    test) and the broken verifiers are caught. Under ``constant`` every block position is
    drafted and accepted many times; under ``auto`` the batch-level policy chooses every
    row's k (from a fixed cost line here, so the test does not depend on timings), and
    drafts are still accepted at every position."""
    target = tiny_backend(0)
    proposer = ArgmaxProposer(tiny_backend(0))
    generator = (BrokenGenerator(target, proposer, 3, policy, broken=broken) if broken
                 else SpeculativeGenerator(target, proposer, 3, policy))
    batched = BatchedGenerator(generator, 8)
    # a fixed cost line (verification cheap, the batch dearer as it fills), so that auto's
    # choices, and with them the draws, do not depend on this machine's timings
    batched.costs.seconds = [None] + [0.05 + 0.001 * n for n in range(1, 33)]
    batched.costs.observe = batched.draft_costs.observe = lambda n, seconds: None
    params = SamplingParams(temperature=0.2, seed=0, max_new_tokens=4)
    test = audit_distribution(target, BatchedEngine(batched, "batched"),
                              [[1, 2, 3, 1, 2], [23, 15, 9]], params, 600, 0.01)
    assert test.rejected == (broken is not None), [p.positions for p in test.prompts]
    if not broken:
        floor = [50, 50, 50] if policy == "constant" else [200, 100, 20]
        assert all(a >= f for a, f in zip(test.accepted_per_position, floor)), (
            test.drafted_per_position, test.accepted_per_position)


@pytest.mark.parametrize("broken", [None, *BROKEN_VERIFIERS])
def test_batched_draft_model_sampling_follows_the_target_at_every_block_position(broken):
    """A draft model close to the target (noisy weights: p ≠ q) drafting for eight rows at a
    temperature, its forwards packed: every position of the continuation follows the
    target's conditional, each of the 3 block positions drafted and accepted many times, and
    the broken verifiers are caught."""
    target = tiny_backend(0)
    draft = perturbed_backend(target, 0.02)
    rows = recording_forwards(draft)
    proposer = DraftModelProposer(draft, target)
    generator = (BrokenGenerator(target, proposer, 3, "constant", broken=broken) if broken
                 else SpeculativeGenerator(target, proposer, 3, "constant"))
    params = SamplingParams(temperature=0.8, seed=0, max_new_tokens=4)
    test = audit_distribution(target, BatchedEngine(BatchedGenerator(generator, 8), "batched"),
                              [[1, 2, 3, 1, 2], [23, 15, 9]], params, 600, 0.01)
    assert test.rejected == (broken is not None), [p.positions for p in test.prompts]
    assert max(rows) == 8  # the eight rows' draft forwards packed
    if not broken:
        assert all(a >= 50 for a in test.accepted_per_position[:3]), (
            test.drafted_per_position, test.accepted_per_position)

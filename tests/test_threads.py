"""Threads on a shared machine (exactspec.threads): the chooser moves to the thread count
that measures faster and back, and a forward's logits do not depend on the count."""

import pytest
import torch

from exactspec.threads import EXPLORE_FIRST, EXPLORE_MOST, ThreadChooser, torch_threads

from conftest import tiny_backend, one


def run(chooser: ThreadChooser, seconds_per_thread_count: dict[int, float], forwards: int,
        num_tokens: int = 1) -> list[int]:
    """Drive ``chooser`` with forwards whose time depends only on the thread count."""
    used = []
    for _ in range(forwards):
        threads = chooser.choose(num_tokens)
        chooser.record(num_tokens, threads, seconds_per_thread_count[threads])
        used.append(threads)
    return used


def test_the_chooser_moves_to_one_thread_when_a_core_is_busy_and_back_when_it_frees():
    chooser = ThreadChooser(2)
    idle, busy = {1: 0.030, 2: 0.020}, {1: 0.030, 2: 0.100}
    used = run(chooser, idle, 300)
    assert chooser.current == 2 and used.count(1) <= 8  # tries grow rarer: 8, 16, 32, ...
    assert chooser.interval == EXPLORE_MOST
    used = run(chooser, busy, EXPLORE_MOST + 20)
    assert chooser.current == 1  # found at the next try
    used = run(chooser, busy, 200)
    assert used.count(2) <= 5  # a try of the slow count is rare
    run(chooser, idle, 2 * EXPLORE_MOST + 20)  # at most one interval, then two tries
    assert chooser.current == 2


def test_the_chooser_compares_forwards_over_as_many_tokens_only():
    chooser = ThreadChooser(2)
    for step in range(200):  # 2 threads always faster at equal size; 9-token forwards slower
        n = 9 if step % 2 else 1
        threads = chooser.choose(n)
        chooser.record(n, threads, (0.02 if threads == 2 else 0.03) * (2 if n == 9 else 1))
    assert chooser.current == 2


def test_one_thread_has_nothing_to_choose_and_bad_counts_are_refused():
    assert set(run(ThreadChooser(1), {1: 0.01}, EXPLORE_FIRST * 3)) == {1}
    with pytest.raises(ValueError, match="threads = 0 is invalid"):
        ThreadChooser(0)


def test_torch_threads_sets_and_restores():
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2  # under pytest -n, workers run one thread
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before


def test_a_forward_gives_the_same_logits_on_one_thread_and_on_two():
    """What lets the chooser switch at any forward: single tokens, a 9-token block and a
    packed batch give the same bits with 1 and 2 threads (prefill, whose cache both share,
    runs on the most threads either way)."""
    target = tiny_backend(0)
    prompt = target.tokenizer.encode("the cat sat on the mat")
    outputs = []
    for threads in (1, 2):
        target.threads = ThreadChooser(2)
        target.threads.choose = lambda num_tokens, t=threads: t  # no tries
        one(target).prefill(prompt[:-1])
        single = one(target).forward(prompt[-1:])
        one(target).rollback(1)
        block = one(target).forward(prompt[-1:] + prompt[:8])
        for s in range(2):
            target.release(s)
            target.prefill(s, prompt[:-1 - s])
        packed = target.forward([(0, prompt[-1:]), (1, prompt[-2:])])
        outputs.append([single, block, *packed])
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_without_the_native_kernels_the_thread_count_stays_fixed(monkeypatch):
    """PyTorch's reductions may split differently with another thread count, so a backend
    on them never changes its count between forwards."""
    from exactspec.backends import transformers_backend

    monkeypatch.setattr(transformers_backend, "native_kernels_apply", lambda weight: False)
    chooser = tiny_backend(0).threads
    assert not chooser.adaptive
    assert set(run(chooser, {1: 0.001, 2: 0.100}, 3 * EXPLORE_FIRST)) == {chooser.max_threads}
    from conftest import CharTokenizer, tiny_model
    from exactspec.backends import TransformersBackend

    fast = TransformersBackend(tiny_model(0), CharTokenizer(), kernels="fast")
    assert not fast.threads.adaptive

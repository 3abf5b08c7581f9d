"""Threads on a machine that others share: where each part of a decoding step runs.

Threads that split one forward wait for each other at every step of it; when another
process takes one of their cores, the forward waits for a thread that is not running, and
decoding does not slow down a little, it collapses (measured: docs/backends.md, "Choosing
--threads", and results/threads-2026-12-01). So:

- **Host-side tensor work** (logits processing, sampling, verification: a few rows of the
  vocabulary) runs on one thread, where it is fastest for its size and never waits for
  another core: the engine runs its loop inside :func:`torch_threads` (1).
- **The target's own compute** (the transformers backend's decode-phase forwards) uses as
  many threads as a :class:`ThreadChooser` finds fastest, from measured forward times:
  every so often one forward runs with the other thread count, and the faster count is
  kept, so the backend moves to one thread while a core is busy and back when it frees.
  exactspec's native kernels' results do not depend on the thread count (threads split
  output columns or heads only), so a change of count never changes a logit; where they do
  not run (PyTorch's kernels, whose reductions may split differently), the count stays
  fixed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

EXPLORE_FIRST = 8
"""Forwards between two tries of the other thread count at first."""
EXPLORE_MOST = 256
"""The longest interval between tries: each try that confirms the current count doubles the
interval up to this (a try of the slower count costs at most one slow forward in this many)."""
SWITCH_FACTOR = 0.9
"""The other count is taken when its forward time is below this share of the current one's
in two tries in a row."""
SMOOTHING = 0.3
"""Weight of a new time in the running average of a (tokens, threads count in use) pair."""


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """PyTorch's intra-op threads set to ``num_threads`` inside the block, restored after
    (OpenMP keeps the setting per calling thread; setting it costs well under a
    microsecond)."""
    before = torch.get_num_threads()
    if before == num_threads:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ThreadChooser:
    """Chooses between one thread and ``max_threads`` for each forward from measured times.

    Forwards are compared only with forwards over as many tokens. Each forward's time
    updates a running average per (tokens, threads); after every ``interval`` forwards one
    runs with the count not in use, and the current count changes when the other is faster
    by :data:`SWITCH_FACTOR` in two tries in a row.

    Args:
        max_threads: the most threads to use (≥ 1); with 1 there is nothing to choose.
        adaptive: False: always ``max_threads`` (for kernels whose results may depend on
            the thread count).
    Raises:
        ValueError: for ``max_threads`` < 1.
    """

    def __init__(self, max_threads: int, adaptive: bool = True) -> None:
        if not isinstance(max_threads, int) or isinstance(max_threads, bool) or max_threads < 1:
            raise ValueError(f"threads = {max_threads!r} is invalid: it must be an integer ≥ 1")
        self.max_threads, self.adaptive = max_threads, adaptive
        self.current = max_threads
        self.interval = EXPLORE_FIRST
        self._since_try = 0
        self._trying = self._confirming = False
        self._seconds: dict[tuple[int, int], float] = {}  # (tokens, threads) → running mean

    def choose(self, num_tokens: int) -> int:
        """The thread count for the next forward over ``num_tokens`` tokens."""
        if self.max_threads == 1 or not self.adaptive:
            return self.max_threads
        self._since_try += 1
        self._trying = (self._since_try >= self.interval
                        and (num_tokens, self.current) in self._seconds)
        if self._trying:
            self._since_try = 0
            return self._other()
        return self.current

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """The forward over ``num_tokens`` tokens took ``seconds`` with ``threads``."""
        key = (num_tokens, threads)
        old = self._seconds.get(key)
        if not self._trying:
            self._seconds[key] = seconds if old is None else old + SMOOTHING * (seconds - old)
            return
        self._trying = False
        self._seconds[key] = seconds  # a try stands for itself: the load may have changed
        if seconds < SWITCH_FACTOR * self._seconds[(num_tokens, self.current)]:
            if self._confirming:  # a second try agrees: switch
                self.current, self.interval, self._confirming = threads, EXPLORE_FIRST, False
                self._seconds = {k: v for k, v in self._seconds.items() if k[1] == threads}
            else:  # one try can be noise: try again at the next forward
                self._confirming, self.interval = True, 1
        else:
            self._confirming = False
            self.interval = min(2 * self.interval, EXPLORE_MOST)

    @contextlib.contextmanager
    def forward(self, num_tokens: int) -> Iterator[None]:
        """Run the block (one forward over ``num_tokens`` tokens) on the chosen thread count
        and record its time."""
        threads, start = self.choose(num_tokens), time.perf_counter()
        with torch_threads(threads):
            yield
        self.record(num_tokens, threads, time.perf_counter() - start)

    def _other(self) -> int:
        return 1 if self.current == self.max_threads else self.max_threads

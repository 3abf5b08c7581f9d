"""Work spread over Ray workers (the optional extra ``exactspec[ray]``), or run here.

A run that shards (``audit --ray``, ``bench --ray``) is a list of *units*: picklable
argument tuples for a module-level function ``function(state, *unit)``, where ``state`` is
what the run's ``build()`` loaded (the model, the engines). An :class:`Executor` runs them:

- :class:`LocalExecutor`: in this process, one after another, on the state loaded here;
- :class:`RayExecutor`: on N Ray actors (docs/distributed.md), each calling ``build()``
  once when it starts, so each holds its own copy of the model. The units are handed out
  in order to whichever actor is free (at most :data:`IN_FLIGHT` at a time each). An actor
  that dies (its process killed, its machine lost) is restarted once by Ray and its
  unfinished units are retried on it (``max_restarts=1, max_task_retries=1``); the units
  of an actor that dies again are returned as :class:`Missing`, never dropped, and it gets
  no more. An exception raised by a unit's function is not a worker
  failure: it is raised in the driver, as it would be here.

Results come back in the units' order, whichever executor ran them, so a run whose units
are reproducible (seeded, no timing-driven choice, no state carried from one unit to the
next) gives the same results on both.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import platform
import socket
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

RAY_EXTRA = "pip install 'exactspec[ray]'"
IN_FLIGHT = 2
"""Units sent to one Ray actor before it returns one (the next is queued there, so the
actor does not wait for the driver between units)."""


class RayNotInstalledError(ImportError):
    """Ray is not installed (it is the optional extra ``exactspec[ray]``)."""


@dataclass(frozen=True)
class Missing:
    """A unit with no result: its worker died twice (``reason`` says how)."""

    unit: tuple
    reason: str


class Executor(Protocol):
    """Runs units of work and returns their results in order."""

    description: str
    """E.g. ``this process`` or ``2 Ray workers × 1 CPU``."""

    def map(self, function: Callable[..., Any], units: Sequence[tuple],
            progress: Callable[[int, Any], None] = lambda index, result: None) -> list[Any]:
        """``[function(state, *unit) for unit in units]`` (a :class:`Missing` in place of a
        unit whose worker died twice); ``progress(index, result)`` after each unit, in the
        order they finish.

        Raises:
            Exception: whatever a unit's function raised.
        """
        ...


class LocalExecutor:
    """Units run in this process on ``state``."""

    description = "this process"

    def __init__(self, state: Any) -> None:
        self.state = state

    def map(self, function, units, progress=lambda index, result: None) -> list[Any]:
        results = []
        for index, unit in enumerate(units):
            results.append(function(self.state, *unit))
            progress(index, results[-1])
        return results


def require_ray():
    """Import Ray, or raise RayNotInstalledError naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise RayNotInstalledError(f"Ray is not installed: {RAY_EXTRA} (or pip install "
                                   "'ray[serve]')") from None
    return ray


def connect(address: str | None = None):
    """Ray, connected: to the cluster at ``address`` (``auto``: the one this machine
    belongs to; ``ray://host:10001``: through Ray Client), or, for None, Ray's default:
    ``RAY_ADDRESS`` if set, else the cluster ``ray start`` last started on this machine,
    else a new local instance on this machine's cores. Already connected: kept.

    Raises:
        RayNotInstalledError: without Ray.
        ConnectionError: when no cluster answers at ``address``.
    """
    ray = require_ray()
    if not ray.is_initialized():
        _check_reachable(address)
        try:
            with warnings.catch_warnings():  # Ray Client's version notes: not the user's
                warnings.simplefilter("ignore")
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         logging_level="ERROR")
        except ConnectionError as error:
            raise _unreachable(address, error) from None
    return ray


@functools.cache
def code_fingerprint() -> str:
    """The first 12 hex digits of a SHA-256 over exactspec's own source files (``.py`` and
    ``.c``, by path): equal only for the same code, uncommitted changes included."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """For a ``host:port`` or ``ray://host:port`` address, check that something listens
    there (Ray itself would retry for minutes).

    Raises:
        ConnectionError: when nothing answers within ``timeout`` seconds.
    """
    host, _, port = (address or "").removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # None, "auto", "local": Ray resolves them itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise _unreachable(address, error.strerror or error) from None


def _unreachable(address: str | None, why) -> ConnectionError:
    return ConnectionError(f"no Ray cluster answers at {address} ({why}); start one with "
                           "'ray start --head', or give no address for a local one")


class _Holder:
    """A Ray actor's body: the state ``build()`` returned, and units run on it."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.state = build()

    def ready(self) -> tuple[str, str]:
        """Where this worker runs and the fingerprint of its exactspec code."""
        return platform.node(), code_fingerprint()

    def run(self, function: Callable[..., Any], unit: tuple) -> Any:
        return function(self.state, *unit)


class RayExecutor:
    """``num_workers`` Ray actors, each holding ``build()``'s state (loaded once per actor).

    Args:
        build: a picklable function of no argument that loads the state (runs in each
            actor's process, on its machine).
        num_workers: actors (≥ 1).
        cpus_per_worker: CPUs Ray reserves for each (its threads should match).
    Raises:
        RayNotInstalledError: without Ray (connect first: :func:`connect`).
        RuntimeError: when an actor cannot load its state (the cause is in the message), or
            the cluster has too few CPUs for the actors.
    """

    def __init__(self, build: Callable[[], Any], num_workers: int, cpus_per_worker: int = 1
                 ) -> None:
        ray = require_ray()
        if num_workers < 1:
            raise ValueError(f"num_workers {num_workers} is invalid: it must be ≥ 1")
        available = ray.cluster_resources().get("CPU", 0)
        if num_workers * cpus_per_worker > available:
            raise RuntimeError(f"{num_workers} Ray workers × {cpus_per_worker} CPU need "
                               f"{num_workers * cpus_per_worker} CPUs; the cluster has "
                               f"{available:g}: use fewer workers or fewer threads each")
        actor = ray.remote(num_cpus=cpus_per_worker, max_restarts=1, max_task_retries=1)(_Holder)
        self.actors = [actor.remote(build) for _ in range(num_workers)]
        self.description = f"{num_workers} Ray workers × {cpus_per_worker} CPU"
        self.dead: set[int] = set()  # actors that died for good (after their one restart)
        try:
            ready = ray.get([a.ready.remote() for a in self.actors])
        except ray.exceptions.RayActorError as error:
            self.close()
            cause = [line for line in str(error).splitlines() if line.strip()][-1]
            raise RuntimeError(f"a Ray worker could not load: {cause.strip()}") from None
        here = code_fingerprint()
        other = [(host, fingerprint) for host, fingerprint in ready if fingerprint != here]
        if other:
            self.close()
            raise RuntimeError(f"a Ray worker on {other[0][0]} runs other exactspec code than "
                               f"this process (fingerprint {other[0][1]}, here {here}): install "
                               "the same exactspec on every node of the cluster")

    def map(self, function, units, progress=lambda index, result: None) -> list[Any]:
        """As :meth:`Executor.map`: the units in order, each to the next live actor with
        fewer than :data:`IN_FLIGHT` units in flight (so none idles while units remain).

        Raises:
            RuntimeError: when every actor has died for good (no unit can run).
        """
        ray = require_ray()
        waiting = collections.deque(range(len(units)))
        pending: dict[Any, tuple[int, int]] = {}  # result ref → (unit index, actor)
        load = collections.Counter()
        results: list[Any] = [None] * len(units)
        try:
            while waiting or pending:
                for _ in range(IN_FLIGHT):  # round robin, up to IN_FLIGHT each
                    for actor in range(len(self.actors)):
                        if waiting and actor not in self.dead and load[actor] < IN_FLIGHT:
                            index = waiting.popleft()
                            ref = self.actors[actor].run.remote(function, units[index])
                            pending[ref], load[actor] = (index, actor), load[actor] + 1
                if not pending:
                    raise RuntimeError("every Ray worker died twice: nothing can run (see "
                                       "the Ray logs of the dead workers)")
                done, _ = ray.wait(list(pending), num_returns=1)
                index, actor = pending.pop(done[0])
                load[actor] -= 1
                try:
                    results[index] = ray.get(done[0])
                except ray.exceptions.RayTaskError as error:
                    raise error.as_instanceof_cause() from None
                except ray.exceptions.UnserializableException as error:
                    raise RuntimeError(f"a Ray worker failed: {error}") from None
                except ray.exceptions.RayActorError as error:
                    self.dead.add(actor)
                    results[index] = Missing(units[index], "its Ray worker died twice ("
                                             f"{str(error).splitlines()[0]})")
                progress(index, results[index])
        finally:
            for ref in pending:
                ray.cancel(ref)
        return results

    def close(self) -> None:
        """End the actors (their models are freed)."""
        ray = require_ray()
        for actor in self.actors:
            ray.kill(actor)


def default_workers(cpus_per_worker: int) -> int:
    """As many workers of ``cpus_per_worker`` CPUs as the connected cluster holds (≥ 1)."""
    ray = require_ray()
    return max(1, int(ray.cluster_resources().get("CPU", 1) // cpus_per_worker))

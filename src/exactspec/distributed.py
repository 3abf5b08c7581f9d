"""Work spread over Ray workers (the optional extra ``exactspec[ray]``), or run here.

A run that shards (``audit --ray``, ``bench --ray``) is a list of *units*: picklable
argument tuples for a module-level function ``function(state, *unit)``, where ``state`` is
what the run's ``build()`` loaded (the model, the engines). An :class:`Executor` runs them:

- :class:`LocalExecutor`: in this process, one after another, on the state loaded here;
- :class:`RayExecutor`: on N Ray actors (docs/distributed.md), each calling ``build()``
  once when it starts, so each holds its own copy of the model. Unit i goes to actor
  i mod N (fixed, so which units share an actor does not depend on timing), and an actor
  runs its units in the order given. An actor that dies (its process killed, its machine
  lost) is restarted once by Ray and its unfinished units are retried on it
  (``max_restarts=1, max_task_retries=1``); the units of an actor that dies again are
  returned as :class:`Missing`, never dropped, and later calls use the live actors only. An exception raised by a unit's function is not a worker
  failure: it is raised in the driver, as it would be here.

Results come back in the units' order, whichever executor ran them, so a run whose units
are reproducible (seeded, no timing-driven choice) gives the same results on both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

RAY_EXTRA = "pip install 'exactspec[ray]'"


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
    belongs to; ``ray://host:10001``: through Ray Client), or, for None, to ``RAY_ADDRESS``
    if set, else a new local instance on this machine's cores. Already connected: kept.

    Raises:
        RayNotInstalledError: without Ray.
        ConnectionError: when no cluster answers at ``address``.
    """
    ray = require_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     logging_level="ERROR")
        except ConnectionError as error:
            raise ConnectionError(f"--ray {address}: no Ray cluster answers there ({error}); "
                                  "start one with 'ray start --head', or give no address for "
                                  "a local one") from None
    return ray


class _Holder:
    """A Ray actor's body: the state ``build()`` returned, and units run on it."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.state = build()

    def ready(self) -> bool:
        return True

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
            ray.get([a.ready.remote() for a in self.actors])
        except ray.exceptions.RayActorError as error:
            self.close()
            cause = [line for line in str(error).splitlines() if line.strip()][-1]
            raise RuntimeError(f"a Ray worker could not load: {cause.strip()}") from None

    def map(self, function, units, progress=lambda index, result: None) -> list[Any]:
        """As :meth:`Executor.map`; unit i goes to live actor i mod (live actors).

        Raises:
            RuntimeError: when every actor has died for good (no unit can run).
        """
        ray = require_ray()
        live = [i for i in range(len(self.actors)) if i not in self.dead]
        if not live and units:
            raise RuntimeError("every Ray worker died twice: nothing can run (see the Ray logs "
                               "of the dead workers)")
        pending = {}
        for index, unit in enumerate(units):
            actor = live[index % len(live)]
            pending[self.actors[actor].run.remote(function, unit)] = (index, actor)
        results: list[Any] = [None] * len(units)
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                index, actor = pending.pop(done[0])
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

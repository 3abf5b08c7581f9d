"""``exactspec serve --replicas N``: the same FastAPI application on N Ray Serve replicas.

Each replica is a Ray actor that loads the target and proposer once and builds the
application of :func:`~exactspec.server.app.create_app` (its own engine worker, batch and
queue); Ray Serve's HTTP proxy in front routes each request to a replica (to the one with
the fewest requests in flight of two picked at random: Ray Serve's default router), so the
endpoints, errors, streaming and authentication are the single server's. A replica that
dies is restarted by Ray Serve; a request in flight on it is answered with an error by the
proxy (500, or a stream cut before its ``[DONE]``), never silently dropped, and requests
arriving meanwhile go to the live replicas.

Metrics: ``GET /metrics`` answers with the registry of the replica that took the request;
every metric is also recorded as a Ray metric (``exactspec_`` + the name after
``exactspec:``) tagged with its deployment and replica, which Ray exports on each node's
metrics port for Prometheus to scrape and sum (the Ray way: docs/distributed.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from exactspec.distributed import code_fingerprint, connect, require_ray

APP_NAME = "exactspec"
_connected_here = False  # whether start() connected to Ray (stop() then disconnects)


def deployment(build: Callable[[], object], *, replicas: int, cpus_per_replica: int,
               max_ongoing_requests: int):
    """The Ray Serve application: ``replicas`` replicas, each checking that it runs this
    process's exactspec code (:func:`~exactspec.distributed.code_fingerprint`), then running
    ``build()`` once (a picklable function returning the FastAPI application, e.g. loading
    the model and calling :func:`~exactspec.server.app.create_app` with
    ``ray_metrics=True``), with ``cpus_per_replica`` CPUs reserved and at most
    ``max_ongoing_requests`` requests in flight each (beyond it Ray Serve queues them in
    front of the replicas).

    Raises:
        RayNotInstalledError: without Ray Serve.
    """
    connect()
    from ray import serve

    @serve.deployment(name="ExactspecServer", num_replicas=replicas,
                      ray_actor_options={"num_cpus": cpus_per_replica},
                      max_ongoing_requests=max_ongoing_requests)
    @serve.ingress()
    class ExactspecServer:
        def __init__(self, build: Callable[[], object], fingerprint: str) -> None:
            if code_fingerprint() != fingerprint:
                raise RuntimeError(f"this replica runs other exactspec code than the command "
                                   f"that deployed it (fingerprint {code_fingerprint()}, "
                                   f"expected {fingerprint}): install the same exactspec on "
                                   "every node of the cluster")
            self.exactspec_app = build()

        def __serve_build_asgi_app__(self):
            return self.exactspec_app

    return ExactspecServer.bind(build, code_fingerprint())


def start(build: Callable[[], object], *, replicas: int, cpus_per_replica: int = 1,
          max_ongoing_requests: int = 72, host: str = "127.0.0.1", port: int = 8000,
          ray_address: str | None = None) -> None:
    """Connect to Ray (``ray_address``: see :func:`exactspec.distributed.connect`), deploy
    :func:`deployment` behind Ray Serve's proxy on ``host``:``port`` and return once every
    replica is up (the application runs until :func:`stop`).

    Raises:
        RayNotInstalledError, ConnectionError: see :func:`exactspec.distributed.connect`.
        RuntimeError: when the cluster has too few CPUs for the replicas, or a replica
            cannot start (e.g. the model cannot be loaded): the replica's error in the
            message.
    """
    global _connected_here
    _connected_here = not require_ray().is_initialized()
    ray = connect(ray_address)
    from ray import serve

    available = ray.cluster_resources().get("CPU", 0)
    if replicas * cpus_per_replica > available:
        if _connected_here:
            ray.shutdown()
        raise RuntimeError(f"{replicas} replicas × {cpus_per_replica} CPU need "
                           f"{replicas * cpus_per_replica} CPUs; the Ray cluster has "
                           f"{available:g}: use fewer replicas or fewer --threads each")
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # exactspec says what matters
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(deployment(build, replicas=replicas, cpus_per_replica=cpus_per_replica,
                             max_ongoing_requests=max_ongoing_requests),
                  name=APP_NAME, route_prefix="/")
    except Exception as error:  # Ray Serve wraps a replica's constructor error in its own
        status = serve.status().applications.get(APP_NAME)
        why = [line for d in (status.deployments.values() if status else ())
               for line in d.message.strip().splitlines()[-1:]]
        serve.shutdown()
        raise RuntimeError(f"the replicas could not start: {why[0] if why else error}") from None


def stop() -> None:
    """Remove the application and Ray Serve's proxy; disconnect from Ray if :func:`start`
    connected (a local instance it started ends with it)."""
    import ray
    from ray import serve

    serve.shutdown()
    if _connected_here:
        ray.shutdown()

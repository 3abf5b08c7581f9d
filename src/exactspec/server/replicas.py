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

import argparse

from exactspec.distributed import connect

APP_NAME = "exactspec"


def deployment(args: argparse.Namespace):
    """The Ray Serve application: ``args.replicas`` replicas of the server ``args`` describe
    (the parsed ``serve`` options; each replica gets ``--threads`` CPUs, default 1).

    Raises:
        RayNotInstalledError: without Ray Serve.
    """
    connect(args.ray_address)
    from ray import serve

    threads = args.threads or 1

    @serve.deployment(name="ExactspecServer", num_replicas=args.replicas,
                      ray_actor_options={"num_cpus": threads},
                      # the application queues and answers 503 itself beyond this
                      max_ongoing_requests=args.max_batch_size + args.max_queue)
    @serve.ingress()
    class ExactspecServer:
        def __init__(self, options: argparse.Namespace) -> None:
            from exactspec.cli.serve import build_app

            self.exactspec_app = build_app(options, ray_metrics=True)

        def __serve_build_asgi_app__(self):
            return self.exactspec_app

    options = argparse.Namespace(**{**{k: v for k, v in vars(args).items() if k != "subparser"},
                                    "threads": threads})
    return ExactspecServer.bind(options)


def start(args: argparse.Namespace) -> None:
    """Deploy :func:`deployment` behind Ray Serve's proxy on ``args.host``:``args.port`` and
    return once every replica is up (the application keeps running until :func:`stop`).

    Raises:
        RayNotInstalledError, ConnectionError: see :func:`exactspec.distributed.connect`.
        RuntimeError: when a replica cannot start (e.g. the model cannot be loaded).
    """
    connect(args.ray_address)
    from ray import serve

    serve.start(http_options={"host": args.host, "port": args.port})
    try:
        serve.run(deployment(args), name=APP_NAME, route_prefix="/")
    except Exception as error:  # Ray Serve wraps a replica's constructor error in its own
        status = serve.status().applications.get(APP_NAME)
        why = [line for d in (status.deployments.values() if status else ())
               for line in d.message.strip().splitlines()[-1:]]
        serve.shutdown()
        raise RuntimeError(f"the replicas could not start: {why[0] if why else error}") from None


def stop() -> None:
    """Remove the application and Ray Serve's proxy."""
    from ray import serve

    serve.shutdown()

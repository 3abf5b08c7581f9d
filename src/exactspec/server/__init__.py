"""``exactspec serve``: an OpenAI-compatible HTTP server over the speculative engine.

:mod:`~exactspec.server.protocol` (request bodies, translated to the engine's; with
:mod:`~exactspec.server.structured_outputs` and :mod:`~exactspec.server.errors`),
:mod:`~exactspec.server.responses` (response bodies, one renderer per endpoint),
:mod:`~exactspec.server.worker` (the engine thread and its queue),
:mod:`~exactspec.server.streaming` (a job's events as a response or server-sent events),
:mod:`~exactspec.server.metrics` (Prometheus) and :mod:`~exactspec.server.app` (the FastAPI
application, :func:`create_app`). Its dependencies are the extra ``exactspec[server]``.
"""

from exactspec.extras import require

require("server", "exactspec.server")

from exactspec.server.app import create_app  # noqa: E402 (after the extra's check)
from exactspec.speculation import SpeculationSettings  # noqa: E402

__all__ = ["SpeculationSettings", "create_app"]

"""Per-cycle traces shown: the terminal view of ``generate --show``
(:mod:`~exactspec.trace.terminal`) and the web page of ``generate --trace``
(:mod:`~exactspec.trace.page`), over what they share (:mod:`~exactspec.trace.view`). The
record itself, written by the engine, is :mod:`exactspec.cycle_trace` (below the engine;
this package sits above it)."""

"""Per-cycle traces: recording (:mod:`~exactspec.trace.record`), the terminal view of
``generate --show`` (:mod:`~exactspec.trace.terminal`) and the web page of ``generate
--trace`` (:mod:`~exactspec.trace.page`)."""

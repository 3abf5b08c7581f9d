"""Names the command line lists without loading the audit (``exactspec audit --help``):
how an audit over HTTP compares, and the broken control of a constrained audit."""

MODES = ("two-sample", "reference", "greedy")
"""How an audit over HTTP compares (:class:`~exactspec.audit.EndpointSpec`'s ``mode``): A's
samples against B's; against a local copy's exact probabilities; greedy identity alone."""
CONSTRAINT_CONTROL = "verified-position-only"
"""The broken control of a constrained audit: the constraint masks the verified position
only (:class:`~exactspec.audit.broken.ConstraintControl`)."""

"""Names the command line lists without loading the audit (``exactspec audit --help``):
how an audit over HTTP compares, a local audit's engines and broken controls."""

MODES = ("two-sample", "reference", "greedy")
"""How an audit over HTTP compares (:class:`~exactspec.audit.EndpointSpec`'s ``mode``): A's
samples against B's; against a local copy's exact probabilities; greedy identity alone."""
CONSTRAINT_CONTROL = "verified-position-only"
"""The broken control of a constrained audit: the constraint masks the verified position
only (:class:`~exactspec.audit.broken.ConstraintControl`)."""
PEERS = {"transformers": "hf", "llama_cpp": "llama"}
"""A local audit's engines other than exactspec (``AuditSpec.engine``) → the peer
(:mod:`exactspec.peers`) that runs them."""
ENGINES = ("exactspec", *PEERS)
BROKEN = ("accept-all", "no-residual", CONSTRAINT_CONTROL, "none")
"""A local audit's broken controls (:mod:`exactspec.audit.broken`; ``none``: no control)."""

"""How an audit over HTTP compares (:class:`~exactspec.audit.EndpointSpec`'s ``mode``), known
without loading the audit: ``exactspec audit --help`` lists them."""

MODES = ("two-sample", "reference", "greedy")
"""A's samples against B's; against a local copy's exact probabilities; greedy identity
alone."""

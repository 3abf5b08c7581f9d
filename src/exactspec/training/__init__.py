"""Training a draft head (``exactspec train-draft``), a tool above the engine: its data, the
target's own conversations (:mod:`~exactspec.training.data`), and its training
(:mod:`~exactspec.training.train`). The head itself and its file format, which the
proposer loads, are the library's (:mod:`exactspec.draft_head.model`). Design:
docs/design.md, "The draft head"."""

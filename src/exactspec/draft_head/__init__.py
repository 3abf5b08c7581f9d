"""A draft head trained on the target's own features (EAGLE family): the head and its file
format (:mod:`~exactspec.draft_head.model`) and the heads shipped for the embedded models
(``heads/``), which :class:`~exactspec.proposers.head.HeadProposer` drafts with. Its
training is a tool above the engine (:mod:`exactspec.training`, ``exactspec
train-draft``). Design: docs/design.md, "The draft head"."""

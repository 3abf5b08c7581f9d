"""A draft head trained on the target's own features (EAGLE family): the head and its file
format (:mod:`~exactspec.draft_head.model`), its training data, the target's own
conversations (:mod:`~exactspec.draft_head.data`), and its training
(:mod:`~exactspec.draft_head.train`, ``exactspec train-draft``). Design: docs/design.md,
"The draft head"."""

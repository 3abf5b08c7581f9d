"""A draft head trained on the target's own features (issue 30, in progress): its training
data (:mod:`exactspec.draft_head.data`)."""

"""How a draft head is trained (:class:`TrainingConfig`), apart from the training itself so
that ``exactspec train-draft --help`` shows its defaults without loading PyTorch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingConfig:
    """How a head is trained (stored in its checkpoint; a resumed run keeps it).

    Attributes:
        draft_vocab_size: V' (FR-Spec), the tokens the head drafts from.
        num_steps: S, drafting steps unrolled per position (training-time test).
        total_updates: optimizer steps of the whole schedule (warm-up, then cosine decay).
        batch_tokens: most tokens (padded) per optimizer step.
        learning_rate: peak learning rate (AdamW).
        warmup_updates: linear warm-up steps.
        weight_decay: AdamW's.
        held_out_every: conversation i is held out when i % held_out_every == 0.
        eval_every: updates between held-out evaluations (and checkpoints).
        eval_conversations: held-out conversations evaluated each time.
        eval_steps: drafted positions evaluated (may exceed num_steps).
        seed: the run's seed (initialisation, batch order).
        feature_layers: the target's layers fused (None: EAGLE-3's choice).
        bfloat16: compute under bfloat16 autocast (weights and optimizer in float32).
        features: the backend whose hidden features train the head: ``transformers`` (the
            transformers model's float32 prefill) or ``native`` (the native kernels over
            the GGUF file's weights: the features the head reads when it drafts there).
        initial_head: a head file (``exactspec train-draft``'s) whose weights the run starts
            from instead of a fresh head's (the draft vocabulary is still this data's most
            frequent ``draft_vocab_size`` tokens: the weights do not depend on it); None: a
            fresh head.
    """

    draft_vocab_size: int = 16384
    num_steps: int = 3
    total_updates: int = 4000
    batch_tokens: int = 4096
    learning_rate: float = 5e-4
    warmup_updates: int = 100
    weight_decay: float = 0.0
    held_out_every: int = 20
    eval_every: int = 200
    eval_conversations: int = 64
    eval_steps: int = 5
    seed: int = 0
    feature_layers: tuple[int, ...] | None = None
    bfloat16: bool = True
    initial_head: str | None = None
    features: str = "transformers"

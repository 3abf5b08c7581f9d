"""Training a draft head on the target's own features (``exactspec train-draft``).

Data: conversations the target wrote itself (:mod:`exactspec.training.data`), stored as
token ids; the target's features are recomputed by prefill on the backend the head will
draft on (:func:`extract_features`, kept in the run folder so that a resumed run does not
recompute them). Objective (EAGLE-3 §3.2, "training-time test"): at every position t and
drafting step j < S, the cross-entropy of the head's draft distribution against the
target's next-token distribution at position t + j + 1, both over the draft vocabulary
(FR-Spec), on the positions whose next token is an answer token; step j > 0 reads the
head's own step j − 1 output (:meth:`DraftHead.unrolled`).
The draft vocabulary is the training answers' tokens by frequency, then the unseen ones by
id (a BPE merge order, roughly by frequency).

A run folder holds ``features/`` or ``features-native/`` (the extracted features),
``checkpoint.pt`` (the head, the optimizer and the history: a run resumes from it),
``head.safetensors`` (the head at the last checkpoint), ``history.json`` and
``training.png`` (losses and held-out top-1 agreement per drafted position).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from exactspec.backends.batch_invariant import kernel_mode
from exactspec.backends.transformers_backend import module_tensors
from exactspec.draft_head.model import DraftHead, HeadConfig, load_head, new_head, save_head
from exactspec.extras import require
from exactspec.progress import LoggedProgress
from exactspec.training.config import TrainingConfig
from exactspec.training.data import Conversation

require("plots", "exactspec train-draft")  # its training.png


@dataclass
class Example:
    """One conversation's tensors: ``tokens [T]``, ``features [T, F]`` and ``final [T, h]``
    (the target's final normed hidden state, whose LM head row gives its next-token
    logits), both float16; the answer starts at ``prompt_length``."""

    tokens: torch.Tensor
    features: torch.Tensor
    final: torch.Tensor
    prompt_length: int
    index: int


def extract_features(model, conversations: Sequence[Conversation], folder: Path,
                     feature_layers: Sequence[int], *, backend=None, chunk: int = 128,
                     batch_size: int = 8, show_progress: bool = True) -> list[Example]:
    """The target's features of every conversation, by prefill, kept in ``folder`` in chunks
    of ``chunk`` conversations (a chunk already there is read, not recomputed) and read
    back memory-mapped (float16; 4.6 KB a token for a 576-wide target).

    Args:
        model: the target as a transformers causal LM.
        backend: None: the features of ``model``'s own prefill (PyTorch's fast kernels);
            or a backend that provides hidden features (the native backend, a backend of its
            own: it records ``feature_layers`` and the last layer), whose features are the
            ones drafting reads on it; the final norm is then ``model``'s, applied to the
            backend's last layer.
    """
    folder.mkdir(parents=True, exist_ok=True)
    prefill = (_transformers_features(model, feature_layers) if backend is None
               else _backend_features(model, backend, feature_layers))
    examples: list[Example] = []
    with LoggedProgress(disable=not show_progress) as progress:
        task = progress.add_task("target features (prefill)",
                                 total=sum(len(c.prompt_ids) + len(c.answer_ids)
                                           for c in conversations))
        for start in range(0, len(conversations), chunk):
            part = conversations[start:start + chunk]
            path = folder / f"features-{start:06d}-{len(part)}.pt"
            if path.exists():
                examples += _read_chunk(path)
                progress.advance(task, sum(len(c.prompt_ids) + len(c.answer_ids) for c in part))
                continue
            computed = []
            order = sorted(part, key=lambda c: len(c.prompt_ids) + len(c.answer_ids))
            for b in range(0, len(order), batch_size):
                batch = order[b:b + batch_size]
                ids = [list(c.prompt_ids) + list(c.answer_ids) for c in batch]
                for conversation, x, (features, final) in zip(batch, ids, prefill(ids)):
                    computed.append(dict(
                        tokens=torch.tensor(x, dtype=torch.int32),
                        features=features.to(torch.float16).clone(),
                        final=final.to(torch.float16).clone(),
                        prompt_length=len(conversation.prompt_ids), index=conversation.index))
                progress.advance(task, sum(len(x) for x in ids))
            computed.sort(key=lambda item: item["index"])
            torch.save(computed, path)
            examples += _read_chunk(path)
    return examples


def _read_chunk(path: Path) -> list[Example]:
    """A chunk of features, memory-mapped: a large run's features live in the page cache,
    which the kernel can evict, not in the process's memory (issue 43's fifth head: 3.2 M
    tokens, 14.5 GB of features, and the training's own allocations passed this machine's
    24 GB and were killed when they were read into memory)."""
    return [Example(**item) for item in torch.load(path, mmap=True)]


def _transformers_features(model, feature_layers: Sequence[int]):
    """``prefill(ids)``: each sequence's ``(features [T, F], final [T, h])`` by one padded
    forward of ``model``."""
    layers = model.base_model.layers

    def prefill(ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        outputs: dict[int, torch.Tensor] = {}
        hooks = [layers[layer].register_forward_hook(
            lambda module, args, out, layer=layer: outputs.__setitem__(
                layer, out[0] if isinstance(out, tuple) else out))
            for layer in feature_layers]
        try:
            with kernel_mode("fast"), torch.inference_mode():
                final = model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        finally:
            for hook in hooks:
                hook.remove()
        features = torch.cat([outputs[layer] for layer in feature_layers], -1)
        return [(features[row, :len(x)], final[row, :len(x)]) for row, x in enumerate(ids)]

    return prefill


def _backend_features(model, backend, feature_layers: Sequence[int]):
    """``prefill(ids)`` on ``backend``: the sequences' rows packed in one forward per chunk,
    the features of ``feature_layers``; the final state is ``model``'s norm of the last
    layer's."""
    last = int(model.config.get_text_config(decoder=True).num_hidden_layers) - 1
    recorded = tuple(dict.fromkeys([*feature_layers, last]))
    backend.record_hidden_features(recorded)
    norm = model.base_model.norm

    def prefill(ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        try:
            for s, x in enumerate(ids):
                backend.prefill(s, x[:1])
            for start in range(1, max(len(x) for x in ids), backend.prefill_chunk_size):
                backend.forward([(s, x[start:start + backend.prefill_chunk_size])
                                 for s, x in enumerate(ids) if len(x) > start], num_logits=1)
            results = []
            for s in range(len(ids)):
                layers = backend.hidden_features(s, 0).unflatten(-1, (len(recorded), -1))
                with torch.inference_mode():
                    final = norm(layers[:, recorded.index(last)])
                results.append((layers[:, :len(feature_layers)].flatten(1), final))
            return results
        finally:
            for s in range(len(ids)):
                backend.release(s)

    return prefill


def draft_vocabulary(examples: Sequence[Example], vocab_size: int, size: int) -> torch.Tensor:
    """``[size]`` ids: the answers' tokens by frequency, then unseen ids in order."""
    counts = Counter(token for example in examples
                     for token in example.tokens[example.prompt_length:].tolist())
    order = [token for token, _ in counts.most_common()]
    seen = set(order)
    order += [token for token in range(vocab_size) if token not in seen]
    return torch.tensor(order[:size])


@dataclass
class Batch:
    features: torch.Tensor  # [B, T, F] float32
    token_ids: torch.Tensor  # [B, T + S − 1]: token t + 1 at t
    final: torch.Tensor  # [B, T, h] float32
    next_tokens: torch.Tensor  # [B, T]: token u + 1 at u (−1 past the end)
    answer_start: torch.Tensor  # [B]: prompt length − 1 (the first u that drafts an answer token)
    lengths: torch.Tensor  # [B]


def make_batch(examples: Sequence[Example], num_steps: int) -> Batch:
    length = max(len(e.tokens) for e in examples)
    batch = len(examples)
    features = torch.zeros(batch, length, examples[0].features.shape[1])
    final = torch.zeros(batch, length, examples[0].final.shape[1])
    token_ids = torch.zeros(batch, length + num_steps - 1, dtype=torch.long)
    next_tokens = torch.full((batch, length), -1, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.tokens)
        features[row, :n] = example.features.float()
        final[row, :n] = example.final.float()
        token_ids[row, :n - 1] = example.tokens[1:].long()
        next_tokens[row, :n - 1] = example.tokens[1:].long()
    return Batch(features, token_ids, final, next_tokens,
                 torch.tensor([e.prompt_length - 1 for e in examples]),
                 torch.tensor([len(e.tokens) for e in examples]))


def step_losses(head: DraftHead, batch: Batch, num_steps: int,
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per drafting step j: the mean cross-entropy against the target, the top-1 agreement
    flags with the target's own next token (the data's: greedy answers), and the valid
    rows' root positions; row t of step j is valid when position u = t + j + 1 drafts an
    answer token (answer_start ≤ u ≤ length − 2)."""
    outputs = head.unrolled(batch.features, batch.token_ids, num_steps)
    length = batch.features.shape[1]
    positions = torch.arange(length)
    losses, agreements, roots = [], [], []
    for step, output in enumerate(outputs):
        u = positions + step + 1  # [T]
        valid = ((u[None] >= batch.answer_start[:, None]) & (u[None] <= batch.lengths[:, None] - 2))
        rows, columns = valid.nonzero(as_tuple=True)
        targets_at = columns + step + 1
        logits = head.logits(output[rows, columns])  # [N, V']
        with torch.no_grad():
            target_logits = batch.final[rows, targets_at] @ head.lm_head.T
            target_probs = target_logits.softmax(-1)
            # the target's own next token, in the draft vocabulary's indices (−1 if outside)
            truth = batch.next_tokens[rows, targets_at]
        losses.append(-(target_probs * logits.log_softmax(-1)).sum(-1).mean())
        drafted = head.draft_token_ids[logits.argmax(-1)]
        agreements.append((drafted == truth).float())
        roots.append(rows * length + columns)
    return losses, agreements, roots


def chained_acceptance(agreements: list[torch.Tensor], roots: list[torch.Tensor]) -> list[float]:
    """Greedy acceptance per drafted position (a chain from each root stops at its first
    miss): the fraction of roots whose first j + 1 drafts all agree, for each j."""
    if not agreements or not len(roots[0]):
        return []
    alive = dict(zip(roots[0].tolist(), agreements[0].tolist()))
    rates = [sum(alive.values()) / len(alive)]
    for flags, index in zip(agreements[1:], roots[1:]):
        step = dict(zip(index.tolist(), flags.tolist()))
        alive = {root: alive[root] * step.get(root, 0.0) for root in alive if root in step}
        rates.append(sum(alive.values()) / max(len(alive), 1))
    return rates


@dataclass
class History:
    updates: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    held_out_loss: list[list[float]] = field(default_factory=list)
    held_out_agreement: list[list[float]] = field(default_factory=list)
    held_out_chained: list[list[float]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def evaluate(head: DraftHead, examples: Sequence[Example], steps: int, batch_size: int = 8,
             bfloat16: bool = False) -> tuple[list[float], list[float], list[float]]:
    """Held-out per drafted position: cross-entropy, top-1 agreement (teacher-forced), and
    chained greedy acceptance (:func:`chained_acceptance`)."""
    sums = [[0.0, 0.0, 0] for _ in range(steps)]
    chained, chains = [0.0] * steps, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
        for start in range(0, len(examples), batch_size):
            part = examples[start:start + batch_size]
            losses, agreements, roots = step_losses(head, make_batch(part, steps), steps)
            for j in range(steps):
                n = len(agreements[j])
                sums[j][0] += float(losses[j]) * n
                sums[j][1] += float(agreements[j].sum())
                sums[j][2] += n
            rates = chained_acceptance(agreements, roots)
            n0 = len(roots[0])
            for j, rate in enumerate(rates):
                chained[j] += rate * n0
            chains += n0
    return ([s[0] / max(s[2], 1) for s in sums], [s[1] / max(s[2], 1) for s in sums],
            [c / max(chains, 1) for c in chained])


def plot_history(history: History, path: Path) -> None:
    """Losses and held-out agreement per drafted position against updates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 5.5))
    if history.train_loss:
        left.plot(history.updates, history.train_loss, color="black",
                  label="training (mean over the unrolled steps)")
    for j in range(len(history.held_out_loss[0]) if history.held_out_loss else 0):
        color = f"C{j}"
        left.plot(history.updates, [row[j] for row in history.held_out_loss], color=color,
                  label=f"held out, position {j + 1}", linestyle="--")
        right.plot(history.updates, [row[j] for row in history.held_out_agreement], color=color,
                   label=f"position {j + 1}, given the true tokens before")
        right.plot(history.updates, [row[j] for row in history.held_out_chained], color=color,
                   linestyle=":", label=f"position {j + 1}, chained (greedy acceptance)")
    left.set(xlabel="update", ylabel="cross-entropy vs the target (nats)", title="loss")
    right.set(xlabel="update", ylabel="top-1 agreement with the target", ylim=(0, 1),
              title="held-out agreement per drafted position")
    left.legend(fontsize=7)
    right.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def train(model, conversations: Sequence[Conversation], folder: str | Path,
          config: TrainingConfig | None = None, *, backend=None, target_name: str = "",
          max_minutes: float | None = None, show_progress: bool = True) -> Path:
    """Train (or resume training) a draft head for the transformers causal LM ``model``.

    Args:
        model: the target (its weights are only read).
        conversations: its own conversations (:func:`~exactspec.training.data.read_conversations`).
        folder: the run folder (see the module docstring); a checkpoint there is resumed
            with its own config (``config`` None, or equal to it).
        config: see :class:`TrainingConfig` (default: its defaults).
        backend: where the features come from when ``config.features`` is not
            ``transformers``: a backend of that name that provides hidden features, used for
            nothing else (see :func:`extract_features`).
        target_name: recorded in the head.
        max_minutes: stop (with a checkpoint) after this long; run again to go on.
    Returns:
        the path of ``head.safetensors``.
    Raises:
        ValueError: for no conversations, none left for training after the held-out split,
            a ``config`` other than the resumed checkpoint's (naming each difference), or a
            ``backend`` other than ``config.features`` asks for.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint_path = folder / "checkpoint.pt"
    checkpoint = torch.load(checkpoint_path, weights_only=False) if checkpoint_path.exists() else None
    if checkpoint:
        stored = TrainingConfig(**checkpoint["config"])
        if config is not None and config != stored:
            changed = ", ".join(f"{name} = {getattr(config, name)!r} (the run's: "
                                f"{getattr(stored, name)!r})"
                                for name in vars(stored) if getattr(config, name) != getattr(stored, name))
            hint = (f" (its features are the {stored.features} backend's: resume it on that "
                    f"backend, --backend {stored.features})"
                    if config.features != stored.features else "")
            raise ValueError(f"{folder} holds a run with other settings: {changed}{hint}; resume "
                             "it with its own settings, or start a new run in another folder")
        config = stored
    config = config or TrainingConfig()
    if not conversations:
        raise ValueError("no conversations to train on")
    source = "transformers" if backend is None else backend.name
    if source != config.features:
        raise ValueError(f"the run trains on the {config.features} backend's features; "
                         f"the {source} backend's were given")
    layers = HeadConfig.for_target(model, 1, feature_layers=config.feature_layers).feature_layers
    examples = extract_features(
        model, conversations, folder / ("features" if backend is None else f"features-{source}"),
        layers, backend=backend, show_progress=show_progress)
    held_out = [e for e in examples if e.index % config.held_out_every == 0]
    training = [e for e in examples if e.index % config.held_out_every != 0]
    if not training:
        raise ValueError(f"all {len(examples)} conversations are held out "
                         f"(held_out_every = {config.held_out_every})")
    initial = load_head(config.initial_head, module_tensors(model)) if config.initial_head else None
    if initial is not None and initial.config.feature_layers != tuple(layers):
        raise ValueError(f"initial_head {config.initial_head} fuses the target's layers "
                         f"{list(initial.config.feature_layers)}; this run fuses {list(layers)}")
    vocab = (checkpoint["draft_token_ids"] if checkpoint else
             draft_vocabulary(training, int(model.get_output_embeddings().weight.shape[0]),
                              config.draft_vocab_size))
    head = new_head(model, vocab, target_name, layers, seed=config.seed)
    if initial is not None and not checkpoint:  # its weights; the vocabulary is this data's
        head.load_state_dict(initial.state_dict() | {"draft_token_ids": vocab})
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad],
                                  lr=config.learning_rate, weight_decay=config.weight_decay)
    history, update = History(), 0
    if checkpoint:
        head.load_state_dict(checkpoint["head"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        history, update = History(**checkpoint["history"]), checkpoint["update"]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: _learning_rate_factor(
        u, config.warmup_updates, config.total_updates), last_epoch=update - 1)
    batches = _batches(training, config, epoch_seed=config.seed)
    evaluation = held_out[:config.eval_conversations]
    started, elapsed_before = time.perf_counter(), (history.seconds[-1] if history.seconds else 0)
    running = []

    def save() -> None:
        losses, agreement, chained = evaluate(head.eval(), evaluation, config.eval_steps,
                                              bfloat16=config.bfloat16)
        head.train()
        history.updates.append(update)
        history.train_loss.append(sum(running) / max(len(running), 1))
        running.clear()
        history.held_out_loss.append(losses)
        history.held_out_agreement.append(agreement)
        history.held_out_chained.append(chained)
        history.seconds.append(elapsed_before + time.perf_counter() - started)
        torch.save({"config": asdict(config), "head": head.state_dict(),
                    "optimizer": optimizer.state_dict(), "history": asdict(history),
                    "update": update, "draft_token_ids": head.draft_token_ids}, checkpoint_path)
        save_head(head, folder / "head.safetensors", {
            "updates": update, "seconds": history.seconds[-1],
            "training_conversations": len(training), "held_out_conversations": len(held_out),
            "training_tokens": sum(len(e.tokens) for e in training),
            "held_out_agreement": agreement, "held_out_chained": chained,
            "config": asdict(config)})
        (folder / "history.json").write_text(json.dumps(asdict(history), indent=1))
        plot_history(history, folder / "training.png")

    head.train()
    with LoggedProgress(disable=not show_progress) as progress:
        task = progress.add_task("training the draft head", total=config.total_updates,
                                 completed=update)
        for batch_examples in _skip(batches, update):
            if update >= config.total_updates:
                break
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bfloat16):
                losses, _, _ = step_losses(head, make_batch(batch_examples, config.num_steps),
                                           config.num_steps)
                loss = sum(losses) / len(losses)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            update += 1
            running.append(loss.item())
            progress.advance(task)
            if update % config.eval_every == 0 or update == config.total_updates:
                save()
            if max_minutes is not None and time.perf_counter() - started > max_minutes * 60:
                if update % config.eval_every:
                    save()
                break
    return folder / "head.safetensors"


def _learning_rate_factor(update: int, warmup: int, total: int) -> float:
    if update < warmup:
        return (update + 1) / warmup
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _batches(examples: Sequence[Example], config: TrainingConfig, epoch_seed: int):
    """Endless batches of about ``batch_tokens`` padded tokens, conversations of similar
    length together, in a seeded order per epoch."""
    epoch = 0
    while True:
        rng = random.Random(f"{epoch_seed}:{epoch}")
        order = sorted(examples, key=lambda e: (len(e.tokens), rng.random()))
        batches, current = [], []
        for example in order:
            if current and (len(current) + 1) * len(example.tokens) > config.batch_tokens:
                batches.append(current)
                current = []
            current.append(example)
        if current:
            batches.append(current)
        rng.shuffle(batches)
        yield from batches
        epoch += 1


def _skip(batches, count: int):
    """``batches`` after its first ``count`` (a resumed run continues the same order)."""
    for index, batch in enumerate(batches):
        if index >= count:
            yield batch

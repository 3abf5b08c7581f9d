"""Draft-head proposer: a head trained on the target's own hidden features drafts k tokens.

Source: Li et al. 2024, "EAGLE" (arXiv 2401.15077), §3 and §4 (drafting: the head runs over
the target's features of the committed positions, then chains on its own outputs); the
head itself is :class:`~exactspec.draft_head.model.DraftHead` (EAGLE-3's fused features,
FR-Spec's draft vocabulary). Drafting is a chain (one token per step); each token is the
head's argmax when greedy, else sampled from q, the head's distribution after the request's
logits pipeline (penalties, bans, temperature, filters), returned over the target's
vocabulary (0 outside the draft vocabulary), so verification stays exact at any
temperature.

The features come from the target's forward passes that scored the positions
(``Backend.hidden_features``): no extra target forward. The engine tells the proposer which
of the target's sequences it continues (:meth:`HeadProposer.follow`); the head's own KV
cache holds one row per committed position but the last (row s: the target's feature at s
and token s + 1), is rolled back to its common prefix with the context like a draft model's,
and drops the drafted rows after each proposal.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from pathlib import Path

import torch

from exactspec.backends import native
from exactspec.backends.base import Backend, UnsupportedModelError
from exactspec.draft_head.kernels import NativeHead
from exactspec.draft_head.model import DraftHead, HeadCache, load_head, shipped_head
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import EMPTY_PROPOSAL, Draw, Proposal, Proposer, draw_draft_token
from exactspec.sampling import sample_from_probs
from exactspec.threads import torch_threads


TREE_BEAM = 4
"""Nodes a token tree expands per level (EAGLE-2's top-k of the level; one head pass)."""
TREE_BRANCH = 4
"""Most children a node of a token tree gets (EAGLE-2's top-k per node)."""


class _SequenceState:
    """What the head holds for one sequence: its KV cache and each row's input token."""

    def __init__(self) -> None:
        self.cache = HeadCache()
        self.row_tokens: list[int] = []  # row s's input token (the context's token s + 1)
        self.last_output: torch.Tensor | None = None  # [1, h], the last row's output
        self.last_logits: torch.Tensor | None = None  # [1, V'], its draft logits


def _greedy_draw(draft_logits: torch.Tensor, ids: torch.Tensor,
                 min_confidence: float) -> Draw | None:
    """:func:`~exactspec.proposers.base.draw_draft_token` of a greedy request without
    logits processors, over the draft vocabulary alone (``draft_logits [V']``, token ids
    ``ids [V']``; the target-vocabulary logits are −inf elsewhere, so the argmax and its
    probability are the same; a tie goes to the earlier draft-vocabulary entry, as in
    training)."""
    best = int(draft_logits.argmax())
    confidence = float(draft_logits.softmax(-1)[best]) if min_confidence else 1.0
    return None if confidence < min_confidence else Draw(int(ids[best]), None, confidence)


def _sampled_draw(draft_logits: torch.Tensor, ids: torch.Tensor, pipeline: LogitsPipeline,
                  rng: torch.Generator, vocab_size: int, min_confidence: float) -> Draw | None:
    """:func:`~exactspec.proposers.base.draw_draft_token` of a sampled request whose logits
    pipeline has no history-dependent step (``is_identity``): its warpers (temperature,
    top-k, top-p, min-p) over the draft vocabulary alone (``draft_logits [V']``, token ids
    ``ids [V']``) give the same q as over the target vocabulary with −inf elsewhere, so q is
    computed over V' entries and scattered to ``[vocab_size]`` once (what verification
    reads)."""
    logits = draft_logits[None]  # [1, V']
    confidence = float(logits.softmax(-1).max()) if min_confidence else 1.0
    if confidence < min_confidence:
        return None
    q = pipeline.probs(logits)[0]  # [V']
    token = int(ids[int(sample_from_probs(q[None], rng)[0])])
    full = q.new_zeros(vocab_size)
    full[ids] = q
    return Draw(token, full, confidence)


class HeadProposer(Proposer):
    """Drafts with a trained draft head (see module docstring).

    Args:
        target: the target's backend; it must provide hidden features (transformers,
            native).
        head: a :class:`DraftHead`, a head file, or None for the head shipped for this
            target (:func:`~exactspec.draft_head.model.shipped_head`).
        dtype: bfloat16 (the default: a head file's values as stored), computed on
            exactspec's native kernels where they build
            (:class:`~exactspec.draft_head.kernels.NativeHead`: the weights quantised once
            to Q8_0, int8 activations; the fastest), else in PyTorch's bfloat16; or float32
            (PyTorch, training's arithmetic). q is whatever the head computes, so the
            choice changes acceptance and speed, never exactness.
        threads: PyTorch threads while drafting (default: PyTorch's count at construction).
        tree_nodes: draft a token tree of at most this many nodes and depth at most k each
            cycle (EAGLE-2's dynamic tree, see :meth:`propose`) instead of a chain; None: a
            chain.
        weights: with bfloat16 on the native kernels, how they hold the weights
            (:data:`~exactspec.draft_head.kernels.WEIGHTS`: ``q4_0``, the default, ``q8_0``:
            finer arithmetic, more bytes read a step, or ``bf16``).
    Raises:
        UnsupportedModelError: on a backend without hidden features (llama.cpp), naming the
            backends that have them, or when no head is shipped for this target.
        FileNotFoundError: for a missing file.
        ValueError: for a head of another target's shape, ``tree_nodes`` not an integer
            ≥ 1, or other ``weights``.
    """

    supports_min_confidence = True
    """Drafting stops once the product of the drafted tokens' top probabilities (EAGLE-2's
    estimate that the whole draft is accepted) would fall below ``min_confidence``."""
    estimates_acceptance = True
    batchable = True
    needs_target_features = True
    """Each copy keeps its own head cache (:meth:`reset` makes a new one); the head's weights
    are shared and only read."""

    def __init__(self, target: Backend, head: DraftHead | str | Path | None = None, *,
                 dtype: torch.dtype = torch.bfloat16, threads: int | None = None,
                 tree_nodes: int | None = None, weights: str = "q4_0") -> None:
        if tree_nodes is not None and (isinstance(tree_nodes, bool)
                                       or not isinstance(tree_nodes, int) or tree_nodes < 1):
            raise ValueError(f"tree = {tree_nodes!r} is invalid: it must be an integer ≥ 1 "
                             "(the most nodes of a drafted token tree)")
        if not target.provides_hidden_features:
            raise UnsupportedModelError(
                f"a draft head reads the target's hidden features, which the {target.name} "
                "backend cannot give; use the native (a GGUF file) or transformers backend")
        if not isinstance(head, DraftHead):
            tensors = target.target_tensors()
            head = load_head(shipped_head(tensors) if head is None else head, tensors)
        head.to_dtype(dtype)
        if head.config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft head drafts over a vocabulary of "
                             f"{head.config.vocab_size} tokens; the target has "
                             f"{target.vocab_size}")
        target.record_hidden_features(head.config.feature_layers)
        self.threads = threads or torch.get_num_threads()
        kernels = native.load() if dtype == torch.bfloat16 else None
        self.target = target
        self.head = head if kernels is None else NativeHead(head, kernels, self.threads, weights)
        self.tree_nodes = tree_nodes
        self.drafts_trees = tree_nodes is not None
        self.sequence_id: int | None = None
        self._state = _SequenceState()

    def follow(self, sequence_id: int) -> None:
        self.sequence_id = sequence_id

    def reset(self, reproducible: bool = False, scope: Hashable = None) -> None:
        self._state = _SequenceState()

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        if k <= 0 or len(token_ids) < 2:  # no position of the target's to draft from
            return EMPTY_PROPOSAL
        if self.sequence_id is None:
            raise RuntimeError("HeadProposer.propose before follow(): the engine must say which "
                               "target sequence it continues")
        if self.tree_nodes is not None:
            with torch.inference_mode(), torch_threads(self.threads):
                return self._propose_tree(token_ids, k, pipeline, min_confidence)
        head, state = self.head, self._state
        with torch.inference_mode(), torch_threads(self.threads):
            hidden, draft_logits = self._sync(token_ids)
            real_rows = len(state.cache)
            drafted: list[int] = []
            probs: list[torch.Tensor] = []
            ids = head.draft_token_ids
            confidence = 1.0  # the product of the drafted tokens' top probabilities
            # greedy without processors: the draft vocabulary's logits are the whole q
            plain_greedy = pipeline.is_identity and pipeline.params.greedy
            for step in range(k):  # draft_logits [1, V']: the head's for the next token
                if plain_greedy:
                    draw = _greedy_draw(draft_logits[0], ids, min_confidence / confidence)
                elif pipeline.is_identity:
                    draw = _sampled_draw(draft_logits[0], ids, pipeline, rng,
                                         self.target.vocab_size, min_confidence / confidence)
                else:
                    logits = draft_logits.new_full((1, self.target.vocab_size), float("-inf"))
                    logits[0, ids] = draft_logits[0]
                    draw = draw_draft_token(logits, [*token_ids, *drafted], pipeline, rng,
                                            min_confidence / confidence)
                if draw is None:
                    break
                confidence *= draw.confidence
                drafted.append(draw.token)
                if draw.q is not None:
                    probs.append(draw.q)
                if step + 1 < k:
                    hidden, draft_logits = head.draft_step(state.cache, hidden,
                                                           torch.tensor([draw.token]))
            state.cache.crop(real_rows)
        return Proposal(drafted, torch.stack(probs) if probs else None)

    def _propose_tree(self, token_ids: Sequence[int], depth: int, pipeline: LogitsPipeline,
                      min_confidence: float) -> Proposal:
        """A token tree of at most ``tree_nodes`` nodes and ``depth`` levels (EAGLE-2,
        arXiv 2406.16858, §4.1–4.2): each level expands the :data:`TREE_BEAM` nodes of the
        level before with the highest value (the product of the head's probabilities along
        the path, after the request's logits pipeline) in one head pass over those nodes
        (each attends to the committed rows and its own path), giving each its
        :data:`TREE_BRANCH` most likely children; then the ``tree_nodes`` nodes of highest value
        are kept (a node's value never exceeds its parent's, so they form a tree), in
        level order. Nodes below ``min_confidence`` are not kept. The tree depends on the
        context only, so each node is a point-mass draft (``Proposal.probs`` None) and
        :func:`~exactspec.verification.verify_tree` stays exact at any temperature."""
        head, state, budget = self.head, self._state, self.tree_nodes
        hidden, draft_logits = self._sync(token_ids)  # [1, h], [1, V']: the first level's
        real_rows = len(state.cache)
        values: list[float] = []  # each candidate node's log value
        nodes: list[tuple[int, int, int]] = []  # each candidate's (token, parent or −1, depth)
        node_rows: dict[int, int] = {}  # expanded candidate → its row in the head's cache
        node_outputs: dict[int, torch.Tensor] = {}  # expanded candidate → its row's output
        frontier = [-1]  # the nodes expanded at this level (draft_logits: theirs)
        floor = math.log(min_confidence) if min_confidence > 0 else -math.inf
        for level in range(1, depth + 1):
            logprobs = self._tree_logprobs(draft_logits, frontier, nodes, token_ids, pipeline)
            top_values, top_ids = logprobs.topk(min(budget, TREE_BRANCH, logprobs.shape[-1]),
                                                dim=-1)
            base = torch.tensor([0.0 if f < 0 else values[f] for f in frontier])
            top_values = (top_values.double() + base[:, None].double()).tolist()
            tokens = head.draft_token_ids[top_ids].tolist()
            level_nodes = []
            for row, parent in enumerate(frontier):
                for value, token in zip(top_values[row], tokens[row]):
                    if value >= floor and value > -math.inf:  # never a banned token
                        level_nodes.append(len(nodes))
                        values.append(value)
                        nodes.append((token, parent, level))
            if not level_nodes or level == depth:
                break
            frontier = sorted(level_nodes, key=values.__getitem__, reverse=True)[:TREE_BEAM]
            draft_logits = head.logits(
                self._expand(frontier, nodes, node_rows, node_outputs, hidden, real_rows))
        state.cache.crop(real_rows)
        kept = sorted(sorted(range(len(nodes)), key=values.__getitem__, reverse=True)[:budget])
        index = {node: i for i, node in enumerate(kept)}
        return Proposal([nodes[n][0] for n in kept],
                        parents=[index.get(nodes[n][1], -1) for n in kept])

    def _tree_logprobs(self, draft_logits: torch.Tensor, frontier: list[int],
                       nodes: list[tuple[int, int, int]], token_ids: Sequence[int],
                       pipeline: LogitsPipeline) -> torch.Tensor:
        """``[len(frontier), V']`` the head's log-probabilities over its draft vocabulary
        for the children of each frontier node (its draft logits ``[len(frontier), V']``),
        after the request's logits pipeline over the node's path."""
        head = self.head
        if not pipeline.is_identity:
            ids, rows = head.draft_token_ids, []
            for row, node in enumerate(frontier):
                logits = draft_logits.new_full((1, self.target.vocab_size), float("-inf"))
                logits[0, ids] = draft_logits[row]
                rows.append(pipeline.process(logits, [*token_ids, *self._path(node, nodes)])[0, ids])
            draft_logits = torch.stack(rows)
        # A node whose every child is banned gets none (its row would be NaN); a banned
        # token stays at −inf (nan_to_num would make it the least finite float, a node)
        return draft_logits.log_softmax(-1).nan_to_num(nan=-math.inf, neginf=-math.inf)

    @staticmethod
    def _path(node: int, nodes: list[tuple[int, int, int]]) -> list[int]:
        """The tokens from the root's child down to ``node`` (−1: none)."""
        path = []
        while node >= 0:
            path.append(nodes[node][0])
            node = nodes[node][1]
        return path[::-1]

    def _expand(self, frontier: list[int], nodes: list[tuple[int, int, int]],
                node_rows: dict[int, int], node_outputs: dict[int, torch.Tensor],
                hidden: torch.Tensor, real_rows: int) -> torch.Tensor:
        """Append a head row per frontier node (its token, its parent's output as input,
        position real + depth − 1, attending to the committed rows and its path's rows) and
        return their outputs ``[len(frontier), h]``."""
        head, cache = self.head, self._state.cache
        start = len(cache)
        inputs, positions, mask = [], [], torch.zeros(len(frontier), start + len(frontier),
                                                      dtype=torch.bool)
        mask[:, :real_rows] = True
        for i, node in enumerate(frontier):
            token, parent, depth = nodes[node]
            inputs.append(hidden[0] if parent < 0 else node_outputs[parent])
            positions.append(real_rows + depth - 1)
            mask[i, start + i] = True
            ancestor = parent
            while ancestor >= 0:
                mask[i, node_rows[ancestor]] = True
                ancestor = nodes[ancestor][1]
            node_rows[node] = start + i
        outputs = head.extend(cache, torch.stack(inputs),
                              torch.tensor([nodes[n][0] for n in frontier]),
                              torch.tensor(positions), mask)
        node_outputs.update(zip(frontier, outputs))
        return outputs

    def _sync(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the head's rows to the context (rolled back to the common prefix, then the
        target's features of the new positions fed) and return the last row's output
        ``[1, h]`` and its draft logits ``[1, V']``, which draft the token after
        ``token_ids``."""
        state, head = self._state, self.head
        new_tokens = token_ids[1:]  # row s's input token is the context's token s + 1
        rows = len(state.row_tokens)
        if list(new_tokens[:rows]) == state.row_tokens:  # the usual case: one C-level compare
            common = rows
        else:
            common, limit = 0, min(rows, len(new_tokens))
            while common < limit and state.row_tokens[common] == new_tokens[common]:
                common += 1
        if common == len(new_tokens) == rows and common:
            return state.last_output, state.last_logits
        common = min(common, len(new_tokens) - 1)  # the last row is always fed again
        state.cache.crop(common)
        del state.row_tokens[common:]
        features = self.target.hidden_features(self.sequence_id, common)
        if features.shape[0] != len(new_tokens) - common:
            raise RuntimeError(f"the target holds {common + features.shape[0]} positions of "
                               f"this sequence, the context has {len(token_ids)} tokens: the "
                               "target's cache must hold all but the last")
        output, state.last_logits = head.feature_step(state.cache, features,
                                                      torch.tensor(new_tokens[common:]))
        state.row_tokens.extend(new_tokens[common:])
        state.last_output = output[-1:]
        return state.last_output, state.last_logits

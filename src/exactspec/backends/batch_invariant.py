"""Batch-invariant kernels for the transformers backend: a token's logits are bit-identical
whether it is scored alone or with the other tokens of a verification.

Why it matters: speculative decoding scores ``[last, d_1 .. d_k]`` in one forward pass and
compares the result with what plain decoding (one token per forward) would have produced.
PyTorch's CPU kernels choose their blocking, vector width and thread split from the shapes:
a matrix product over 4 rows sums in a different order from one over 2 rows, and
``scaled_dot_product_attention`` over a block of queries differs from one query. The logits
of the same token then differ in the last bits (results/kernels-2026-11-30),
enough to flip a near-tied greedy argmax and to change the sampling probabilities slightly.
Following He et al. 2025 ("Defeating Nondeterminism in LLM Inference", Thinking Machines
Lab: batch-invariant matmul, attention and norms), every decode-phase forward here runs
kernels whose reduction order cannot depend on the number of tokens (design notes:
this docstring; measurements: ``results/kernels-2026-11-30``):

- **Linear layers**: :mod:`exactspec.backends.native`'s compiled kernel reads the weights
  once for all rows and reduces every output element in one fixed order, whatever the
  number of rows, the other rows or the thread split (so scoring n tokens costs little more
  than one while the weights' memory traffic dominates). Where it cannot run (no C
  compiler, a GPU, another dtype) the product is computed by PyTorch on blocks of exactly
  :data:`FALLBACK_ROWS` rows (the last block zero-padded), as ``W @ block.T``: every call
  has the same shape, so the kernel, its blocking and its thread split are the same.
- **Attention**: each query over exactly the keys it may see, with a one-token step's
  arithmetic at that position: the native kernel for a block of queries, else one query
  row at a time in PyTorch (``[Hkv, g, d] @ [Hkv, d, L_i]``, softmax, ``@ V[:L_i]``, the
  same shapes a one-token forward at that position uses).
- Everything else in a Llama-style decoder (embedding, RMSNorm, rotary embedding, SiLU,
  residual additions) already works row by row.

Nothing here is trusted blindly: the backend checks bit-identity on the loaded model
(:func:`~exactspec.backends.base.check_batch_invariance`) and the engine refuses to
speculate where it fails. Prefill (filling the cache with the prompt) keeps the fast kernels:
its cache entries are shared by plain and speculative decoding alike.

The ``fast`` kernels (the alternative, :data:`~exactspec.load_options.KERNELS`) are
PyTorch's own, except that on a CPU in float32 a product over at most
:data:`SKINNY_MAX_ROWS` rows is computed as
``(W @ x.T).T``, which streams the weights once in their stored order (MKL's ``x @ W.T``
repacks them on every call, which costs more for a few rows; a single row is
computed as two identical rows, faster there than MKL's one-row path). They are faster but
not batch-invariant, so with them greedy identity holds only up to rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from exactspec.backends import native
from exactspec.trees import TreePaths

FALLBACK_ROWS = 2
"""Rows of every decode-phase matrix product where the native kernels cannot run (no C
compiler, a GPU, another dtype): each call then has this shape, zero-padded, so a forward
over n tokens costs ceil(n / FALLBACK_ROWS) products (results/kernels-2026-11-30)."""
SKINNY_MAX_ROWS = 16
"""The fast kernels compute products over at most this many rows as ``(W @ x.T).T``."""
ATTENTION = "exactspec"
"""The name the attention function is registered under in transformers."""

_kernels: contextvars.ContextVar[str] = contextvars.ContextVar("exactspec_kernels",
                                                                default="fast")


@contextlib.contextmanager
def kernel_mode(name: str) -> Iterator[None]:
    """Run the forward passes inside the block with kernels ``name`` (one of
    :data:`~exactspec.load_options.KERNELS`)."""
    token = _kernels.set(name)
    try:
        yield
    finally:
        _kernels.reset(token)


class BatchInvariantLinear(nn.Linear):
    """``nn.Linear`` whose kernel follows :func:`kernel_mode` (see the module docstring). Shapes
    as ``nn.Linear``: input ``[..., in_features]``, output ``[..., out_features]``. Weights
    are shared with the module it replaces (tied embeddings stay tied)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        if _kernels.get() != "fast":
            out = invariant_product(self.weight, flat)
        elif rows <= SKINNY_MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32:
            out = skinny_product(self.weight, flat)
        else:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def skinny_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The fast kernels' ``x @ weight.T`` for ``x`` ``[rows ≤ SKINNY_MAX_ROWS, in]``:
    ``(W @ x.T).T``, a single row computed as two identical rows (see the module
    docstring). Returns a contiguous ``[rows, out]``."""
    rows = x.shape[0]
    doubled = torch.cat((x, x)) if rows == 1 else x
    return (weight @ doubled.t()).t()[:rows].contiguous()


def native_kernels_apply(weight: torch.Tensor) -> bool:
    """Whether the native kernels compute products with ``weight`` (float32 on the CPU,
    contiguous, and the kernels built: :func:`exactspec.backends.native.load`)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.is_contiguous() and native.load() is not None)


def invariant_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``x`` ``[rows, in]``) with a reduction order per output element that
    depends on nothing but the weight's shape: the native kernels (one read of the weights
    for all rows), else PyTorch's on blocks of :data:`FALLBACK_ROWS`. Returns a contiguous
    ``[rows, out]``."""
    if native_kernels_apply(weight):
        return native.load().linear(x if x.stride(-1) == 1 else x.contiguous(), weight)
    return _fixed_rows_product(weight, x, FALLBACK_ROWS)


def _fixed_rows_product(weight: torch.Tensor, x: torch.Tensor, width: int) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``[rows, in]``, computed in blocks of ``width`` rows
    (zero-padded) so that every kernel call has the same shape. Returns a contiguous
    ``[rows, out]`` (element-wise kernels take another path on a strided view)."""
    rows, blocks = x.shape[0], []
    for start in range(0, rows, width):
        block = x[start:start + width]
        if block.shape[0] < width:
            block = torch.cat((block, block.new_zeros(width - block.shape[0], x.shape[1])))
        blocks.append((weight @ block.t()).t())
    return torch.cat(blocks)[:rows].contiguous()


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface. Fast kernels: transformers' SDPA.
    Batch-invariant kernels: each query causal over one unpadded sequence whose last ``q``
    positions are the queries, as a one-token step there (the native kernel, else one query
    row at a time); inside :func:`packed_sequences` (either kernels), the same per sequence
    of the packed forward, over that sequence's own cache; inside :func:`token_tree`
    (either kernels), each query over the cache and its own path, as a one-token step
    after that path.

    Args:
        query: ``[batch, heads, q, head_dim]``; key, value: ``[batch, kv_heads, L, head_dim]``.
    Returns:
        ``[batch, q, heads, head_dim]`` attention output, and None (no weights).
    Raises:
        ValueError: for attention variants this function does not implement (logit
            soft-capping, sliding windows, attention sinks).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    unsupported = [name for name in ("softcap", "sliding_window", "s_aux")
                   if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(f"exactspec's attention does not implement {', '.join(unsupported)}")
    tree = _tree.get()
    if _kernels.get() == "fast" and _packed.get() is None and tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    scaling = head_dim ** -0.5 if scaling is None else scaling
    packed = _packed.get()
    sequences = [(key, value, 0, q_len)]  # (keys, values, first query, queries) per sequence
    if packed is not None:  # several sequences, each attending to its own cache only
        assert sum(packed.lengths) == q_len, "the packed lengths must cover every query"
        offsets = itertools.accumulate(packed.lengths, initial=0)
        sequences = [(cache.layers[module.layer_idx].keys, cache.layers[module.layer_idx].values,
                      offset, length)
                     for cache, length, offset in zip(packed.caches, packed.lengths, offsets)]
    kernels = native.load()
    if batch == 1 and query.dtype == torch.float32 and query.device.type == "cpu" \
            and kernels is not None:
        output = query.new_empty(q_len, heads, head_dim)
        for keys, values, offset, length in sequences:
            kernels.attention(query[0, :, offset:offset + length], keys[0], values[0],
                              scaling, output[offset:offset + length], tree=tree)
        return output[None], None
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, q_len, head_dim)
    rows = [row for keys, values, offset, length in sequences
            for row in _causal_rows(grouped, keys, values, offset, length, scaling, tree)]
    output = torch.stack(rows, dim=3).reshape(batch, heads, q_len, head_dim)
    return output.transpose(1, 2).contiguous(), None


def _causal_rows(grouped: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: int,
                 length: int, scaling: float, tree: TreePaths | None = None) -> list[torch.Tensor]:
    """Queries ``offset .. offset+length`` of ``grouped`` (``[batch, kv_heads, g, q, d]``),
    the last ``length`` positions of the sequence whose keys and values are ``key``,
    ``value`` (``[batch, kv_heads, L, d]``), each as a one-query problem over exactly the
    keys up to its position (with ``tree``: the keys before the queries, then its own path,
    gathered into the shape a one-token step after that path has). Returns ``length``
    tensors ``[batch, kv_heads, g, d]``."""
    kv_len, rows = key.shape[2], []
    before = kv_len - length
    for i in range(length):
        if tree is None:
            keys, values = key[:, :, :before + i + 1], value[:, :, :before + i + 1]
        else:
            visible = torch.cat([torch.arange(before), before + torch.tensor(tree.paths[i])])
            keys, values = key[:, :, visible], value[:, :, visible]
        scores = grouped[:, :, :, offset + i] @ keys.transpose(-1, -2) * scaling
        rows.append(scores.softmax(dim=-1) @ values)
    return rows


class PackedSequences:
    """The KV caches of several sequences scored in one packed forward (batched decoding):
    the model sees one sequence of ``sum(lengths)`` tokens; :meth:`update` (transformers'
    cache interface) appends each sequence's slice of the new keys and values to its own
    ``DynamicCache``, and :func:`attention` (inside :func:`packed_sequences`) computes each
    query over its own sequence's keys, the same one-query problem as a single sequence's
    forward. Row i's logits are then bit-identical to scoring that sequence alone.

    Args:
        caches: one ``DynamicCache`` per sequence, in packing order.
        lengths: tokens of each sequence in this forward (≥ 1 each).
    """

    def __init__(self, caches: list, lengths: list[int]) -> None:
        self.caches, self.lengths = caches, lengths

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        offset = 0
        for cache, length in zip(self.caches, self.lengths):
            cache.update(key_states[:, :, offset:offset + length],
                         value_states[:, :, offset:offset + length], layer_idx)
            offset += length
        return key_states, value_states


_packed: contextvars.ContextVar[PackedSequences | None] = contextvars.ContextVar(
    "exactspec_packed", default=None)
_tree: contextvars.ContextVar[TreePaths | None] = contextvars.ContextVar(
    "exactspec_tree", default=None)


@contextlib.contextmanager
def token_tree(tree: TreePaths) -> Iterator[None]:
    """Run the forward passes inside the block over one sequence whose new tokens are the
    nodes of ``tree``: each attends to the cache before them and to its own path only (the
    arithmetic of a one-token step after that path, whatever :func:`kernel_mode` says)."""
    token = _tree.set(tree)
    try:
        yield
    finally:
        _tree.reset(token)


@contextlib.contextmanager
def packed_sequences(packed: PackedSequences) -> Iterator[None]:
    """Run the forward passes inside the block as one packed forward of ``packed``'s
    sequences (attention per sequence, whatever :func:`kernel_mode` says)."""
    token = _packed.set(packed)
    try:
        yield
    finally:
        _packed.reset(token)


def use_exactspec_kernels(model: nn.Module) -> None:
    """Turn every plain ``nn.Linear`` of ``model`` into a :class:`BatchInvariantLinear` and
    its attention into :func:`attention`, in place (no weight is copied). The kernels used
    are then chosen per call with :func:`kernel_mode`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BatchInvariantLinear
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)

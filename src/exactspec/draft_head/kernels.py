"""The draft head's inference on exactspec's native kernels.

:class:`NativeHead` computes what :meth:`DraftHead.fc`, :meth:`DraftHead.extend` and
:meth:`DraftHead.logits` compute, on the native kernels' products and, for a chain, their
attention (``es_attention``), with the q/k/v and gate/up products fused into one each, and
a step over committed positions (:meth:`NativeHead.feature_step`) projecting the target's
features (``fc``) inside the same C call. A drafting step is a handful of one-row products
whose cost is reading the weights (the target's forward between two cycles evicts them
from the caches): 17.6 MB a drafted token for the embedded model's head in bfloat16, most
of it the LM head's draft-vocabulary rows. So the weights are quantised once, by default
to Q4_0 (int4 in blocks of 32 with a scale, 5.0 MB; ``weights="q8_0"``: int8, 9.4 MB,
finer logits) and multiplied with int8 activations (``es_linear_q8``, as the native
backend's own products); ``weights="bf16"`` reads the stored bfloat16 values with float32
arithmetic (``es_linear_typed``). PyTorch's one-row bfloat16 products run far below the memory's speed
on a CPU (issue 43, item 5).

What it changes: the head's arithmetic (its weights' and activations' rounding), so its
drafts may differ from the PyTorch path's at near-ties and its acceptance by a little;
never exactness, since verification uses the q the head actually drafted from (a chain) or
point masses (a tree).
"""

from __future__ import annotations

import gguf
import torch
from torch.nn import functional as F

from exactspec.backends import native
from exactspec.draft_head.model import DraftHead, HeadCache, _rms_norm, attend, rotate

BF16 = native.WEIGHT_TYPES["BF16"]
WEIGHTS = ("q8_0", "q4_0", "bf16")
"""How :class:`NativeHead` holds the head's weights (see the module docstring)."""


class _Matrix:
    """One ``[n, K]`` product's weights as the kernels take them."""

    def __init__(self, kernels: native.NativeKernels, weights: str, *rows: torch.Tensor) -> None:
        stacked = torch.cat([w.detach().float() for w in rows]).to(torch.bfloat16)
        self.n, self.k = stacked.shape
        self.type = native.WEIGHT_TYPES[weights.upper()]
        if weights == "bf16":
            self.data, self.packed = stacked.contiguous().view(torch.int16).numpy(), None
        else:
            blocks = gguf.quants.quantize(stacked.float().numpy(),
                                          gguf.GGMLQuantizationType[weights.upper()])
            self.data, self.packed = None, kernels.repack(blocks, self.type, self.n, self.k)

    def __call__(self, kernels: native.NativeKernels, x: torch.Tensor,
                 threads: int) -> torch.Tensor:
        x = x.contiguous()
        if self.packed is None:
            return kernels.linear_typed(x, self.data, BF16, self.n, threads)
        return kernels.linear_int8(x, self.packed, self.type, self.n, threads)


class NativeHead:
    """A :class:`DraftHead`'s inference on the native kernels (see the module docstring):
    the same ``fc``, ``extend`` and ``logits`` with the same shapes, float32 in and out.

    Args:
        head: the head (its weights are read once, rounded to bfloat16: a head file's values
            as stored).
        kernels: the loaded native kernels (:func:`exactspec.backends.native.load`).
        threads: threads of each product (output columns are split; the results do not
            depend on it).
        weights: ``q4_0`` (the default: int4 in blocks of 32 with a scale, 5.0 MB read a step
            for the embedded model's head), ``q8_0`` (9.4 MB, finer arithmetic) or
            ``bf16`` (see the module docstring).
    Raises:
        ValueError: for other ``weights``.
    Attributes:
        config, draft_token_ids: the head's.
        dtype: ``torch.float32``, what ``fc``, ``extend`` and ``logits`` take and return.
    """

    dtype = torch.float32

    def __init__(self, head: DraftHead, kernels: native.NativeKernels, threads: int,
                 weights: str = "q4_0") -> None:
        if weights not in WEIGHTS:
            raise ValueError(f"weights = {weights!r} is invalid: choose one of "
                             f"{', '.join(WEIGHTS)}")
        c = head.config
        self.config, self.draft_token_ids = c, head.draft_token_ids
        self._kernels, self._threads = kernels, threads
        matrix = lambda *rows: _Matrix(kernels, weights, *rows)
        self._fc = matrix(head.fc.weight)
        self._qkv = matrix(head.q_proj.weight, head.k_proj.weight, head.v_proj.weight)
        self._o = matrix(head.o_proj.weight)
        self._gate_up = matrix(head.gate_proj.weight, head.up_proj.weight)
        self._down = matrix(head.down_proj.weight)
        self._lm_head = matrix(head.lm_head)
        self._norms = [norm.weight.detach().float().contiguous() for norm in (
            head.input_norm, head.hidden_norm, head.post_attention_norm)]
        self._final_norm = head.final_norm_weight.float().contiguous()
        self._embedding = head.embedding.float().contiguous()
        self._inv_freq = head.inv_freq.float().contiguous()
        self._q_width = c.num_attention_heads * c.head_dim
        self._kv_width = c.num_key_value_heads * c.head_dim
        self._scale = c.head_dim ** -0.5
        self._c_head = None if weights == "bf16" else native.Head(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, len(self.draft_token_ids), self._qkv.type, c.rms_norm_eps,
            *(tensor.data_ptr() for tensor in (self._embedding, *self._norms,
                                               self._final_norm, self._inv_freq)),
            *(matrix.packed.ctypes.data for matrix in (self._qkv, self._o, self._gate_up,
                                                       self._down, self._lm_head)),
            self._fc.k, self._fc.packed.ctypes.data)

    def _linear(self, x: torch.Tensor, weight: _Matrix) -> torch.Tensor:
        return weight(self._kernels, x, self._threads)

    def fc(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, h]`` the fused features ``[n, F]`` (float32) projected to the hidden size."""
        return self._linear(features.float(), self._fc)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, V']`` float32 draft logits of the head's outputs ``[n, h]``."""
        eps = self.config.rms_norm_eps
        return self._linear(_rms_norm(hidden, self._final_norm, eps), self._lm_head)

    def draft_step(self, cache: HeadCache, hidden: torch.Tensor,
                   token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DraftHead.draft_step`: chain rows appended and their outputs ``[n, h]``,
        with the last row's draft logits ``[1, V']``; with int8-product weights (Q8_0, Q4_0)
        one call of ``es_head_step``."""
        if self._c_head is None:
            outputs = self.extend(cache, hidden, token_ids)
            return outputs, self.logits(outputs[-1:])
        return self._native_step(cache, hidden, token_ids, logits=True)

    def feature_step(self, cache: HeadCache, features: torch.Tensor,
                     token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`DraftHead.feature_step`: :meth:`draft_step` of ``fc(features)``
        (``[n, F]``); with int8-product weights one call of ``es_head_step``, the projection
        included (the same arithmetic as :meth:`fc`)."""
        if self._c_head is None:
            return self.draft_step(cache, self.fc(features), token_ids)
        return self._native_step(cache, features, token_ids, logits=True, features=True)

    def _native_step(self, cache: HeadCache, hidden: torch.Tensor, token_ids: torch.Tensor,
                     logits: bool, features: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``es_head_step`` over chain rows: their outputs ``[n, h]`` and, if ``logits``,
        the last row's draft logits ``[1, V']`` (else None); with ``features``, ``hidden``
        holds the rows' fused target features ``[n, F]``, projected by ``fc`` in the call."""
        c, n, start = self.config, hidden.shape[0], len(cache)
        tokens = token_ids.to(torch.int64).contiguous()
        if n == 0 or tokens.shape != (n,):
            raise ValueError(f"{n} rows need {n} token ids (at least one); got "
                             f"{tuple(tokens.shape)}")
        if not 0 <= int(tokens.min()) <= int(tokens.max()) < self._embedding.shape[0]:
            raise ValueError(f"token ids must lie in [0, {self._embedding.shape[0]})")
        width = self._fc.k if features else c.hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != width:
            raise ValueError(f"rows of {width} {'features' if features else 'hidden values'} "
                             f"expected; got a tensor of shape {tuple(hidden.shape)}")
        hidden = hidden.float().contiguous()
        cache.new_rows(n, (c.num_key_value_heads, c.head_dim), torch.float32)
        out = torch.empty(n, c.hidden_size)
        draft_logits = torch.empty(1, len(self.draft_token_ids)) if logits else None
        self._kernels.head_step(self._c_head, cache.keys.data_ptr(), cache.values.data_ptr(),
                                start, n, None if features else hidden.data_ptr(),
                                hidden.data_ptr() if features else None, tokens.data_ptr(),
                                out.data_ptr(),
                                None if draft_logits is None else draft_logits.data_ptr(),
                                self._threads, native.ISAS.index(self._kernels.isa))
        return out, draft_logits

    def extend(self, cache: HeadCache, hidden: torch.Tensor, token_ids: torch.Tensor,
               positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`DraftHead.extend`: append rows to ``cache`` and return their outputs
        ``[n, h]``; a chain (``positions`` and ``mask`` None) in one call of
        ``es_head_step`` with int8-product weights, else on the native kernels' products with a
        chain's attention on the native kernels and a tree's mask through PyTorch."""
        if self._c_head is not None and positions is None and mask is None:
            return self._native_step(cache, hidden, token_ids, logits=False)[0]
        c, eps = self.config, self.config.rms_norm_eps
        n, start = hidden.shape[0], len(cache)
        if positions is None:
            positions = torch.arange(start, start + n)
        input_norm, hidden_norm, post_norm = self._norms
        x = torch.cat([_rms_norm(self._embedding[token_ids], input_norm, eps),
                       _rms_norm(hidden, hidden_norm, eps)], -1)
        qkv = self._linear(x, self._qkv)
        q = qkv[:, :self._q_width].view(n, c.num_attention_heads, c.head_dim)
        k = qkv[:, self._q_width:self._q_width + self._kv_width].view(
            n, c.num_key_value_heads, c.head_dim)
        v = qkv[:, self._q_width + self._kv_width:].view(n, c.num_key_value_heads, c.head_dim)
        q, k = rotate(q, k, positions, self._inv_freq)
        cache.append(k, v)
        if mask is None:  # a chain: each row sees the rows up to its own
            attention = torch.empty(n, c.num_attention_heads, c.head_dim)
            self._kernels.attention(q.transpose(0, 1), cache.keys.transpose(0, 1),
                                    cache.values.transpose(0, 1), self._scale, attention,
                                    threads=self._threads)
        else:
            attention = attend(q, cache, mask)
        hidden = hidden + self._linear(attention.reshape(n, self._q_width), self._o)
        gate, up = self._linear(_rms_norm(hidden, post_norm, eps),
                                self._gate_up).split(c.intermediate_size, -1)
        return hidden + self._linear(F.silu(gate) * up, self._down)

"""The draft head's inference on exactspec's native kernels.

:class:`NativeHead` computes what :meth:`DraftHead.fc`, :meth:`DraftHead.extend` and
:meth:`DraftHead.logits` compute, with the head's bfloat16 weights read in place by the
native kernels' BF16 products (``es_linear_typed``: float32 arithmetic over the stored
bfloat16 values) and, for a chain, their attention (``es_attention``). A drafting step is
a handful of one-row products: PyTorch's bfloat16 products for one row run far below the
memory's speed on a CPU, and were most of the head's cost beside the native backend's
5–7 ms step (issue 43, item 5). The q/k/v and gate/up products are fused into one each.

What it changes: the head's arithmetic (float32 activations instead of PyTorch's bfloat16
ones), so its drafts may differ from the PyTorch path's at near-ties; never exactness,
since verification uses the q the head actually drafted from (a chain) or point masses (a
tree).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from exactspec.backends import native
from exactspec.draft_head.model import DraftHead, HeadCache, _rms_norm, _rotate

BF16 = native.WEIGHT_TYPES["BF16"]


def _bf16_rows(*weights: torch.Tensor) -> np.ndarray:
    """The weights stacked by rows, rounded to bfloat16, as the int16 array the kernels
    read (one contiguous ``[N, K]`` matrix)."""
    stacked = torch.cat([w.detach().float() for w in weights]).to(torch.bfloat16).contiguous()
    return stacked.view(torch.int16).numpy()


class NativeHead:
    """A :class:`DraftHead`'s inference on the native kernels (see the module docstring):
    the same ``fc``, ``extend`` and ``logits`` with the same shapes, float32 in and out.

    Args:
        head: the head (its weights are read once, rounded to bfloat16: a head file's values
            as stored).
        kernels: the loaded native kernels (:func:`exactspec.backends.native.load`).
        threads: threads of each product (output columns are split; the results do not
            depend on it).
    Attributes:
        config, draft_token_ids: the head's.
        dtype: ``torch.float32``, what ``fc``, ``extend`` and ``logits`` take and return.
    """

    dtype = torch.float32

    def __init__(self, head: DraftHead, kernels: native.NativeKernels, threads: int) -> None:
        c = head.config
        self.config, self.draft_token_ids = c, head.draft_token_ids
        self._kernels, self._threads = kernels, threads
        self._fc = _bf16_rows(head.fc.weight)
        self._qkv = _bf16_rows(head.q_proj.weight, head.k_proj.weight, head.v_proj.weight)
        self._o = _bf16_rows(head.o_proj.weight)
        self._gate_up = _bf16_rows(head.gate_proj.weight, head.up_proj.weight)
        self._down = _bf16_rows(head.down_proj.weight)
        self._lm_head = _bf16_rows(head.lm_head)
        self._norms = [norm.weight.detach().float() for norm in (
            head.input_norm, head.hidden_norm, head.post_attention_norm)]
        self._final_norm = head.final_norm_weight.float()
        self._embedding = head.embedding.float()
        self._inv_freq = head.inv_freq
        self._q_width = c.num_attention_heads * c.head_dim
        self._kv_width = c.num_key_value_heads * c.head_dim
        self._scale = c.head_dim ** -0.5

    def _linear(self, x: torch.Tensor, weight: np.ndarray) -> torch.Tensor:
        return self._kernels.linear_typed(x.contiguous(), weight, BF16, weight.shape[0],
                                          self._threads)

    def fc(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, h]`` the fused features ``[n, F]`` (float32) projected to the hidden size."""
        return self._linear(features.float(), self._fc)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, V']`` float32 draft logits of the head's outputs ``[n, h]``."""
        eps = self.config.rms_norm_eps
        return self._linear(_rms_norm(hidden, self._final_norm, eps), self._lm_head)

    def extend(self, cache: HeadCache, hidden: torch.Tensor, token_ids: torch.Tensor,
               positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`DraftHead.extend`: append rows to ``cache`` and return their outputs
        ``[n, h]``; a chain (``mask`` None) attends on the native kernels, a tree's mask
        through PyTorch."""
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
        angles = positions.float()[:, None] * self._inv_freq
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        cache.append(k, v)
        if mask is None:  # a chain: each row sees the rows up to its own
            attention = torch.empty(n, c.num_attention_heads, c.head_dim)
            self._kernels.attention(q.transpose(0, 1), cache.keys.transpose(0, 1),
                                    cache.values.transpose(0, 1), self._scale, attention,
                                    threads=self._threads)
        else:
            attention = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], cache.keys.transpose(0, 1)[None],
                cache.values.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)[0]
            attention = attention.transpose(0, 1)
        hidden = hidden + self._linear(attention.reshape(n, self._q_width), self._o)
        gate, up = self._linear(_rms_norm(hidden, post_norm, eps),
                                self._gate_up).split(c.intermediate_size, -1)
        return hidden + self._linear(F.silu(gate) * up, self._down)

"""The draft head: one decoder layer that drafts from the target's own hidden features.

Sources (the choice is argued in docs/design.md, "The draft head"):

- Li et al. 2024, "EAGLE" (arXiv 2401.15077), §3: a feature-level head of one decoder layer
  over (the target's feature at position t, the embedding of token t + 1), whose output
  goes through the target's own final norm and LM head (frozen, not copied) to draft token
  t + 2, and is fed back as the next step's feature.
- Li et al. 2025, "EAGLE-3" (arXiv 2503.01840), §3: the feature is the target's low, middle
  and high layer outputs fused by a linear layer (``fc``); the layer's input is the
  normalised token embedding concatenated with the normalised hidden state (attention
  projections of width 2·hidden), the residual is the hidden state; trained with
  "training-time test": step j > 0 takes the head's own step j − 1 output as its feature
  (:meth:`DraftHead.unrolled`).
- Zhao et al. 2025, "FR-Spec" (arXiv 2502.14856): the head's LM head keeps only the
  ``draft_vocab_size`` most frequent tokens (``draft_token_ids``); the draft's q is 0
  elsewhere, which verification handles exactly (min(1, p/q) with the full-vocabulary p).

Shapes: h = ``hidden_size``, F = ``len(feature_layers) · h``, V' = ``draft_vocab_size``.
A head file (:func:`save_head`, :func:`load_head`) holds only the trained weights
(bfloat16), the draft vocabulary and the config; the embedding, final norm and LM head are
the target's. The head computes with the stored values exactly: in bfloat16 as they are, or
in float32 after a conversion that is exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
import hashlib

import torch
from torch import nn
from torch.nn import functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from exactspec.backends.base import TargetTensors, UnsupportedModelError
from exactspec.backends.transformers_backend import module_tensors

FORMAT = "exactspec-draft-head/1"
"""The ``format`` field of a head file's metadata."""


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape and the target it belongs to.

    Attributes:
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
            rms_norm_eps: the decoder layer's shape (the target's by default).
        rope_theta: the base of the head's rotary position embedding.
        feature_layers: the target's decoder layers (0-based) whose outputs are fused.
        vocab_size: the target's vocabulary (logits width).
        draft_vocab_size: V', the tokens the head drafts from (FR-Spec).
        num_target_layers: the target's decoder layer count (checked at load).
        target: the target's name, for messages.
        target_fingerprint: :func:`target_fingerprint` of the target's weights (how the
            head shipped for a target is found).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    feature_layers: tuple[int, ...]
    vocab_size: int
    draft_vocab_size: int
    num_target_layers: int
    target: str = ""
    target_fingerprint: str = ""

    @classmethod
    def for_target(cls, model: nn.Module, draft_vocab_size: int, target: str = "",
                   feature_layers: tuple[int, ...] | None = None) -> HeadConfig:
        """The config of a head for a transformers causal LM ``model`` (Llama-like: its
        decoder layer shape), fusing ``feature_layers`` (default EAGLE-3's choice: layers
        2, L/2 and L − 3 of L).

        Raises:
            ValueError: for a draft vocabulary outside [1, vocab] or layers outside [0, L).
        """
        config = model.config.get_text_config(decoder=True)
        num_layers = int(config.num_hidden_layers)
        layers = tuple(feature_layers if feature_layers is not None else
                       sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))
        if not layers or any(not 0 <= layer < num_layers for layer in layers):
            raise ValueError(f"feature_layers = {layers} is invalid: the target's layers are "
                             f"0 .. {num_layers - 1}")
        vocab_size = int(model.get_output_embeddings().weight.shape[0])
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size = {draft_vocab_size} is invalid: it must be in "
                             f"[1, {vocab_size}] (the target's vocabulary)")
        heads = int(config.num_attention_heads)
        return cls(hidden_size=int(config.hidden_size), num_attention_heads=heads,
                   num_key_value_heads=int(getattr(config, "num_key_value_heads", heads)),
                   head_dim=int(getattr(config, "head_dim", None)
                                or config.hidden_size // heads),
                   intermediate_size=int(config.intermediate_size),
                   rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
                   rope_theta=float(getattr(config, "rope_theta", None) or 10000.0),
                   feature_layers=layers, vocab_size=vocab_size,
                   draft_vocab_size=int(draft_vocab_size), num_target_layers=num_layers,
                   target=target, target_fingerprint=target_fingerprint(
                       model.get_output_embeddings().weight))

    @property
    def feature_size(self) -> int:
        """F, the width of the fused target features."""
        return len(self.feature_layers) * self.hidden_size


class HeadCache:
    """The head's keys and values of one sequence, row i at position i: ``keys`` and
    ``values`` are ``[n, num_key_value_heads, head_dim]`` views of buffers that grow by
    doubling (appending a row copies one row, not the whole cache)."""

    def __init__(self) -> None:
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:self._length]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:self._length]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows ``keys``, ``values`` ``[n, num_key_value_heads, head_dim]``."""
        new_keys, new_values = self.new_rows(keys.shape[0], keys.shape[1:], keys.dtype,
                                             keys.device)
        new_keys.copy_(keys)
        new_values.copy_(values)

    def new_rows(self, n: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``n`` rows of ``shape`` (``[num_key_value_heads, head_dim]``), left for the
        caller to write, and return them (views of the buffers, ``[n, *shape]``)."""
        end = self._length + n
        if self._keys is None or end > self._keys.shape[0]:
            size = max(end, 2 * (0 if self._keys is None else self._keys.shape[0]), 64)
            grown_keys = torch.empty((size, *shape), dtype=dtype, device=device)
            grown_values = torch.empty((size, *shape), dtype=dtype, device=device)
            if self._length:
                grown_keys[:self._length] = self.keys
                grown_values[:self._length] = self.values
            self._keys, self._values = grown_keys, grown_values
        start, self._length = self._length, end
        return self._keys[start:end], self._values[start:end]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` rows."""
        self._length = min(self._length, length)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class DraftHead(nn.Module):
    """The head (see the module docstring).

    Args:
        config: its :class:`HeadConfig`.
        embedding: ``[vocab, h]`` the target's input embedding (shared, frozen).
        final_norm_weight: ``[h]`` the target's final RMSNorm weight (frozen).
        lm_head_weight: ``[vocab, h]`` the target's LM head (frozen; the head keeps the
            rows of ``draft_token_ids``).
        draft_token_ids: ``[V']`` the target ids the head drafts from, most frequent first.
    Raises:
        ValueError: if the target's tensors do not have the config's shapes.
    """

    def __init__(self, config: HeadConfig, embedding: torch.Tensor,
                 final_norm_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 draft_token_ids: torch.Tensor) -> None:
        super().__init__()
        h, c = config.hidden_size, config
        if (embedding.shape[1] != h or lm_head_weight.shape != (c.vocab_size, h)
                or draft_token_ids.shape != (c.draft_vocab_size,)):
            raise ValueError(
                f"the target's tensors (embedding {tuple(embedding.shape)}, LM head "
                f"{tuple(lm_head_weight.shape)}) do not fit this head (hidden size {h}, "
                f"vocabulary {c.vocab_size}, draft vocabulary {c.draft_vocab_size}): the head "
                f"was trained for another target ({c.target or 'unnamed'})")
        self.config = config
        self.fc = nn.Linear(config.feature_size, h, bias=False)
        self.input_norm = RMSNorm(h, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)  # on the hidden state
        self.q_proj = nn.Linear(2 * h, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, h, bias=False)
        self.post_attention_norm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.register_buffer("draft_token_ids", draft_token_ids.to(torch.long))
        # the target's frozen tensors: not parameters, not saved
        self.embedding = embedding.detach()
        self.final_norm_weight = final_norm_weight.detach()
        self.lm_head = lm_head_weight.detach()[draft_token_ids].float().contiguous()  # [V', h]

        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float()
                                                 / c.head_dim))

    @property
    def dtype(self) -> torch.dtype:
        """What the head computes in (its weights' type)."""
        return self.fc.weight.dtype

    def to_dtype(self, dtype: torch.dtype) -> DraftHead:
        """Compute in ``dtype`` from now on (weights and the LM head rows converted)."""
        self.to(dtype)
        self.lm_head = self.lm_head.to(dtype)
        return self

    # -- the layer -----------------------------------------------------------------------
    def project(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor):
        """Queries, keys and values of rows (``hidden [..., T, h]``, the input token
        ``token_ids [..., T]`` at ``positions [T]``): ``[..., T, heads, head_dim]`` each
        (keys and values with ``num_key_value_heads``)."""
        c = self.config
        x = torch.cat([self.input_norm(F.embedding(token_ids, self.embedding).to(hidden.dtype)),
                       self.hidden_norm(hidden)], -1)
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(*shape, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(*shape, c.num_key_value_heads, c.head_dim)
        return rotate(q, k, positions, self.inv_freq) + (v,)

    def finish(self, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[..., T, h]`` from its input hidden state and the attention
        output ``[..., T, heads, head_dim]``."""
        hidden = hidden + self.o_proj(attention.flatten(-2))
        x = self.post_attention_norm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., V']`` draft logits of the head's outputs ``[..., h]`` (the target's final
        norm and LM head rows of the draft vocabulary)."""
        return (_rms_norm(hidden, self.final_norm_weight.to(hidden.dtype), self.config.rms_norm_eps)
                @ self.lm_head.T).float()

    # -- training ------------------------------------------------------------------------
    def unrolled(self, features: torch.Tensor, token_ids: torch.Tensor,
                 num_steps: int) -> list[torch.Tensor]:
        """The head over whole sequences, ``num_steps`` drafting steps at every position at
        once ("training-time test", EAGLE-3 §3.2).

        Args:
            features: ``[B, T, F]`` the target's fused features at positions 0 .. T − 1.
            token_ids: ``[B, T + num_steps − 1]`` the sequences' tokens from position 1 on:
                row t of step j takes token t + j + 1.
            num_steps: S ≥ 1.
        Returns:
            ``[S]`` outputs ``[B, T, h]``: step j's row t drafts token t + j + 2, having
            attended to the real rows 0 .. t and to its own chain's steps 1 .. j, exactly as
            :meth:`extend` and drafting do at inference.
        """
        length = features.shape[1]
        positions = torch.arange(length, device=features.device)
        hidden = self.fc(features)
        keys, values, outputs = [], [], []
        causal = torch.ones(length, length, dtype=torch.bool, device=features.device).tril()
        for step in range(num_steps):
            q, k, v = self.project(hidden, token_ids[:, step:step + length], positions + step)
            keys.append(k)
            values.append(v)
            hidden = self.finish(hidden, self._attend_unrolled(q, keys, values, causal))
            outputs.append(hidden)
        return outputs

    def _attend_unrolled(self, q, keys, values, causal) -> torch.Tensor:
        """Step j's attention: the real rows s ≤ t (keys[0]) and the chain's own rows
        (keys[1 .. j], one per query)."""
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        scale = 1.0 / math.sqrt(self.config.head_dim)
        q = q.transpose(1, 2)  # [B, H, T, D]
        k0 = keys[0].repeat_interleave(groups, 2).transpose(1, 2)
        v0 = values[0].repeat_interleave(groups, 2).transpose(1, 2)
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        own = [(k.repeat_interleave(groups, 2).transpose(1, 2), v.repeat_interleave(
            groups, 2).transpose(1, 2)) for k, v in zip(keys[1:], values[1:])]
        scores += [(q * k).sum(-1, keepdim=True) * scale for k, _ in own]  # [B, H, T, 1]
        weights = torch.cat(scores, -1).softmax(-1)
        length = q.shape[2]
        out = weights[..., :length] @ v0
        for i, (_, v) in enumerate(own):
            out = out + weights[..., length + i:length + i + 1] * v
        return out.transpose(1, 2)  # [B, T, H, D]

    # -- inference -----------------------------------------------------------------------
    def extend(self, cache: HeadCache, hidden: torch.Tensor, token_ids: torch.Tensor,
               positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append rows to ``cache`` and return their outputs ``[n, h]``.

        Args:
            cache: the sequence's keys and values (rows 0 .. len − 1).
            hidden: ``[n, h]`` the rows' input hidden states (``fc`` of target features, or
                the head's previous output while drafting).
            token_ids: ``[n]`` the rows' input tokens.
            positions: ``[n]`` their positions (default: the rows' indices, a chain).
            mask: ``[n, len + n]`` bool, the rows each new row attends to (default: causal;
                a token tree passes each node's path).
        """
        start = len(cache)
        if positions is None:
            positions = torch.arange(start, start + hidden.shape[0])
        q, k, v = self.project(hidden, token_ids, positions)
        cache.append(k, v)
        n, total = hidden.shape[0], len(cache)
        if mask is None and n > 1:
            mask = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]
        return self.finish(hidden, attend(q, cache, mask))

    def draft_step(self, cache: HeadCache, hidden: torch.Tensor,
                   token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`extend` by chain rows (``hidden [n, h]``, ``token_ids [n]``), then the draft
        logits of the last: returns the outputs ``[n, h]`` and ``[1, V']``."""
        outputs = self.extend(cache, hidden, token_ids)
        return outputs, self.logits(outputs[-1:])

    def feature_step(self, cache: HeadCache, features: torch.Tensor,
                     token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`draft_step` over rows of committed positions: their hidden input is
        ``fc`` of the target's fused features ``[n, F]`` (EAGLE-3's input; float32 or the
        head's dtype). Returns the outputs ``[n, h]`` and the last row's draft logits
        ``[1, V']``."""
        return self.draft_step(cache, self.fc(features.to(self.dtype)), token_ids)


def rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's rotary position embedding (halves rotated) of queries and keys
    ``[..., T, heads, D]`` at ``positions [T]`` (frequencies ``inv_freq [D/2]``)."""
    angles = positions.float()[:, None] * inv_freq  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].to(q.dtype)  # [T, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def attend(q: torch.Tensor, cache: HeadCache, mask: torch.Tensor | None) -> torch.Tensor:
    """``[n, heads, D]`` attention of the queries ``q [n, heads, D]`` over the cache's rows
    (``mask [n, len]`` bool, or None: all of them), grouped-query heads sharing theirs."""
    attention = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], cache.keys.transpose(0, 1)[None],
        cache.values.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return attention[0].transpose(0, 1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def target_fingerprint(lm_head_weight: torch.Tensor) -> str:
    """16 hex digits identifying a target's weights: a hash of its first 64 LM head rows
    (``lm_head_weight`` ``[vocab, h]``) rounded to bfloat16 (the same for the same weights
    in float32 or bfloat16, on any backend that dequantises them alike)."""
    rows = lm_head_weight[:64].detach().to(torch.bfloat16).cpu()
    return hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


def new_head(model: nn.Module, draft_token_ids: torch.Tensor, target: str = "",
             feature_layers: tuple[int, ...] | None = None, seed: int = 0) -> DraftHead:
    """A freshly initialised head for ``model`` (seeded), drafting from ``draft_token_ids``.
    The trained layers start as PyTorch's defaults; ``fc`` starts as the mean of the fused
    layers' features (so that an untrained head already reads them)."""
    config = HeadConfig.for_target(model, len(draft_token_ids), target, feature_layers)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = DraftHead(config, *module_tensors(model)[:3], draft_token_ids)
    with torch.no_grad():
        eye = torch.eye(config.hidden_size) / len(config.feature_layers)
        head.fc.weight.copy_(eye.repeat(1, len(config.feature_layers)))
    return head


def save_head(head: DraftHead, path: str | Path, metadata: dict | None = None) -> None:
    """Write the head's trained weights (rounded to bfloat16), its draft vocabulary and
    config to a safetensors file; ``metadata`` (JSON-serialisable) is kept with them (e.g.
    how it was trained)."""
    tensors = {name: value.detach().to(torch.bfloat16).contiguous()
               for name, value in head.named_parameters()}
    tensors["draft_token_ids"] = head.draft_token_ids.to(torch.int32)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={
        "format": FORMAT, "config": json.dumps(dataclasses.asdict(head.config)),
        "training": json.dumps(metadata or {})})


def load_head(path: str | Path, target: TargetTensors) -> DraftHead:
    """The head in ``path`` (written by :func:`save_head`) on the target's tensors
    (``Backend.target_tensors``), in float32 (the stored bfloat16 values, converted
    exactly; :meth:`DraftHead.to_dtype`).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if it is not a head file, or it was trained for a target of another shape.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"draft head {str(path)!r} does not exist")
    try:
        with safe_open(str(path), "pt") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except Exception as error:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a draft head file ({error})") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a draft head file (format {metadata.get('format')!r}, "
                         f"expected {FORMAT!r})")
    config = head_config(path)
    if target.num_layers != config.num_target_layers:
        raise ValueError(f"{path} was trained for a target of {config.num_target_layers} layers "
                         f"({config.target or 'unnamed'}); this one has {target.num_layers}")
    head = DraftHead(config, *target[:3], tensors.pop("draft_token_ids"))
    head.load_state_dict({name: value.float() for name, value in tensors.items()}
                         | {"draft_token_ids": head.draft_token_ids})
    return head.eval().requires_grad_(False)


SHIPPED_HEADS = Path(__file__).with_name("heads")
"""The heads shipped in the package (``*.safetensors``, made by ``exactspec train-draft``)."""


def head_config(path: str | Path) -> HeadConfig:
    """The :class:`HeadConfig` stored in a head file."""
    with safe_open(str(path), "pt") as file:
        fields = json.loads((file.metadata() or {})["config"])
    return HeadConfig(**(fields | {"feature_layers": tuple(fields["feature_layers"])}))


def shipped_head(target: TargetTensors) -> Path:
    """The shipped head trained on this target's weights (``Backend.target_tensors``).

    Raises:
        UnsupportedModelError: if none was (naming the targets that have one).
    """
    fingerprint = target_fingerprint(target.lm_head_weight)
    heads = sorted(SHIPPED_HEADS.glob("*.safetensors"))
    for path in heads:
        if head_config(path).target_fingerprint == fingerprint:
            return path
    names = ", ".join(head_config(path).target for path in heads) or "none"
    raise UnsupportedModelError(
        f"no draft head is shipped for this target (shipped for: {names}); train one with "
        "`exactspec train-draft` and use --proposer head:PATH")


def head_metadata(path: str | Path) -> dict:
    """The training metadata :func:`save_head` stored in ``path``."""
    with safe_open(str(path), "pt") as file:
        return json.loads((file.metadata() or {}).get("training", "{}"))

"""The native backend: Llama-family GGUF models on exactspec's own kernels.

The GGUF file's tensors are memory-mapped (:class:`~exactspec.gguf_file.GGUFFile`) and read in their own block
formats (:data:`~exactspec.backends.native.WEIGHT_TYPES`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the
K-quants Q4_K, Q5_K, Q6_K, F16, BF16, F32), never copied to float32; one call of the
compiled ``es_forward`` (``native/forward.c``, whose header gives the arithmetic) runs a whole forward pass
over any number of rows of any number of sequences, each with a static float32 KV cache
that grows by doubling. Every output element of every product is reduced in one fixed
order whatever the rows, so verification blocks, packed sequences, token trees and prefill
chunks score each token bit for bit as a one-token step (docs/design.md, "The native
backend").

Architectures: :data:`ARCHITECTURES` (Llama, Mistral, Qwen2: grouped-query attention,
RoPE in llama.cpp's "norm" or "neox" layout with linear scaling or Llama 3's frequency
factors, tied or untied embeddings, q/k/v biases); others are refused by name.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import torch

from exactspec.backends import native
from exactspec.load_options import ACTIVATIONS
from exactspec.backends.base import (PREFILL_CHUNK_SIZE, TargetTensors, UnsupportedModelError,
                                     check_batch_invariance, check_context, check_reserve,
                                     check_retain, check_rows, check_sequence_invariance,
                                     check_tree)
from exactspec.backends.transformers_backend import HFTokenizer
from exactspec.gguf_file import GGUFFile
from exactspec.model_files import check_gguf_file, converted_gguf, gguf_tokenizer
from exactspec.threads import ThreadChooser
from exactspec.trees import TreePaths

ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}
"""GGUF architectures the native backend runs → whether RoPE rotates halves ("neox", as
llama.cpp runs Qwen2) rather than adjacent pairs ("norm", as it runs Llama)."""

_VOCABULARY_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                      "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}

INITIAL_CAPACITY = 256
"""Positions a new sequence's KV cache holds before it first doubles."""


class NativeKernelsUnavailableError(RuntimeError):
    """The native backend needs exactspec's compiled kernels, which could not be built."""


class GGUFModel:
    """A GGUF file's Llama-family decoder, its tensors mapped in place, as ``es_forward``
    takes it (:class:`exactspec.backends.native.Model`).

    Args:
        path: the ``.gguf`` file.
        activations: how products over Q4_0, Q4_1 and Q8_0 weights treat their input:
            ``int8`` (the default: each row quantised per block of 32, exact integer dot
            products, as llama.cpp does; several times faster, docs/design.md "The native
            backend: int8 activations") or ``float32`` (the dequantised weights times the
            float32 input). Other weight types always take the float32 product. Either is
            batch-invariant; they differ from each other by the input's rounding.
    Attributes:
        architecture, n_layer, n_embd, n_head, n_head_kv, head_dim, n_vocab: the shapes.
        context_length: the model's trained context (tokens).
        weight_types: each tensor type in the file and how many tensors have it.
        bits_per_weight: the matrices' bytes (embedding and LM head included) × 8 over their
            weights: 8.5 for Q8_0, 4.5 for Q4_0, about 4.9 for a Q4_K_M file.
        metadata: the file's key → value fields (the vocabulary's arrays left out).
    Raises:
        UnsupportedModelError: for another architecture (naming the supported ones), a
            mixture of experts, or a tensor type or shape the kernels do not take (naming
            the tensor, its type and the supported types).
        ValueError: if the file is not GGUF or lacks a tensor the architecture needs.
    """

    def __init__(self, path: Path, activations: str = "int8") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations = {activations!r} is invalid: choose one of "
                             f"{', '.join(ACTIVATIONS)}")
        self.path, self.activations = Path(path), activations
        try:
            reader = GGUFFile(self.path)
        except (ValueError, OSError) as error:
            raise ValueError(f"{self.path} is not a readable GGUF file: {error}") from error
        self._reader = reader  # keeps the memory map open
        self.metadata = {name: value for name, value in reader.fields.items()
                         if name not in _VOCABULARY_ARRAYS}
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"the native backend runs the GGUF architectures {', '.join(ARCHITECTURES)}; "
                f"{self.path.name} is {arch!r} (use --backend llama_cpp or transformers)")
        self.architecture = arch
        value = lambda key, default=None: self.metadata.get(f"{arch}.{key}", default)
        tensors = {tensor.name: tensor for tensor in reader.tensors}
        if any(name.endswith("_exps.weight") for name in tensors) or value("expert_count"):
            raise UnsupportedModelError(f"{self.path.name} is a mixture of experts; the native "
                                        "backend runs dense models only")
        self.n_layer = int(value("block_count"))
        self.n_embd = int(value("embedding_length"))
        self.n_head = int(value("attention.head_count"))
        self.n_head_kv = int(value("attention.head_count_kv", self.n_head))
        self.head_dim = int(value("attention.key_length", self.n_embd // self.n_head))
        self.context_length = int(value("context_length", 2048))
        embeddings = self._tensor(tensors, "token_embd.weight")
        self.n_vocab = int(embeddings.shape[1])
        scaling = value("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"RoPE scaling {scaling!r} is not supported by the "
                                        "native backend (none or linear)")
        factor = float(value("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        self.weight_types: dict[str, int] = {}
        self._matrix_bytes = self._matrix_weights = 0
        self._keep: list[object] = []  # arrays whose memory the C structs point to
        layers = (native.Layer * self.n_layer)()
        for i, layer in enumerate(layers):
            get = lambda name: self._tensor(tensors, f"blk.{i}.{name}")
            layer.attn_norm = self._vector(get("attn_norm.weight"), self.n_embd)
            layer.ffn_norm = self._vector(get("ffn_norm.weight"), self.n_embd)
            q_width, kv_width = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
            for field, name, width in (("bq", "attn_q.bias", q_width),
                                       ("bk", "attn_k.bias", kv_width),
                                       ("bv", "attn_v.bias", kv_width)):
                bias = tensors.get(f"blk.{i}.{name}")  # Qwen2 has them, Llama not
                setattr(layer, field, None if bias is None else self._vector(bias, width))
            n_ff = int(get("ffn_gate.weight").shape[1])
            for field, name, rows, cols in (
                    ("wq", "attn_q", q_width, self.n_embd), ("wk", "attn_k", kv_width, self.n_embd),
                    ("wv", "attn_v", kv_width, self.n_embd), ("wo", "attn_output", self.n_embd, q_width),
                    ("gate", "ffn_gate", n_ff, self.n_embd), ("up", "ffn_up", n_ff, self.n_embd),
                    ("down", "ffn_down", self.n_embd, n_ff)):
                setattr(layer, field, self._matrix(get(f"{name}.weight"), rows, cols))
        output = tensors.get("output.weight", embeddings)  # tied embeddings: none in the file
        factors = tensors.get("rope_freqs.weight")
        rope_dims = int(value("rope.dimension_count", self.head_dim))
        self.c_model = native.Model(
            n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
            n_head_kv=self.n_head_kv, head_dim=self.head_dim, n_ff=n_ff, n_vocab=self.n_vocab,
            rope_dims=rope_dims, rope_neox=int(ARCHITECTURES[arch]),
            rms_eps=float(value("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(value("rope.freq_base", 10000.0)), rope_scale=1.0 / factor,
            rope_factors=None if factors is None else self._vector(factors, rope_dims // 2),
            output_norm=self._vector(self._tensor(tensors, "output_norm.weight"), self.n_embd),
            tok_embd=self._matrix(embeddings, self.n_vocab, self.n_embd, product=False),
            output=self._matrix(output, self.n_vocab, self.n_embd), layers=layers)
        self._keep.append(layers)
        self.n_ff = n_ff
        self._output_tensors = (embeddings, self._tensor(tensors, "output_norm.weight"), output)
        self.output_token_ids: np.ndarray | None = None

    @property
    def bits_per_weight(self) -> float:
        return 8 * self._matrix_bytes / self._matrix_weights

    def restrict_output(self, token_ids: Sequence[int]) -> None:
        """Score only the LM head's rows of ``token_ids`` from now on (a draft vocabulary,
        FR-Spec: Zhao et al. 2025, arXiv 2502.14856): the forward's logits are then
        ``[rows, len(token_ids)]``, column i token ``token_ids[i]``'s logit, computed exactly
        as over the whole vocabulary (the same bytes of those rows, copied once and repacked;
        each column's arithmetic does not depend on the others).

        Raises:
            ValueError: for an empty, repeated or out-of-range id list.
        """
        ids = np.asarray(token_ids, dtype=np.int64)
        if (ids.ndim != 1 or not ids.size or len(np.unique(ids)) != ids.size
                or ids.min() < 0 or ids.max() >= self.n_vocab):
            raise ValueError(f"a restricted output takes distinct token ids in [0, "
                             f"{self.n_vocab}); got {ids.size} ids")
        output = self._output_tensors[2]
        rows = np.ascontiguousarray(output.data.reshape(self.n_vocab, -1)[ids])
        self.c_model.output = self._matrix(output, len(ids), self.n_embd, data=rows)
        self.c_model.n_vocab = len(ids)
        self.output_token_ids = ids

    @functools.cached_property
    def target_tensors(self) -> TargetTensors:
        """The embedding, final norm and LM head dequantised to float32 (gguf's
        ``dequantize``, as transformers loads a GGUF file: the same values), for a draft
        head; the embedding's tensor once where the LM head is tied to it."""
        arrays = {id(tensor): torch.from_numpy(np.array(  # a copy: the map is read-only
            gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            for tensor in self._output_tensors}
        embedding, norm, output = (arrays[id(tensor)] for tensor in self._output_tensors)
        return TargetTensors(embedding.reshape(self.n_vocab, self.n_embd),
                             norm.reshape(self.n_embd),
                             output.reshape(self.n_vocab, self.n_embd), self.n_layer)

    def _tensor(self, tensors: dict, name: str):
        if name not in tensors:
            raise ValueError(f"{self.path.name} lacks tensor {name!r}, which a "
                             f"{self.architecture} model has")
        return tensors[name]

    def _count(self, tensor) -> None:
        name = tensor.tensor_type.name
        self.weight_types[name] = self.weight_types.get(name, 0) + 1

    def _vector(self, tensor, length: int) -> int:
        """Address of a float32 vector tensor of ``length`` elements."""
        self._count(tensor)
        data = np.ascontiguousarray(tensor.data).reshape(-1)
        if tensor.tensor_type.name != "F32" or data.size != length:
            raise UnsupportedModelError(f"tensor {tensor.name} is {tensor.tensor_type.name} "
                                        f"{list(tensor.shape)}; the native backend takes an F32 "
                                        f"vector of {length} there")
        self._keep.append(data)
        return data.ctypes.data

    def _matrix(self, tensor, rows: int, cols: int, product: bool = True,
                data: np.ndarray | None = None) -> native.Weight:
        """The ``es_weight`` of a ``[rows, cols]`` matrix tensor, read in place (or ``data``:
        some of its rows, :meth:`restrict_output`), and for a ``product`` with int8
        activations its repacked copy (the same bytes reordered)."""
        whole = data is None
        if whole:
            self._count(tensor)
            data = tensor.data
            self._matrix_bytes += data.nbytes
            self._matrix_weights += rows * cols
        type_name = tensor.tensor_type.name
        type_number = native.WEIGHT_TYPES.get(type_name)
        shape = [int(n) for n in tensor.shape]  # GGUF order: [cols, rows]
        kernels = _kernels()
        if type_number is None or kernels.row_bytes(type_number, cols) == 0:
            raise UnsupportedModelError(
                f"tensor {tensor.name} is {type_name}; the native backend reads "
                f"{', '.join(native.WEIGHT_TYPES)} (with rows a multiple of 32 weights for "
                "the block types): use --backend llama_cpp, or convert the file")
        if ((whole and shape != [cols, rows]) or shape[0] != cols
                or data.nbytes != rows * kernels.row_bytes(type_number, cols)):
            raise UnsupportedModelError(f"tensor {tensor.name} has shape {shape}; the native "
                                        f"backend expects [{cols}, {rows}]")
        if not data.flags.c_contiguous:
            raise UnsupportedModelError(f"tensor {tensor.name} is not stored contiguously")
        self._keep.append(data)
        packed = None
        if product and self.activations == "int8" and type_name in native.INT8_TYPES:
            packed = kernels.repack(data, type_number, rows, cols)
            self._keep.append(packed)
        return native.Weight(data=data.ctypes.data, type=type_number,
                             packed=None if packed is None else packed.ctypes.data)


def converted(path: Path, weight_type: str) -> Path:
    """:func:`~exactspec.model_files.converted_gguf` with exactspec's Q4_0 quantiser
    (:meth:`~exactspec.backends.native.NativeKernels.quantize_q4_0` over float32 rows) for
    ``weight_type`` Q4_0; what the GGUF backends load for ``--weight-type``.

    Raises:
        ValueError: as ``converted_gguf``.
        NativeKernelsUnavailableError: for Q4_0 where the kernels cannot be built.
    """
    quantize = None
    if weight_type == "Q4_0":
        kernels = _kernels()
        quantize = lambda rows: kernels.quantize_q4_0(rows, native.WEIGHT_TYPES["F32"], *rows.shape)
    return converted_gguf(path, weight_type, quantize)


def _kernels() -> native.NativeKernels:
    kernels = native.load()
    if kernels is None:
        raise NativeKernelsUnavailableError(
            "the native backend needs exactspec's compiled kernels, which could not be built "
            "here (a C compiler is needed, see the warning above); use --backend llama_cpp "
            "or transformers")
    return kernels


class _Sequence:
    """One sequence's static KV cache (``[layers, kv_heads, capacity, head_dim]`` keys and
    values, float32), its length, and its recorded hidden features."""

    def __init__(self, model: GGUFModel, features_width: int) -> None:
        self.length = 0
        shape = (model.n_layer, model.n_head_kv, INITIAL_CAPACITY, model.head_dim)
        self.keys, self.values = torch.empty(shape), torch.empty(shape)
        self.features = torch.empty(INITIAL_CAPACITY, features_width) if features_width else None

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def make_room(self, length: int) -> None:
        """Grow (doubling) to hold ``length`` positions."""
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        if capacity == self.capacity:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = torch.empty(*old.shape[:2], capacity, old.shape[3])
            grown[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, grown)
        if self.features is not None:
            grown = torch.empty(capacity, self.features.shape[1])
            grown[:self.length] = self.features[:self.length]
            self.features = grown


class NativeBackend:
    """A Llama-family GGUF model on exactspec's native kernels (see ``Backend`` and the
    module docstring).

    Args:
        model: the :class:`GGUFModel`.
        tokenizer: a :class:`~exactspec.backends.base.Tokenizer`.
        eos_token_ids: ids that end generation (default: the file's EOS and end-of-turn ids).
        threads: the most CPU threads a forward uses (default: PyTorch's count); each
            forward runs on one or this many, whichever
            :class:`~exactspec.threads.ThreadChooser` measures faster (the results do not
            depend on it).
        max_context_length: most positions a sequence may hold (default and most: the
            model's trained context).
    Raises:
        NativeKernelsUnavailableError: where the kernels cannot be built.
        ValueError: for a ``max_context_length`` < 1 or above the model's context.
    """

    name = "native"
    provides_hidden_features = True
    scores_trees = True
    prefill_chunk_size = PREFILL_CHUNK_SIZE
    max_sequences = 256
    """A bound on sequences held at once (each one's cache grows as it is used)."""
    batch_variance_fix = ("The native kernels are batch-invariant by construction; this is a "
                          "bug: please report it with the model file")

    def __init__(self, model: GGUFModel, tokenizer, eos_token_ids: Sequence[int] | None = None,
                 threads: int | None = None, max_context_length: int | None = None) -> None:
        self._kernels = _kernels()
        self.model, self.tokenizer = model, tokenizer
        self.vocab_size = model.n_vocab
        self.whole_vocab_size = model.n_vocab  # vocab_size before restrict_logits
        if max_context_length is not None and not 1 <= max_context_length <= model.context_length:
            raise ValueError(f"max_model_len = {max_context_length} is invalid: the model's "
                             f"context holds {model.context_length} tokens")
        self.max_context_length = max_context_length or model.context_length
        if eos_token_ids is None:
            eos_token_ids = [model.metadata[key] for key in (
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id") if key in model.metadata]
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.device = torch.device("cpu")
        self.threads = ThreadChooser(torch.get_num_threads() if threads is None else threads)
        types = ", ".join(sorted(model.weight_types))
        int8 = model.activations == "int8" and set(model.weight_types) & set(native.INT8_TYPES)
        self.description = (f"native {self._kernels.isa} kernels, {types} weights"
                            + (", int8 activations" if int8 else ""))
        self._sequences: dict[int, _Sequence] = {}
        self._feature_layers: tuple[int, ...] | None = None
        self._feature_layer_ids = torch.zeros(0, dtype=torch.int64)  # es_forward's argument
        self.batch_invariant = check_batch_invariance(self).invariant

    @classmethod
    def load(cls, path: str | Path, *, threads: int | None = None,
             max_model_len: int | None = None, activations: str = "int8") -> NativeBackend:
        """Load a ``.gguf`` file; the tokenizer and chat template are the file's own (through
        transformers' GGUF tokenizer, converted once and cached, no weights loaded).
        ``activations``: see :class:`GGUFModel`.

        Raises:
            FileNotFoundError: if ``path`` does not exist.
            ValueError: if it is not a GGUF file, or for a bad ``max_model_len``/``threads``.
            UnsupportedModelError: see :class:`GGUFModel`.
            NativeKernelsUnavailableError: where the kernels cannot be built.
        """
        path = Path(path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist")
        check_gguf_file(path)
        for name, value in (("threads", threads), ("max_model_len", max_model_len)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} = {value!r} is invalid: it must be an integer ≥ 1")
        model = GGUFModel(path, activations)
        return cls(model, HFTokenizer(gguf_tokenizer(path)), threads=threads,
                   max_context_length=max_model_len)

    def restrict_logits(self, token_ids: Sequence[int]) -> None:
        """Logits of ``token_ids`` only from now on (a draft model's draft vocabulary,
        :mod:`exactspec.proposers.draft_vocabulary`): :meth:`forward`'s logits are then
        ``[rows, len(token_ids)]``, column i token ``token_ids[i]``'s (bit for bit its
        logit over the whole vocabulary, :meth:`GGUFModel.restrict_output`), and
        :attr:`vocab_size` their width; token ids in still range over the whole vocabulary.

        Raises:
            ValueError: for an empty, repeated or out-of-range id list.
        """
        self.model.restrict_output(token_ids)
        self.vocab_size = len(token_ids)

    def reserve(self, num_sequences: int) -> None:
        check_reserve(self, num_sequences)

    @functools.cached_property
    def sequences_invariant(self) -> bool:
        """Whether a batched forward scores each sequence bit for bit as alone (measured once,
        :func:`~exactspec.backends.base.check_sequence_invariance`)."""
        return check_sequence_invariance(self)

    def prefill(self, sequence_id: int, token_ids: Sequence[int]) -> None:
        sequence = self._sequences.get(sequence_id)
        check_context(self, 0 if sequence is None else sequence.length, len(token_ids))
        if sequence is None:
            if len(self._sequences) >= self.max_sequences:
                raise ValueError(f"all {self.max_sequences} sequences are held: release one first")
            sequence = self._sequences[sequence_id] = _Sequence(self.model, self._features_width)
        for start in range(0, len(token_ids), self.prefill_chunk_size):
            self._run([(sequence, token_ids[start:start + self.prefill_chunk_size], None)], 0)

    def forward(self, rows: Sequence[tuple[int, Sequence[int]]],
                num_logits: int | None = None) -> list[torch.Tensor]:
        check_rows(rows, num_logits)
        return self._run(self._parts([(i, token_ids, None) for i, token_ids in rows]),
                         num_logits)

    def forward_trees(self, rows: Sequence[tuple[int, Sequence[int], Sequence[int] | None]]
                      ) -> list[torch.Tensor]:
        """See ``Backend.forward_trees``: chains and trees in one packed forward (each
        tree's nodes attend to their own paths, as in :meth:`forward_tree`)."""
        check_rows([(sequence_id, token_ids) for sequence_id, token_ids, _ in rows], None)
        return self._run(self._parts(rows), None)

    def _parts(self, rows: Sequence[tuple[int, Sequence[int], Sequence[int] | None]]
               ) -> list[tuple[_Sequence, Sequence[int], TreePaths | None]]:
        """``_run``'s parts of checked rows (each sequence held and at most once, its
        chain or tree within the context)."""
        parts = []
        for sequence_id, token_ids, parents in rows:
            sequence = self._sequence(sequence_id)
            tree = None if parents is None else check_tree(token_ids, parents)
            check_context(self, sequence.length,
                          len(token_ids) if tree is None else max(tree.depths) + 1)
            parts.append((sequence, token_ids, tree))
        if len({id(sequence) for sequence, _, _ in parts}) != len(parts):
            raise ValueError("forward takes each sequence at most once")
        return parts

    def forward_tree(self, sequence_id: int, token_ids: Sequence[int],
                     parents: Sequence[int]) -> torch.Tensor:
        tree = check_tree(token_ids, parents)
        sequence = self._sequence(sequence_id)
        check_context(self, sequence.length, max(tree.depths) + 1)
        return self._run([(sequence, token_ids, tree)], None)[0]

    def retain(self, sequence_id: int, num_rows: int, keep: Sequence[int]) -> None:
        sequence = self._sequence(sequence_id)
        keep = check_retain(num_rows, keep, sequence.length)
        start = sequence.length - num_rows
        if keep != list(range(len(keep))):  # move the kept rows down, in order
            rows = torch.tensor(keep) + start
            for tensor in (sequence.keys, sequence.values):
                tensor[:, :, start:start + len(keep)] = tensor[:, :, rows]
            if sequence.features is not None:
                sequence.features[start:start + len(keep)] = sequence.features[rows]
        sequence.length = start + len(keep)

    def rollback(self, sequence_id: int, num_tokens: int) -> None:
        sequence = self._sequence(sequence_id)
        if not 0 <= num_tokens <= sequence.length:
            raise ValueError(f"rollback({sequence_id}, {num_tokens}) is invalid: the "
                             f"sequence holds {sequence.length} tokens")
        sequence.length -= num_tokens

    def release(self, sequence_id: int) -> None:
        self._sequences.pop(sequence_id, None)

    def num_cached_tokens(self, sequence_id: int) -> int:
        return self._sequence(sequence_id).length

    def record_hidden_features(self, layers: Sequence[int]) -> None:
        layers = tuple(int(layer) for layer in layers)
        if not layers or any(not 0 <= layer < self.model.n_layer for layer in layers):
            raise ValueError(f"layers {list(layers)} are invalid: the model's decoder layers "
                             f"are 0 .. {self.model.n_layer - 1}")
        if self._feature_layers is not None and layers != self._feature_layers:
            raise ValueError(f"this backend records layers {list(self._feature_layers)} "
                             f"already; it cannot record {list(layers)} as well")
        self._feature_layers = layers
        self._feature_layer_ids = torch.tensor(layers, dtype=torch.int64)

    def hidden_features(self, sequence_id: int, start: int) -> torch.Tensor:
        sequence = self._sequence(sequence_id)
        if sequence.features is None:
            raise ValueError(f"sequence {sequence_id} was cached before its hidden features "
                             "were recorded (call record_hidden_features before its prefill)")
        if not 0 <= start <= sequence.length:
            raise ValueError(f"start = {start} is invalid: the sequence holds "
                             f"{sequence.length} positions")
        return sequence.features[start:sequence.length].clone()

    def target_tensors(self) -> TargetTensors:
        return self.model.target_tensors

    @property
    def _features_width(self) -> int:
        return 0 if self._feature_layers is None else len(self._feature_layers) * self.model.n_embd

    def _sequence(self, sequence_id: int) -> _Sequence:
        try:
            return self._sequences[sequence_id]
        except KeyError:
            raise ValueError(f"sequence {sequence_id!r} is not held (prefill it first)") from None

    def _run(self, parts: list[tuple[_Sequence, Sequence[int], TreePaths | None]],
             num_logits: int | None) -> list[torch.Tensor]:
        """One ``es_forward`` over ``parts`` (a sequence, its new tokens, its tree or None);
        the logits of each part's last ``num_logits`` rows (None: all; 0: none)."""
        segments = (native.Segment * len(parts))()
        tokens, positions, logit_rows, counts, keep = [], [], [], [], []
        features_width = self._features_width
        for segment, (sequence, token_ids, tree) in zip(segments, parts):
            n = len(token_ids)
            sequence.make_room(sequence.length + n)
            depths = tree.depths if tree is not None else range(n)
            positions.extend(sequence.length + depth for depth in depths)
            first = len(tokens)
            tokens.extend(int(t) for t in token_ids)
            count = n if num_logits is None else min(num_logits, n)
            logit_rows.extend(range(first + n - count, first + n))
            counts.append(count)
            segment.k_cache, segment.v_cache = sequence.keys.data_ptr(), sequence.values.data_ptr()
            segment.capacity, segment.n_past, segment.n_tokens = sequence.capacity, sequence.length, n
            if tree is not None:
                keep.append(tree)
                segment.tree_rows, segment.tree_offsets = (tree.rows.data_ptr(),
                                                           tree.offsets.data_ptr())
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.model.n_vocab:
            raise ValueError(f"token ids must lie in [0, {self.model.n_vocab}); got "
                             f"{min(tokens)} .. {max(tokens)}")
        vocab_ids = torch.tensor(tokens, dtype=torch.int64)
        position_ids = torch.tensor(positions, dtype=torch.int64)
        logit_ids = torch.tensor(logit_rows, dtype=torch.int64)
        logits = torch.empty(len(logit_rows), self.model.c_model.n_vocab)
        features = torch.empty(len(tokens), features_width)
        threads = self.threads.choose(len(tokens))
        start = time.perf_counter()
        self._kernels.forward(ctypes.byref(self.model.c_model), segments, len(parts),
                              vocab_ids.data_ptr(), position_ids.data_ptr(), len(tokens),
                              logit_ids.data_ptr(), len(logit_rows), logits.data_ptr(),
                              self._feature_layer_ids.data_ptr(),
                              self._feature_layer_ids.numel() if features_width else 0,
                              features.data_ptr(), threads, native.ISAS.index(self._kernels.isa))
        self.threads.record(len(tokens), threads, time.perf_counter() - start)
        row = 0
        for sequence, token_ids, _ in parts:
            if sequence.features is not None and features_width:
                sequence.features[sequence.length:sequence.length + len(token_ids)] = \
                    features[row:row + len(token_ids)]
            sequence.length += len(token_ids)
            row += len(token_ids)
        return list(logits.split(counts))

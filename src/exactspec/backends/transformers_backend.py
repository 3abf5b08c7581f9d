"""Hugging Face transformers (PyTorch) backend.

Loads a local model folder or a GGUF file (dequantised by transformers), keeps one
``DynamicCache`` per sequence and rolls it back with ``DynamicCache.crop(-n)``. Models whose cache
layers are not plain full-attention layers (sliding windows, recurrent state) cannot be
rolled back exactly and are refused with :class:`UnsupportedModelError`. Decode-phase
forwards run batch-invariant kernels by default
(:mod:`~exactspec.backends.batch_invariant`), so that verification scores every token
bit for bit as plain decoding does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from exactspec.backends import native
from exactspec.backends.base import (PREFILL_CHUNK_SIZE, TargetTensors, UnsupportedModelError,
                                     chat_messages, check_batch_invariance, check_context,
                                     check_reserve, check_retain, check_rows,
                                     check_sequence_invariance, check_tree, forward_trees_apart)
from exactspec.backends.batch_invariant import (PackedSequences, kernel_mode,
                                                 native_kernels_apply, packed_sequences,
                                                 token_tree, use_exactspec_kernels)
from exactspec.load_options import KERNELS
from exactspec.model_files import check_model_folder, converted_gguf_folder
from exactspec.threads import ThreadChooser, torch_threads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""dtype names accepted by :meth:`TransformersBackend.load`."""


def resolve_device(device: str) -> torch.device:
    """``"auto"`` → cuda when available, else cpu; otherwise ``torch.device(device)``.

    Raises:
        ValueError: for an unknown device string, or cuda on a machine without one.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device {device!r} is invalid: use auto, cpu, cuda or cuda:N") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but PyTorch sees no CUDA GPU "
                         f"(torch {torch.__version__}); use --device cpu")
    return resolved


class HFTokenizer:
    """:class:`~exactspec.backends.base.Tokenizer` over a transformers tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.hf_tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
        if not self.hf_tokenizer.chat_template:
            raise ValueError("this model has no chat template; run without --chat")
        ids = self.hf_tokenizer.apply_chat_template(
            chat_messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    def get_vocab(self) -> dict[str, int]:
        return self.hf_tokenizer.get_vocab()

    @functools.cache
    def constraint_tokenizer(self, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=vocab_size,
                                            eos_token=list(eos_token_ids))


class TransformersBackend:
    """A transformers causal LM with a rollback-able ``DynamicCache`` per sequence held (see
    ``Backend``).

    Args:
        model: a ``PreTrainedModel`` for causal LM, already on its device and in eval mode.
        tokenizer: a :class:`~exactspec.backends.base.Tokenizer`.
        eos_token_ids: ids that end generation; by default the model's generation config's.
        kernels: ``batch-invariant`` (the default: a token's logits are bit-identical
            whether scored alone or in a block; exactspec's native kernels where they
            build, see ``description``) or ``fast`` (PyTorch's own kernels, equal only up
            to rounding); see :mod:`~exactspec.backends.batch_invariant`.
        threads: the most CPU threads a forward uses (default: PyTorch's count at
            construction); each decode-phase forward runs with one thread or this many,
            whichever :class:`~exactspec.threads.ThreadChooser` measures faster (one while
            another process takes a core), prefill with this many.
    Attributes:
        batch_invariant: the result of the bit-identity check run at construction.
    Raises:
        UnsupportedModelError: if the model's cache cannot be rolled back.
        ValueError: for unknown ``kernels``.

    The model's linear layers and attention are replaced in place by exactspec's (same
    weights); peers given the same model object use them with the fast kernels.
    """

    def __init__(self, model, tokenizer, eos_token_ids: Sequence[int] | None = None,
                 kernels: str = "batch-invariant", threads: int | None = None) -> None:
        from transformers import DynamicCache

        if kernels not in KERNELS:
            raise ValueError(f"kernels {kernels!r} is invalid: choose one of {', '.join(KERNELS)}")
        self.kernels = kernels
        self.model = model.eval()
        use_exactspec_kernels(model)
        self.tokenizer = tokenizer
        config = model.config.get_text_config(decoder=True)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context_length = getattr(config, "max_position_embeddings", None)
        if eos_token_ids is None:
            eos = model.generation_config.eos_token_id
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.device = next(model.parameters()).device
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        runs_native = kernels != "fast" and native_kernels_apply(
            model.get_output_embeddings().weight)
        # a forward's thread count may change only where the logits cannot change with it
        self.threads = ThreadChooser(torch.get_num_threads() if threads is None else threads,
                                     adaptive=runs_native)
        self.description = f"transformers {dtype} {self.device.type}, " + (
            "fast kernels" if kernels == "fast" else
            f"native {native.load().isa} kernels" if runs_native else "PyTorch 2-row kernels")
        self._new_cache = lambda: DynamicCache(config=model.config)
        _check_rollback(model, self._new_cache())
        self._caches: dict[int, object] = {}  # sequence id → its DynamicCache
        self._features = HiddenFeatures(model)
        self.batch_invariant = check_batch_invariance(self).invariant
        self.batch_variance_fix = (
            "These are the fast kernels: load the model with kernels='batch-invariant' (the "
            "default; --kernels batch-invariant)." if kernels == "fast" else
            "Even the batch-invariant kernels differ on this model, dtype and device: try "
            "--device cpu --dtype float32.")

    @classmethod
    def load(cls, path: str | Path, *, device: str = "auto", dtype: str = "float32",
             gguf_file: str | None = None, kernels: str = "batch-invariant",
             max_model_len: int | None = None, threads: int | None = None) -> TransformersBackend:
        """Load a local model folder, or a GGUF file (``path`` ending in .gguf).

        Args:
            path: a folder with ``config.json`` and weights, or a ``.gguf`` file.
            device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
            dtype: one of :data:`DTYPES` (float32 is the default; whether greedy output
                is bit-identical to plain decoding on a dtype and device is what the
                batch-invariance check at construction finds).
            gguf_file: a GGUF file name inside folder ``path`` (alternative to a .gguf path).
                A GGUF file is dequantised to float32 once and kept as a model folder in
                the cache (see :func:`converted_gguf_folder`).
            kernels: ``batch-invariant`` (the default) or ``fast``, see the class.
            max_model_len: most tokens (prompt + generated) a sequence may hold (default and
                most: the model's ``max_position_embeddings``).
            threads: see the class.
        Raises:
            FileNotFoundError: if ``path`` does not exist, or a folder lacks a config,
                weights or a tokenizer (``ModelNotFoundError``, naming what is missing).
            ValueError: for an unknown dtype or device, a ``.gguf`` file that is not GGUF, or
                a ``max_model_len`` < 1 or above the model's context.
            UnsupportedModelError: if the cache cannot be rolled back.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is invalid: choose one of {', '.join(DTYPES)}")
        if max_model_len is not None and (isinstance(max_model_len, bool)
                                          or not isinstance(max_model_len, int) or max_model_len < 1):
            raise ValueError(f"max_model_len = {max_model_len!r} is invalid: it must be an "
                             "integer ≥ 1")
        resolved_device = resolve_device(device)
        path = Path(path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist")
        if gguf_file:
            path = path / gguf_file
        if path.suffix == ".gguf":
            path = converted_gguf_folder(path)
        elif path.is_dir():
            check_model_folder(path)
        hf_logging.disable_progress_bar()  # callers show their own progress indicator
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        finally:
            hf_logging.enable_progress_bar()
        backend = cls(model.to(resolved_device), HFTokenizer(tokenizer), kernels=kernels,
                      threads=threads)
        if max_model_len is not None:
            limit = backend.max_context_length
            if limit is not None and max_model_len > limit:
                raise ValueError(f"max_model_len = {max_model_len} is invalid: the model's "
                                 f"context holds {limit} tokens")
            backend.max_context_length = max_model_len
        return backend

    name = "transformers"
    provides_hidden_features = True
    prefill_chunk_size = PREFILL_CHUNK_SIZE
    max_sequences = 256
    """A bound on sequences held at once (each one's cache grows as it is used)."""

    def reserve(self, num_sequences: int) -> None:
        check_reserve(self, num_sequences)

    @functools.cached_property
    def sequences_invariant(self) -> bool:
        """Whether a batched forward scores each sequence bit for bit as alone (measured once,
        :func:`~exactspec.backends.base.check_sequence_invariance`)."""
        return check_sequence_invariance(self)

    def prefill(self, sequence_id: int, token_ids: Sequence[int]) -> None:
        """See ``Backend.prefill``. The fast kernels run here: a prompt's cache entries are
        shared by plain and speculative decoding alike, so they need not match one-token
        scoring."""
        cache = self._caches.get(sequence_id)
        check_context(self, 0 if cache is None else cache.get_seq_length(), len(token_ids))
        if cache is None:
            if len(self._caches) >= self.max_sequences:
                raise ValueError(f"all {self.max_sequences} sequences are held: release one first")
            cache = self._caches[sequence_id] = self._new_cache()
            self._features.hold(sequence_id)
        with kernel_mode("fast"), torch_threads(self.threads.max_threads), torch.inference_mode():
            for start in range(0, len(token_ids), self.prefill_chunk_size):
                chunk = token_ids[start:start + self.prefill_chunk_size]
                with self._features.capture([sequence_id], [len(chunk)]):
                    self.model(input_ids=self._tensor(chunk), cache=cache, use_cache=True,
                               logits_to_keep=1)

    def forward(self, rows: Sequence[tuple[int, Sequence[int]]],
                num_logits: int | None = None) -> list[torch.Tensor]:
        """See ``Backend.forward``. Several rows are packed into one sequence whose attention
        runs per sequence over its own cache (:class:`PackedSequences`); a lone row runs
        unpacked (the same arithmetic, and the fast kernels' own attention)."""
        check_rows(rows, num_logits)
        caches = [self._cache(sequence_id) for sequence_id, _ in rows]
        lengths = [len(token_ids) for _, token_ids in rows]
        for cache, length in zip(caches, lengths):
            check_context(self, cache.get_seq_length(), length)
        token_ids = [token for _, ids in rows for token in ids]
        with (kernel_mode(self.kernels), self.threads.forward(len(token_ids)),
              torch.inference_mode(), self._features.capture([i for i, _ in rows], lengths)):
            if len(rows) == 1:
                logits = self.model(input_ids=self._tensor(token_ids), cache=caches[0],
                                    use_cache=True,
                                    logits_to_keep=num_logits or len(token_ids)).logits[0]
                return [logits]
            positions = [cache.get_seq_length() + i for cache, n in zip(caches, lengths)
                         for i in range(n)]
            # A 4-D mask is used as given: transformers builds none (attention ignores it here).
            mask = torch.zeros((1, 1, len(token_ids), 1), device=self.device)
            packed = PackedSequences(caches, lengths)
            with packed_sequences(packed):
                output = self.model(input_ids=self._tensor(token_ids),
                                    position_ids=self._tensor(positions), attention_mask=mask,
                                    cache=packed, use_cache=True,
                                    logits_to_keep=len(token_ids))
        rows_logits = output.logits[0].split(lengths)
        return list(rows_logits) if num_logits is None else [
            logits[-num_logits:] for logits in rows_logits]

    scores_trees = True

    def forward_tree(self, sequence_id: int, token_ids: Sequence[int],
                     parents: Sequence[int]) -> torch.Tensor:
        """See ``Backend.forward_tree``: one forward over the nodes, each at position
        cached + depth, attending to the cache and its own path (:func:`token_tree`)."""
        tree = check_tree(token_ids, parents)
        cache = self._cache(sequence_id)
        cached, n = cache.get_seq_length(), len(token_ids)
        check_context(self, cached, max(tree.depths) + 1)
        positions = [cached + depth for depth in tree.depths]
        mask = torch.zeros((1, 1, n, 1), device=self.device)  # used as given (see forward)
        with (kernel_mode(self.kernels), self.threads.forward(n), torch.inference_mode(),
              self._features.capture([sequence_id], [n]), token_tree(tree)):
            return self.model(input_ids=self._tensor(token_ids),
                              position_ids=self._tensor(positions), attention_mask=mask,
                              cache=cache, use_cache=True, logits_to_keep=n).logits[0]

    def forward_trees(self, rows: Sequence[tuple[int, Sequence[int], Sequence[int] | None]]
                      ) -> list[torch.Tensor]:
        """See ``Backend.forward_trees``: the chains packed in one forward, each tree in its
        own (:func:`~exactspec.backends.base.forward_trees_apart`)."""
        return forward_trees_apart(self, rows)

    def retain(self, sequence_id: int, num_rows: int, keep: Sequence[int]) -> None:
        cache = self._cache(sequence_id)
        keep = check_retain(num_rows, keep, cache.get_seq_length())
        start = cache.get_seq_length() - num_rows
        if keep != list(range(len(keep))):  # move the kept rows down, in order
            rows = torch.tensor(keep, device=self.device) + start
            with torch.inference_mode():
                self._move_rows(cache, start, rows)
            self._features.retain(sequence_id, num_rows, keep)
        self.rollback(sequence_id, num_rows - len(keep))

    @staticmethod
    def _move_rows(cache, start: int, rows: torch.Tensor) -> None:
        """Copy cache positions ``rows`` to ``start``, ``start + 1``, ... in every layer."""
        for layer in cache.layers:
            layer.keys[:, :, start:start + len(rows)] = layer.keys[:, :, rows]
            layer.values[:, :, start:start + len(rows)] = layer.values[:, :, rows]

    def rollback(self, sequence_id: int, num_tokens: int) -> None:
        cache = self._cache(sequence_id)
        if not 0 <= num_tokens <= cache.get_seq_length():
            raise ValueError(f"rollback({sequence_id}, {num_tokens}) is invalid: the "
                             f"sequence holds {cache.get_seq_length()} tokens")
        if num_tokens:
            cache.crop(-num_tokens)
            self._features.drop(sequence_id, num_tokens)

    def release(self, sequence_id: int) -> None:
        self._caches.pop(sequence_id, None)
        self._features.release(sequence_id)

    def record_hidden_features(self, layers: Sequence[int]) -> None:
        self._features.record(layers)

    def hidden_features(self, sequence_id: int, start: int) -> torch.Tensor:
        return self._features.read(sequence_id, start, self.num_cached_tokens(sequence_id))

    def target_tensors(self) -> TargetTensors:
        return module_tensors(self.model)

    def num_cached_tokens(self, sequence_id: int) -> int:
        return self._cache(sequence_id).get_seq_length()

    def _cache(self, sequence_id: int):
        try:
            return self._caches[sequence_id]
        except KeyError:
            raise ValueError(f"sequence {sequence_id!r} is not held (prefill it first)") from None

    def _tensor(self, token_ids: Sequence[int]) -> torch.Tensor:
        """``[1, len(token_ids)]`` long tensor on the model's device."""
        return torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)


class HiddenFeatures:
    """The recorded decoder-layer outputs of every sequence held (see
    ``Backend.record_hidden_features``): forward hooks on the chosen layers keep their
    outputs while this backend's own forward runs (:meth:`capture`), split per sequence."""

    def __init__(self, model) -> None:
        self.model = model
        self.layers: tuple[int, ...] | None = None
        self._chunks: dict[int, list[torch.Tensor]] = {}  # sequence → [n_i, F] pieces
        self._outputs: dict[int, torch.Tensor] | None = None  # layer → output, while capturing

    def record(self, layers: Sequence[int]) -> None:
        decoder_layers = getattr(self.model.base_model, "layers", None)
        if decoder_layers is None:
            raise UnsupportedModelError(f"{type(self.model).__name__} has no decoder layer list "
                                        "(base_model.layers): its hidden features cannot be "
                                        "recorded")
        layers = tuple(int(layer) for layer in layers)
        if not layers or any(not 0 <= layer < len(decoder_layers) for layer in layers):
            raise ValueError(f"layers {list(layers)} are invalid: the model's decoder layers "
                             f"are 0 .. {len(decoder_layers) - 1}")
        if self.layers is not None:
            if layers != self.layers:
                raise ValueError(f"this backend records layers {list(self.layers)} already; "
                                 f"it cannot record {list(layers)} as well")
            return
        self.layers = layers
        for layer in layers:
            decoder_layers[layer].register_forward_hook(functools.partial(self._keep, layer))

    def _keep(self, layer: int, module, inputs, output) -> None:
        if self._outputs is not None:
            self._outputs[layer] = (output[0] if isinstance(output, tuple) else output)[0]

    def hold(self, sequence_id: int) -> None:
        if self.layers is not None:
            self._chunks[sequence_id] = []

    @contextlib.contextmanager
    def capture(self, sequence_ids: Sequence[int], lengths: Sequence[int]):
        """Keep the recorded layers' outputs of the forward run inside, ``lengths[i]``
        positions of ``sequence_ids[i]`` in order."""
        if self.layers is None:
            yield
            return
        self._outputs = {}
        try:
            yield
            features = torch.cat([self._outputs[layer] for layer in self.layers], -1).float()
            for sequence_id, piece in zip(sequence_ids, features.split(list(lengths))):
                if sequence_id in self._chunks:
                    self._chunks[sequence_id].append(piece)
        finally:
            self._outputs = None

    def drop(self, sequence_id: int, num_positions: int) -> None:
        chunks = self._chunks.get(sequence_id)
        while chunks and num_positions:
            last = chunks.pop()
            if last.shape[0] > num_positions:
                chunks.append(last[:-num_positions])
            num_positions -= min(num_positions, last.shape[0])

    def retain(self, sequence_id: int, num_rows: int, keep: Sequence[int]) -> None:
        """Of the last ``num_rows`` positions, move ``keep``'s to the front, in order (the
        rest are then dropped with :meth:`drop`)."""
        chunks = self._chunks.get(sequence_id)
        if not chunks:
            return
        pieces, needed = [], num_rows
        while needed:
            last = chunks.pop()
            pieces.append(last[-needed:])
            if last.shape[0] > needed:
                chunks.append(last[:-needed])
            needed -= pieces[-1].shape[0]
        tail = torch.cat(pieces[::-1])
        chunks.append(torch.cat([tail[keep], tail[len(keep):]]))

    def release(self, sequence_id: int) -> None:
        self._chunks.pop(sequence_id, None)

    def read(self, sequence_id: int, start: int, num_cached: int) -> torch.Tensor:
        chunks = self._chunks.get(sequence_id)
        if chunks is None:
            raise ValueError(f"sequence {sequence_id} was cached before its hidden features "
                             "were recorded (call record_hidden_features before its prefill)")
        if not 0 <= start <= num_cached:
            raise ValueError(f"start = {start} is invalid: the sequence holds {num_cached} "
                             "positions")
        pieces, needed = [], num_cached - start
        for chunk in reversed(chunks):
            if needed <= 0:
                break
            pieces.append(chunk[-needed:] if chunk.shape[0] > needed else chunk)
            needed -= pieces[-1].shape[0]
        width = len(self.layers) * self.model.config.get_text_config(decoder=True).hidden_size
        return torch.cat(pieces[::-1]) if pieces else torch.zeros(0, width)


def _check_rollback(model, cache) -> None:
    from transformers.cache_utils import DynamicLayer

    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps a recurrent state that cannot be rolled back after "
            "a rejected draft; speculative decoding on it is not supported")
    odd = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if odd:
        raise UnsupportedModelError(
            f"{type(model).__name__} uses cache layers {sorted(odd)} (e.g. sliding-window "
            "attention) that cannot be rolled back exactly after a rejected draft; only "
            "full-attention models are supported by the transformers backend for now")


def module_tensors(model: torch.nn.Module) -> TargetTensors:
    """The :class:`~exactspec.backends.base.TargetTensors` of a transformers causal LM: its
    own parameters (shared, not copied; float32 when loaded so).

    Raises:
        UnsupportedModelError: for a model without a final norm (``base_model.norm``).
    """
    norm = getattr(model.base_model, "norm", None)
    if norm is None or not hasattr(norm, "weight"):
        raise UnsupportedModelError(f"{type(model).__name__} has no final norm "
                                    "(base_model.norm): a draft head is not supported for it")
    return TargetTensors(model.get_input_embeddings().weight.detach(), norm.weight.detach(),
                         model.get_output_embeddings().weight.detach(),
                         int(model.config.get_text_config(decoder=True).num_hidden_layers))

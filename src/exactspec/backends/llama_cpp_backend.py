"""llama.cpp backend (through ``llama-cpp-python``): GGUF models at CPU speed.

The model and the KV caches of the sequences it holds (one llama.cpp sequence id, a slot,
per sequence) are driven with llama.cpp's batch API: a batch carries each token's slot,
position and a flag saying whether its logits are wanted, so a verification scores
``k + 1`` tokens of one or many sequences in one ``llama_decode`` and copies out only the
rows it asked for; ``llama_memory_seq_rm`` removes rejected positions from a slot. The
tokenizer and chat template are the GGUF file's own.

Recurrent and hybrid models (whose state cannot lose its last positions) are refused with
:class:`~exactspec.backends.base.UnsupportedModelError`; sliding-window caches are kept in
full (``swa_full``) so that a rollback never needs an evicted position.

Exactness needs batch-invariant kernels: a token's logits must not depend on how many
tokens share its forward pass, or a verification (k + 1 tokens) would score differently
from plain decoding (1 token). llama.cpp's default CPU build is not: its llamafile sgemm
kernels take over for batches, and on SmolLM2 Q4_1 the logits of the same token then differ
by up to 0.8 (re-quantising the activations at every layer amplifies the rounding), enough
to change greedy output and the sampling distribution. Built with ``GGML_LLAMAFILE=OFF``,
batch and single-token logits are bit-identical. Every backend checks this when it loads
(:attr:`LlamaCppBackend.batch_invariant`) and the engine refuses to speculate on one that
fails; plain decoding is still allowed.

``llama-cpp-python`` is optional; it compiles llama.cpp from source (minutes; see
docs/setup.md): ``CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" CFLAGS="-mno-amx-tile -mno-amx-int8
-mno-amx-bf16" CXXFLAGS="..." pip install --no-cache-dir 'exactspec[llama-cpp]'``
(``--no-cache-dir`` so that pip does not reuse a wheel it built earlier without the flags).
The compiler flags keep AMX out of the build: on a virtual machine whose CPU reports AMX
without letting a process use it, llama.cpp's AMX matrix multiply crashes the process
(docs/backends.md, "Why the build flags").
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from exactspec.backends.base import (PREFILL_CHUNK_SIZE, TargetTensors, UnsupportedModelError,
                                     chat_messages, check_batch_invariance, check_context,
                                     check_retain, check_rows, check_sequence_invariance,
                                     forward_trees_apart)
from exactspec.backends.native_backend import converted
from exactspec.load_options import default_threads
from exactspec.model_files import gguf_architecture_value

NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
INSTALL_HINT = (f"CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" CFLAGS=\"{NO_AMX}\" CXXFLAGS=\"{NO_AMX}\" "
                "pip install --no-cache-dir 'llama-cpp-python==0.3.36'")
"""How to install a llama-cpp-python build whose CPU kernels are batch-invariant (and that
leaves AMX out, see the module docstring)."""
AMX_WARNING = ("this llama-cpp-python build uses AMX (AMX_INT8 = 1 in its system info); on a "
               "virtual machine whose CPU reports AMX without enabling it, llama.cpp crashes "
               "with a segmentation fault in its first forward. If it does, reinstall: "
               + INSTALL_HINT + " --force-reinstall")
HIDDEN_FEATURES_REFUSAL = (
    "the llama.cpp backend cannot give the target's hidden features that a draft head reads "
    "(llama-cpp-python returns only final embeddings, from a context made for embeddings); "
    "use the native (a GGUF file) or transformers backend for --proposer head")
TREE_REFUSAL = (
    "the llama.cpp backend does not score token trees (tree drafting: a head's tree=N); use "
    "the native (a GGUF file) or transformers backend, or draft a chain")
DEFAULT_CONTEXT_LENGTH = 8192
"""KV cache size (tokens) when the caller gives none, capped by the model's own context."""

class LlamaCppNotInstalledError(ImportError):
    """``llama-cpp-python`` is missing; the message gives the install command."""


def import_llama_cpp():
    """The ``llama_cpp`` module.

    Raises:
        LlamaCppNotInstalledError: with the install command, if it is not installed.
    """
    try:
        import llama_cpp
    except ImportError as error:
        raise LlamaCppNotInstalledError(
            f"the llama_cpp backend needs llama-cpp-python, which is not installed "
            f"({error}); install it with: {INSTALL_HINT}") from None
    return llama_cpp


def llama_cpp_available() -> bool:
    """Whether ``llama-cpp-python`` can be imported (without importing it)."""
    return importlib.util.find_spec("llama_cpp") is not None


SLOW_DECODING_FACTOR = 5.0
"""How many times slower than the load-time check decoding must run to be warned about."""


def slow_decoding_warning(backend, num_tokens: int, seconds: float) -> str | None:
    """A warning when ``num_tokens`` decoded in ``seconds`` (prefill excluded) ran more than
    :data:`SLOW_DECODING_FACTOR` × slower than the single-token forwards timed when
    ``backend`` loaded, on more than one thread: the sign of another process taking a core
    (see :func:`~exactspec.load_options.default_threads`); it names ``--threads``. None
    otherwise, and for backends other than llama.cpp."""
    if not isinstance(backend, LlamaCppBackend):
        return None
    at_load, threads = backend.seconds_per_token_at_load, backend.llama.n_threads
    if not at_load or threads < 2 or num_tokens < 1 or seconds <= 0:
        return None
    rate, expected = num_tokens / seconds, 1 / at_load
    if rate * SLOW_DECODING_FACTOR >= expected:
        return None
    return (f"decoding ran at {rate:.1f} tokens/s, {expected / rate:.0f}× slower than llama.cpp "
            f"scored tokens when it loaded ({expected:.0f} tokens/s) with {threads} threads: "
            "another process is probably using the CPU, and llama.cpp's threads wait for each "
            "other when one loses its core; try fewer threads (--threads 1)")


class LlamaCppTokenizer:
    """:class:`~exactspec.backends.base.Tokenizer` from a GGUF file's vocabulary and chat
    template, through llama.cpp's tokenizer."""

    def __init__(self, llama) -> None:
        self.llama = llama
        self.chat_template = llama.metadata.get("tokenizer.chat_template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # special=True parses "<|im_start|>"-style tokens in the text, as transformers does.
        return self.llama.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=True)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.llama.detokenize(list(token_ids), special=False).decode("utf-8", "replace")

    def apply_chat_template(self, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
        if not self.chat_template:
            raise ValueError("this model has no chat template; run without --chat")
        text = self._chat_formatter(messages=chat_messages(prompt)).prompt
        return self.encode(text, add_special_tokens=False)  # the template writes BOS itself

    @functools.cached_property
    def _chat_formatter(self):
        """The GGUF's chat template, compiled once."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        piece = lambda token: (self.llama.detokenize([token], special=True).decode("utf-8", "replace")
                               if token >= 0 else "")
        return Jinja2ChatFormatter(self.chat_template, eos_token=piece(self.llama.token_eos()),
                                   bos_token=piece(self.llama.token_bos()))

    def get_vocab(self) -> dict[str, int]:
        llama_cpp = import_llama_cpp()
        vocab = llama_cpp.llama_model_get_vocab(self.llama.model)
        return {llama_cpp.llama_vocab_get_text(vocab, i).decode("utf-8", "replace"): i
                for i in range(self.llama.n_vocab())}

    @functools.cache
    def constraint_tokenizer(self, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance.llamacpp

        llama_cpp = import_llama_cpp()
        with warnings.catch_warnings():  # llguidance reads each token's attributes through
            warnings.simplefilter("ignore", DeprecationWarning)  # a deprecated name
            return llguidance.llamacpp.lltokenizer_from_vocab(
                llama_cpp.llama_model_get_vocab(self.llama.model), n_vocab=vocab_size,
                eos_token=list(eos_token_ids))


class LlamaCppBackend:
    """A GGUF model on llama.cpp with a rollback-able KV cache per sequence held (see
    ``Backend``).

    Args:
        llama: a ``llama_cpp.Llama`` (its own batch and cache are not used).
        tokenizer: a :class:`~exactspec.backends.base.Tokenizer`; by default the GGUF's.
        eos_token_ids: ids that end generation; by default every end-of-generation token
            of the vocabulary (llama.cpp's ``llama_vocab_is_eog``).
    Attributes:
        batch_invariant: whether a batch of tokens gets bit-identical logits to single-token
            forwards, checked at construction (see the module docstring).
        seconds_per_token_at_load: mean seconds of that check's single-token forwards, the
            speed :func:`slow_decoding_warning` compares decoding with.
    Raises:
        UnsupportedModelError: for recurrent or hybrid models (their state cannot roll back).

    Each sequence held is a slot (a llama.cpp sequence id) of one context: the ``Llama``'s
    own, with one slot, until :meth:`reserve` asks for more and replaces it with a context of
    that many slots, each with a KV cache of its own (``kv_unified`` off, so a sequence's
    cells are its positions) as long as the context, so n slots take n × one sequence's
    memory.
    """

    name = "llama_cpp"
    provides_hidden_features = False
    """llama-cpp-python gives embeddings only from a context made for them (pooled or
    final-layer, not chosen layers), so a draft head is refused here."""

    def record_hidden_features(self, layers: Sequence[int]) -> None:
        raise UnsupportedModelError(HIDDEN_FEATURES_REFUSAL)

    def hidden_features(self, sequence_id: int, start: int) -> torch.Tensor:
        raise UnsupportedModelError(HIDDEN_FEATURES_REFUSAL)

    def target_tensors(self) -> TargetTensors:
        raise UnsupportedModelError(HIDDEN_FEATURES_REFUSAL)

    scores_trees = False
    """A tree needs each node in the cache sequences of its descendants' paths only
    (llama.cpp's multi-sequence cells); not done here: tree drafting is refused."""

    def forward_tree(self, sequence_id: int, token_ids: Sequence[int],
                     parents: Sequence[int]) -> torch.Tensor:
        raise UnsupportedModelError(TREE_REFUSAL)

    def forward_trees(self, rows: Sequence[tuple[int, Sequence[int], Sequence[int] | None]]
                      ) -> list[torch.Tensor]:
        """See ``Backend.forward_trees``: the chains packed in one forward, each tree in its
        own (:func:`~exactspec.backends.base.forward_trees_apart`)."""
        return forward_trees_apart(self, rows)

    def retain(self, sequence_id: int, num_rows: int, keep: Sequence[int]) -> None:
        keep = check_retain(num_rows, keep, self.num_cached_tokens(sequence_id))
        if keep != list(range(len(keep))):
            raise UnsupportedModelError(TREE_REFUSAL)
        self.rollback(sequence_id, num_rows - len(keep))

    @functools.cached_property
    def sequences_invariant(self) -> bool:
        """Whether a batched forward scores each sequence bit for bit as alone (measured once,
        :func:`~exactspec.backends.base.check_sequence_invariance`)."""
        return check_sequence_invariance(self)
    batch_variance_fix = ("Reinstall llama-cpp-python without llamafile's kernels: "
                          + INSTALL_HINT + " --force-reinstall")
    """What the engine's refusal tells a user whose build is not batch-invariant."""

    def __init__(self, llama, tokenizer=None, eos_token_ids: Sequence[int] | None = None) -> None:
        llama_cpp = import_llama_cpp()
        if getattr(llama, "_is_recurrent", False) or getattr(llama, "_is_hybrid", False):
            raise UnsupportedModelError(
                "this model keeps a recurrent state that cannot be rolled back after a "
                "rejected draft; speculative decoding on it is not supported")
        self._llama_cpp = llama_cpp
        self.llama = llama
        self.tokenizer = tokenizer if tokenizer is not None else LlamaCppTokenizer(llama)
        self.vocab_size = int(llama.n_vocab())
        # the context asked for (llama.cpp pads its cache to a multiple of 256 cells)
        asked = llama.context_params.n_ctx or llama.n_ctx()
        self.max_context_length = int(min(asked, llama.n_ctx(), llama._model.n_ctx_train()))
        if eos_token_ids is None:
            vocab = llama_cpp.llama_model_get_vocab(llama.model)
            eos_token_ids = [i for i in range(self.vocab_size)
                             if llama_cpp.llama_vocab_is_eog(vocab, i)]
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.device = torch.device("cpu")
        threads = llama.n_threads
        self.description = f"llama.cpp cpu, {threads} thread{'s' if threads != 1 else ''}"
        # the Llama's own context (one slot) until reserve() makes one with more
        self._context, self._own_context = llama.ctx, False
        self._memory = llama_cpp.llama_get_memory(self._context)
        self._batch_capacity = int(llama.n_batch)
        self.prefill_chunk_size = self._batch_capacity  # llama_decode takes n_batch at a time
        self._batch = llama_cpp.llama_batch_init(self._batch_capacity, 0, 1)
        self._slots: dict[int, int] = {}  # sequence id → its slot (llama.cpp seq_id)
        self._slot_lengths: list[int] = [0]  # tokens cached per slot
        if "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace"):
            warnings.warn(AMX_WARNING, RuntimeWarning, stacklevel=2)
        self.batch_invariant, self.seconds_per_token_at_load = check_batch_invariance(self)

    @classmethod
    def load(cls, path: str | Path, *, threads: int | None = None,
             context_length: int | None = None,
             weight_type: str | None = None) -> LlamaCppBackend:
        """Load a ``.gguf`` file on the CPU.

        Args:
            path: the GGUF file.
            threads: CPU threads for llama.cpp (default:
                :func:`~exactspec.load_options.default_threads`, half the cores this
                process may use).
            context_length: KV cache size in tokens, per sequence (default: the model's own
                context, at most :data:`DEFAULT_CONTEXT_LENGTH`).
            weight_type: run the file's weights converted to this GGUF type (``F32``,
                ``BF16``, ``F16``, ``Q8_0``, ``Q4_0``; converted once and cached, see
                :func:`~exactspec.backends.native_backend.converted`), None: as the file
                has them.
        Raises:
            LlamaCppNotInstalledError: if llama-cpp-python is not installed.
            FileNotFoundError: if ``path`` does not exist.
            ValueError: if ``path`` is not a GGUF file, threads/context_length < 1,
                context_length above the model's own context, or an unknown weight_type.
            UnsupportedModelError: see the class.
        """
        import_llama_cpp()  # fail first, with the install command
        path = Path(path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {str(path)!r} does not exist")
        if path.suffix != ".gguf":
            raise ValueError(f"the llama_cpp backend loads .gguf files, not {str(path)!r}; "
                             "use --backend transformers for a model folder")
        for name, value in (("threads", threads), ("context_length", context_length)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} = {value!r} is invalid: it must be an integer ≥ 1")
        trained = gguf_architecture_value(path, "context_length")
        if context_length is None:
            context_length = min(trained or DEFAULT_CONTEXT_LENGTH, DEFAULT_CONTEXT_LENGTH)
        elif trained and context_length > trained:
            raise ValueError(f"context_length = {context_length} is invalid: {path.name}'s "
                             f"context holds {trained} tokens")
        if weight_type is not None:
            path = converted(path, weight_type)
        backend = cls(new_llama(path, threads=threads or default_threads(),
                                context_length=context_length))
        if weight_type is not None:
            backend.description += f", weights converted to {weight_type}"
        return backend

    def new_llama(self, **overrides):
        """Another ``llama_cpp.Llama`` on the same file, threads and context size, with
        ``overrides`` (e.g. ``draft_model=`` for llama-cpp-python's own speculation, which
        :class:`~exactspec.peers.LlamaCppPeer` runs)."""
        return new_llama(self.llama.model_path, threads=self.llama.n_threads,
                         context_length=self.llama.n_ctx(), **overrides)

    @property
    def max_sequences(self) -> int:
        """Sequences that can be held now: the context's slots (1 until :meth:`reserve`)."""
        return len(self._slot_lengths)

    def reserve(self, num_sequences: int) -> None:
        """See ``Backend.reserve``: a context with more slots replaces the current one (each
        slot a cache as long as the context, so n slots take n × one sequence's memory)."""
        limit = int(self._llama_cpp.llama_max_parallel_sequences())
        if (not isinstance(num_sequences, int) or isinstance(num_sequences, bool)
                or not 1 <= num_sequences <= limit):
            raise ValueError(f"{num_sequences!r} sequences cannot be reserved: llama.cpp holds "
                             f"1 to {limit}")
        if num_sequences <= self.max_sequences:
            return
        if self._slots:
            raise ValueError(f"cannot grow from {self.max_sequences} to {num_sequences} sequence "
                             f"slots while {len(self._slots)} are held: release them first")
        llama_cpp = self._llama_cpp
        params = type(self.llama.context_params).from_buffer_copy(self.llama.context_params)
        params.n_seq_max = num_sequences
        params.kv_unified = False
        params.n_ctx = self.max_context_length * num_sequences
        context = llama_cpp.llama_init_from_model(self.llama.model, params)
        if not context:
            raise RuntimeError(f"llama.cpp could not make a context for {num_sequences} "
                               f"sequences of {self.max_context_length} tokens (memory? a "
                               "smaller max_model_len needs less)")
        self._free_own_context()
        self._context, self._own_context = context, True
        self._memory = llama_cpp.llama_get_memory(context)
        self._slot_lengths = [0] * num_sequences
        # new caches: measure both checks again on them
        self.__dict__.pop("sequences_invariant", None)
        self.batch_invariant = check_batch_invariance(self).invariant

    def prefill(self, sequence_id: int, token_ids: Sequence[int]) -> None:
        new = sequence_id not in self._slots
        if new:
            free = sorted(set(range(self.max_sequences)) - set(self._slots.values()))
            if not free:
                raise ValueError(f"all {self.max_sequences} sequence slots are in use: release "
                                 "one first (or reserve more while none is held)")
            self._slots[sequence_id] = free[0]
            # whatever another user of the Llama's own context left in the slot goes
            self._llama_cpp.llama_memory_seq_rm(self._memory, free[0], -1, -1)
        try:
            if len(token_ids) > 0:
                self._decode([(self._slots[sequence_id], token_ids)], num_logits=0)
        except Exception:
            if new:  # a failed first prefill holds nothing
                self.release(sequence_id)
            raise

    def forward(self, rows: Sequence[tuple[int, Sequence[int]]],
                num_logits: int | None = None) -> list[torch.Tensor]:
        check_rows(rows, num_logits)
        slots = [(self._slot(sequence_id), token_ids) for sequence_id, token_ids in rows]
        logits = self._decode(slots, num_logits)
        return list(logits.split([min(num_logits or len(ids), len(ids)) for _, ids in rows]))

    def rollback(self, sequence_id: int, num_tokens: int) -> None:
        slot = self._slot(sequence_id)
        if not 0 <= num_tokens <= self._slot_lengths[slot]:
            raise ValueError(f"rollback({sequence_id}, {num_tokens}) is invalid: the "
                             f"sequence holds {self._slot_lengths[slot]} tokens")
        if num_tokens:
            keep = self._slot_lengths[slot] - num_tokens
            if not self._llama_cpp.llama_memory_seq_rm(self._memory, slot, keep, -1):
                raise UnsupportedModelError("llama.cpp could not remove positions from this "
                                            "model's cache")
            self._slot_lengths[slot] = keep

    def release(self, sequence_id: int) -> None:
        slot = self._slots.pop(sequence_id, None)
        if slot is not None:
            self._llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
            self._slot_lengths[slot] = 0

    def num_cached_tokens(self, sequence_id: int) -> int:
        return self._slot_lengths[self._slot(sequence_id)]

    def _slot(self, sequence_id: int) -> int:
        try:
            return self._slots[sequence_id]
        except KeyError:
            raise ValueError(f"sequence {sequence_id!r} is not held (prefill it first)") from None

    def _free_own_context(self) -> None:
        if self._own_context:
            self._llama_cpp.llama_free(self._context)
            self._own_context = False

    def _decode(self, rows: Sequence[tuple[int, Sequence[int]]],
                num_logits: int | None) -> torch.Tensor:
        """Append each ``(slot, token_ids)`` row to its slot in batches of at most
        ``n_batch`` tokens. Returns the logits of each row's last ``num_logits`` tokens
        (None: all; 0: none), in row order: ``[total, vocab]``. A batch that fails leaves
        its slots as they were before it."""
        for slot, token_ids in rows:
            check_context(self, self._slot_lengths[slot], len(token_ids), "llama.cpp")
        items = []  # (slot, token, whether its logits are wanted)
        for slot, token_ids in rows:
            first_wanted = len(token_ids) - min(num_logits or len(token_ids), len(token_ids))
            items += [(slot, token, num_logits != 0 and i >= first_wanted)
                      for i, token in enumerate(token_ids)]
        out = []
        for start in range(0, len(items), self._batch_capacity):
            chunk = items[start:start + self._batch_capacity]
            lengths = list(self._slot_lengths)  # positions: committed only once decoded
            batch = self._batch
            try:
                batch.n_tokens = len(chunk)
                for i, (slot, token, wanted) in enumerate(chunk):
                    batch.token[i] = token
                    batch.pos[i] = lengths[slot]
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = slot
                    batch.logits[i] = wanted
                    lengths[slot] += 1
                status = self._llama_cpp.llama_decode(self._context, batch)
                if status != 0:
                    raise RuntimeError(f"llama_decode failed with status {status}")
            except BaseException:  # nothing of the chunk may stay in the caches
                for slot in {slot for slot, _, _ in chunk}:
                    self._llama_cpp.llama_memory_seq_rm(self._memory, slot,
                                                        self._slot_lengths[slot], -1)
                raise
            self._slot_lengths = lengths
            num_rows = sum(wanted for _, _, wanted in chunk)
            if num_rows:
                pointer = self._llama_cpp.llama_get_logits(self._context)
                out.append(np.ctypeslib.as_array(pointer, shape=(num_rows, self.vocab_size)).copy())
        if not out:
            return torch.empty(0, self.vocab_size)
        return torch.from_numpy(out[0] if len(out) == 1 else np.concatenate(out))

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._llama_cpp.llama_batch_free(self._batch)
        with contextlib.suppress(Exception):
            self._free_own_context()


def new_llama(path: str | Path, *, threads: int, context_length: int, **overrides):
    """A ``llama_cpp.Llama`` on the CPU as exactspec runs it: ``threads`` for decoding and
    prompt processing, batches of 512, sliding-window caches kept in full."""
    llama_cpp = import_llama_cpp()
    return llama_cpp.Llama(str(path), n_ctx=context_length, n_batch=PREFILL_CHUNK_SIZE,
                           n_ubatch=PREFILL_CHUNK_SIZE,
                           n_threads=threads, n_threads_batch=threads, swa_full=True,
                           verbose=False, **overrides)

"""Shared fixtures: tiny randomly initialised models built from a config in code, a
character tokenizer, and simple proposers used as proposers in the tests."""

from __future__ import annotations

import os
import string
from collections.abc import Sequence

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of -n N workers: one thread each, as the
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers share the cores (before torch)

import torch  # noqa: E402

from exactspec.backends.base import forward_one, new_sequence_id
from exactspec.backends.transformers_backend import TransformersBackend
from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer
from exactspec.sampling import SamplingParams

def kernel_paths_line() -> str:
    """Which native kernel paths this run tests, for the header and the summary."""
    from exactspec.backends import native

    kernels = native.load()
    if kernels is None:
        return "exactspec native kernels: not built (no C compiler?); their tests skip"
    forced = os.environ.get(native.ISA_VARIABLE)
    return (f"exactspec native kernels: paths tested {', '.join(kernels.paths)} (this CPU "
            f"runs up to {kernels.cpu_isa}"
            + (f"; {native.ISA_VARIABLE}={forced}" if forced else "")
            + f"); PyTorch's CPU capability {torch.backends.cpu.get_cpu_capability()}")


def pytest_report_header(config) -> str:
    return kernel_paths_line()


def pytest_terminal_summary(terminalreporter) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        terminalreporter.write_line(kernel_paths_line())


ALPHABET = (string.ascii_lowercase + string.digits + " ,.!?\n" + string.ascii_uppercase  # 68
            + '{}[]":')  # 74: JSON's punctuation for a JSON-capable vocabulary (JSON_VOCAB)
VOCAB = 64  # tokens 0..63 map to ALPHABET[:64]
JSON_VOCAB = len(ALPHABET)  # a tokenizer over all of ALPHABET can write JSON


class CharTokenizer:
    """One character per token; ``vocab`` tokens. Implements the Tokenizer protocol."""

    def __init__(self, vocab: int = VOCAB) -> None:
        self.chars = ALPHABET[:vocab]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.chars.index(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.chars[t] for t in token_ids)

    def apply_chat_template(self, prompt) -> list[int]:
        from exactspec.backends.base import chat_messages

        turns = "".join(f"{m['role']} {m['content']}\n" for m in chat_messages(prompt))
        return self.encode(turns.replace("assistant ", "bot ") + "bot ")

    def get_vocab(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.chars)}

    def constraint_tokenizer(self, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance

        chars = self.chars

        class Vocabulary:  # what llguidance.TokenizerWrapper reads; EOS is a special token
            eos_token_id, bos_token_id, special_token_ids = eos_token_ids[0], None, []
            tokens = [b"\xff<eos>" if i in eos_token_ids else c.encode() for i, c in
                      enumerate(chars)] + [b""] * (vocab_size - len(chars))

            def __call__(self, text):
                text = text.decode() if isinstance(text, bytes) else text
                return [chars.index(c) for c in text]
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()),
                                      n_vocab=vocab_size, eos_token=list(eos_token_ids))


def tiny_model(seed: int = 0, vocab: int = VOCAB, max_context: int = 512,
               dtype: torch.dtype = torch.float32):
    """A 2-layer Llama with random weights; logits spread widely (init range 0.3) so that
    greedy argmaxes are not near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_context, initializer_range=0.3,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_backend(seed: int = 0, *, eos: Sequence[int] = (), model=None, vocab: int = VOCAB,
                 tokenizer_vocab: int | None = None, max_context: int = 512,
                 dtype: torch.dtype = torch.float32) -> TransformersBackend:
    """A backend over :func:`tiny_model` (or ``model``) with a :class:`CharTokenizer`."""
    model = model if model is not None else tiny_model(seed, vocab, max_context, dtype)
    return TransformersBackend(model, CharTokenizer(tokenizer_vocab or min(vocab, VOCAB)),
                               eos_token_ids=eos)


def perturbed_backend(target: TransformersBackend, noise: float = 0.05,
                      seed: int = 0) -> TransformersBackend:
    """A draft close to ``target``: a copy of its model with Gaussian noise on the weights,
    so it agrees often (high acceptance) but not always (p ≠ q)."""
    import copy

    model = copy.deepcopy(target.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * noise)
    return TransformersBackend(model, target.tokenizer, eos_token_ids=target.eos_token_ids)


class OneSequence:
    """One sequence of a backend driven as a single cache, the tests' shorthand for the
    by-id API underneath: :meth:`prefill` starts the sequence anew."""

    def __init__(self, backend) -> None:
        self.backend, self.sequence_id = backend, new_sequence_id()

    def prefill(self, token_ids) -> None:
        self.backend.release(self.sequence_id)
        self.backend.prefill(self.sequence_id, token_ids)

    def forward(self, token_ids, num_logits=None) -> torch.Tensor:
        return forward_one(self.backend, self.sequence_id, token_ids, num_logits)

    def rollback(self, num_tokens: int) -> None:
        self.backend.rollback(self.sequence_id, num_tokens)

    @property
    def num_cached_tokens(self) -> int:
        return self.backend.num_cached_tokens(self.sequence_id)

    def release(self) -> None:
        """Free the sequence (a llama.cpp slot) for others."""
        self.backend.release(self.sequence_id)


def one(backend) -> OneSequence:
    """The tests' one sequence on ``backend`` (the same one at every call)."""
    if "_one_sequence" not in backend.__dict__:
        backend.__dict__["_one_sequence"] = OneSequence(backend)
    return backend.__dict__["_one_sequence"]


class RandomProposer(Proposer):
    """Drafts uniformly random tokens (point mass): almost always wrong."""

    def __init__(self, vocab: int = VOCAB, seed: int = 0) -> None:
        self.vocab = vocab
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0) -> Proposal:
        return Proposal(torch.randint(self.vocab, (k,), generator=self.rng).tolist())


class ScriptedProposer(Proposer):
    """Drafts the continuation of ``reference`` (token ids of a full sequence) when the
    context is a prefix of it: an oracle that is right every time in greedy mode."""

    def __init__(self, reference: Sequence[int]) -> None:
        self.reference = list(reference)

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0) -> Proposal:
        n = len(token_ids)
        if self.reference[:n] != list(token_ids):
            return EMPTY_PROPOSAL
        return Proposal(self.reference[n:n + k])


def row_dependent_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``x`` ``[rows, K]``, ``weight`` ``[N, K]``, float32) summed over k
    in ascending order for one row and in descending order for a block: the non-invariant
    reference (the broken control of the batch-invariance tests). Each product and each addition is one IEEE float32 operation in PyTorch's
    element-wise kernels (no fused multiply-add, no BLAS), so the two orders give the same
    values on every machine, and they differ: float32 addition is not associative."""
    products = x[:, None, :] * weight[None, :, :]  # [rows, N, K], each rounded once
    order = range(x.shape[1]) if x.shape[0] == 1 else reversed(range(x.shape[1]))
    total = torch.zeros(products.shape[:2])
    for k in order:
        total = total + products[:, :, k]
    return total


@pytest.fixture
def row_dependent_fast_kernels(monkeypatch) -> None:
    """The transformers backend's fast kernels with :func:`row_dependent_product` for their
    products over at most ``SKINNY_MAX_ROWS`` rows: not batch-invariant on any machine."""
    from exactspec.backends import batch_invariant

    monkeypatch.setattr(batch_invariant, "skinny_product", row_dependent_product)


@pytest.fixture
def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=24)


class BackendFactory:
    """Builds tiny backends of one kind (``transformers``, ``llama_cpp`` or ``native``) from
    the same seeded tiny Llama, so that a test parametrised over ``make_backend`` runs
    unchanged on every runtime. ``same_as=backend`` gives a second backend (own KV cache) on the same
    weights."""

    def __init__(self, kind: str, folder=None) -> None:
        self.kind, self.folder = kind, folder

    def __call__(self, seed: int = 0, *, eos: Sequence[int] = (), vocab: int = VOCAB,
                 max_context: int = 512, same_as=None):
        if self.kind == "transformers":
            return tiny_backend(seed, eos=eos, vocab=vocab, max_context=max_context,
                                model=same_as.model if same_as is not None else None)
        from tiny_gguf import write_tiny_gguf

        if same_as is not None:
            path = same_as.model.path if self.kind == "native" else same_as.llama.model_path
            max_context = same_as.max_context_length
        else:
            path = self.folder / f"tiny-{seed}-{vocab}-{max_context}.gguf"
            if not path.exists():
                write_tiny_gguf(tiny_model(seed, vocab, max_context), path)
        if self.kind == "native":
            from exactspec.backends.native_backend import GGUFModel, NativeBackend

            return NativeBackend(GGUFModel(path), CharTokenizer(min(vocab, VOCAB)),
                                 eos_token_ids=eos, threads=1)
        from exactspec.backends.llama_cpp_backend import LlamaCppBackend, new_llama

        llama = new_llama(path, threads=1, context_length=max_context)
        return LlamaCppBackend(llama, CharTokenizer(min(vocab, VOCAB)), eos_token_ids=eos)


@pytest.fixture(params=["transformers", "llama_cpp", "native"])
def make_backend(request, tmp_path_factory) -> BackendFactory:
    """A :class:`BackendFactory` per backend; llama_cpp is skipped when llama-cpp-python is
    not installed, native where exactspec's kernels cannot be built (no C compiler)."""
    if request.param == "transformers":
        return BackendFactory("transformers")
    folder = tmp_path_factory.getbasetemp() / "tiny-gguf"
    folder.mkdir(exist_ok=True)
    if request.param == "native":
        from exactspec.backends import native

        if native.load() is None:
            pytest.skip("exactspec's native kernels could not be built here")
        return BackendFactory("native", folder)
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                                            "(pip install 'exactspec[llama-cpp]')")
    return BackendFactory("llama_cpp", folder)


CHAT_TEMPLATE = "{% for m in messages %}user {{ m['content'] }}\nbot {% endfor %}"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Llama with a character-level fast tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-model")
    vocab = {c: i for i, c in enumerate(ALPHABET[:VOCAB])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    model = tiny_model(3)
    model.generation_config.eos_token_id = vocab["!"]
    model.save_pretrained(folder)
    return folder



def trained_head(target: TransformersBackend, folder, updates: int = 60) -> str:
    """Train (``exactspec.training.train``) a draft head for a tiny ``target`` on 160 of its
    own samples (temperature 1, 48 tokens after a 4-token prompt), drafting from 48 of its
    64 tokens; returns the head file's path."""
    from exactspec.training.data import Conversation
    from exactspec.training.train import TrainingConfig, train

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(target.vocab_size, (160, 4), generator=generator)
    with torch.no_grad():  # plain ancestral sampling of all rows at once
        for _ in range(48):
            logits = target.model(input_ids=tokens).logits[:, -1]
            tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1,
                                                          generator=generator)], 1)
    conversations = [Conversation(i, "", row[:4].tolist(), row[4:].tolist(), "length")
                     for i, row in enumerate(tokens)]
    config = TrainingConfig(draft_vocab_size=48, total_updates=updates, batch_tokens=2048,
                            learning_rate=3e-3, warmup_updates=5, eval_every=updates,
                            eval_conversations=8, feature_layers=(0, 1))
    return str(train(target.model, conversations, folder, config, target_name="tiny",
                     show_progress=False))


@pytest.fixture(scope="session")
def tiny_head_file(tmp_path_factory) -> str:
    """:func:`trained_head` for ``tiny_backend(0)`` (any backend over that model loads it)."""
    return trained_head(tiny_backend(0), tmp_path_factory.mktemp("head"))


def write_corpus_wheel(path, news, pages):
    """A zip archive laid out like gensim's wheel: ``news`` lines (Latin-1) and a bz2
    MediaWiki dump of ``pages`` ((title, namespace, wikitext))."""
    import bz2
    import zipfile
    from xml.sax.saxutils import escape

    from exactspec.training.data import CORPUS_FILES

    xml = "".join(f"<page><title>{escape(title)}</title><ns>{ns}</ns><revision><text>"
                  f"{escape(text)}</text></revision></page>" for title, ns, text in pages)
    dump = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
            f"{xml}</mediawiki>").encode()
    with zipfile.ZipFile(path, "w") as archive:
        first, second = CORPUS_FILES["news"]
        archive.writestr(first, "\n".join(news[:-1]).encode("latin-1"))
        archive.writestr(second, news[-1].encode("latin-1"))
        archive.writestr(CORPUS_FILES["wikipedia"][0], bz2.compress(dump))
    return path


class RestrictedLogits:
    """Any backend with :meth:`NativeBackend.restrict_logits`'s contract (logits of some
    tokens' columns only), for the draft-vocabulary tests on transformers models: the
    columns are sliced out of the whole vocabulary's logits."""

    def __init__(self, backend) -> None:
        self._backend, self.token_ids = backend, None
        self.vocab_size = backend.vocab_size

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def restrict_logits(self, token_ids) -> None:
        self.token_ids = torch.tensor(list(token_ids))
        self.vocab_size = len(self.token_ids)

    def forward(self, rows, num_logits=None):
        return [logits if self.token_ids is None else logits[:, self.token_ids]
                for logits in self._backend.forward(rows, num_logits)]

"""Peers: other engines decoding the same model, which the benchmark times and the audit
tests beside exactspec.

- ``hf``: transformers ``generate()`` on the target's own model object
  (:class:`TransformersPeer`), plain or with its own speculation: ``prompt_lookup_num_tokens``,
  ``assistant_early_exit`` or ``assistant_model``.
- ``llama``: llama-cpp-python's own ``Llama.generate()`` on the target's GGUF file
  (:class:`LlamaCppPeer`), plain or with its ``LlamaPromptLookupDecoding`` draft; with a
  draft model (``llama-draft:MODEL``), llama.cpp's own ``llama-server`` and its speculative
  decoding (:class:`LlamaServerPeer`; llama-cpp-python has no draft-model speculation).

A peer is named by a proposer spec with its prefix (``hf-prompt-lookup:k=10``; the grammar is
in :mod:`exactspec.proposers.spec`) and made by :func:`make_peer`. Both search n-grams of
at most 2 tokens, their own default: a spec's ``ngram=`` is not passed on.

Each peer is an :class:`~exactspec.engines.Engine`. It translates the
:class:`~exactspec.sampling.SamplingParams` fields it lists in ``translates`` and refuses a
call that sets any other field; ``comparable`` lists the fields with which its sampling
distribution is by definition the one exactspec samples from (:meth:`Peer.sample`, what the
audit draws, refuses the others).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from exactspec.backends.base import Backend
from exactspec.backends.llama_cpp_backend import LlamaCppBackend
from exactspec.engines import Generation, one_after_another
from exactspec.generation_stats import GenerationStats
from exactspec.model_files import check_model_path
from exactspec.proposers.spec import ProposerSpec
from exactspec.sampling import SamplingParams

PEERS = {"hf": ("plain", "prompt-lookup", "early-exit", "draft"),
         "llama": ("plain", "prompt-lookup", "draft")}
"""Peer prefix → the proposer kinds it runs (the ``peers`` of
:func:`~exactspec.proposers.spec.parse_proposer`)."""
LLAMA_CPP_SAMPLER_ORDER = ("applies top-k, top-p and min-p before the temperature (exactspec, "
                           "transformers and vLLM apply them after), a different distribution "
                           "by definition")
"""Why llama.cpp's sampling (llama-cpp-python's and llama-server's) is audited with the
temperature and seed only."""
DEFAULT_PROMPT_LOOKUP_K = 10
"""A peer's prompt-lookup tokens per draft when the spec gives no ``k=`` (both engines' own
default)."""


def is_peer(name: str) -> bool:
    """Whether a method or spec name is a peer's (``hf-*``, ``llama-*``) rather than exactspec's."""
    return name.startswith(tuple(f"{peer}-" for peer in PEERS))


def set_fields(params: SamplingParams, allowed: Sequence[str]) -> list[str]:
    """The fields of ``params`` outside ``allowed`` that differ from their defaults."""
    defaults = SamplingParams()
    return [field for field, value in vars(params).items()
            if field not in allowed and value != getattr(defaults, field)]


class Peer:
    """What every peer shares: an :class:`~exactspec.engines.Engine` that checks the
    sampling parameters and serves requests one after another.

    Attributes:
        label: how messages call the engine, e.g. ``transformers generate()``.
        name: how reports call it (default: its label).
        translates: the SamplingParams fields it honours; a call setting others is refused.
        comparable: the fields with which it samples from exactly the distribution exactspec
            does (see ``incomparable_reason`` for why not the others).
        corpus, draft_stats: None (a peer keeps no corpus and does not report its drafts).
    """

    label: str
    translates: tuple[str, ...]
    comparable: tuple[str, ...]
    incomparable_reason = ""
    corpus = None
    draft_stats = None

    def __init__(self) -> None:
        self.name = self.label

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 at_once: bool = False) -> list[Generation]:
        """As :meth:`Engine.generate <exactspec.engines.Engine.generate>`: one request at a
        time, each seeded as if alone; ``seconds`` is the wall time of its decoding.

        Raises:
            ValueError: if ``params`` sets a field outside ``translates``.
        """
        self._refuse_untranslated(params)

        def decode(prompt_ids: Sequence[int]) -> Generation:
            start = time.perf_counter()
            token_ids = self._samples(prompt_ids, params, 1)[0]
            seconds = time.perf_counter() - start
            return Generation(token_ids, seconds, seconds)
        return one_after_another(decode, prompts)

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        """As :meth:`Engine.sample <exactspec.engines.Engine.sample>`.

        Raises:
            ValueError: if ``params`` sets a field outside ``comparable`` (naming the
                values that would audit it) or outside ``translates``.
        """
        incomparable = [field for field in set_fields(params, self.comparable)
                        if field in self.translates]
        if incomparable:
            defaults = SamplingParams()
            reset = " ".join(f"--{field.replace('_', '-')} {getattr(defaults, field):g}"
                             for field in incomparable)
            raise ValueError(f"{self.label} is audited with {', '.join(self.comparable)} only "
                             f"(it got {', '.join(incomparable)}): {self.incomparable_reason}; "
                             f"audit it with {reset}")
        self._refuse_untranslated(params)
        return [tuple(token_ids) for token_ids in self._samples(prompt_ids, params, num_samples)]

    def _samples(self, prompt_ids: Sequence[int], params: SamplingParams,
                 num_samples: int) -> list[list[int]]:
        """``num_samples`` continuations of ``prompt_ids``, reproducible for ``params.seed``
        (parameters already checked)."""
        raise NotImplementedError

    def _refuse_untranslated(self, params: SamplingParams) -> None:
        untranslated = set_fields(params, self.translates)
        if untranslated:
            raise ValueError(f"{self.label} does not translate {', '.join(untranslated)}; it "
                             f"supports {', '.join(self.translates)}")


class TransformersPeer(Peer):
    """transformers ``generate()`` on the target's own model object.

    Args:
        target: the target's transformers backend.
        generate_kwargs: what selects the mode (see :func:`transformers_generate_kwargs`),
            e.g. ``{"prompt_lookup_num_tokens": 4}``; none: plain decoding.
    Raises:
        ValueError: if ``target`` is not a transformers backend.
    """

    label = "transformers generate()"
    translates = comparable = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens")

    def __init__(self, target: Backend, generate_kwargs: dict | None = None) -> None:
        if target.name != "transformers":
            raise ValueError(f"{self.label} needs the transformers backend (--backend transformers)")
        super().__init__()
        self.target, self.generate_kwargs = target, dict(generate_kwargs or {})

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 at_once: bool = False) -> list[Generation]:
        """As :meth:`Peer.generate`; but plain ``generate()`` decodes requests submitted at
        once as one left-padded batch (each one's seconds and latency: the batch's). Its
        assisted modes refuse batches, so they serve one request at a time."""
        if not at_once or self.generate_kwargs:
            return super().generate(prompts, params)
        self._refuse_untranslated(params)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        start = time.perf_counter()
        outputs = self._generate_padded(prompts, params)
        seconds = time.perf_counter() - start
        return [Generation(output, seconds, seconds) for output in outputs]

    def _samples(self, prompt_ids: Sequence[int], params: SamplingParams,
                 num_samples: int) -> list[list[int]]:
        """One ``torch.manual_seed(params.seed)`` (where set), then one ``generate()`` a
        sample."""
        if params.seed is not None:
            torch.manual_seed(params.seed)
        return [self._generate_padded([prompt_ids], params)[0] for _ in range(num_samples)]

    def _generate_padded(self, prompts: Sequence[Sequence[int]],
                         params: SamplingParams) -> list[list[int]]:
        """``generate()`` on the prompts as one batch, left-padded; each output cut after
        its first EOS."""
        width = max(len(p) for p in prompts)
        eos = list(self.target.eos_token_ids)
        pad = eos[0] if eos else 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts],
                                 device=self.target.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                                      device=self.target.device)
        sampling = {"do_sample": False} if params.greedy else {
            "do_sample": True, "temperature": params.temperature, "top_k": params.top_k,
            "top_p": params.top_p, "min_p": params.min_p or None}
        with torch.inference_mode():
            output = self.target.model.generate(
                input_ids, attention_mask=attention_mask,
                max_new_tokens=params.max_new_tokens, eos_token_id=eos or None,
                pad_token_id=pad, **sampling, **self.generate_kwargs)
        outputs = []
        for row in output[:, width:].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
            outputs.append(row[:end])
        return outputs


def transformers_generate_kwargs(proposer_spec: ProposerSpec, k: int,
                                 load_model: Callable[[str], Backend]) -> dict:
    """transformers ``generate()`` keyword arguments for the same proposer as ``proposer``,
    drafting ``k`` tokens per cycle; ``load_model`` loads a draft model by name or path.

    Raises:
        ValueError: if the draft model does not load on the transformers backend.
    """
    if proposer_spec.kind == "prompt-lookup":
        return {"prompt_lookup_num_tokens": k}
    if proposer_spec.kind == "early-exit":
        return {"assistant_early_exit": proposer_spec.layers, "num_assistant_tokens": k}
    if proposer_spec.kind == "draft":
        draft = load_model(proposer_spec.model)
        if draft.name != "transformers":
            raise ValueError(f"{TransformersPeer.label} needs the draft model {proposer_spec.model!r} "
                             "on the transformers backend (--backend transformers)")
        # the assistant reads its draft length from its own generation config
        draft.model.generation_config.num_assistant_tokens = k
        return {"assistant_model": draft.model, "num_assistant_tokens": k}
    return {}


class LlamaCppPeer(Peer):
    """llama-cpp-python's own ``Llama.generate()`` on the target's GGUF file, with its
    ``LlamaPromptLookupDecoding`` draft (``num_pred_tokens`` = k) or none.

    llama-cpp-python verifies a draft by sampling the target at every drafted position and
    keeping the drafts that equal the samples, which is exact for a deterministic draft.

    Args:
        target: the target's llama.cpp backend, or a native one (then the same file is
            loaded on llama.cpp with as many threads, for comparing the two runtimes).
        k: drafted tokens per cycle (0: no draft).
        share: with k = 0, generate with the target's own ``Llama`` (its cache is
            overwritten) instead of a second instance of the same file.
    Raises:
        ValueError: if ``target`` is neither.
    """

    label = "llama-cpp-python generate()"
    translates = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens")
    comparable = ("temperature", "seed", "max_new_tokens")
    incomparable_reason = f"llama-cpp-python {LLAMA_CPP_SAMPLER_ORDER}"

    def __init__(self, target: Backend, k: int = 0, *, share: bool = False) -> None:
        if target.name == "native":  # the same GGUF file on llama.cpp, as many threads

            target = LlamaCppBackend.load(target.model.path, threads=target.threads.max_threads,
                                          context_length=target.max_context_length)
            share = True
        if target.name != "llama_cpp":
            raise ValueError(f"{self.label} needs a GGUF target (--backend llama_cpp or native)")
        super().__init__()
        if k:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            # logits_all=True as well: with a draft model alone, llama-cpp-python 0.3.36 sizes
            # its logits buffer for n_batch (512) positions and fails on longer contexts.
            self.llama = target.new_llama(
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k), logits_all=True)
        else:
            self.llama = target.llama if share else target.new_llama()
        self.eos = set(target.eos_token_ids)

    def _samples(self, prompt_ids: Sequence[int], params: SamplingParams,
                 num_samples: int) -> list[list[int]]:
        """Sample i seeded with ``seed × 1000003 + i`` (a ``Llama`` holds one sequence, so
        requests submitted at once are served one at a time too)."""
        samples = []
        for i in range(num_samples):
            self.llama.set_seed((params.seed or 0) * 1_000_003 + i)
            samples.append(self._generate(prompt_ids, params))
        return samples

    def _generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """From an empty cache, stopped after an EOS token or ``max_new_tokens`` tokens; no
        repetition penalty."""
        sampling = {"temp": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        if not params.greedy:
            sampling = {"temp": params.temperature, "top_k": params.top_k,
                        "top_p": params.top_p, "min_p": params.min_p}
        self.llama.reset()
        token_ids: list[int] = []
        for token in self.llama.generate(list(prompt_ids), **sampling, repeat_penalty=1.0):
            token_ids.append(token)
            if token in self.eos or len(token_ids) >= params.max_new_tokens:
                break
        return token_ids


LLAMA_SERVER_ENV = "LLAMA_SERVER"
"""The environment variable naming llama.cpp's ``llama-server`` binary (default:
``.cache/llama-server/bin/llama-server`` under the working directory, where
``scripts/build_llama_server.sh`` builds it)."""


def llama_server_binary() -> Path:
    """llama.cpp's ``llama-server``: ``$LLAMA_SERVER``, else the build script's output.

    Raises:
        FileNotFoundError: where it is not, saying how to build it.
    """
    path = Path(os.environ.get(LLAMA_SERVER_ENV)
                or Path.cwd() / ".cache" / "llama-server" / "bin" / "llama-server")
    if not path.is_file():
        raise FileNotFoundError(
            f"llama.cpp's llama-server is not at {path}: build it with "
            f"scripts/build_llama_server.sh (from exactspec's repository), or set "
            f"{LLAMA_SERVER_ENV} to its path")
    return path


class LlamaServerPeer(Peer):
    """llama.cpp's own speculative decoding with a draft model: its ``llama-server``
    (``-md`` the draft's GGUF file as it is, ``--spec-type draft-simple``,
    ``--spec-draft-n-max`` = k, its other settings its defaults, e.g. its ``p_min``
    confidence stop), started on loopback at the first request with one slot and the
    target's threads (for the target and the draft alike), stopped by :meth:`close` or at
    exit. Requests go to its ``/completion`` endpoint as token ids, one at a time, without
    its prompt cache.

    llama.cpp verifies a draft by sampling the target at every drafted position and keeping
    the drafts equal to the samples (``common/speculative.cpp``): exact in distribution,
    but its batched verification rounds differently from its one-token steps, so its greedy
    output may differ from its plain decoding's.

    Args:
        target: the target on the native or llama_cpp backend (its GGUF file is served).
        draft_path: the draft model's GGUF file.
        k: most drafted tokens per cycle (≥ 1).
    Attributes:
        command: the ``llama-server`` command line.
    Raises:
        ValueError: for a target on another backend, a draft that is not a GGUF file, or
            k < 1.
        FileNotFoundError: where ``llama-server`` is not built (:func:`llama_server_binary`).
    """

    label = "llama-server (llama.cpp's speculative decoding with a draft model)"
    translates = LlamaCppPeer.translates
    comparable = LlamaCppPeer.comparable
    incomparable_reason = f"llama.cpp {LLAMA_CPP_SAMPLER_ORDER}"
    START_SECONDS = 300
    """How long the server may take to load both models before it is given up."""

    def __init__(self, target: Backend, draft_path: str | Path, k: int) -> None:
        if target.name == "native":
            path, threads = target.model.path, target.threads.max_threads
        elif target.name == "llama_cpp":
            path, threads = target.llama.model_path, target.llama.n_threads
        else:
            raise ValueError(f"{self.label} needs a GGUF target (--backend native or llama_cpp)")
        if Path(draft_path).suffix != ".gguf":
            raise ValueError(f"{self.label} needs a GGUF draft model, not {str(draft_path)!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k = {k!r} is invalid: llama-server drafts at least 1 token")
        super().__init__()
        self.port = _free_port()
        self.command = [
            str(llama_server_binary()), "-m", str(path), "-md", str(draft_path),
            "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
            "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads),
            "-c", str(target.max_context_length or 4096), "-np", "1",
            "--host", "127.0.0.1", "--port", str(self.port)]
        self.eos = set(target.eos_token_ids)
        self._process: subprocess.Popen | None = None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 at_once: bool = False) -> list[Generation]:
        """As :meth:`Peer.generate`, with the server's own timings as ``stats``: its
        prefill (``prompt_ms``) and decoding (``predicted_ms``) seconds, drafted and
        accepted tokens (``draft_n``, ``draft_n_accepted``)."""
        self._refuse_untranslated(params)

        def decode(prompt_ids: Sequence[int]) -> Generation:
            start = time.perf_counter()
            token_ids, timings = self._complete(prompt_ids, params, params.seed or 0)
            seconds = time.perf_counter() - start
            prefill = timings.get("prompt_ms", 0.0) / 1000
            stats = GenerationStats(
                num_prompt_tokens=len(prompt_ids), num_generated_tokens=len(token_ids),
                drafted_tokens=timings.get("draft_n", 0),
                accepted_tokens=timings.get("draft_n_accepted", 0), prefill_seconds=prefill,
                total_seconds=prefill + timings.get("predicted_ms", 0.0) / 1000)
            return Generation(token_ids, seconds, seconds, stats.to_dict())
        return one_after_another(decode, prompts)

    def _samples(self, prompt_ids: Sequence[int], params: SamplingParams,
                 num_samples: int) -> list[list[int]]:
        """Sample i seeded with ``seed × 1000003 + i``."""
        return [self._complete(prompt_ids, params, (params.seed or 0) * 1_000_003 + i)[0]
                for i in range(num_samples)]

    def _complete(self, prompt_ids: Sequence[int], params: SamplingParams,
                  seed: int) -> tuple[list[int], dict]:
        """One ``/completion`` request: its tokens (ending with the EOS token where it
        stopped at one) and its ``timings``."""
        sampling = ({"temperature": 0.0, "top_k": 1} if params.greedy else
                    {"temperature": params.temperature, "top_k": params.top_k,
                     "top_p": params.top_p, "min_p": params.min_p})
        body = {"prompt": list(prompt_ids), "n_predict": params.max_new_tokens,
                "seed": seed, "cache_prompt": False, "return_tokens": True,
                "repeat_penalty": 1.0, **sampling}
        answer = self._post("/completion", body)
        token_ids = [int(t) for t in answer["tokens"]]
        if (answer.get("stop_type") == "eos" and len(token_ids) < params.max_new_tokens
                and not (token_ids and token_ids[-1] in self.eos) and self.eos):
            token_ids.append(min(self.eos))  # llama-server leaves the EOS token out
        return token_ids, answer.get("timings", {})

    def _post(self, path: str, body: dict) -> dict:
        self._start()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.load(response)

    def _start(self) -> None:
        """Start the server unless it runs; wait until its ``/health`` answers.

        Raises:
            RuntimeError: if it exits or does not answer within :data:`START_SECONDS`,
                with the end of its log.
        """
        if self._process is not None and self._process.poll() is None:
            return
        log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.close)
        deadline = time.monotonic() + self.START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.close()
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"llama-server did not start ({' '.join(self.command)}):"
                                   f"\n{tail}")
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the server (a later request starts it again)."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_peer(proposer_spec: ProposerSpec, target: Backend, load_model: Callable[[str], Backend],
              k: int, *, share: bool = False) -> Peer:
    """The peer ``proposer.peer`` running ``proposer`` with ``k`` tokens per draft on
    ``target``; ``load_model`` loads a draft model; ``share`` as in :class:`LlamaCppPeer`.

    Raises:
        ValueError: if the target's backend is not the peer's, or the peer cannot run the
            proposer.
    """
    check_peer_runs(proposer_spec)
    if proposer_spec.peer == "hf":
        peer = TransformersPeer(target)  # refuses another backend before loading a draft
        peer.generate_kwargs = transformers_generate_kwargs(proposer_spec, k, load_model)
        return peer
    if proposer_spec.kind == "draft":
        return LlamaServerPeer(target, check_model_path(proposer_spec.model), k)
    return LlamaCppPeer(target, k if proposer_spec.drafts else 0, share=share)


def check_peer_runs(proposer_spec: ProposerSpec) -> None:
    """Check, without any model, that ``proposer.peer`` can run ``proposer``.

    Raises:
        ValueError: if it names no peer, or one that cannot run its kind of proposer.
    """
    if proposer_spec.peer not in PEERS:
        raise ValueError(f"{proposer_spec.spec!r} names no peer: prefix it with "
                         f"{' or '.join(f'{peer}-' for peer in PEERS)}")
    if proposer_spec.kind not in PEERS[proposer_spec.peer]:
        label = {"hf": TransformersPeer.label,
                 "llama": f"{LlamaCppPeer.label} (llama-server with a draft model)"}
        *kinds, last = PEERS[proposer_spec.peer]
        raise ValueError(f"{label[proposer_spec.peer]} runs only {', '.join(kinds)} or {last}, "
                         f"not {proposer_spec.spec!r}")

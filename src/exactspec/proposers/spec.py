"""Proposers named by a spec string: the one grammar of ``exactspec generate --proposer``,
``exactspec audit --proposer`` and ``exactspec bench --method``.

A spec is ``[PEER-]KIND[:ARG][:key=value...]``::

    plain                        no drafting: plain decoding
    forced                       only the tokens a request's constraint forces (a JSON
                                 schema's keys and punctuation; nothing without a
                                 constraint). Every proposer drafts them first under one.
    prompt-lookup[:ngram=MIN-MAX]  n-gram lookup in the context, longest n-gram first
                                 (default ngram=2-3)
    suffix[:ngram=MIN-MAX][:corpus=TOKENS]
                                 the most frequent continuation of the longest earlier
                                 match, drafted while likely (default ngram=1-8); corpus=N
                                 also drafts from earlier outputs of this process, up to N
                                 tokens of them per scope, of the same scope only (the server's: API
                                 key and cache_salt; default: off)
    early-exit:L                 the target's first L ≥ 1 layers (self-draft; transformers)
    head[:PATH][:tree=N][:weights=W]
                                 a draft head trained on the target's own features (EAGLE
                                 family; transformers): the one shipped for the target, or
                                 the head file PATH (``exactspec train-draft``); tree=N
                                 drafts a token tree of up to N nodes (EAGLE-2) instead of
                                 a chain, its depth at most k (one sequence at a time);
                                 weights=W how the native kernels hold its weights (q4_0,
                                 the default, q8_0 or bf16; see exactspec.draft_head.kernels)
    draft:MODEL[:vocab=N][:weights=W]
                                 a smaller model on the same tokenizer (embedded name, model
                                 folder or .gguf); vocab=N scores and drafts only the N
                                 tokens its target writes most (a draft vocabulary, FR-Spec;
                                 native backend; default 32768 where a table fits the
                                 tokenizer, vocab=all for the whole); weights=W its GGUF
                                 weights converted once to W (q4_0, q8_0, f16, bf16, f32;
                                 file: as the file has them, or as --weight-type says)
    MATCHER+MODEL                a matcher (prompt-lookup or suffix, each with its options)
                                 drafts when it has a match, the model proposer (head,
                                 draft or early-exit) in the cycles it has none, e.g.
                                 ``suffix+head`` (:mod:`exactspec.proposers.fallback`)

    :k=N                         most tokens drafted per cycle            } where the command
    :policy=P                    speculation-length policy (constant,    } has no flag of its
                                 auto, heuristic, confidence)             } own (bench --method)

``PEER-`` (only where a command compares peers, ``bench --method``): the same proposer run by
another engine on the same model instead of exactspec, ``hf-`` for transformers
``generate()`` and ``llama-`` for llama-cpp-python, or llama.cpp's ``llama-server`` for a
draft model (see :mod:`exactspec.peers`), e.g. ``hf-plain``, ``hf-prompt-lookup:k=10``,
``hf-draft:MODEL``, ``llama-prompt-lookup:k=10``, ``llama-draft:MODEL:k=8``.

One name per kind: the former spellings ``none`` (for ``plain``) and ``assistant`` (for
``draft``) are refused with a message naming the one to use.

The n-gram range is written ``MIN-MAX``; ``generate --prompt-lookup`` also takes its old
spelling ``MIN:MAX`` (both through :func:`parse_ngram`).

:func:`parse_proposer` takes a spec apart and checks it without loading any model (this
module imports nothing else of exactspec's, so that the command line's parser reads it
without loading PyTorch); :func:`~exactspec.proposers.build.build_proposer` makes
exactspec's :class:`~exactspec.proposers.base.Proposer` from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

DEFAULT_NGRAM = (2, 3)
"""Prompt lookup's n-gram sizes (MIN, MAX) when a spec gives none."""
DEFAULT_SUFFIX_NGRAM = (1, 8)
"""Suffix drafting's n-gram sizes (MIN, MAX) when none are given."""
KINDS = ("plain", "forced", "prompt-lookup", "suffix", "early-exit", "draft", "head")
NGRAM_DEFAULTS = {"prompt-lookup": DEFAULT_NGRAM, "suffix": DEFAULT_SUFFIX_NGRAM}
"""The kinds that match n-grams, and their sizes when a spec gives none."""
RENAMED = {"none": "plain", "assistant": "draft"}
"""Former names of a kind (refused, naming the kind's one name)."""
ARGUMENT = {"early-exit": "L", "draft": "MODEL"}
"""Kinds that take a positional argument, and its name."""
FORMS = ("plain, forced, prompt-lookup[:ngram=MIN-MAX], "
         "suffix[:ngram=MIN-MAX][:corpus=TOKENS], early-exit:L, "
         "draft:MODEL[:vocab=N][:weights=W], head[:PATH][:tree=N][:weights=W], MATCHER+MODEL (e.g. suffix+head)")
"""The allowed forms, for messages."""
BACKENDS_NEEDED = {"early-exit": (("transformers",), "drafts with the target's own layers"),
                   "head": (("native", "transformers"),
                            "drafts from the target's hidden features")}
"""Kinds that run on some backends only: kind → (those backends, why, for messages)."""
OPTION_VALUES = {"k": "N", "policy": "P"}
MATCHERS = ("prompt-lookup", "suffix")
"""Kinds that may draft first in ``MATCHER+MODEL`` (they draft only where they match)."""
MODELS = ("early-exit", "draft", "head")
"""Kinds that may draft where the matcher has no match in ``MATCHER+MODEL``."""
HEAD_WEIGHTS = ("q8_0", "q4_0", "bf16")
"""How the native kernels may hold a draft head's weights (``head:…:weights=``;
``exactspec.draft_head.kernels.WEIGHTS``)."""
DRAFT_WEIGHTS = ("file", "q4_0", "q8_0", "f16", "bf16", "f32")
"""A draft model's weights (``draft:…:weights=``): ``file`` as loaded for the target (its
file's, or ``--weight-type``), else converted once to that GGUF type
(:func:`~exactspec.model_files.converted_gguf`)."""


@dataclass(frozen=True)
class ProposerSpec:
    """A proposer spec taken apart (see the module docstring).

    Attributes:
        spec: the text it was parsed from.
        kind: one of :data:`KINDS`.
        ngram: the (MIN, MAX) n-gram sizes prompt lookup or suffix drafting match.
        layers: early exit's L (None for other kinds).
        model: the draft model's name or path (None for other kinds).
        corpus: suffix only: ``corpus=`` (tokens of earlier outputs kept per scope), None: off.
        head: a draft head file (``head:PATH``), None for the shipped head or other kinds.
        tree: head only: ``tree=`` (most nodes of a drafted token tree), None: a chain.
        weights: head and draft: ``weights=`` (:data:`HEAD_WEIGHTS`, :data:`DRAFT_WEIGHTS`),
            None: the default.
        vocab: draft only: ``vocab=`` (a draft vocabulary's size, or ``"all"``), None: the
            default (:data:`~exactspec.proposers.draft_model.DEFAULT_DRAFT_VOCAB_SIZE`).
        k: ``k=`` if given, else None (the command's default).
        policy: ``policy=`` if given, else None (the command's default).
        peer: the peer prefix (``hf``, ``llama``), None for exactspec itself.
        fallback: ``MATCHER+MODEL``: this spec is the matcher's (its ``spec`` the whole
            text, its ``k`` and ``policy`` the whole's), ``fallback`` the model proposer's
            (None: a single proposer).
    """

    spec: str
    kind: str
    ngram: tuple[int, int] = DEFAULT_NGRAM
    layers: int | None = None
    model: str | None = None
    corpus: int | None = None
    head: str | None = None
    tree: int | None = None
    weights: str | None = None
    vocab: int | str | None = None
    k: int | None = None
    policy: str | None = None
    peer: str | None = None
    fallback: ProposerSpec | None = None

    @property
    def parts(self) -> tuple[ProposerSpec, ...]:
        """The proposers it names: itself, and for ``MATCHER+MODEL`` the model's too."""
        return (self,) if self.fallback is None else (self, self.fallback)

    @property
    def drafts(self) -> bool:
        """Whether this spec drafts at all (every kind but ``plain``)."""
        return self.kind != "plain"

    @property
    def description(self) -> str:
        """In words, e.g. ``prompt lookup 2:3``, ``draft model NAME``."""
        if self.fallback is not None:
            alone = dataclasses.replace(self, fallback=None)
            return f"{alone.description}, else {self.fallback.description}"
        return {"plain": "plain decoding", "forced": "a constraint's forced tokens",
                "prompt-lookup": "prompt lookup {0}:{1}".format(*self.ngram),
                "suffix": "suffix {0}:{1}".format(*self.ngram) + (
                    f" with a corpus of {self.corpus} tokens" if self.corpus else ""),
                "early-exit": f"early-exit self-draft, {self.layers} layers",
                "draft": f"draft model {self.model}" + (
                    f", draft vocabulary {self.vocab}" if self.vocab else "") + (
                    f", weights {self.weights}" if self.weights else ""),
                "head": f"draft head {self.head or '(shipped)'}" + (
                    f", trees of {self.tree} nodes" if self.tree else "")}[self.kind]


def parse_ngram(text: str) -> tuple[int, int]:
    """``MIN-MAX`` (or the older ``MIN:MAX``) → (MIN, MAX) n-gram sizes, 1 ≤ MIN ≤ MAX.

    Raises:
        ValueError: naming ``text`` and the expected form.
    """
    try:
        low, high = (int(part) for part in text.replace(":", "-").split("-"))
    except ValueError:
        raise ValueError(f"{text!r} is invalid: give MIN-MAX n-gram sizes, e.g. 1-3") from None
    if not 1 <= low <= high:
        raise ValueError(f"{text!r} is invalid: need 1 ≤ MIN ≤ MAX")
    return low, high


def parse_proposer(spec: str, *, what: str = "proposer", options: Collection[str] = (),
                  peers: Mapping[str, Collection[str]] | None = None) -> ProposerSpec:
    """Take a proposer spec apart and check it, without any model (see the module docstring).

    Args:
        spec: the text, e.g. ``prompt-lookup:ngram=1-3``.
        what: how messages call it (``proposer``, ``method``).
        options: which of ``k``, ``policy`` the caller accepts besides ``ngram``.
        peers: accepted peer prefixes → the kinds each can run (None: no peers).
    Raises:
        ValueError: ``{what} {spec!r} is invalid: …``, naming the allowed forms or the bad value.
    """
    prefix = f"{what} {spec!r} is invalid"
    combination = _split_combination(spec)
    if combination is not None:
        return _parse_combination(*combination, prefix, options, peers)
    peer = next((name for name in peers or () if spec.startswith(f"{name}-")), None)
    kind, *parts = spec[len(peer) + 1 if peer else 0:].split(":")
    if kind in RENAMED:
        raise ValueError(f"{prefix}: the kind {kind!r} is called {RENAMED[kind]!r} now (one "
                         f"name per kind: {FORMS})")
    keys = dict(part.split("=", 1) for part in parts if "=" in part)
    positional = [part for part in parts if "=" not in part]
    allowed_keys = {"ngram", "corpus", "tree", "weights", "vocab", *options}
    if (kind not in KINDS or (len(positional) != (kind in ARGUMENT)
                              and kind not in ("draft", "head"))
            or (kind == "draft" and not any(positional)) or set(keys) - allowed_keys
            or ("ngram" in keys and kind not in NGRAM_DEFAULTS)
            or ("corpus" in keys and kind != "suffix")
            or ("tree" in keys and kind != "head")
            or ("weights" in keys and kind not in ("head", "draft"))
            or ("vocab" in keys and kind != "draft")):
        extras = [f":{key}={OPTION_VALUES[key]}" for key in options] + (
            [f"a peer prefix {' or '.join(f'{p}-' for p in peers)}"] if peers else [])
        raise ValueError(f"{prefix}: use one of {FORMS}" + (
            f", each optionally with {', '.join(extras[:-1])}{' and ' if extras[1:] else ''}"
            f"{extras[-1]}" if extras else ""))
    if peer and kind not in peers[peer]:
        raise ValueError(f"{prefix}: the {peer}- peer runs only {', '.join(peers[peer])}")
    numbers = {name: keys[name] for name in ("k", "tree", "corpus") if name in keys}
    if kind == "early-exit":
        numbers["L"] = positional[0]
    bad = next((name for name, value in numbers.items() if not value.lstrip("-").isdigit()), None)
    if bad:
        raise ValueError(f"{prefix}: {bad} = {numbers[bad]!r} is not an integer")
    k, tree, corpus, layers = (int(numbers[name]) if name in numbers else None
                               for name in ("k", "tree", "corpus", "L"))
    if corpus is not None and corpus < 1:
        raise ValueError(f"{prefix}: corpus = {corpus} must be ≥ 1 (tokens kept; leave it out "
                         "for no corpus)")
    try:
        ngram = parse_ngram(keys["ngram"]) if "ngram" in keys else NGRAM_DEFAULTS.get(
            kind, DEFAULT_NGRAM)
    except ValueError as error:
        raise ValueError(f"{prefix}: ngram {error}") from None
    if tree is not None and tree < 1:
        raise ValueError(f"{prefix}: tree = {tree} must be ≥ 1 (the most nodes of a drafted "
                         "token tree; leave it out for a chain)")
    weights = keys.get("weights")
    allowed_weights = DRAFT_WEIGHTS if kind == "draft" else HEAD_WEIGHTS
    if weights is not None and weights not in allowed_weights:
        raise ValueError(f"{prefix}: weights = {weights!r} must be one of "
                         f"{', '.join(allowed_weights)}")
    if layers is not None and layers < 1:
        raise ValueError(f"{prefix}: L = {layers} must be ≥ 1")
    vocab = keys.get("vocab")
    if vocab is not None and vocab != "all":
        if not vocab.isdigit() or int(vocab) < 2:
            raise ValueError(f"{prefix}: vocab = {vocab!r} must be a number of tokens ≥ 2 or "
                             "'all'")
        vocab = int(vocab)
    policy = keys.get("policy")  # checked by the caller that takes it (bench methods)
    model = ":".join(positional) if kind == "draft" else None  # a path may hold colons
    head = ":".join(positional) or None if kind == "head" else None
    return ProposerSpec(spec, kind, ngram, layers, model, corpus, head, tree, weights, vocab, k,
                        policy, peer)


def _split_combination(spec: str) -> tuple[str, str] | None:
    """``MATCHER+MODEL`` → (MATCHER, MODEL), split at the first ``+``; None for one proposer.
    It is a combination where a kind's name follows the ``+`` (or nothing is on one side):
    a path may hold a ``+`` (``draft:/models/a+b`` is one proposer)."""
    first, plus, rest = spec.partition("+")
    if not plus:
        return None
    after = rest.replace("+", ":").split(":")[0]
    return (first, rest) if after in KINDS or after in RENAMED or not first or not rest else None


def _parse_combination(first: str, rest: str, prefix: str, options: Collection[str],
                       peers: Mapping[str, Collection[str]] | None) -> ProposerSpec:
    """``MATCHER+MODEL`` (see the module docstring): each part parsed alone, the options
    (``k``, ``policy``) written once, on the last part, for the whole."""
    if not first or not rest or _split_combination(rest) is not None:
        raise ValueError(f"{prefix}: combine two proposers, MATCHER+MODEL (e.g. suffix+head)")
    if peers and any(part.startswith(f"{peer}-") for part in (first, rest) for peer in peers):
        raise ValueError(f"{prefix}: a peer ({', '.join(f'{p}-' for p in peers)}) runs one "
                         "proposer; MATCHER+MODEL is exactspec's")
    kinds = first.split(":")[0], rest.split(":")[0]
    if kinds[0] not in MATCHERS or kinds[1] not in MODELS:
        raise ValueError(f"{prefix}: in MATCHER+MODEL the matcher is one of "
                         f"{', '.join(MATCHERS)} and the model one of {', '.join(MODELS)}, "
                         f"not {kinds[0]}+{kinds[1]}")
    written = [key for key in options if f":{key}=" in first]
    if written:
        raise ValueError(f"{prefix}: write {', '.join(written)} once, at the end, for the "
                         "whole (e.g. suffix+head:k=4)")
    try:
        matcher = parse_proposer(first, what="its part")
        model = parse_proposer(rest, what="its part", options=options)
    except ValueError as error:
        raise ValueError(f"{prefix}: {error}") from None
    return dataclasses.replace(matcher, spec=f"{first}+{rest}", k=model.k, policy=model.policy,
                               fallback=dataclasses.replace(model, k=None, policy=None))

"""Draft vocabularies: the tokens a draft model scores (FR-Spec, Zhao et al. 2025, arXiv
2502.14856), the N its target writes most.

A draft model's LM head is a large share of what it reads per token (the Qwen2.5-Coder 0.5B's
151,936 × 896 rows are 145 of its 485 MB); scoring only the N most frequent tokens of the
target's own outputs reads N rows. Tokens outside the draft vocabulary are never drafted
and the draft's q is normalised over the vocabulary it scored, so exactness holds: q is the
distribution actually drafted from, zero outside it, and verification's residual
max(0, p − q) recovers every token the draft cannot propose.

The order of a tokenizer's ids by frequency is a table shipped beside this module
(``draft_vocabularies/*.npz``, made by ``scripts/draft_vocabulary.py`` from conversations the
target wrote itself; no benchmark text), used only for the tokenizer whose digest it holds.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np

TABLES = Path(__file__).with_name("draft_vocabularies")
"""The shipped frequency tables, one ``.npz`` per tokenizer."""


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the tokenizer's token → id map (sorted JSON): which table fits it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


@functools.cache
def _tables() -> dict[str, Path]:
    found = {}
    for path in sorted(TABLES.glob("*.npz")):
        with np.load(path) as table:
            found[str(table["tokenizer_sha256"])] = path
    return found


def frequency_order(tokenizer) -> np.ndarray | None:
    """``[num_tokens]`` the tokenizer's ids, the most frequent in its target's outputs first
    (int64), or None where no table was made for this tokenizer."""
    path = _tables().get(tokenizer_digest(tokenizer))
    if path is None:
        return None
    with np.load(path) as table:
        return table["token_ids"].astype(np.int64)


def draft_vocabulary(tokenizer, size: int, always: tuple[int, ...] = ()) -> np.ndarray | None:
    """``[size]`` ids (ascending) a draft scores: ``always`` (the end-of-sequence ids) and
    the most frequent others; None where no table fits the tokenizer.

    Raises:
        ValueError: for a size outside [len(always) + 1, the tokenizer's size].
    """
    order = frequency_order(tokenizer)
    if order is None:
        return None
    if not len(set(always)) < size <= len(order):
        raise ValueError(f"vocab = {size} is invalid: a draft vocabulary holds "
                         f"{len(set(always)) + 1} .. {len(order)} tokens")
    kept = set(always)
    chosen = [t for t in order.tolist() if t not in kept][:size - len(kept)]
    return np.array(sorted([*chosen, *kept]), dtype=np.int64)

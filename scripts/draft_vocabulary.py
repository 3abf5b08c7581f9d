"""Make a draft vocabulary table (FR-Spec: the draft scores only the tokens the target writes
most): the target writes conversations of its own (exactspec.training.data.synthesize: user
turns it asks itself, answered greedily and at 0.7 in turn; no benchmark text), and every
token id of the tokenizer is ordered by how often it appears in the answers, then the unseen
ones by id. The table is written with the tokenizer's digest, so that it is used only for
that tokenizer (exactspec.proposers.draft_vocabulary).

Usage: python scripts/draft_vocabulary.py TARGET CONVERSATIONS.jsonl NUM_CONVERSATIONS OUT.npz
(the conversations file is resumable: run again to extend it)."""
import glob
import os
import sys
import sysconfig
from collections import Counter

import numpy as np

from exactspec import load_model
from exactspec.proposers.draft_vocabulary import tokenizer_digest
from exactspec.training.data import synthesize

target_name, conversations_path, count, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
target = load_model(target_name)
conversations = synthesize(target, conversations_path, count)
counts = Counter(token for c in conversations for token in list(c.answer_ids))
real = max(target.tokenizer.get_vocab().values()) + 1
order = [token for token, _ in counts.most_common() if token < real]
corpus = Counter()
for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
    with open(path, encoding="utf-8", errors="ignore") as file:
        corpus.update(target.tokenizer.encode(file.read()))
seen = set(order)
order += [token for token, _ in corpus.most_common() if token < real and token not in seen]
seen = set(order)
order += [token for token in range(real) if token not in seen]
np.savez_compressed(out, token_ids=np.array(order, dtype=np.uint32),
                    tokenizer_sha256=tokenizer_digest(target.tokenizer),
                    answer_tokens=sum(counts.values()), conversations=len(conversations),
                    corpus_tokens=sum(corpus.values()),
                    target=target_name)
print(f"{len(conversations)} conversations, {sum(counts.values())} answer tokens, "
      f"{len(counts)} distinct; written {out}")

#!/bin/sh
# The fifth head's data (issue 43): the passage tasks over real prose, news articles and
# Wikipedia passages from the test data in gensim's wheel (read from the wheel, nothing
# installed; Spec-Bench's prompts excluded by 13-word overlap), answers by the target on the
# native backend, 16 rows at a time. Resumable: run again to go on; N conversations in all.
set -e
D=training/smollm2-135m-instruct
mkdir -p build/corpus
[ -f build/corpus/gensim-4.4.0-*.whl ] || pip download --no-deps -d build/corpus gensim==4.4.0
python - "${N:-4000}" <<'PY'
import glob, json, sys, time
from exactspec.models import load_model
from exactspec.training.data import corpus_passages, synthesize
exclude = [turn for line in open("../shared/data/spec_bench/question.jsonl")
           for turn in json.loads(line)["turns"]]
passages = corpus_passages(glob.glob("build/corpus/gensim-4.4.0-*.whl")[0], exclude=exclude)
print(f"{len(passages)} passages, none sharing 13 words with Spec-Bench's {len(exclude)} turns")
start = time.perf_counter()
done = synthesize(load_model("smollm2-135m-instruct"), "training/smollm2-135m-instruct/conversations-v5.jsonl",
                  int(sys.argv[1]), seed=2, tasks=("summarize", "passage-question", "extract", "rewrite"),
                  passages=passages, batch_size=16, chunk_size=128)
print(f"{len(done)} conversations, {time.perf_counter() - start:.0f} s")
PY

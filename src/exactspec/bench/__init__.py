"""``exactspec bench``: speedup per Spec-Bench task group, side by side with the peers
(:func:`run` takes a :class:`BenchSpec`). Its dependencies (matplotlib, for the charts) are
the extra ``exactspec[bench]``."""

from exactspec.extras import require

require("bench", "exactspec bench")

from exactspec.bench.methods import Method, parse_method  # noqa: E402 (after the check)
from exactspec.bench import pipeline  # noqa: E402
from exactspec.bench.pipeline import BenchSpec, run  # noqa: E402
from exactspec.bench.questions import GROUPS, Question, load_humaneval, load_questions  # noqa: E402
from exactspec.bench.report import summarize, write_report  # noqa: E402
from exactspec.bench.runner import BenchResults, Record, run_bench  # noqa: E402

__all__ = ["GROUPS", "BenchResults", "BenchSpec", "Method", "Question", "Record",
           "load_humaneval", "load_questions",
           "parse_method", "pipeline", "run", "run_bench", "summarize", "write_report"]

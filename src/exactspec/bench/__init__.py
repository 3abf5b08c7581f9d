"""``exactspec bench``: speedup per Spec-Bench task group, side by side with the peers."""

from exactspec.bench.methods import Method, parse_method
from exactspec.bench.questions import GROUPS, Question, load_questions
from exactspec.bench.report import summarize, write_report
from exactspec.bench.runner import BenchResults, Record, run_bench

__all__ = ["GROUPS", "BenchResults", "Method", "Question", "Record", "load_questions",
           "parse_method", "run_bench", "summarize", "write_report"]

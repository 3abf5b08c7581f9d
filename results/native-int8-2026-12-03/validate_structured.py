"""Every output of the structured bench (`structured/results.json`) decoded and validated
against its question's JSON schema (jsonschema); prints the counts.

    .venv/bin/python results/native-int8-2026-12-03/validate_structured.py
"""

import json
from collections import Counter
from pathlib import Path

import jsonschema

from importlib.resources import files

from exactspec.backends.native_backend import HFTokenizer, gguf_tokenizer
from exactspec.bench.questions import load_questions
from exactspec.model_files import resolve_model_path

results = json.loads((Path(__file__).parent / "structured/results.json").read_text())
schemas = {q.question_id: q.json_schema
           for q in load_questions(files("exactspec.bench") / "structured.jsonl")}
tokenizer = HFTokenizer(gguf_tokenizer(resolve_model_path("smollm2-135m-instruct")))
counts = Counter()
for record in results["records"]:
    text = tokenizer.decode(record["token_ids"]).strip()
    try:
        jsonschema.validate(json.loads(text), schemas[record["question_id"]])
        counts["valid"] += 1
    except (json.JSONDecodeError, jsonschema.ValidationError):
        counts["cut by max_new_tokens" if record["num_tokens"] >= 96 else "invalid"] += 1
print(dict(counts), "of", len(results["records"]))

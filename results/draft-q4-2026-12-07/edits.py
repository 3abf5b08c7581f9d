"""The pair on code edits: each request gives a function from Python's standard library
(``inspect.getsource``; no benchmark text) and asks for it back with type hints and a
docstring, code unchanged, so most of the answer copies the prompt. Greedy, 256 new tokens,
measured as ``measure.py`` measures (interleaved, decoding tokens/s with prefill excluded,
every output checked equal to plain decoding's).

Usage: python edits.py METHOD...   (METHOD: plain or SPEC,K,POLICY, as measure.py)"""
import fnmatch, glob, inspect, json, shutil, sys, textwrap

from exactspec.models import ModelSpec
from measure import build, measure

FUNCTIONS = [textwrap.dedent, textwrap.indent, shutil.copyfileobj, shutil.which,
             fnmatch.translate, glob.has_magic, json.dumps, textwrap.shorten]
INSTRUCTION = ("Rewrite this Python function with type hints and a docstring, keeping its "
               "code exactly the same:\n```python\n{source}```")
spec = ModelSpec("qwen2.5-coder-1.5b-instruct")
target = spec.load()
prompts = [INSTRUCTION.format(source=inspect.getsource(function)) for function in FUNCTIONS]
for row in measure(target, build(spec, target, sys.argv[1:]), prompts, max_new_tokens=256):
    print(json.dumps(row), flush=True)

"""Remake the README's two trace images on the embedded model (llama.cpp if installed):
``show.svg`` (``generate --show`` as a terminal shows it, via rich's SVG export) and
``trace-page.png`` (the ``--trace`` page, screenshot by headless Chromium).

    python docs/images/make_images.py      # from the repository root; needs chromium
"""

import subprocess
import tempfile
from pathlib import Path

from rich.console import Console

from exactspec import PromptLookupProposer, SamplingParams, SpeculativeGenerator, load_model
from exactspec.trace.page import write_trace
from exactspec.trace.terminal import legend, marked_text

PROMPT = "Repeat this sentence three times: The quick brown fox jumps over the lazy dog."
HERE = Path(__file__).parent

target = load_model()
generator = SpeculativeGenerator(target, PromptLookupProposer(), 4, "constant")
result = generator.generate(PROMPT, SamplingParams(max_new_tokens=48, temperature=0.7, seed=2),
                            chat=True, trace=True)
console = Console(record=True, width=100, force_terminal=True, color_system="truecolor",
                  highlight=False)
console.print(f'$ exactspec generate "{PROMPT}" --temperature 0.7 --seed 2 --policy constant '
              "--show", style="bold")
console.print(marked_text(result.trace, target.tokenizer.decode, colour=True))
console.print(legend(colour=True))
console.print(result.stats.summary(), style="dim")
console.save_svg(str(HERE / "show.svg"), title="exactspec generate --show")

with tempfile.TemporaryDirectory() as folder:
    page, _ = write_trace(Path(folder) / "trace.html", [result], target.tokenizer.decode,
                          {"model": "smollm2-135m-instruct", "method": "prompt lookup 2:3",
                           "policy": "constant, k = 4", "prompt": PROMPT,
                           "sampling": "temperature 0.7, seed 2"})
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", "--window-size=1200,1500",
                    f"--screenshot={HERE / 'trace-page.png'}", page.as_uri()],
                   check=True, capture_output=True)

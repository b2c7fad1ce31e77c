"""mkdocs hook: serve the committed benchmark plots from benchmarks/results/cpu/ at results/cpu/.

The guides include the result tables with pymdownx.snippets (``--8<--``); images cannot be
included that way, so this adds the plot files to the site as they are in the repository,
with no copy under docs/.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu"


def on_files(files, config):
    for plot in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/cpu/{plot.name}", abs_src_path=str(plot)))
    return files

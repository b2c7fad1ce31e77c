"""``python -m benchmarks``: the repository's name for ``python -m pergrad.bench``, writing to
``benchmarks/results/<device>/`` (the committed results) unless ``--out`` says otherwise.

The harness lives in ``src/pergrad/bench/`` so that it ships with the package.
"""

from pathlib import Path

from pergrad.bench import main

main(prog="python -m benchmarks", results_root=Path(__file__).parent / "results")

"""pergrad's repository benchmarks: the scripts (``python benchmarks/core_overhead.py`` ...) and
their committed results. The main benchmark ships inside the package: ``python -m pergrad.bench``
(``python -m benchmarks`` runs it from the repository root, writing to ``benchmarks/results/``).

(Opacus 1.6 installs a top-level package also named ``benchmarks``; from the repository root this
one comes first on ``sys.path``. The scripts import from ``pergrad.bench``, not from here.)
"""

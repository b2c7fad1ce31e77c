"""pergrad's benchmarks: ``python -m benchmarks [--quick] [--out DIR] [--workloads ...]``.

Run from the repository root. (Opacus 1.6 installs a top-level package also named
``benchmarks``; from the repository root this one comes first on ``sys.path``.)
"""

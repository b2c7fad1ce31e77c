"""pergrad's benchmark, shipped with the package: pergrad against a Python loop, the batch
gradient (the floor) and the peers (torch.func, Opacus, BackPACK, hand-written JAX).

Run it on your own machine::

    python -m pergrad.bench                  # cuda if torch sees a GPU, else cpu; ~10 min
    python -m pergrad.bench --device cuda    # models and data on the GPU
    python -m pergrad.bench --quick          # smoke run, under a minute

It writes ``results.json``, ``results.md`` and plots to ``./pergrad-bench-results/<device>/``
(``--out DIR`` elsewhere) and prints the table. It needs PyTorch; JAX, Opacus, BackPACK and
matplotlib are optional (a peer that is not installed is skipped with a note). The modules:
``workloads`` (the models, in torch and JAX), ``methods`` (what is timed), ``timing``,
``memory`` (peak memory in a fresh process), ``child`` (a function run in a child process),
``machine`` (the machine, for headers), ``report`` (tables, headers and plots), ``cli`` (the
command), ``host_syncs`` (the host syncs and kernels of a piece of code, counted on any device). The scripts in the repository's ``benchmarks/`` use the same ``timing``, ``memory``,
``child``, ``machine`` and ``report``.
"""

from __future__ import annotations

from pathlib import Path


def main(
    argv: list[str] | None = None,
    prog: str = "python -m pergrad.bench",
    results_root: Path | None = None,
) -> None:
    """Run the benchmark command with ``argv`` (default: the command line).

    ``results_root``: where ``<device>/`` goes when ``--out`` is not given (default
    ``./pergrad-bench-results``).
    """
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit(
            "pergrad.bench needs PyTorch, which is not installed: pip install torch "
            "(or pip install 'pergrad[torch,jax,plot]' for the JAX rows and the plots too)"
        ) from None
    from pergrad.bench import cli

    cli.main(argv, prog, results_root or cli.RESULTS_ROOT)

"""What the exact influence solver costs before and after issue 21's change.

Run:  python benchmarks/influence_solvers.py [--hidden 32] [--rounds 3] [--out PATH]

The exact solver materialises the P x P Hessian (P Hessian-vector products), then solves
``(H + d I) x = g`` for the test gradients. Before: an eigendecomposition on every call, so a
damping grid of G values paid G Hessians and G eigendecompositions. After: one damping is a
Cholesky factorisation (with two 30-step power iterations that check it stands clear of
rounding); a grid is one Hessian and one eigendecomposition for all G. Side by side in one run,
medians of ``--rounds`` (interleaved), on an MLP 64-hidden-10 trained with an L2 penalty (1e-3)
by L-BFGS on 500 of scikit-learn's digits in PyTorch (float32), with 20 test gradients.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from pergrad._src.influence import ihvp
from pergrad._src.influence.scores import FlatLoss
from pergrad.bench.report import markdown_table, publish, sentence_header
from pergrad.bench.timing import time_interleaved

GRID = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
L2 = 1e-3


def problem(hidden: int):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:500] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:500])
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(64, hidden, generator=g) / 8,
        "b1": torch.zeros(hidden),
        "w2": torch.randn(hidden, 10, generator=g) / hidden**0.5,
        "b2": torch.zeros(10),
    }

    def logits_of(p, xs):
        return torch.tanh(xs @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def weight_decay(p):
        return 0.5 * L2 * sum((v**2).sum() for v in p.values())

    # trained to a minimum of the L2-regularised loss, where influence functions are derived
    # (and H + the L2 is positive definite)
    leaves = [v.requires_grad_(True) for v in params.values()]
    optimizer = torch.optim.LBFGS(leaves, max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        value = torch.nn.functional.cross_entropy(logits_of(params, x), y) + weight_decay(params)
        value.backward()
        return value

    optimizer.step(closure)
    params = {k: v.detach() for k, v in params.items()}

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy(logits_of(p, xi[None]), yi[None])

    flat = FlatLoss.create("bench", loss, params, None, regularizer=weight_decay)
    return flat, (x, y), flat.grads((x[:20], y[:20]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    flat, batch, rows = problem(args.hidden)
    operator = flat.hessian(batch, 500, 0.0)
    solver = ihvp.Exact()
    size = operator.size
    bk = flat.backend

    def hessian():
        return ihvp.hessian_matrix(operator, solver)

    built = hessian()
    shifted = built + GRID[0] * bk.eye(size, built)

    def eigendecomposition():
        return ihvp.exact_solutions("bench", operator, rows, built, [GRID[0]])

    def cholesky():
        factor = bk.cholesky(shifted)
        assert factor is not None, "the benchmark's system must be positive definite"
        ihvp._well_above_rounding(bk, shifted, factor, "float32")  # noqa: SLF001
        return bk.cholesky_solve(factor, rows)

    agree = float((cholesky() - eigendecomposition()[0]).norm() / cholesky().norm())
    pieces = {"hessian": hessian, "eigh": eigendecomposition, "cholesky": cholesky}
    times = time_interleaved(pieces, args.rounds, warmup=0)
    s = {name: statistics.median(t) for name, t in times.items()}
    g = len(GRID)
    rows_out = [
        ("one damping", s["hessian"] + s["eigh"], s["hessian"] + s["cholesky"]),
        (f"a grid of {g} dampings", g * (s["hessian"] + s["eigh"]), s["hessian"] + s["eigh"]),
    ]
    summary = (
        f"P = {size} parameters, 500 Hessian examples, 20 test gradients, float32. Pieces "
        f"(median of {args.rounds}): Hessian {s['hessian']:.2f} s, eigendecomposition and "
        f"solve {s['eigh']:.2f} s, Cholesky, its check and solve {s['cholesky']:.3f} s. "
        f"Cholesky and eigendecomposition solutions agree to {agree:.1e} (relative)."
    )
    rows = [
        [task, f"{before:.2f}", f"{after:.2f}", f"{before / after:.1f}x"]
        for task, before, after in rows_out
    ]
    header = ["task", "before (s)", "after (s)", "before / after"]
    table = summary + "\n\n" + markdown_table(header, rows)
    publish(table, args.out, lambda: sentence_header("influence_solvers.py", ["torch", "numpy"]))


if __name__ == "__main__":
    main()

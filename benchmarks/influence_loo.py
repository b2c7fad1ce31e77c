"""Do influence functions predict leave-one-out retraining? The validation of Koh & Liang (2017).

Run:  python benchmarks/influence_loo.py [--quick] [--out PATH]

The model: L2-regularised logistic regression on scikit-learn's bundled digits, 3 versus 8
(8x8 images scaled to [0, 1], no download): 250 training and 107 test images, 65 parameters.

1. Train to convergence with Newton's method in numpy float64 (gradient norm < 1e-12).
2. For 50 training points drawn at random, retrain without each one (Newton again, warm-started
   from the full solution) and record the actual change in every test example's loss.
3. Predict those changes with ``pergrad.influence.influence_function`` as ``scores / n_train``
   (the docstring's convention: removing train example i changes test example j's loss by
   about +scores[i, j] / n_train), for each solver and both frameworks.
4. Report the Pearson correlation between predicted and actual changes over all
   50 x 107 (train, test) pairs, the least-squares slope of actual on predicted (1 when the
   scale and sign are right), and how far each solver lands from the exact solve.

The retraining is plain numpy, independent of pergrad. ``--out`` also writes the table with a
machine header.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad.bench import machine
from pergrad.bench.report import markdown_table, publish, titled
from pergrad.bench.timing import timed

L2 = 1e-2  # weight of (L2 / 2) |w|^2 in every example's loss
N_TRAIN, N_LOO, SEED = 250, 50, 0


@dataclass(frozen=True)
class Data:
    x_train: np.ndarray  # (n_train, 64) float64
    y_train: np.ndarray  # (n_train,) in {0, 1}
    x_test: np.ndarray
    y_test: np.ndarray


def load_data(seed: int = SEED) -> Data:
    from sklearn.datasets import load_digits

    digits = load_digits()
    keep = (digits.target == 3) | (digits.target == 8)
    x, y = digits.data[keep] / 16.0, (digits.target[keep] == 8).astype(np.float64)
    order = np.random.default_rng(seed).permutation(len(x))
    train, test = order[:N_TRAIN], order[N_TRAIN:]
    return Data(x[train], y[train], x[test], y[test])


# --------------------------------------------------------------------------------------------
# The numpy reference: the same loss, its exact Hessian, Newton's method.


def example_losses(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each example's loss: binary cross-entropy plus (L2 / 2) |w|^2; theta = (w, b)."""
    logits = x @ theta[:-1] + theta[-1]
    return np.logaddexp(0.0, logits) - y * logits + 0.5 * L2 * theta[:-1] @ theta[:-1]


def gradient_and_hessian(theta: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Gradient and Hessian of the MEAN loss over (x, y)."""
    design = np.hstack([x, np.ones((len(x), 1))])
    prob = 1.0 / (1.0 + np.exp(-(design @ theta)))
    ridge = np.full(len(theta), L2)
    ridge[-1] = 0.0
    gradient = design.T @ (prob - y) / len(x) + ridge * theta
    hessian = (design * (prob * (1 - prob))[:, None]).T @ design / len(x) + np.diag(ridge)
    return gradient, hessian


def fit(x: np.ndarray, y: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """Newton's method on the mean loss, to a gradient norm below 1e-12."""
    theta = np.zeros(x.shape[1] + 1) if start is None else start.copy()
    for _ in range(100):
        gradient, hessian = gradient_and_hessian(theta, x, y)
        if np.linalg.norm(gradient) < 1e-12:
            return theta
        theta = theta - np.linalg.solve(hessian, gradient)
    raise RuntimeError("Newton's method did not converge")


@dataclass(frozen=True)
class LeaveOneOut:
    theta: np.ndarray  # the full-data optimum (65,)
    removed: np.ndarray  # (N_LOO,) indices of the training points left out
    actual: np.ndarray  # (N_LOO, n_test) change in each test loss when each point is removed


def leave_one_out(data: Data, count: int = N_LOO, seed: int = SEED) -> LeaveOneOut:
    theta = fit(data.x_train, data.y_train)
    base = example_losses(theta, data.x_test, data.y_test)
    removed = np.sort(np.random.default_rng(seed).choice(len(data.x_train), count, replace=False))
    actual = []
    for i in removed:
        keep = np.arange(len(data.x_train)) != i
        retrained = fit(data.x_train[keep], data.y_train[keep], start=theta)
        actual.append(example_losses(retrained, data.x_test, data.y_test) - base)
    return LeaveOneOut(theta, removed, np.array(actual))


# --------------------------------------------------------------------------------------------
# pergrad's predictions, in each framework.


def torch_setup(data: Data, theta: np.ndarray) -> tuple[Callable, Any, tuple, tuple]:
    import torch
    import torch.nn.functional as F

    def loss(params, x, y):  # ONE example
        logit = x @ params["w"] + params["b"]
        return F.softplus(logit) - y * logit + 0.5 * L2 * (params["w"] ** 2).sum()

    params = {"w": torch.tensor(theta[:-1]), "b": torch.tensor(theta[-1])}
    train = (torch.tensor(data.x_train), torch.tensor(data.y_train))
    test = (torch.tensor(data.x_test), torch.tensor(data.y_test))
    return loss, params, train, test


def jax_setup(data: Data, theta: np.ndarray) -> tuple[Callable, Any, tuple, tuple]:
    import jax
    import jax.numpy as jnp

    def loss(params, x, y):  # ONE example
        logit = x @ params["w"] + params["b"]
        return jax.nn.softplus(logit) - y * logit + 0.5 * L2 * (params["w"] ** 2).sum()

    params = {"w": jnp.asarray(theta[:-1]), "b": jnp.asarray(theta[-1])}
    train = (jnp.asarray(data.x_train), jnp.asarray(data.y_train))
    test = (jnp.asarray(data.x_test), jnp.asarray(data.y_test))
    return loss, params, train, test


def solvers(quick: bool = False) -> dict[str, Any]:
    from pergrad.influence import CG, LiSSA

    return {
        "exact": "exact",
        "cg": CG(tol=1e-8),
        "lissa": LiSSA(depth=300 if quick else 1000),
        "lissa, minibatch 50": LiSSA(
            depth=300 if quick else 1000, batch_size=50, repeats=1 if quick else 4
        ),
    }


def predicted_scores(framework: str, data: Data, theta: np.ndarray, solver: Any) -> np.ndarray:
    """``scores`` (n_train, n_test) from pergrad in float64, as numpy."""
    from pergrad import influence

    if framework == "jax":
        import jax

        with jax.enable_x64(True):
            loss, params, train, test = jax_setup(data, theta)
            return np.asarray(
                influence.influence_function(loss, params, train, test, solver=solver)
            )
    loss, params, train, test = torch_setup(data, theta)
    return influence.influence_function(loss, params, train, test, solver=solver).numpy()


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


def slope(predicted: np.ndarray, actual: np.ndarray) -> float:
    """Least-squares slope through the origin of actual on predicted."""
    return float(predicted.ravel() @ actual.ravel() / (predicted.ravel() @ predicted.ravel()))


@dataclass(frozen=True)
class Row:
    framework: str
    solver: str
    pearson: float
    slope: float
    diff_from_exact: float  # max |scores - exact scores| / max |exact scores|
    seconds: float


def run(quick: bool = False, frameworks: tuple[str, ...] = ("torch", "jax")) -> list[Row]:
    data = load_data()
    loo = leave_one_out(data)
    rows = []
    for framework in frameworks:
        predicted_scores(framework, data, loo.theta, "exact")  # warm-up: imports, first traces
        exact = None
        for name, solver in solvers(quick).items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # non-convergence shows in the numbers
                scores, seconds = timed(
                    functools.partial(predicted_scores, framework, data, loo.theta, solver)
                )
            exact = scores if exact is None else exact
            predicted = scores[loo.removed] / len(data.x_train)
            rows.append(
                Row(
                    framework,
                    name,
                    pearson(predicted, loo.actual),
                    slope(predicted, loo.actual),
                    float(np.abs(scores - exact).max() / np.abs(exact).max()),
                    seconds,
                )
            )
    return rows


def table(rows: list[Row]) -> str:
    header = ["framework", "solver", "Pearson r (predicted vs actual LOO)", "slope"]
    header += ["max diff from exact", "seconds"]
    cells = [
        [r.framework, r.solver, f"{r.pearson:.4f}", f"{r.slope:.3f}"]
        + [f"{r.diff_from_exact:.1e}", f"{r.seconds:.2f}"]
        for r in rows
    ]
    return markdown_table(header, cells)


def machine_header() -> str:
    return titled(
        "Influence functions against leave-one-out retraining",
        [
            f"machine: {machine.cpu_and_cores()}; load average at the end {machine.load_average()}",
            machine.software("torch", "jax", "numpy", "pergrad"),
            f"date: {machine.timestamp()}",
            f"command: `{machine.command_line()}`",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shallower LiSSA, for a smoke run")
    parser.add_argument("--out", help="also write the markdown table, with a machine header, here")
    args = parser.parse_args()
    data = load_data()
    print(
        f"digits 3 vs 8: {len(data.x_train)} train, {len(data.x_test)} test, 65 parameters, "
        f"L2 = {L2}; {N_LOO} leave-one-out retrainings (numpy Newton, float64)\n"
    )
    text = table(run(quick=args.quick))
    notes = (
        "Pearson r over all (removed train point, test point) pairs of the predicted change "
        "in test loss (scores / n_train) and the actual change after retraining without the "
        "point; slope: least-squares slope of actual on predicted (1 = right scale and sign). "
        "Max diff from exact: max |scores - exact| / max |exact| for the same framework. "
        "Seconds: one call after a warm-up call (JAX compiles the Hessian-vector product of each "
        "call anew). Solvers: CG(tol=1e-8), LiSSA(scale estimated by power iteration); the minibatch "
        "LiSSA draws 50 examples per step and averages 4 repeats."
    )
    publish(text + "\n\n" + notes, args.out, machine_header)


if __name__ == "__main__":
    main()

"""The linear datamodeling score (LDS) of attribution methods on scikit-learn's digits (issue 21).

Run:  python benchmarks/attribution_lds.py [--quick] [--models mlp logreg] [--out DIR]

Ground truth (Park et al. 2023): 64 random half-size subsets of 1000 training digits; a model
retrained on each (full batch, L-BFGS to convergence, L2 penalty 1e-3 / 2 |theta|^2, float64,
the same initialisation), evaluated on 200 target digits by the margin ``logit_y - logsumexp(other
logits)``. A second regime, ``mlp-sgd``: the MLP trained as people train it (minibatch SGD with
momentum for 10 epochs, no convergence), the ground truth averaged over 3 training seeds per
subset, the ensemble's models from different seeds. Cached in ``benchmarks/results/lds_ground_truth_<model>.npz`` (recomputed when its
settings change).

Every method scores the full-set model(s) (float32, PyTorch): pergrad's ``grad_dot``,
``grad_cosine``, ``influence_function`` (CG, with the L2 penalty as ``regularizer``, the target
``-margin``), its exact solver for the logistic regression, its K-FAC and EK-FAC curvature
(``nn.Linear`` copies of the models, the L2 penalty folded into the damping), ``trak`` with 1
and 5 models, and
``traker`` (the TRAK authors' package, CPU ``BasicProjector``) with the same models and
projection dimension. A method's damping is chosen on the even-numbered subsets and its LDS
reported on the odd-numbered ones. Times are wall seconds for one damping (a grid's extra
values are not counted; for K-FAC / EK-FAC the whole grid, which shares one factorisation, and
their damping column is added to the L2 penalty), on this machine, side by side in one run.
``--only K-FAC EK-FAC`` runs a subset of the methods (a partial run: do not commit its table).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import pergrad  # noqa: E402
from pergrad import influence, per_example_grads  # noqa: E402
from pergrad.bench.machine import cpu_model, load_average  # noqa: E402

N_TRAIN, N_TARGET, N_SUBSETS, ALPHA, L2, HIDDEN, ENSEMBLE, PROJ = (
    1000,
    200,
    64,
    0.5,
    1e-3,
    128,
    5,
    2048,
)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
IF_GRID = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]
TRAK_GRID = [0.0, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0]


# --- data and models --------------------------------------------------------------------------


def load_data(n_train: int, n_target: int) -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x, y = digits.data[order] / 16.0, digits.target[order]
    return (
        x[:n_train],
        y[:n_train],
        x[n_train : n_train + n_target],
        y[n_train : n_train + n_target],
    )


SGD_EPOCHS, SGD_BATCH, SGD_LR, SGD_SEEDS = 10, 32, 0.1, 3


def init(kind: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "logreg":
        return {
            "w": torch.zeros(64, 10, dtype=torch.float64),
            "b": torch.zeros(10, dtype=torch.float64),
        }
    return {
        "w1": torch.randn(64, HIDDEN, generator=g, dtype=torch.float64) / 8,
        "b1": torch.zeros(HIDDEN, dtype=torch.float64),
        "w2": torch.randn(HIDDEN, 10, generator=g, dtype=torch.float64) / HIDDEN**0.5,
        "b2": torch.zeros(10, dtype=torch.float64),
    }


def logits_of(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if "w" in p:
        return x @ p["w"] + p["b"]
    return torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def weight_decay(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return 0.5 * L2 * sum((v**2).sum() for v in p.values())


def train(kind: str, x: np.ndarray, y: np.ndarray, seed: int) -> dict[str, torch.Tensor]:
    """Full batch, L-BFGS to convergence on the L2-penalised mean cross-entropy, float64; for
    ``"mlp-sgd"``, minibatch SGD with momentum for a few epochs, as people train (no
    convergence; the seed also orders the minibatches)."""
    if kind == "mlp-sgd":
        return train_sgd(x, y, seed)
    params = {k: v.requires_grad_(True) for k, v in init(kind, seed).items()}
    xt, yt = torch.tensor(x), torch.tensor(y)
    optimizer = torch.optim.LBFGS(
        list(params.values()),
        max_iter=3000,
        tolerance_grad=1e-9,
        tolerance_change=1e-14,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = F.cross_entropy(logits_of(params, xt), yt) + weight_decay(params)
        value.backward()
        return value

    optimizer.step(closure)
    return {k: v.detach() for k, v in params.items()}


def train_sgd(x: np.ndarray, y: np.ndarray, seed: int) -> dict[str, torch.Tensor]:
    params = {k: v.requires_grad_(True) for k, v in init("mlp", seed).items()}
    xt, yt = torch.tensor(x), torch.tensor(y)
    optimizer = torch.optim.SGD(list(params.values()), lr=SGD_LR, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + seed)
    for _ in range(SGD_EPOCHS):
        order = torch.randperm(len(x), generator=g)
        for start in range(0, len(x), SGD_BATCH):
            rows = order[start : start + SGD_BATCH]
            optimizer.zero_grad()
            value = F.cross_entropy(logits_of(params, xt[rows]), yt[rows]) + weight_decay(params)
            value.backward()
            optimizer.step()
    return {k: v.detach() for k, v in params.items()}


def margins(p: dict[str, torch.Tensor], x: np.ndarray, y: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        z = logits_of(p, torch.tensor(x))
        correct = z.gather(1, torch.tensor(y)[:, None])[:, 0]
        others = z.scatter(1, torch.tensor(y)[:, None], -torch.inf).logsumexp(1)
        return (correct - others).numpy()


def ground_truth(
    kind: str, data: tuple[np.ndarray, ...], quick: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``(masks (m, n_train), outputs (m, n_target))``, cached by their settings."""
    x, y, x_target, y_target = data
    subsets = 8 if quick else N_SUBSETS
    seeds = SGD_SEEDS if kind == "mlp-sgd" else 1  # SGD's noise averaged out, as TRAK does
    regime = (
        f"sgd-{SGD_EPOCHS}-{SGD_BATCH}-{SGD_LR}-{seeds}" if kind == "mlp-sgd" else "lbfgs-f64-v1"
    )
    settings = json.dumps([kind, len(x), len(x_target), subsets, ALPHA, L2, HIDDEN, regime])
    key = hashlib.sha256(settings.encode()).hexdigest()[:12]
    path = os.path.join(RESULTS, f"lds_ground_truth_{kind}.npz")
    if os.path.exists(path):
        cached = np.load(path)
        if str(cached["key"]) == key:
            return cached["masks"], cached["outputs"]
    masks = influence.lds_subsets(len(x), subsets, fraction=ALPHA, seed=0)
    start = time.perf_counter()
    outputs = np.stack(
        [
            np.mean(
                [
                    margins(train(kind, x[m], y[m], seed=s), x_target, y_target)
                    for s in range(seeds)
                ],
                axis=0,
            )
            for m in masks
        ]
    )
    print(
        f"  ground truth for {kind}: {subsets} retrainings in {time.perf_counter() - start:.0f} s"
    )
    if not quick:
        np.savez_compressed(path, key=key, masks=masks, outputs=outputs)
    return masks, outputs


# --- pergrad's per-example functions (one example; torch.func-friendly) ----------------------


def ce_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits_of(p, x), 0).gather(0, y.reshape(1))[0]


def margin(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = logits_of(p, x)
    others = torch.where(torch.arange(10) == y, -torch.inf, z)
    return z.gather(0, y.reshape(1))[0] - torch.logsumexp(others, 0)


def neg_margin(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -margin(p, x, y)


def one_minus_p(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 1 - torch.softmax(logits_of(p, x), 0).gather(0, y.reshape(1))[0]


# --- methods: each returns (scores for each grid value (g, n_train, n_target), seconds for one)


def run_grad(kind: str, models: list, arrays: tuple, cosine: bool) -> tuple[np.ndarray, float]:
    x, y, xt, yt = arrays
    start = time.perf_counter()
    train_grads = per_example_grads(ce_loss)(models[0], x, y)
    target_grads = per_example_grads(neg_margin)(models[0], xt, yt)
    method = influence.grad_cosine if cosine else influence.grad_dot
    scores = method(train_grads, target_grads)
    return scores.numpy()[None], time.perf_counter() - start


def run_influence(models: list, arrays: tuple, solver: Any) -> tuple[np.ndarray, float]:
    x, y, xt, yt = arrays
    grid = []
    seconds = 0.0
    for damping in IF_GRID:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", influence.InfluenceWarning)
            scores = influence.influence_function(
                ce_loss,
                models[0],
                (x, y),
                (xt, yt),
                damping=damping,
                solver=solver,
                target_fn=neg_margin,
                regularizer=weight_decay,
            )
        seconds = time.perf_counter() - start if damping == IF_GRID[0] else seconds
        grid.append(scores.numpy())
    return np.stack(grid), seconds


def as_module(p: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The same model as ``nn.Linear`` layers (weights transposed), so that the capture engine
    records their inputs and output gradients for K-FAC."""
    if "w" in p:
        model = torch.nn.Sequential(torch.nn.Linear(64, 10))
        pairs = [(model[0], "w", "b")]
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(64, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 10)
        )
        pairs = [(model[0], "w1", "b1"), (model[2], "w2", "b2")]
    model = model.to(p[pairs[0][1]].dtype)
    with torch.no_grad():
        for layer, weight, bias in pairs:
            layer.weight.copy_(p[weight].T)
            layer.bias.copy_(p[bias])
    return model


def batch_neg_margin(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``-margin`` of one example given with a batch axis of one, for ``module_loss``."""
    others = torch.where(torch.arange(10) == y[0], -torch.inf, z[0])
    return torch.logsumexp(others, 0) - z[0].gather(0, y)[0]


def run_kfac(models: list, arrays: tuple, solver: str, draws: int = 0) -> tuple[np.ndarray, float]:
    """Influence with the K-FAC / EK-FAC curvature: the L2 penalty's Hessian ``L2 I`` joins the
    damping (the factored curvature takes no regularizer), one factorisation for the grid.
    ``draws > 0``: the true Fisher, from that many labels per input sampled from the model
    (``hessian_batch``); else the empirical Fisher of the training labels."""
    x, y, xt, yt = arrays
    model = as_module(models[0])
    loss = pergrad.module_loss(model, F.cross_entropy)
    target = pergrad.module_loss(model, batch_neg_margin)
    start = time.perf_counter()
    hessian_batch = None
    if draws:
        with torch.no_grad():
            probabilities = torch.softmax(model(x), 1)
        generator = torch.Generator().manual_seed(0)
        labels = torch.multinomial(probabilities, draws, replacement=True, generator=generator)
        hessian_batch = (x.repeat(draws, 1), labels.T.reshape(-1))
    scores = influence.influence_function(
        loss,
        loss.params(),
        (x, y),
        (xt, yt),
        damping=[L2 + d for d in IF_GRID],
        solver=solver,
        target_fn=target,
        hessian_batch=hessian_batch,
    )
    return scores.numpy(), time.perf_counter() - start


def run_trak(models: list, arrays: tuple) -> tuple[np.ndarray, float]:
    x, y, xt, yt = arrays
    start = time.perf_counter()
    scores = influence.trak(
        margin, models, (x, y), (xt, yt), weight_fn=one_minus_p, proj_dim=PROJ, damping=TRAK_GRID
    )
    return scores.numpy(), time.perf_counter() - start


class Net(torch.nn.Module):
    """The same model as an nn.Module, for traker."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(dict(self.p), x)


def run_traker(models: list, arrays: tuple, grid: list[float]) -> tuple[np.ndarray, float]:
    """traker with its documented calls for the first ``lambda_reg``; the other values of the
    grid re-finalise the stored features with the new ``lambda_reg`` (through traker's score
    computer and saver, so featurisation is not repeated and only the first value is timed)."""
    from trak import TRAKer

    logging.getLogger("TRAK").setLevel(logging.ERROR)
    x, y, xt, yt = arrays
    results = []
    with tempfile.TemporaryDirectory() as save_dir:
        start = time.perf_counter()
        traker = TRAKer(
            model=Net(models[0]),
            task="image_classification",
            train_set_size=len(x),
            save_dir=save_dir,
            device="cpu",
            proj_dim=PROJ,
            use_half_precision=False,
            lambda_reg=grid[0],
            logging_level=logging.ERROR,
        )
        for model_id, params in enumerate(models):
            traker.load_checkpoint(Net(params).state_dict(), model_id=model_id)
            for s in range(0, len(x), 250):
                chunk = (x[s : s + 250], y[s : s + 250])
                traker.featurize(batch=chunk, num_samples=len(chunk[0]))
        traker.finalize_features()
        for model_id, params in enumerate(models):
            traker.start_scoring_checkpoint(
                exp_name="targets",
                checkpoint=Net(params).state_dict(),
                model_id=model_id,
                num_targets=len(xt),
            )
            traker.score(batch=(xt, yt), num_samples=len(xt))
        results.append(np.array(traker.finalize_scores(exp_name="targets")))
        seconds = time.perf_counter() - start
        for lam in grid[1:]:
            traker.score_computer.lambda_reg = lam
            for model_id in range(len(models)):
                traker.saver.model_ids[model_id]["is_finalized"] = 0
            traker.projector.proj_matrix = None  # finalize_features frees it, once only
            traker.finalize_features()
            results.append(np.array(traker.finalize_scores(exp_name="targets")))
    return np.stack(results), seconds


# --- the run ----------------------------------------------------------------------------------


def held_out_lds(scores: np.ndarray, masks: np.ndarray, outputs: np.ndarray) -> tuple[float, int]:
    """Choose the grid value on the even subsets, report the LDS on the odd ones."""
    tune = [influence.lds(s, masks[0::2], outputs[0::2]) for s in scores]
    best = int(np.nanargmax(tune))
    return influence.lds(scores[best], masks[1::2], outputs[1::2]), best


def evaluate(
    kind: str, quick: bool, with_traker: bool, only: list[str] | None = None
) -> list[tuple[str, str, float, float]]:
    data = load_data(200 if quick else N_TRAIN, 50 if quick else N_TARGET)
    masks, outputs = ground_truth(kind, data, quick)
    ensemble = 2 if quick else ENSEMBLE
    models: list[dict[str, torch.Tensor]] = []  # trained below, once the methods are known
    arrays = (
        torch.tensor(data[0], dtype=torch.float32),
        torch.tensor(data[1]),
        torch.tensor(data[2], dtype=torch.float32),
        torch.tensor(data[3]),
    )
    methods: dict[str, Callable[[], tuple[np.ndarray, float]]] = {
        "pergrad grad_dot": lambda: run_grad(kind, models, arrays, cosine=False),
        "pergrad grad_cosine": lambda: run_grad(kind, models, arrays, cosine=True),
        "pergrad influence_function (CG, tol 1e-2)": lambda: run_influence(
            models, arrays, influence.CG(tol=1e-2)
        ),
    }
    if kind == "logreg":
        methods["pergrad influence_function (exact)"] = lambda: run_influence(
            models, arrays, "exact"
        )
    methods["pergrad influence_function (K-FAC)"] = lambda: run_kfac(models, arrays, "kfac")
    methods["pergrad influence_function (EK-FAC)"] = lambda: run_kfac(models, arrays, "ekfac")
    methods["pergrad influence_function (EK-FAC, sampled labels)"] = lambda: run_kfac(
        models, arrays, "ekfac", draws=10
    )
    methods["pergrad trak, 1 model"] = lambda: run_trak(models[:1], arrays)
    methods[f"pergrad trak, {ensemble} models"] = lambda: run_trak(models, arrays)
    if with_traker:
        methods["traker TRAK, 1 model"] = lambda: run_traker(models[:1], arrays, TRAK_GRID)
        methods[f"traker TRAK, {ensemble} models"] = lambda: run_traker(models, arrays, TRAK_GRID)
    if only:
        methods = {n: m for n, m in methods.items() if any(word in n for word in only)}
    needed = ensemble if any(f"{ensemble} models" in name for name in methods) else 1
    start = time.perf_counter()
    full = [train(kind, data[0], data[1], seed=s) for s in range(needed)]
    print(f"  {needed} full-set model(s) trained in {time.perf_counter() - start:.0f} s")
    models.extend({k: v.float() for k, v in p.items()} for p in full)
    grids = {"influence": IF_GRID, "trak": TRAK_GRID, "TRAK": TRAK_GRID}
    rows = []
    for name, method in methods.items():
        scores, seconds = method()
        value, best = held_out_lds(scores, masks, outputs)
        grid = next((g for word, g in grids.items() if word in name), None)
        chosen = f"damping {grid[best]:g}" if grid is not None and len(scores) > 1 else "-"
        rows.append((name, chosen, value, seconds))
        print(f"  {name:45s} LDS {value:.3f}  ({chosen}; {seconds:.1f} s)")
    random_scores = np.random.default_rng(0).normal(size=(len(data[0]), len(data[2])))
    rows.append(
        ("random scores", "-", influence.lds(random_scores, masks[1::2], outputs[1::2]), 0.0)
    )
    return rows


TITLES = {
    "logreg": "logistic regression (650 parameters), trained to convergence",
    "mlp": "MLP 64-128-10, tanh (9610 parameters), trained to convergence",
    "mlp-sgd": (
        f"MLP 64-128-10, tanh, trained as people train: SGD with momentum, {SGD_EPOCHS} epochs, "
        f"batch {SGD_BATCH} (ground truth averaged over {SGD_SEEDS} training seeds per subset)"
    ),
}


def plot(all_rows: dict[str, list], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(all_rows), figsize=(6 * len(all_rows), 4.5), squeeze=False)
    for ax, (kind, rows) in zip(axes[0], all_rows.items()):
        for name, _, value, seconds in rows:
            if seconds > 0:
                ax.scatter(seconds, value, color="tab:red" if "traker" in name else "tab:blue")
                ax.annotate(name.replace("pergrad ", ""), (seconds, value), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("wall seconds (one damping)")
        ax.set_ylabel("LDS (held-out subsets)")
        ax.set_title(f"digits, {kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds)")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["logreg", "mlp", "mlp-sgd"],
        choices=["logreg", "mlp", "mlp-sgd"],
    )
    parser.add_argument("--no-traker", action="store_true", help="skip the traker peer")
    parser.add_argument(
        "--only",
        nargs="+",
        help="run only the methods whose name contains one of these words (e.g. K-FAC)",
    )
    parser.add_argument("--out", help="write attribution_lds.md and .png into this directory")
    args = parser.parse_args()
    torch.manual_seed(0)
    try:
        import trak  # noqa: F401

        with_traker = not args.no_traker
    except ImportError:
        print("traker is not installed (pip install traker): the peer is skipped")
        with_traker = False
    all_rows = {}
    for kind in args.models:
        print(f"{kind}:")
        all_rows[kind] = evaluate(kind, args.quick, with_traker, args.only)
    lines = []
    for kind, rows in all_rows.items():
        lines += [
            f"### {TITLES[kind]}",
            "",
            "| method | chosen on even subsets | LDS (odd subsets) | seconds |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| {n} | {c} | {v:.3f} | {s:.1f} |" for n, c, v, s in rows]
        lines.append("")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        header = (
            f"# attribution_lds.py\n\nMachine: {cpu_model()}, {os.cpu_count()} cores, "
            f"{platform.system()}, torch {torch.__version__}, load average {load_average()}, "
            f"{datetime.date.today().isoformat()}. {N_TRAIN} training digits, {N_TARGET} "
            f"targets, {N_SUBSETS} half-size subsets (32 to choose the damping, 32 to score), "
            f"projection dimension {PROJ}, L2 {L2}.\n\n"
        )
        with open(os.path.join(args.out, "attribution_lds.md"), "w") as f:
            f.write(header + table)
        plot(all_rows, os.path.join(args.out, "attribution_lds.png"))


if __name__ == "__main__":
    main()

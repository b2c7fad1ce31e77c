"""The linear datamodeling score (LDS) of attribution methods on scikit-learn's digits (issue 21).

Run:  python benchmarks/attribution_lds.py [--quick] [--models mlp logreg] [--out DIR]
      python benchmarks/attribution_lds.py --metagradient [--quick] --out DIR
      python benchmarks/attribution_lds.py --trak-seeds 5 --out DIR

Ground truth (Park et al. 2023): 64 random half-size subsets of 1000 training digits; a model
retrained on each (full batch, L-BFGS to convergence, L2 penalty 1e-3 / 2 |theta|^2, float64,
the same initialisation), evaluated on 200 target digits by the margin ``logit_y - logsumexp(other
logits)``. A second regime, ``mlp-sgd``: the MLP trained as people train it (minibatch SGD with
momentum for 10 epochs, no convergence), the ground truth averaged over 3 training seeds per
subset, the ensemble's models from different seeds. Cached in ``benchmarks/results/lds_ground_truth_<model>.npz`` (recomputed when its
settings change).

Every method scores the full-set model(s) (float32, PyTorch unless said): pergrad's ``grad_dot``
(also of factored projections), ``grad_cosine``, ``influence_function`` with CG (default
options), LiSSA (minibatches), the exact solver (logistic regression), K-FAC and EK-FAC
(``nn.Linear`` copies of the models, the L2 penalty folded into the damping; the others take it
as ``regularizer``; the target ``-margin``), ``trak`` with 1, 5 and 10 models (dense projection;
also through the JAX backend on the same weights, and with the factored projection), and
``traker`` (the TRAK authors' package, CPU ``BasicProjector``) with the same models and
projection dimension. A method's damping is chosen on the even-numbered subsets, from a grid of
its own that reaches below its choice (a choice at a grid's edge is marked), and its LDS
reported on the odd-numbered ones. Times are wall seconds on this machine, side by side in one
run: for CG and LiSSA the chosen damping's solve, for the others the whole grid (which shares
one factorisation or one set of features). On the MLP, CG is also run at several tolerances
(``--cg-tolerances``) at the damping it chose. The load average is printed at the start and
the end (a shared machine makes times noisy). ``--only K-FAC EK-FAC`` runs a subset of the
methods (a partial run: do not commit its table).

``--metagradient`` adds pergrad's metagradient (``influence.metagradient`` through the mlp-sgd
run of seed 0, and the mean over the runs of seeds 0-4, the runs replayed exactly in float64)
to the mlp-sgd table, and scores every row in a second regime beside the seed-averaged one:
the same-seed ground truth of seed 0's run (64 subsets per fraction, 1%, 10% and 50% dropped,
retrained with the same initialisation and order and the dropped examples' weights 0, through
``metagradient_lds.py``'s vectorised retraining), each method's damping chosen on that
truth's even subsets; with seconds per target. It writes ``attribution_lds_metagradient.md``
(``--models`` then defaults to mlp-sgd; its header gives the command, so a run of some rows
with ``--only`` says which), and the default run stays as it was.

``--trak-seeds N`` runs only the TRAK comparison (pergrad on both frameworks against traker, 1,
5 and 10 models, every regime), repeated over N projection seeds on the same models, and
reports each row's mean and spread and its paired difference to traker's LDS (same models,
same seed index), in ``attribution_lds_trak_seeds.md``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import pergrad  # noqa: E402
from pergrad import influence, per_example_grads  # noqa: E402
from pergrad.bench.machine import command_line, load_average  # noqa: E402
from pergrad.bench.report import machine_sentence, markdown_table, write_text  # noqa: E402
from pergrad.bench.timing import timed  # noqa: E402

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
# Damping grids, per method, each reaching below the value it chooses (issue 21: the former
# grid's smallest value, 1e-4, was chosen by K-FAC, EK-FAC and the exact solver).
CG_GRID = [1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]  # each value costs a solve
EXACT_GRID = [1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]  # one eigendecomposition
LISSA_GRID = [1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]
KFAC_GRID = [0.0, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]  # added to L2, shared
TRAK_GRID = [0.0, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0, 1e4]
# LiSSA as one runs it on a thousand examples: minibatches of 50, 1000 steps (about 50 passes
# over the data, as many Hessian-vector products as ~50 CG iterations).
LISSA = {"depth": 1000, "batch_size": 50}
# Factored (LoGra) projection: each weight's k_in x k_out block; biases projected to OTHER_DIM.
FACTORED_DIMS, OTHER_DIM = (32, 32), 256
CG_TOLERANCES = [1e-6, 1e-4, 1e-3, 1e-2, 1e-1]
# --trak-seeds: projection seed index s is pergrad's seed TRAK_SEED_STRIDE * s (its model m then
# projects with that + m, so no two indices share a matrix) and traker's projector_seed s
# (traker offsets its per-model and per-block seeds by 1e5 and 1e3 itself); index 0 is the
# full run's.
TRAK_SEED_STRIDE = 100


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


SGD_EPOCHS, SGD_BATCH, SGD_LR, SGD_MOMENTUM, SGD_SEEDS = 10, 32, 0.1, 0.9, 3


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
    optimizer = torch.optim.SGD(list(params.values()), lr=SGD_LR, momentum=SGD_MOMENTUM)
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


def margin_values(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``logit_y - logsumexp(other logits)`` of logits ``z`` ``(n, 10)``: ``(n,)``."""
    correct = z.gather(1, y[:, None])[:, 0]
    others = z.scatter(1, y[:, None], -torch.inf).logsumexp(1)
    return correct - others


def margins(p: dict[str, torch.Tensor], x: np.ndarray, y: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return margin_values(logits_of(p, torch.tensor(x)), torch.tensor(y)).numpy()


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

    def retrained_margins() -> np.ndarray:
        return np.stack(
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

    outputs, seconds = timed(retrained_margins)
    print(f"  ground truth for {kind}: {subsets} retrainings in {seconds:.0f} s")
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
    method = influence.grad_cosine if cosine else influence.grad_dot

    def scores() -> np.ndarray:
        train_grads = per_example_grads(ce_loss)(models[0], x, y)
        target_grads = per_example_grads(neg_margin)(models[0], xt, yt)
        return method(train_grads, target_grads).numpy()[None]

    return timed(scores)


def run_influence(
    models: list, arrays: tuple, solver: Any, grid: list[float]
) -> tuple[np.ndarray, list[float]]:
    """Influence with the Hessian-vector-product solvers, one solve per damping of ``grid``
    (each timed)."""
    x, y, xt, yt = arrays

    def solve(damping: float) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", influence.InfluenceWarning)
            try:
                return influence.influence_function(
                    ce_loss,
                    models[0],
                    (x, y),
                    (xt, yt),
                    damping=damping,
                    solver=solver,
                    target_fn=neg_margin,
                    regularizer=weight_decay,
                ).numpy()
            except ValueError as error:  # LiSSA diverging at a small damping: not a candidate
                print(f"    damping {damping:g}: {str(error)[:100]}...")
                return np.full((len(x), len(xt)), np.nan)

    scores, seconds = zip(*(timed(functools.partial(solve, damping)) for damping in grid))
    return np.stack(scores), list(seconds)


def run_exact(models: list, arrays: tuple) -> tuple[np.ndarray, float]:
    """The exact solver for the whole grid at once (one Hessian, one eigendecomposition)."""
    x, y, xt, yt = arrays
    return timed(
        lambda: influence.influence_function(
            ce_loss,
            models[0],
            (x, y),
            (xt, yt),
            damping=EXACT_GRID,
            solver="exact",
            target_fn=neg_margin,
            regularizer=weight_decay,
        ).numpy()
    )


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

    def scores() -> np.ndarray:
        hessian_batch = None
        if draws:
            with torch.no_grad():
                probabilities = torch.softmax(model(x), 1)
            generator = torch.Generator().manual_seed(0)
            labels = torch.multinomial(probabilities, draws, replacement=True, generator=generator)
            hessian_batch = (x.repeat(draws, 1), labels.T.reshape(-1))
        return influence.influence_function(
            loss,
            loss.params(),
            (x, y),
            (xt, yt),
            damping=[L2 + d for d in KFAC_GRID],
            solver=solver,
            target_fn=target,
            hessian_batch=hessian_batch,
        ).numpy()

    return timed(scores)


def run_trak(
    models: list,
    arrays: tuple,
    seed: int = 0,
    grid: list[float] = TRAK_GRID,
    kind: str = "rademacher",
) -> tuple[np.ndarray, float]:
    """pergrad's TRAK, model ``m`` projected with seed ``seed + m``, on ``grid``."""
    return timed_trak(margin, one_minus_p, models, arrays, damping=grid, seed=seed, kind=kind)


def timed_trak(
    margin_fn: Callable, weight_fn: Callable, checkpoints: list, arrays: tuple, **options: Any
) -> tuple[np.ndarray, float]:
    """``influence.trak`` of ``margin_fn`` weighted by ``weight_fn``, projected to ``PROJ``
    dimensions: the scores as numpy (which waits for JAX's asynchronous dispatch), and the
    seconds they took."""
    x, y, xt, yt = arrays
    return timed(
        lambda: np.asarray(
            influence.trak(
                margin_fn,
                checkpoints,
                (x, y),
                (xt, yt),
                weight_fn=weight_fn,
                proj_dim=PROJ,
                **options,
            )
        )
    )


def batch_margin(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -batch_neg_margin(z, y)


def batch_one_minus_p(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 1 - torch.softmax(z[0], 0).gather(0, y)[0]


def module_form(models: list) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """One ``nn.Linear`` model (the template the losses run through) and each model's
    parameters under its names: the factored projection reads ``nn.Linear`` records."""
    template = as_module(models[0])
    checkpoints = [
        {name: value.detach() for name, value in as_module(p).named_parameters()} for p in models
    ]
    return template, checkpoints


def run_trak_factored(models: list, arrays: tuple) -> tuple[np.ndarray, float]:
    """TRAK with the factored projection: each weight's ``FACTORED_DIMS`` block from its
    layer's input and output gradient, the biases projected to ``OTHER_DIM``."""
    x, y, xt, yt = arrays

    def scores() -> np.ndarray:
        template, checkpoints = module_form(models)
        return influence.trak(
            pergrad.module_loss(template, batch_margin),
            checkpoints,
            (x, y),
            (xt, yt),
            weight_fn=pergrad.module_loss(template, batch_one_minus_p),
            proj_dim=OTHER_DIM,
            projection="factored",
            factored_dims=FACTORED_DIMS,
            damping=TRAK_GRID,
        ).numpy()

    return timed(scores)


def run_grad_dot_factored(models: list, arrays: tuple) -> tuple[np.ndarray, float]:
    """``grad_dot`` of factored projections of the training losses' and targets' gradients."""
    x, y, xt, yt = arrays
    options = {"k_in": FACTORED_DIMS[0], "k_out": FACTORED_DIMS[1], "other_dim": OTHER_DIM}

    def scores() -> np.ndarray:
        template, checkpoints = module_form(models[:1])
        train = influence.project_factored(
            pergrad.module_loss(template, F.cross_entropy), checkpoints[0], (x, y), **options
        )
        target = influence.project_factored(
            pergrad.module_loss(template, batch_neg_margin), checkpoints[0], (xt, yt), **options
        )
        return influence.grad_dot(train, target).numpy()[None]

    return timed(scores)


def run_trak_jax(models: list, arrays: tuple, seed: int = 0) -> tuple[np.ndarray, float]:
    """The same TRAK through the JAX backend: the torch-trained weights as JAX arrays, the
    model written in ``jax.numpy`` (times include JAX's tracing)."""
    import jax
    import jax.numpy as jnp

    def logits(p: dict[str, Any], x: Any) -> Any:
        if "w" in p:
            return x @ p["w"] + p["b"]
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def margin_jax(p: dict[str, Any], x: Any, y: Any) -> Any:
        z = logits(p, x)
        return z[y] - jax.nn.logsumexp(jnp.where(jnp.arange(10) == y, -jnp.inf, z))

    def one_minus_p_jax(p: dict[str, Any], x: Any, y: Any) -> Any:
        return 1 - jax.nn.softmax(logits(p, x))[y]

    checkpoints = [{k: jnp.asarray(v.numpy()) for k, v in p.items()} for p in models]
    jax_arrays = tuple(jnp.asarray(a.numpy()) for a in arrays)
    return timed_trak(
        margin_jax, one_minus_p_jax, checkpoints, jax_arrays, damping=TRAK_GRID, seed=seed
    )


class Net(torch.nn.Module):
    """The same model as an nn.Module, for traker."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(dict(self.p), x)


def run_traker(
    models: list, arrays: tuple, grid: list[float], seed: int = 0
) -> tuple[np.ndarray, float]:
    """traker with its documented calls for the first ``lambda_reg``; the other values of the
    grid re-finalise the stored features with the new ``lambda_reg`` (through traker's score
    computer and saver, so featurisation is not repeated and only the first value is timed).
    ``seed`` is traker's ``projector_seed``."""
    logging.getLogger("TRAK").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as save_dir:
        first = functools.partial(traker_scores, models, arrays, grid[0], seed, save_dir)
        (traker, scores), seconds = timed(first)
        results = [scores]
        for lam in grid[1:]:
            traker.score_computer.lambda_reg = lam
            for model_id in range(len(models)):
                traker.saver.model_ids[model_id]["is_finalized"] = 0
            traker.projector.proj_matrix = None  # finalize_features frees it, once only
            traker.finalize_features()
            results.append(np.array(traker.finalize_scores(exp_name="targets")))
    return np.stack(results), seconds


def traker_scores(
    models: list, arrays: tuple, lambda_reg: float, seed: int, save_dir: str
) -> tuple[Any, np.ndarray]:
    """A ``TRAKer`` that has featurised the training set with every model, and its scores of
    the targets (``lambda_reg``, projector seed ``seed``)."""
    from trak import TRAKer

    x, y, xt, yt = arrays
    traker = TRAKer(
        model=Net(models[0]),
        task="image_classification",
        train_set_size=len(x),
        save_dir=save_dir,
        device="cpu",
        proj_dim=PROJ,
        use_half_precision=False,
        projector_seed=seed,
        lambda_reg=lambda_reg,
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
    return traker, np.array(traker.finalize_scores(exp_name="targets"))


# --- metagradients of the mlp-sgd run (--metagradient) ----------------------------------------


def metagradient_module() -> Any:
    """``benchmarks/metagradient_lds.py`` (its vectorised retraining and same-seed ground
    truth), imported from this script's folder."""
    folder = os.path.dirname(os.path.abspath(__file__))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import metagradient_lds

    return metagradient_lds


def stacked_logits(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``logits_of`` the MLP for a stack of ``m`` parameter sets (each leaf ``(m, *shape)``):
    ``(m, n, 10)``, for ``metagradient_lds.retrained``."""
    hidden = torch.tanh(torch.einsum("ni,mih->mnh", x, params["w1"]) + params["b1"][:, None])
    return torch.einsum("mnh,mho->mno", hidden, params["w2"]) + params["b2"][:, None]


def sgd_run(data: tuple[np.ndarray, ...], seed: int) -> dict[str, Any]:
    """``train_sgd``'s run of ``seed`` (its initialisation and minibatch order, float64) in
    ``metagradient_lds``'s form: what ``influence.metagradient`` and ``influence.replay`` take
    (``run_of``), the target margins, and the model for ``retrained``."""
    x, y, x_target, y_target = (torch.tensor(a) for a in data)
    order = torch.Generator().manual_seed(1000 + seed)  # train_sgd's order
    epochs = [torch.randperm(len(x), generator=order) for _ in range(SGD_EPOCHS)]
    batches = [e[s : s + SGD_BATCH] for e in epochs for s in range(0, len(x), SGD_BATCH)]

    def target(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return margin_values(logits_of(params, x_target), y_target)

    return {
        "loss": ce_loss,
        "params0": init("mlp", seed),
        "data": (x, y),
        "batches": batches,
        "optimizer": influence.sgd(SGD_LR, momentum=SGD_MOMENTUM, weight_decay=L2),
        "target": target,
        "targets": (x_target, y_target),
        "stacked_logits": stacked_logits,
    }


def metagradient_label(count: int) -> str:
    runs = "1 run (seed 0)" if count == 1 else f"mean of {count} runs (seeds 0-{count - 1})"
    return f"pergrad metagradient, {runs}"


def metagradient_ensemble(
    data: tuple[np.ndarray, ...], counts: tuple[int, ...]
) -> list[tuple[str, np.ndarray, float]]:
    """Per count of ``counts`` (increasing): its row's label, the mean of the metagradients of
    the ``sgd_run``s of seeds ``0 .. count - 1`` (``(n_train, n_target)``), and the seconds of
    those runs' metagradient calls (each run computed once, shared by the counts). First checks
    that ``influence.replay`` of seed 0 is ``train_sgd``'s model."""
    run_of = metagradient_module().run_of
    first = sgd_run(data, 0)
    final = influence.replay(*run_of(first))
    for name, value in train_sgd(data[0], data[1], 0).items():
        torch.testing.assert_close(final[name], value, rtol=1e-7, atol=1e-9)
    runs: list[torch.Tensor] = []
    seconds, rows = 0.0, []
    for count in counts:
        while len(runs) < count:
            setup = first if not runs else sgd_run(data, len(runs))
            call = functools.partial(influence.metagradient, *run_of(setup), setup["target"])
            scores, spent = timed(call)
            runs.append(scores)
            seconds += spent
        mean = torch.stack(runs[:count]).mean(0).numpy()
        rows.append((metagradient_label(count), mean, seconds))
    return rows


def metagradient_methods(
    data: tuple[np.ndarray, ...], five: int
) -> dict[str, tuple[Method, list[float] | None]]:
    """The metagradient rows (seed 0's run; the mean over ``five`` seeds' runs), computed
    together when the first of them runs."""
    counts = (1, five)
    computed: list[tuple[str, np.ndarray, float]] = []

    def row(index: int) -> tuple[np.ndarray, float]:
        if not computed:
            computed.extend(metagradient_ensemble(data, counts))
        _, scores, seconds = computed[index]
        return scores[None], seconds

    return {
        metagradient_label(count): (functools.partial(row, index), None)
        for index, count in enumerate(counts)
    }


def same_seed_problem(
    data: tuple[np.ndarray, ...], quick: bool
) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """The same-seed ground truth of the mlp-sgd run of seed 0 (the full-set models' first):
    per fraction dropped (``metagradient_lds.DROPPED``), ``N_SUBSETS`` subsets (8 quick)
    retrained with that run's initialisation and order, the dropped examples' weights 0; the
    half-size masks are the seed-averaged ground truth's (``lds_subsets`` seed 0)."""
    mg = metagradient_module()
    setup = sgd_run(data, 0)
    mg.check_against_replay(setup)
    subsets = 8 if quick else N_SUBSETS
    truth, seconds = timed(lambda: mg.same_seed_truth(setup, subsets, seed=0))
    print(f"  same-seed ground truth: {len(truth)} x {subsets} retrainings in {seconds:.0f} s")
    return truth


# --- the run ----------------------------------------------------------------------------------


def held_out_lds(scores: np.ndarray, masks: np.ndarray, outputs: np.ndarray) -> tuple[float, int]:
    """Choose the grid value on the even subsets, report the LDS on the odd ones."""
    tune = [
        influence.lds(s, masks[0::2], outputs[0::2]) if np.isfinite(s).all() else np.nan
        for s in scores
    ]
    best = int(np.nanargmax(tune))
    return influence.lds(scores[best], masks[1::2], outputs[1::2]), best


Method = Callable[[], tuple[np.ndarray, Any]]


def models_label(count: int) -> str:
    return f"{count} model{'s' if count > 1 else ''}"


def trak_methods(
    models: list, count: int, arrays: tuple, peers: dict[str, bool], index: int = 0
) -> dict[str, tuple[Method, list[float]]]:
    """The TRAK comparison's rows for the first ``count`` of ``models`` (read when a row runs):
    pergrad (PyTorch, JAX) and traker, each projecting with its own seeded matrices, those of
    projection seed index ``index`` (pergrad's ``seed`` ``TRAK_SEED_STRIDE * index``, traker's
    ``projector_seed`` ``index``)."""
    label = models_label(count)
    seed = TRAK_SEED_STRIDE * index
    methods: dict[str, tuple[Method, list[float]]] = {
        f"pergrad trak, {label}": (lambda: run_trak(models[:count], arrays, seed), TRAK_GRID)
    }
    if peers["jax"]:
        methods[f"pergrad trak (JAX), {label}"] = (
            lambda: run_trak_jax(models[:count], arrays, seed),
            TRAK_GRID,
        )
    if peers["traker"]:
        methods[f"traker TRAK, {label}"] = (
            lambda: run_traker(models[:count], arrays, TRAK_GRID, index),
            TRAK_GRID,
        )
    return methods


def methods_for(
    kind: str, models: list, arrays: tuple, sizes: tuple[int, int], peers: dict[str, bool]
) -> dict[str, tuple[Method, list[float] | None]]:
    """Each row's method and its damping grid (None: no grid)."""
    five, ten = sizes
    methods: dict[str, tuple[Method, list[float] | None]] = {
        "pergrad grad_dot": (lambda: run_grad(kind, models, arrays, cosine=False), None),
        "pergrad grad_cosine": (lambda: run_grad(kind, models, arrays, cosine=True), None),
        f"pergrad grad_dot, factored projection ({FACTORED_DIMS[0]}x{FACTORED_DIMS[1]})": (
            lambda: run_grad_dot_factored(models, arrays),
            None,
        ),
        f"pergrad influence_function (CG, default tol {influence.CG().tol:g})": (
            lambda: run_influence(models, arrays, "cg", CG_GRID),
            CG_GRID,
        ),
    }
    if kind == "logreg":
        methods["pergrad influence_function (exact)"] = (
            lambda: run_exact(models, arrays),
            EXACT_GRID,
        )
    lissa = influence.LiSSA(**LISSA)
    methods[f"pergrad influence_function (LiSSA, depth {LISSA['depth']}, batch 50)"] = (
        lambda: run_influence(models, arrays, lissa, LISSA_GRID),
        LISSA_GRID,
    )
    methods["pergrad influence_function (K-FAC)"] = (
        lambda: run_kfac(models, arrays, "kfac"),
        KFAC_GRID,
    )
    methods["pergrad influence_function (EK-FAC)"] = (
        lambda: run_kfac(models, arrays, "ekfac"),
        KFAC_GRID,
    )
    methods["pergrad influence_function (EK-FAC, sampled labels)"] = (
        lambda: run_kfac(models, arrays, "ekfac", draws=10),
        KFAC_GRID,
    )
    for count in (1, five, ten):
        methods.update(trak_methods(models, count, arrays, peers))
    for count in (1, five):
        label = models_label(count)
        methods[
            f"pergrad trak, factored projection ({FACTORED_DIMS[0]}x{FACTORED_DIMS[1]}), {label}"
        ] = (
            lambda count=count: run_trak_factored(models[:count], arrays),
            TRAK_GRID,
        )
    return methods


def problem(kind: str, quick: bool) -> tuple[tuple[np.ndarray, ...], Any, Any, Any, tuple]:
    """``(data, masks, outputs, ensemble sizes, data as float32 tensors)`` for ``kind``."""
    data = load_data(200 if quick else N_TRAIN, 50 if quick else N_TARGET)
    masks, outputs = ground_truth(kind, data, quick)
    sizes = (2, 3) if quick else (ENSEMBLE, 2 * ENSEMBLE)
    arrays = (
        torch.tensor(data[0], dtype=torch.float32),
        torch.tensor(data[1]),
        torch.tensor(data[2], dtype=torch.float32),
        torch.tensor(data[3]),
    )
    return data, masks, outputs, sizes, arrays


def full_set_models(kind: str, data: tuple[np.ndarray, ...], count: int) -> list:
    """``count`` models trained on the full training set (training seeds ``0 .. count - 1``),
    as float32."""
    full, seconds = timed(lambda: [train(kind, data[0], data[1], seed=s) for s in range(count)])
    print(f"  {count} full-set model(s) trained in {seconds:.0f} s")
    # keys in sorted order, as JAX flattens a dict: both frameworks project the same rows
    return [{k: p[k].float() for k in sorted(p)} for p in full]


def evaluate(
    kind: str,
    quick: bool,
    peers: dict[str, bool],
    only: list[str] | None = None,
    metagradient: bool = False,
) -> tuple[list[tuple[str, str, float, float]], dict[str, Any]]:
    """The table's rows, and what the CG tolerance study needs (the models, the data, the
    damping CG chose). ``metagradient`` (mlp-sgd only): also the metagradient rows, and each
    row's same-seed LDS per fraction dropped in ``study["same_seed"]`` (name -> values)."""
    data, masks, outputs, sizes, arrays = problem(kind, quick)
    models: list[dict[str, torch.Tensor]] = []  # trained below, once the methods are known
    methods = methods_for(kind, models, arrays, sizes, peers)
    same_seed = {}
    if metagradient and kind == "mlp-sgd":
        same_seed = same_seed_problem(data, quick)
        methods.update(metagradient_methods(data, sizes[0]))
    if only:
        methods = {n: m for n, m in methods.items() if any(word in n for word in only)}
    needed = max(
        [1] + [int(n.rsplit(", ", 1)[1].split()[0]) for n in methods if n.endswith("models")]
    )
    models.extend(full_set_models(kind, data, needed))
    rows = []
    study: dict[str, Any] = {"models": models, "arrays": arrays, "masks": masks}
    study["outputs"] = outputs
    for name, (method, grid) in methods.items():
        scores, seconds = method()
        value, best = held_out_lds(scores, masks, outputs)
        if isinstance(seconds, list):  # one solve per damping: the chosen one's time
            seconds = seconds[best]
        chosen = "-"
        if grid is not None:
            edge = " (grid's smallest)" if best == 0 and grid[0] > 0 else ""
            edge = " (L2 alone)" if best == 0 and grid is KFAC_GRID else edge
            edge = " (grid's largest)" if best == len(grid) - 1 else edge
            chosen = f"damping {grid[best]:g}{edge}"
        if "CG" in name:
            study["damping"] = grid[best]
        rows.append((name, chosen, value, seconds))
        print(f"  {name:45s} LDS {value:.3f}  ({chosen}; {seconds:.1f} s)", flush=True)
        if same_seed:
            values = [held_out_lds(scores, *truth)[0] for truth in same_seed.values()]
            study.setdefault("same_seed", {})[name] = values
            print(f"  {'':45s} same-seed LDS " + " / ".join(f"{v:.3f}" for v in values))
    random_scores = np.random.default_rng(0).normal(size=(len(data[0]), len(data[2])))
    rows.append(
        ("random scores", "-", influence.lds(random_scores, masks[1::2], outputs[1::2]), 0.0)
    )
    if same_seed:
        study["same_seed"]["random scores"] = [
            held_out_lds(random_scores[None], *truth)[0] for truth in same_seed.values()
        ]
        study["dropped"] = list(same_seed)
    study["targets"] = len(data[2])
    return rows, study


def trak_seed_problem(kind: str, quick: bool) -> dict[str, Any]:
    """What every seed of the TRAK comparison on ``kind`` shares: the ground truth, the
    ensemble sizes, the data, the models (trained once), and traker's grid in pergrad's units,
    ``damping = lambda_reg * P / k`` (traker divides its projected gradients by ``sqrt(P)`` and
    projects with unit-variance entries; pergrad's entries have variance ``1 / k``)."""
    data, masks, outputs, sizes, arrays = problem(kind, quick)
    models = full_set_models(kind, data, sizes[1])
    size = sum(v.numel() for v in models[0].values())
    return {
        "masks": masks,
        "outputs": outputs,
        "sizes": sizes,
        "arrays": arrays,
        "models": models,
        "converted": [lam * size / PROJ for lam in TRAK_GRID],
    }


def trak_seed_run(
    setup: dict[str, Any], peers: dict[str, bool], index: int
) -> dict[str, tuple[float, float, float]]:
    """The TRAK comparison at projection seed index ``index``: per row ``(chosen damping, LDS,
    seconds)``. pergrad's PyTorch call solves on its grid and, from the same features and
    eigendecompositions, on traker's grid in pergrad's units: the diagnostic row "traker's
    grid x P/k" (its choice given in traker's units; both rows' seconds are that one call's)."""
    models, arrays = setup["models"], setup["arrays"]
    both = TRAK_GRID + setup["converted"]
    rows, diagnostics = {}, {}
    for count in (1, *setup["sizes"]):
        label = models_label(count)
        methods = trak_methods(models, count, arrays, peers, index)
        methods[f"pergrad trak, {label}"] = (
            functools.partial(run_trak, models[:count], arrays, TRAK_SEED_STRIDE * index, both),
            both,
        )
        for name, (method, grid) in methods.items():
            scores, seconds = method()
            parts = [(rows, name, scores)]
            if grid is both:
                diagnostic = f"pergrad trak, traker's grid x P/k, {label}"
                parts = [
                    (rows, name, scores[: len(TRAK_GRID)]),
                    (diagnostics, diagnostic, scores[len(TRAK_GRID) :]),
                ]
            for table, row, row_scores in parts:
                value, best = held_out_lds(row_scores, setup["masks"], setup["outputs"])
                table[row] = (TRAK_GRID[best], value, seconds)
                print(
                    f"  seed {index}: {row:45s} LDS {value:.4f}  (damping {TRAK_GRID[best]:g};"
                    f" {seconds:.1f} s)",
                    flush=True,
                )
    return rows | diagnostics


def paired_difference(
    results: dict[str, list[tuple[float, float, float]]], name: str
) -> np.ndarray | None:
    """Row ``name``'s LDS minus traker's with the same models, per seed index (None: no
    traker row to pair with, or ``name`` is traker's)."""
    peer = results.get("traker TRAK, " + name.rsplit(", ", 1)[1])
    if name.startswith("traker") or peer is None:
        return None
    return np.array([run[1] for run in results[name]]) - np.array([run[1] for run in peer])


def mean_std_se(values: np.ndarray) -> tuple[float, float, float]:
    """Mean, sample standard deviation and standard error of the mean (NaN for one value)."""
    if len(values) < 2:
        return float(values.mean()), float("nan"), float("nan")
    std = float(values.std(ddof=1))
    return float(values.mean()), std, std / len(values) ** 0.5


def trak_seed_table(results: dict[str, list[tuple[float, float, float]]]) -> str:
    """One row per method: the dampings chosen over the seeds, the LDS's mean and standard
    deviation, and the paired difference to traker's LDS."""
    header = ["method", "chosen on even subsets (seeds)", "LDS mean", "LDS std"]
    header += ["minus traker: mean", "std", "SE", "seconds (mean)"]
    rows = []
    for name, runs in results.items():
        chosen = collections.Counter(run[0] for run in runs)
        picks = ", ".join(f"{value:g} x{n}" for value, n in sorted(chosen.items()))
        mean, std, _ = mean_std_se(np.array([run[1] for run in runs]))
        difference = paired_difference(results, name)
        paired = ["-", "-", "-"]
        if difference is not None:
            d_mean, d_std, d_se = mean_std_se(difference)
            paired = [f"{d_mean:+.4f}", f"{d_std:.4f}", f"{d_se:.4f}"]
        seconds = np.mean([run[2] for run in runs])
        rows.append([name, picks, f"{mean:.4f}", f"{std:.4f}", *paired, f"{seconds:.1f}"])
    return markdown_table(header, rows)


def trak_seed_verdict(all_results: dict[str, dict[str, list]]) -> list[str]:
    """Per framework, whether pergrad's TRAK reaches traker's LDS at equal models: each
    comparison at or above (mean paired difference >= 0), below by less than one paired
    standard error, or below by more."""
    lines = []
    for framework, prefix in (("PyTorch", "pergrad trak, "), ("JAX", "pergrad trak (JAX), ")):
        groups: dict[str, list[str]] = {"above": [], "within": [], "below": []}
        for kind, results in all_results.items():
            for name in results:
                if not name.startswith("traker TRAK, ") or prefix + name[13:] not in results:
                    continue
                mean, _, se = mean_std_se(paired_difference(results, prefix + name[13:]))
                text = f"{kind}, {name[13:]}: {mean:+.4f} (SE {se:.4f})"
                group = "above" if mean >= 0 else "within" if mean >= -se else "below"
                groups[group].append(text)
        total = sum(len(group) for group in groups.values())
        if not total:
            continue
        if groups["below"]:
            verdict = "NOT met"
        elif groups["within"]:
            verdict = "not separable from traker (below only by less than one paired SE)"
        else:
            verdict = "met"
        counted = {
            key: f"{len(group)}" + (f" ({'; '.join(group)})" if group else "")
            for key, group in groups.items()
        }
        lines.append(
            f"- pergrad-TRAK ({framework}) >= traker's LDS at equal models: {verdict}. Of "
            f"{total} comparisons (mean paired difference, pergrad - traker), at or above "
            f"traker in {counted['above']}; below by less than one paired SE in "
            f"{counted['within']}; below by more than one paired SE in {counted['below']}."
        )
    return lines


def cg_tolerance_study(study: dict[str, Any], tolerances: list[float]) -> list[str]:
    """CG at each tolerance, at the damping the CG row chose: LDS on the odd subsets and the
    seconds of the solve (issue 21: the default tolerance chosen from these)."""
    rows = []
    for tol in tolerances:
        scores, seconds = run_influence(
            study["models"], study["arrays"], influence.CG(tol=tol), [study["damping"]]
        )
        value = influence.lds(scores[0], study["masks"][1::2], study["outputs"][1::2])
        rows.append([f"{tol:g}", f"{value:.4f}", f"{seconds[0]:.1f}"])
        print(f"  CG tol {tol:g}: LDS {value:.4f}, {seconds[0]:.1f} s", flush=True)
    return [
        f"CG at damping {study['damping']:g} (the CG row's choice), one solve per tolerance:",
        "",
        markdown_table(["CG tol", "LDS (odd subsets)", "seconds"], rows),
    ]


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
                color = "tab:red" if "traker" in name else "tab:blue"
                ax.scatter(seconds, value, color="tab:green" if "JAX" in name else color)
                ax.annotate(name.replace("pergrad ", ""), (seconds, value), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("wall seconds (the chosen damping, or the whole grid)")
        ax.set_ylabel("LDS (held-out subsets)")
        ax.set_title(f"digits, {kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def trak_verdict(all_rows: dict[str, list]) -> list[str]:
    """Whether pergrad's TRAK reaches traker's LDS at equal models, in each framework."""
    lines = []
    for framework, prefix in (("PyTorch", "pergrad trak, "), ("JAX", "pergrad trak (JAX), ")):
        pairs = []
        for kind, rows in all_rows.items():
            values = {name: value for name, _, value, _ in rows}
            for name, value in values.items():
                if name.startswith("traker TRAK, ") and prefix + name[13:] in values:
                    pairs.append((kind, name[13:], values[prefix + name[13:]], value))
        if not pairs:
            continue
        short = [f"{k}, {m}: {a:.3f} vs {b:.3f}" for k, m, a, b in pairs if a < b]
        verdict = "met" if not short else "NOT met"
        detail = f"; below traker in {len(short)}: " + "; ".join(short) if short else ""
        lines.append(
            f"- pergrad-TRAK ({framework}) >= traker's LDS at equal models: {verdict} (in "
            f"{len(pairs) - len(short)} of {len(pairs)} comparisons{detail})."
        )
    return lines


def trak_seeds_main(args: argparse.Namespace, peers: dict[str, bool]) -> None:
    """``--trak-seeds``: the TRAK comparison over projection seeds (each seed on every regime
    before the next seed), its tables and verdict, rewritten from the second seed on after
    each seed (an interrupted run leaves the seeds it finished)."""
    setups = {}
    for kind in args.models:
        print(f"{kind}:")
        setups[kind] = trak_seed_problem(kind, args.quick)
    all_results: dict[str, dict[str, list]] = {kind: {} for kind in args.models}
    for index in range(args.trak_seeds):
        for kind in args.models:
            print(f"{kind}:")
            for name, run in trak_seed_run(setups[kind], peers, index).items():
                all_results[kind].setdefault(name, []).append(run)
        if index >= 1:
            write_trak_seeds(args, all_results, index + 1)


def write_trak_seeds(args: argparse.Namespace, all_results: dict[str, dict], done: int) -> None:
    """Print the tables and verdict of the ``done`` seeds so far; write them to ``--out``."""
    lines = []
    for kind, results in all_results.items():
        lines += [f"### {TITLES[kind]}", "", trak_seed_table(results), ""]
    lines += ["### TRAK against traker", "", *trak_seed_verdict(all_results), ""]
    table = "\n".join(lines)
    print(table)
    load = load_average()
    print(f"load average after {done} seeds: {load}")
    if not args.out:
        return
    asked = "" if done == args.trak_seeds else f" (of the {args.trak_seeds} asked)"
    header = (
        f"# attribution_lds.py --trak-seeds {args.trak_seeds}\n\n{machine_and_load(load)}. "
        f"{N_TRAIN} training digits, {N_TARGET} targets, "
        f"{N_SUBSETS} half-size subsets (32 to choose the damping, 32 to score), projection "
        f"dimension k = {PROJ}, TRAK damping grid {TRAK_GRID} (pergrad's damping, traker's "
        f"lambda_reg). The TRAK comparison of attribution_lds.md repeated over {done} "
        f"projection seed indices s = 0 .. {done - 1}{asked} on the same models (the full-set "
        f"models, trained once per regime): pergrad projects model m with seed "
        f"{TRAK_SEED_STRIDE} s + m, traker with projector_seed s (s = 0 is "
        f"attribution_lds.md's run). \"minus traker\": the row's LDS minus traker's at the "
        f"same seed index and models; over the seeds its mean, std and SE = std / sqrt(seeds). "
        f"Diagnostic row \"traker's grid x P/k\": pergrad searching traker's grid converted to "
        f"pergrad's units, damping = lambda_reg P / k (P parameters: traker divides its "
        f"projected gradients by sqrt(P) and projects with unit-variance entries, pergrad's "
        f'have variance 1/k), solved from the same features as the "pergrad trak" row, '
        f"whose seconds (the whole grid, the two grids together) it shares; its chosen "
        f"damping is in traker's units. Other seconds: the whole grid (traker's: the first "
        f"value), JAX's include tracing.\n\n"
    )
    write_text(os.path.join(args.out, "attribution_lds_trak_seeds.md"), header + table)


def results_table(rows: list[tuple[str, str, float, float]], study: dict[str, Any]) -> str:
    """A regime's table; with same-seed values (``--metagradient``), their columns and the
    seconds per target."""
    header = ["method", "chosen on even subsets", "LDS (odd subsets)"]
    same_seed = study.get("same_seed")
    if not same_seed:
        cells = [[n, c, f"{v:.3f}", f"{s:.1f}"] for n, c, v, s in rows]
        return markdown_table([*header, "seconds"], cells)
    header += [f"same-seed LDS, {d:.0%} dropped" for d in study["dropped"]]
    header += ["seconds", "seconds per target"]
    cells = [
        [n, c, f"{v:.3f}", *(f"{x:.3f}" for x in same_seed[n]), f"{s:.1f}"]
        + [f"{s / study['targets']:.3f}"]
        for n, c, v, s in rows
    ]
    return markdown_table(header, cells)


def metagradient_header(load: str, quick: bool) -> str:
    """The header of ``attribution_lds_metagradient.md``: what the two regimes are."""
    n_train, n_target, subsets = (200, 50, 8) if quick else (N_TRAIN, N_TARGET, N_SUBSETS)
    return (
        f"# attribution_lds.py --metagradient\n\n{machine_and_load(load)}, torch on "
        f"{torch.get_num_threads()} thread(s). The mlp-sgd regime of attribution_lds.md "
        f"({n_train} training digits, {n_target} targets, SGD lr {SGD_LR} momentum "
        f"{SGD_MOMENTUM} L2 {L2}, {SGD_EPOCHS} epochs of batches of {SGD_BATCH}; its damping "
        f'grids), every row scored against two ground truths. "LDS (odd subsets)": the '
        f"seed-averaged one ({subsets} half-size subsets, each retrained with "
        f'{SGD_SEEDS} training seeds and averaged; "what does the recipe learn from example '
        f'i"). "same-seed LDS": the run of seed 0 (the 1-model rows\' model) retrained with '
        f"the same initialisation and order and the dropped examples' weights 0, "
        f"{subsets} subsets per fraction, the half-size ones the seed-averaged truth's "
        f"(\"why did this run do that\"); a method's damping chosen on each truth's even "
        f"subsets, the LDS on its odd ones. pergrad metagradient: "
        f"`influence.metagradient` of the {n_target} margins through seed 0's run (float64, exact "
        f"replay of train_sgd, checked), and the mean over the runs of seeds 0-"
        f"{(2 if quick else ENSEMBLE) - 1}. Seconds: the chosen damping's solve for CG and LiSSA, the whole "
        f"grid for the others, all the runs' calls for the metagradient mean; per target: "
        f"seconds / {n_target}. Command: `{command_line()}`.\n\n"
    )


def machine_and_load(load: str) -> str:
    """The machine, and the load average ``load`` at the end of the run."""
    noisy = f"load average {load} at the end (a shared machine: times are noisy)"
    return machine_sentence(["torch"], [noisy])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds)")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["logreg", "mlp", "mlp-sgd"],
        help="default: all three (with --metagradient: mlp-sgd)",
    )
    parser.add_argument(
        "--metagradient",
        action="store_true",
        help=(
            "add pergrad's metagradient to the mlp-sgd table (seed 0's run; the mean over 5 "
            "seeds' runs) and score every row also in the same-seed regime (seed 0's run "
            "retrained with 1%%, 10%%, 50%% dropped), with seconds per target; writes "
            "attribution_lds_metagradient.md (a run of mlp-sgd takes ~15 min on 2 loaded cores)"
        ),
    )
    parser.add_argument("--no-traker", action="store_true", help="skip the traker peer")
    parser.add_argument("--no-jax", action="store_true", help="skip TRAK through JAX")
    parser.add_argument(
        "--cg-tolerances",
        nargs="*",
        type=float,
        default=CG_TOLERANCES,
        help="CG tolerances to compare on the MLP at the damping CG chose (none: skip)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        help="run only the methods whose name contains one of these words (e.g. K-FAC)",
    )
    parser.add_argument(
        "--trak-seeds",
        type=int,
        metavar="N",
        help=(
            "instead of the full table: only the TRAK comparison (pergrad PyTorch and JAX, "
            "traker; 1, 5 and 10 models; plus a diagnostic pergrad row on traker's grid in "
            "pergrad's units) repeated over N >= 2 projection seeds on the same models, with "
            "each row's mean and std of the LDS and its paired difference to traker's; "
            "writes attribution_lds_trak_seeds.md after each seed from the second (costs N "
            "times the TRAK rows of a full run: ~10 min per seed on 2 loaded CPU cores)"
        ),
    )
    parser.add_argument(
        "--out",
        help="write attribution_lds.md and .png (with --trak-seeds: attribution_lds_trak_seeds"
        ".md) into this directory",
    )
    args = parser.parse_args()
    if args.trak_seeds is not None and (args.trak_seeds < 2 or args.only or args.metagradient):
        parser.error("--trak-seeds takes N >= 2 and runs its own rows (no --only, --metagradient)")
    if args.models is None:
        args.models = ["mlp-sgd"] if args.metagradient else ["logreg", "mlp", "mlp-sgd"]
    torch.manual_seed(0)
    print(f"load average at the start: {load_average()}")
    peers = {"traker": not args.no_traker, "jax": not args.no_jax}
    for peer, hint in (("traker", "pip install traker"), ("jax", "pip install jax")):
        try:
            __import__("trak" if peer == "traker" else peer)
        except ImportError:
            print(f"{peer} is not installed ({hint}): its rows are skipped")
            peers[peer] = False
    if args.trak_seeds is not None:
        trak_seeds_main(args, peers)
        return
    all_rows, studies, study_lines = {}, {}, []
    for kind in args.models:
        print(f"{kind}:")
        all_rows[kind], studies[kind] = evaluate(
            kind, args.quick, peers, args.only, args.metagradient
        )
        study = studies[kind]
        if kind == "mlp" and args.cg_tolerances and "damping" in study and not args.quick:
            study_lines = cg_tolerance_study(study, args.cg_tolerances)
    lines = []
    for kind, rows in all_rows.items():
        lines += [f"### {TITLES[kind]}", "", results_table(rows, studies[kind]), ""]
    if study_lines:
        lines += ["### CG's tolerance on the MLP (trained to convergence)", "", *study_lines, ""]
    verdict = trak_verdict(all_rows)
    if verdict:
        lines += ["### TRAK against traker", "", *verdict, ""]
    table = "\n".join(lines)
    print(table)
    load = load_average()
    print(f"load average at the end: {load}")
    if args.out and args.metagradient:
        write_text(
            os.path.join(args.out, "attribution_lds_metagradient.md"),
            metagradient_header(load, args.quick) + table,
        )
    elif args.out:
        header = (
            f"# attribution_lds.py\n\n{machine_and_load(load)}. {N_TRAIN} training digits, "
            f"{N_TARGET} targets, {N_SUBSETS} half-size subsets (32 to choose the damping, 32 to "
            f"score), projection dimension {PROJ} (factored: "
            f"{FACTORED_DIMS[0]}x{FACTORED_DIMS[1]} per weight, biases to {OTHER_DIM}), L2 {L2}. "
            f"Damping grids: CG {CG_GRID}, exact "
            f"{EXACT_GRID}, LiSSA {LISSA_GRID}, K-FAC / EK-FAC L2 + {KFAC_GRID}, TRAK "
            f"{TRAK_GRID}; a choice at a grid's edge is marked. Seconds: the chosen damping's "
            f"solve for CG and LiSSA, the whole grid for the others (one factorisation or one "
            f"set of features for all its values); JAX's include tracing.\n\n"
        )
        write_text(os.path.join(args.out, "attribution_lds.md"), header + table)
        plot(all_rows, os.path.join(args.out, "attribution_lds.png"))


if __name__ == "__main__":
    main()

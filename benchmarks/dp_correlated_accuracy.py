"""Test accuracy at equal epsilon: DP-SGD, amplified banded Toeplitz noise and BLT noise.

Run:  python benchmarks/dp_correlated_accuracy.py [--quick] [--workers 2] [--framework both]
      [--out PATH]

PyTorch, ``pergrad.dp.DPOptimizer`` around plain SGD (no momentum), and JAX,
``pergrad.dp.dpsgd(..., noise=mech)`` (``optax_aggregate`` then ``optax.sgd``) on per-example
gradients from ``pergrad.per_example_grads``, the whole run one ``jax.lax.scan`` over batches
padded to one size (``pad_batch``, masked). ``--framework torch | jax | both`` (default both)
picks the rows. A 64-32-10 tanh MLP on
scikit-learn's digits: the 1797 images split once into 1347 training and 450 test images
(``train_test_split(test_size=0.25, random_state=0)``), and 270 of the training images held out
for validation (``random_state=1``), so 1077 are trained on. ``k = 16`` steps make an epoch,
``EPOCHS = 40`` epochs (``T = 640`` steps), batches of ``1077 / 16 = 67.3`` examples (expected
or fixed) and ``delta = 1e-5``. Every noise multiplier is calibrated with the PLD accountant.

- **DP-SGD**: independent Gaussian noise; Poisson sampling at rate ``1 / k`` over the whole
  training set (``PoissonBatchSampler``), ``T`` steps, accounted with amplification.
- **banded, amplified**: ``pergrad.dp.toeplitz(coefs, steps=T, min_separation=b,
  sample_rate=b / k)`` with cyclic Poisson sampling (``CyclicPoissonBatchSampler(noise=mech)``:
  the examples split at random into ``b`` groups, step ``t`` Poisson-samples group ``t % b`` at
  rate ``b / k``, the same expected batch). ``b`` bands; the coefficients minimise
  ``||coefs||^2 * max_error`` (scipy's Powell, from the square-root factorisation's
  coefficients), and ``b`` in ``{2, 4, 8, 16}`` is the one of least prefix-sum error
  ``noise_multiplier * sensitivity * sqrt(max_error)`` at the target epsilon (each candidate
  calibrated with RDP, for the ranking): both chosen before training, from no data.
- **BLT**: ``pergrad.dp.optimal_blt(steps=T, participations=EPOCHS, min_separation=k)``,
  accounted as one Gaussian release (no amplification), as jax-privacy runs matrix-factorisation
  DP-FTRL: the training set shuffled once and cut into ``k`` fixed batches, visited in the same
  order every epoch (each example in one step per epoch, ``k`` steps apart).
- **non-private**: the same fixed batches, mean loss, no clipping or noise (a reference).

The JAX rows draw their batches with the numpy samplers (``poisson_batches``,
``cyclic_poisson_batches``, a numpy permutation for the fixed order) and initialise the MLP as
PyTorch does (uniform in ``+-1 / sqrt(fan_in)``) from a JAX key: the same methods, mechanisms,
noise multipliers and grid, independent draws.

Hyperparameters: the same grid for every method and epsilon (``LEARNING_RATES x
MAX_NORMS``); each configuration trains ``SEEDS`` seeds (the seed draws the initial weights,
the batches or the fixed order and groups, and the noise); the configuration of the best mean
VALIDATION accuracy is reported per (framework, method, epsilon), with its TEST accuracy over
the seeds (mean, sample standard deviation, min and max). Runs go to ``--workers`` processes of
one thread each (a JAX job trains every seed of one configuration, compiled once).

Then the cost of the noise: one ``DPOptimizer.step`` with each mechanism on the same model and
batch (interleaved rounds, ``pergrad.bench.timing``), on the digits MLP and on a 64-1024-1024-10
MLP, and the bytes of the buffers each mechanism keeps (``num_buffers`` arrays shaped like the
parameters), in PyTorch. ``--quick``: 2 epochs, one seed, one configuration, epsilon 8, 3
timing rounds.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from pergrad.bench import machine
from pergrad.bench.report import markdown_table, publish, titled
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved

DELTA = 1e-5
STEPS_PER_EPOCH = 16  # k
HIDDEN = 32
FULL = {
    "epochs": 40,
    "epsilons": (1.0, 3.0, 8.0),
    "seeds": 3,
    "learning_rates": (0.25, 0.5, 1.0, 2.0),
    "max_norms": (0.5, 1.0, 2.0),
    "band_choices": (2, 4, 8, 16),
    "timing_rounds": 21,
    "accountant": "pld",
}
QUICK = {
    "epochs": 2,
    "epsilons": (8.0,),
    "seeds": 1,
    "learning_rates": (1.0,),
    "max_norms": (1.0,),
    "band_choices": (2,),
    "timing_rounds": 3,
    "accountant": "rdp",  # PLD calibrations at few steps take seconds each
}
METHODS = ("DP-SGD", "banded, amplified", "BLT", "non-private")
FRAMEWORKS = {"torch": ("torch",), "jax": ("jax",), "both": ("torch", "jax")}

_DATA: dict[str, Any] = {}  # the split, set before the workers fork


def load_split() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0
    )
    x_fit, x_val, y_fit, y_val = train_test_split(x_train, y_train, test_size=270, random_state=1)
    return {
        "x": x_fit, "y": y_fit, "x_val": x_val, "y_val": y_val, "x_test": x_test, "y_test": y_test
    }  # fmt: skip


# --- the mechanisms, chosen before training ------------------------------------------------


def banded_coefs(bands: int, steps: int) -> np.ndarray:
    """The first column of a ``bands``-banded Toeplitz strategy minimising ``||coefs||^2 *
    max_error``, from the truncated square root of the prefix-sum matrix (``1, 1/2, 3/8...``)."""
    from scipy.optimize import minimize

    from pergrad import dp

    k = np.arange(1, bands)
    start = np.cumprod(np.r_[1.0, (2 * k - 1) / (2 * k)])

    def log_loss(rest: np.ndarray) -> float:
        coefs = np.r_[1.0, rest]
        with np.errstate(over="ignore", invalid="ignore"):
            value = float(coefs @ coefs) * dp.toeplitz(coefs, steps=steps).max_error()
        return math.log(value) if math.isfinite(value) else 1e3

    found = minimize(
        log_loss,
        start[1:],
        method="Powell",
        bounds=[(0.0, 1.0)] * (bands - 1),
        options={"xtol": 1e-4, "ftol": 1e-8, "maxiter": 2000},
    )
    best = found.x if found.fun < log_loss(start[1:]) else start[1:]
    return np.r_[1.0, best]


def prefix_rmse(noise_multiplier: float, mech: Any, steps: int) -> float:
    """The root-mean-square error of the running sum of noisy clipped sums, per coordinate and
    unit clipping norm, at its worst step: the proxy the mechanisms are chosen by."""
    if mech is None:  # DP-SGD
        return noise_multiplier * math.sqrt(steps)
    return noise_multiplier * mech.sensitivity() * math.sqrt(mech.max_error())


def calibrate(eps: float, accountant: str, **run: Any) -> tuple[float, float]:
    """``(noise multiplier for eps, the epsilon the accountant then reports)``."""
    from pergrad import dp

    sigma = dp.noise_multiplier_for(target_epsilon=eps, delta=DELTA, accountant=accountant, **run)
    return sigma, dp.epsilon(noise_multiplier=sigma, delta=DELTA, accountant=accountant, **run)


def choose_bands(
    eps: float, coefs: dict[int, np.ndarray], steps: int
) -> tuple[int, dict[int, float]]:
    """The number of bands of least prefix-sum error at ``eps`` (each candidate calibrated with
    the RDP accountant: a ranking, fast), and each candidate's error."""
    from pergrad import dp

    errors = {}
    for b, c in coefs.items():
        mech = dp.toeplitz(c, steps=steps, min_separation=b, sample_rate=b / STEPS_PER_EPOCH)
        sigma = dp.noise_multiplier_for(
            target_epsilon=eps, delta=DELTA, noise=mech, accountant="rdp"
        )
        errors[b] = round(prefix_rmse(sigma, mech, steps), 2)
    return min(errors, key=errors.__getitem__), errors


def plan_mechanisms(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One plan per (method, epsilon): the mechanism's parameters (plain data, rebuilt in the
    workers), its noise multiplier, the accountant's epsilon and the prefix-sum error."""
    from pergrad import dp

    epochs, k, accountant = settings["epochs"], STEPS_PER_EPOCH, settings["accountant"]
    steps = epochs * k
    coefs = {b: banded_coefs(b, steps) for b in settings["band_choices"] if b <= k}
    blt = dp.optimal_blt(steps=steps, participations=epochs, min_separation=k)
    blt_spec = {"kind": "blt", "decays": blt.buffer_decays.tolist(),
                "scales": blt.output_scales.tolist(), "steps": steps,
                "participations": epochs, "min_separation": k}  # fmt: skip
    plans = []
    for eps in settings["epsilons"]:
        sigma, achieved = calibrate(eps, accountant, sample_rate=1.0 / k, steps=steps)
        plans.append(
            {"method": "DP-SGD", "epsilon": eps, "sigma": sigma, "achieved": achieved,
             "rmse": prefix_rmse(sigma, None, steps), "mech": None}
        )  # fmt: skip
        b, errors = choose_bands(eps, coefs, steps)
        spec = {"kind": "toeplitz", "coefs": coefs[b].tolist(), "bands": b, "steps": steps,
                "min_separation": b, "sample_rate": b / k}  # fmt: skip
        mech = build_mechanism(spec)
        sigma, achieved = calibrate(eps, accountant, noise=mech)
        plans.append(
            {"method": "banded, amplified", "epsilon": eps, "sigma": sigma,
             "achieved": achieved, "rmse": prefix_rmse(sigma, mech, steps), "mech": spec,
             "candidates": errors}
        )  # fmt: skip
        sigma, achieved = calibrate(eps, accountant, noise=blt)
        plans.append(
            {"method": "BLT", "epsilon": eps, "sigma": sigma, "achieved": achieved,
             "rmse": prefix_rmse(sigma, blt, steps), "mech": blt_spec}
        )  # fmt: skip
    plans.append(
        {"method": "non-private", "epsilon": math.inf, "sigma": 0.0, "rmse": 0.0,
         "achieved": math.inf, "mech": None}
    )  # fmt: skip
    return plans


def build_mechanism(spec: dict[str, Any] | None) -> Any:
    from pergrad import dp

    if spec is None:
        return None
    if spec["kind"] == "toeplitz":
        return dp.toeplitz(
            spec["coefs"], steps=spec["steps"], min_separation=spec["min_separation"],
            sample_rate=spec["sample_rate"],
        )  # fmt: skip
    return dp.blt(
        spec["decays"], spec["scales"], steps=spec["steps"],
        participations=spec["participations"], min_separation=spec["min_separation"],
    )  # fmt: skip


# --- one training run ----------------------------------------------------------------------


def mlp(hidden: int = HIDDEN, depth: int = 1) -> Any:
    from torch import nn

    widths = [64] + [hidden] * depth
    layers: list[Any] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


def batches(method: str, mech: Any, n: int, steps: int, seed: int) -> Any:
    """The indices of each step, drawn as the method's accounting assumes (module docstring)."""
    import torch

    from pergrad import dp

    generator = torch.Generator().manual_seed(10_000 + seed)
    if method == "DP-SGD":
        return dp.PoissonBatchSampler(n, 1.0 / STEPS_PER_EPOCH, steps, generator)
    if method == "banded, amplified":
        return dp.CyclicPoissonBatchSampler(n, noise=mech, generator=generator)
    order = torch.randperm(n, generator=generator).numpy()
    fixed = [part.tolist() for part in np.array_split(order, STEPS_PER_EPOCH)]
    return (fixed[t % STEPS_PER_EPOCH] for t in range(steps))


def train(job: dict[str, Any]) -> dict[str, Any]:
    """Trains one (plan, lr, max_norm, seed); returns its validation and test accuracies."""
    import torch
    import torch.nn.functional as F

    from pergrad import dp

    torch.set_num_threads(1)
    data = {name: torch.as_tensor(value) for name, value in _DATA.items()}
    n, steps = len(data["x"]), job["steps"]
    method, mech = job["method"], build_mechanism(job["mech"])
    torch.manual_seed(job["seed"])
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=job["lr"])
    private = method != "non-private"
    if private:
        optimizer = dp.DPOptimizer(
            sgd, model, F.cross_entropy, max_norm=job["max_norm"],
            noise_multiplier=job["sigma"], expected_batch_size=n / STEPS_PER_EPOCH,
            generator=torch.Generator().manual_seed(20_000 + job["seed"]), noise=mech,
        )  # fmt: skip
    for indices in batches(method, mech, n, steps, job["seed"]):
        x, y = data["x"][indices], data["y"][indices]
        if private:
            optimizer.step(x, y)
        else:
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            sgd.step()
    with torch.no_grad():
        accuracy = {
            split: float((model(data[f"x_{split}"]).argmax(1) == data[f"y_{split}"]).float().mean())
            for split in ("val", "test")
        }
    return {**job, **accuracy}


def jax_batches(method: str, mech: Any, n: int, steps: int, seed: int) -> list[np.ndarray]:
    """The JAX rows' batch indices, drawn with the numpy samplers as :func:`batches` draws the
    PyTorch rows' (independent draws from the same distributions)."""
    from pergrad import dp

    if method == "DP-SGD":
        return list(dp.poisson_batches(n, 1.0 / STEPS_PER_EPOCH, steps, seed=10_000 + seed))
    if method == "banded, amplified":
        return list(dp.cyclic_poisson_batches(n, noise=mech, seed=10_000 + seed))
    order = np.random.default_rng(10_000 + seed).permutation(n)
    fixed = np.array_split(order, STEPS_PER_EPOCH)
    return [fixed[t % STEPS_PER_EPOCH] for t in range(steps)]


def padded(batch_list: list[np.ndarray], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, size)`` indices and masks: every batch padded to one size, so one compile."""
    from pergrad import dp

    size = max(size, max(len(b) for b in batch_list))
    pairs = [dp.pad_batch(b, size) for b in batch_list]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def jax_mlp(key: Any) -> dict[str, Any]:
    """64-32-10, initialised as ``torch.nn.Linear`` is: uniform in ``+-1 / sqrt(fan_in)``."""
    import jax

    params = {}
    for name, (fan_in, fan_out) in (("1", (64, HIDDEN)), ("2", (HIDDEN, 10))):
        key, w_key, b_key = jax.random.split(key, 3)
        bound = fan_in**-0.5
        params["w" + name] = jax.random.uniform(w_key, (fan_out, fan_in), minval=-bound,
                                                maxval=bound)  # fmt: skip
        params["b" + name] = jax.random.uniform(b_key, (fan_out,), minval=-bound, maxval=bound)
    return params


def train_jax(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Trains one (plan, lr, max_norm) configuration in JAX for every seed: ``dpsgd(...,
    noise=mech)`` (or ``optax.sgd`` on the mean loss, non-private), the run one jitted
    ``lax.scan``, compiled once for the seeds; returns one result per seed."""
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    import jax
    import jax.numpy as jnp
    import optax

    import pergrad
    from pergrad import dp

    data = {name: jnp.asarray(value) for name, value in _DATA.items()}
    n, steps, k = len(_DATA["x"]), job["steps"], STEPS_PER_EPOCH
    method, mech = job["method"], build_mechanism(job["mech"])
    private = method != "non-private"

    def loss(params: Any, x: Any, y: Any) -> Any:  # one example
        hidden = jnp.tanh(params["w1"] @ x + params["b1"])
        return -jax.nn.log_softmax(params["w2"] @ hidden + params["b2"])[y]

    def make_tx(noise_key: Any) -> Any:
        if not private:
            return optax.sgd(job["lr"])
        return dp.dpsgd(job["lr"], job["max_norm"], job["sigma"], noise_key,
                        expected_batch_size=n / k, noise=mech)  # fmt: skip

    per_example = pergrad.per_example_grads(loss)

    @jax.jit
    def run(params: Any, noise_key: Any, indices: Any, masks: Any) -> Any:
        tx = make_tx(noise_key)

        def step(carry: Any, batch: Any) -> Any:
            params, state = carry
            index, mask = batch
            x, y = data["x"][index], data["y"][index]
            if private:
                grads = per_example(params, x, y)
                updates, state = tx.update(grads, state, params, mask=mask)
            else:
                weights = mask / jnp.maximum(mask.sum(), 1)
                grads = jax.grad(lambda p: (jax.vmap(loss, (None, 0, 0))(p, x, y) * weights).sum())(
                    params
                )
                updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), (indices, masks))
        return params

    # one padded size for every seed (a batch above it, rare, compiles once more)
    size = dp.max_batch_size_for(n, 1.0 / k, 1e-6 / steps)
    results = []
    for seed in range(job["seeds"]):
        indices, masks = padded(jax_batches(method, mech, n, steps, seed), size)
        params = run(jax_mlp(jax.random.key(seed)), jax.random.key(20_000 + seed),
                     jnp.asarray(indices), jnp.asarray(masks))  # fmt: skip

        def accuracy(split: str, params: Any = params) -> float:
            hidden = jnp.tanh(data[f"x_{split}"] @ params["w1"].T + params["b1"])
            logits = hidden @ params["w2"].T + params["b2"]
            return float((logits.argmax(1) == data[f"y_{split}"]).mean())

        results.append({**job, "seed": seed, "val": accuracy("val"), "test": accuracy("test")})
    return results


def _train(job: dict[str, Any]) -> list[dict[str, Any]]:
    return train_jax(job) if job["framework"] == "jax" else [train(job)]


def run_all(
    plans: list[dict[str, Any]], settings: dict[str, Any], workers: int, frameworks: tuple
) -> list[dict]:
    """Every (framework, plan, lr, max_norm, seed) run. A PyTorch job is one seed; a JAX job is
    every seed of one configuration (one compile)."""
    steps = settings["epochs"] * STEPS_PER_EPOCH
    jobs = [
        {**{key: plan[key] for key in ("method", "epsilon", "sigma", "mech")},
         "framework": framework, "steps": steps, "lr": lr, "max_norm": max_norm, "seed": seed,
         "seeds": settings["seeds"]}
        for framework in frameworks
        for plan in plans
        for lr in settings["learning_rates"]
        for max_norm in (settings["max_norms"] if plan["method"] != "non-private" else (None,))
        for seed in (range(settings["seeds"]) if framework == "torch" else (None,))
    ]  # fmt: skip
    print(f"{len(jobs)} training jobs on {workers} worker(s)...", file=sys.stderr)
    # the JAX jobs first: longest (a compile and every seed), so the pool ends evenly
    jobs.sort(key=lambda job: job["framework"] != "jax")
    if workers == 1:
        return [run for job in jobs for run in _train(job)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return [run for runs in pool.map(_train, jobs, chunksize=1) for run in runs]


def best_rows(
    plans: list[dict[str, Any]], runs: list[dict[str, Any]], framework: str
) -> list[dict[str, Any]]:
    """Per plan, the configuration of best mean validation accuracy, with its test numbers."""
    rows = []
    for plan in plans:
        mine = [
            r
            for r in runs
            if (r["framework"], r["method"], r["epsilon"])
            == (framework, plan["method"], plan["epsilon"])
        ]
        configs: dict[tuple, list[dict]] = {}
        for run in mine:
            configs.setdefault((run["lr"], run["max_norm"]), []).append(run)
        (lr, max_norm), chosen = max(
            configs.items(), key=lambda item: statistics.mean(r["val"] for r in item[1])
        )
        tests = [r["test"] for r in chosen]
        rows.append(
            {**plan, "lr": lr, "max_norm": max_norm,
             "val": statistics.mean(r["val"] for r in chosen),
             "test": statistics.mean(tests),
             "std": statistics.stdev(tests) if len(tests) > 1 else 0.0,
             "min": min(tests), "max": max(tests)}
        )  # fmt: skip
    return rows


def accuracy_table(rows: list[dict[str, Any]]) -> str:
    header = ["epsilon", "method", "noise multiplier", "epsilon (accountant)", "prefix-sum RMSE"]
    header += ["lr", "clip", "val acc", "test acc (mean ± std)", "test min-max"]
    cells = []
    for r in rows:
        method = r["method"]
        if r["mech"] is not None and r["mech"]["kind"] == "toeplitz":
            method += f" (b={r['mech']['bands']})"
        private = r["method"] != "non-private"
        cells.append(
            [f"{r['epsilon']:g}" if private else "-", method,
             f"{r['sigma']:.3f}" if private else "-",
             f"{r['achieved']:.3f}" if private else "-",
             f"{r['rmse']:.1f}" if private else "-",
             f"{r['lr']:g}", f"{r['max_norm']:g}" if private else "-",
             f"{r['val']:.3f}", f"{r['test']:.3f} ± {r['std']:.3f}",
             f"{r['min']:.3f}-{r['max']:.3f}"]
        )  # fmt: skip
    return markdown_table(header, cells)


# --- what a step costs -----------------------------------------------------------------------


def step_costs(plans: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """Per model: the median ms of a DPOptimizer step with each mechanism (same batch, same
    weights, interleaved rounds) and the bytes of each mechanism's buffers."""
    import torch
    import torch.nn.functional as F

    from pergrad import dp

    torch.set_num_threads(1)
    by_method = {p["method"]: p for p in plans if p["method"] != "non-private"}
    mechs = {name: build_mechanism(by_method[name]["mech"]) for name in METHODS[:3]}
    x = torch.as_tensor(_DATA["x"][:67])
    y = torch.as_tensor(_DATA["y"][:67])
    rows = []
    for label, hidden, depth in (("MLP 64-32-10", HIDDEN, 1), ("MLP 64-1024-1024-10", 1024, 2)):
        torch.manual_seed(0)
        model = mlp(hidden, depth)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        steps = {}
        for name, mech in mechs.items():
            copy = mlp(hidden, depth)
            copy.load_state_dict(model.state_dict())
            optimizer = dp.DPOptimizer(
                torch.optim.SGD(copy.parameters(), lr=1e-3), copy, F.cross_entropy,
                max_norm=1.0, noise_multiplier=1.0, expected_batch_size=67.0,
                generator=torch.Generator().manual_seed(0), noise=mech,
            )  # fmt: skip
            steps[name] = lambda optimizer=optimizer: optimizer.step(x, y)
        times = time_interleaved(steps, rounds, warmup=2)
        base = times["DP-SGD"]
        rows.append(
            {"model": label,
             "params": sum(p.numel() for p in model.parameters()),
             "ms": {name: median_ms(t) for name, t in times.items()},
             "ratio": {name: paired_ratio(t, base) for name, t in times.items()},
             "extra_bytes": {name: (mech.num_buffers if mech is not None else 0) * param_bytes
                             for name, mech in mechs.items()},
             "buffers": {name: (mech.num_buffers if mech is not None else 0)
                         for name, mech in mechs.items()}}
        )  # fmt: skip
    return rows


def cost_table(rows: list[dict[str, Any]]) -> str:
    header = ["model", "parameters", "DP-SGD step ms", "banded step ms", "BLT step ms"]
    header += ["banded / DP-SGD", "BLT / DP-SGD", "banded buffers (bytes)", "BLT buffers (bytes)"]
    cells = [
        [r["model"], f"{r['params']:,}"]
        + [f"{r['ms'][name]:.2f}" for name in METHODS[:3]]
        + [f"{r['ratio'][name]:.3f}x" for name in METHODS[1:3]]
        + [f"{r['buffers'][name]} x {r['extra_bytes'][name] // max(r['buffers'][name], 1):,}"
           f" = {r['extra_bytes'][name]:,}" for name in METHODS[1:3]]
        for r in rows
    ]  # fmt: skip
    return markdown_table(header, cells)


# --- the report ------------------------------------------------------------------------------


def notes(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    k = STEPS_PER_EPOCH
    lines = ["How each row's batches were drawn (and what its accounting assumes):", ""]
    lines += [
        f"- DP-SGD: Poisson sampling over all {len(_DATA['x'])} training examples at rate 1/{k},"
        " each step; independent Gaussian noise; amplified (PoissonSampled Gaussian, composed "
        f"over {settings['epochs'] * k} steps).",
        "- banded, amplified: cyclic Poisson sampling (`CyclicPoissonBatchSampler(noise=mech)`"
        f"): the examples split at random into b groups, step t Poisson-samples group t % b at "
        f"rate b/{k} (expected batch the same); amplified accounting of "
        f"ceil({settings['epochs'] * k} / b) sampled Gaussian releases of sensitivity "
        "||coefs||. b and the coefficients were chosen per epsilon by the prefix-sum error "
        "before training; candidates (b: RMSE, with RDP-calibrated noise):",
    ]
    for r in rows:
        if r["method"] == "banded, amplified":
            coefs = ", ".join(f"{c:.3f}" for c in r["mech"]["coefs"])
            lines.append(f"  - epsilon {r['epsilon']:g}: {r['candidates']}; chosen coefs [{coefs}]")
    blt = next(r for r in rows if r["method"] == "BLT")["mech"]
    lines += [
        "- BLT: `optimal_blt(steps="
        f"{blt['steps']}, participations={blt['participations']}, min_separation={k})` (decays "
        f"{[round(d, 4) for d in blt['decays']]}, scales {[round(s, 4) for s in blt['scales']]}"
        f"); the training set shuffled once (per seed) and cut into {k} fixed batches of 67-68, "
        "visited in the same order every epoch, as jax-privacy runs DP-FTRL; no amplification "
        "(one Gaussian release).",
        "- non-private: the same fixed batches, mean cross-entropy, no clipping or noise.",
        "- JAX rows: the same methods, mechanisms and noise multipliers, the batches drawn by "
        "the numpy samplers (`poisson_batches`, `cyclic_poisson_batches`, a numpy permutation "
        "for the fixed order) and padded to one size with a mask; independent draws from the "
        "PyTorch rows', so the two tables differ by seed noise as well as by framework.",
        "",
        "prefix-sum RMSE: `noise_multiplier * sensitivity * sqrt(max_error)` (DP-SGD: "
        "`noise_multiplier * sqrt(steps)`), the worst step's error of the running sum of noisy "
        "clipped sums per coordinate and unit clip: the proxy the mechanisms minimise. val acc: "
        "the mean validation accuracy over the seeds of the chosen configuration, the one the "
        "grid search maximised; test acc: the same runs on the held-out test set.",
    ]
    return "\n".join(lines)


TABLE_TITLES = {
    "torch": "PyTorch (`pergrad.dp.DPOptimizer(..., noise=mech)` around `torch.optim.SGD`):",
    "jax": "JAX (`pergrad.dp.dpsgd(..., noise=mech)`: `optax_aggregate` then `optax.sgd`, on "
    "`pergrad.per_example_grads`; the run one jitted `lax.scan`):",
}


def header(
    args: argparse.Namespace,
    settings: dict[str, Any],
    load_at_start: str,
    wall: float,
    frameworks: tuple[str, ...],
) -> str:
    grid = (
        f"lr {list(settings['learning_rates'])} x clip {list(settings['max_norms'])}, "
        f"{settings['seeds']} seed(s) each, chosen per (method, epsilon) by mean validation "
        "accuracy"
    )
    return titled(
        "dp_correlated_accuracy.py: DP-SGD, banded and BLT noise at equal epsilon on digits",
        [
            f"machine: {machine.cpu_and_cores()}; {args.workers} worker process(es) of 1 thread",
            machine.software(
                *(("torch",) if "torch" in frameworks else ()),
                *(("jax", "optax") if "jax" in frameworks else ()),
                "dp-accounting",
                "scikit-learn",
                "pergrad",
            ),
            f"date: {machine.timestamp()}",
            f"load average (1, 5, 15 min): {machine.load_span(load_at_start)}",
            f"command: `{machine.command_line()}` ({'quick' if args.quick else 'full'} mode, "
            f"{wall:.0f} s)",
            f"task: digits, 64-{HIDDEN}-10 tanh MLP, {len(_DATA['x'])} train / "
            f"{len(_DATA['x_val'])} validation / {len(_DATA['x_test'])} test, "
            f"{settings['epochs']} epochs of {STEPS_PER_EPOCH} steps, batch 67 (expected or "
            f"fixed), SGD, delta {DELTA:g}, noise calibrated with the "
            f"{settings['accountant'].upper()} accountant",
            f"grid: {grid}",
        ],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seconds: a smoke run")
    parser.add_argument("--workers", type=int, default=2, help="training processes")
    parser.add_argument(
        "--framework", choices=sorted(FRAMEWORKS), default="both", help="which rows to train"
    )
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's RDP order notes
    settings = QUICK if args.quick else FULL
    frameworks = FRAMEWORKS[args.framework]
    load_at_start = machine.load_average()
    start = time.perf_counter()
    _DATA.update(load_split())
    plans = plan_mechanisms(settings)
    runs = run_all(plans, settings, max(1, args.workers), frameworks)
    rows = {framework: best_rows(plans, runs, framework) for framework in frameworks}
    sections = []
    for framework in frameworks:
        sections += [TABLE_TITLES[framework], accuracy_table(rows[framework])]
    sections.append(notes(rows[frameworks[0]], settings))
    if "torch" in frameworks:
        costs = step_costs(plans, settings["timing_rounds"])
        sections += [
            "What the noise adds to a step (PyTorch: same model, same batch of 67, "
            f"DPOptimizer, median of {settings['timing_rounds']} interleaved rounds; buffers: "
            "arrays shaped like the parameters, float32):",
            cost_table(costs),
        ]
    wall = time.perf_counter() - start
    publish(
        "\n\n".join(sections),
        args.out,
        lambda: header(args, settings, load_at_start, wall, frameworks),
    )


if __name__ == "__main__":
    main()

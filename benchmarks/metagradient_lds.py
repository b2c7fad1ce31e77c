"""Metagradients on the digits MLP: the same-seed linear datamodeling score (issue 34).

Run:  python benchmarks/metagradient_lds.py [--quick] [--out PATH]

The run: scikit-learn's digits (8x8 scaled to [0, 1], no download), 1000 training and the next
targets in a fixed shuffle (as benchmarks/attribution_lds.py), an MLP 64-128-10 with tanh,
PyTorch's default initialisation, float64, through ``pergrad.module_loss``; SGD with momentum
0.9 and L2 1e-3 (``pergrad.influence.sgd(lr, momentum=0.9, weight_decay=1e-3)``), 10 epochs of
batches of 32 in a seeded order. The target of each target digit: its margin ``logit_y -
logsumexp(other logits)`` at the end of the run.

The learning rate sets how far the run is from linear in the examples' weights, so each
learning rate of ``LEARNING_RATES`` is a row group: 0.03 is the headline regime (PyTorch's
SGD recipes use 0.01-0.1 with momentum 0.9; by the linear scaling rule, 0.1 at batch 256 is
0.0125 at batch 32), 0.1 the former default (an effective step lr / (1 - momentum) = 1).

Scores: ``pergrad.influence.metagradient`` of the margins (all targets in one call, vectorised
over the adjoints). Ground truth, the same-seed regime: for each drop fraction (1%, 10%, 50%)
and each of ``m`` random subsets (``lds_subsets``), the run retrained with the same
initialisation and order, the dropped examples' weights 0 (their batches keep their size and
normaliser: ``replay``'s ``normalize="batch"``), and the margins recorded; the LDS is the
Spearman correlation of predicted and actual margins over the subsets, averaged over targets
(``pergrad.influence.lds``). The retrainings run all subsets at once (a vectorised loop
written here, the same arithmetic as ``pergrad.influence.replay``, checked against it on one
subset per learning rate). ``linearity_check``: ``pergrad.influence.linearity_check`` at each
fraction (4 drops, 5 training runs), the relative error of the scores' linear prediction.

Seed-averaged regime: attribution_lds.py's ``mlp-sgd`` question (its cached ground truth: 64
half-size subsets, each retrained with 3 training seeds and averaged, 200 targets; learning
rate 0.1, its own initialisation and order), scored on the odd subsets as that table's rows:
the metagradient of the seed-0 run, and the mean of the metagradients of the runs of seeds
0-4 (an ensemble, as TRAK's models).

Times are wall seconds on this machine, torch on one thread (``torch.set_num_threads(1)``: on
a shared machine two threads contend with other processes): the metagradient call (after a
warm-up call on the same run, so that one-off costs are out), per target, and as a multiple of
one training run (``replay`` without weights).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import pergrad
from pergrad import influence
from pergrad.bench.machine import load_average
from pergrad.bench.report import markdown_table, publish, sentence_header
from pergrad.bench.timing import timed

N_TRAIN, HIDDEN, EPOCHS, BATCH, MOMENTUM, L2 = 1000, 128, 10, 32, 0.9, 1e-3
LEARNING_RATES, HEADLINE = (0.01, 0.03, 0.05, 0.1), 0.03
DROPPED = (0.01, 0.10, 0.50)
ENSEMBLE = 5


def load_data(n_train: int, n_target: int) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x, y = torch.tensor(digits.data[order] / 16.0), torch.tensor(digits.target[order])
    end = n_train + n_target
    return x[:n_train], y[:n_train], x[n_train:end], y[n_train:end], x[n_train:], y[n_train:]


def margins_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``logit_y - logsumexp(other logits)`` over the last axis, for any leading axes."""
    onehot = F.one_hot(labels, logits.shape[-1]).bool()
    others = logits.masked_fill(onehot, -torch.inf).logsumexp(-1)
    return (logits * onehot).sum(-1) - others


def stacked_logits(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The MLP on ``x`` (``(n, 64)``) for a stack of ``m`` parameter sets, each leaf ``(m,
    *shape)`` under ``nn.Sequential``'s names: ``(m, n, 10)``."""
    hidden = torch.tanh(
        torch.einsum("ni,mhi->mnh", x, params["0.weight"]) + params["0.bias"][:, None]
    )
    return torch.einsum("mnh,moh->mno", hidden, params["2.weight"]) + params["2.bias"][:, None]


def retrained(setup: dict, weights: np.ndarray) -> dict[str, torch.Tensor]:
    """The run of ``setup`` retrained with each row of ``weights`` (``(m, n_train)``), all at
    once: the final parameters, each ``(m, *shape)``. ``replay``'s arithmetic for
    ``setup["optimizer"]`` (an ``influence.sgd``), vectorised over rows; the model is
    ``setup["stacked_logits"]``, the loss the cross-entropy."""
    x, y = setup["data"]
    optimizer = setup["optimizer"]
    lr, momentum, decay = optimizer.learning_rate, optimizer.momentum, optimizer.weight_decay
    count = len(weights)
    params = {k: v.expand(count, *v.shape) for k, v in setup["params0"].items()}
    velocity = {k: torch.zeros_like(p) for k, p in params.items()}
    weights = torch.as_tensor(weights, dtype=torch.float64)
    for indices in setup["batches"]:
        index = torch.as_tensor(indices)
        params = {k: p.detach().requires_grad_(True) for k, p in params.items()}
        logits = setup["stacked_logits"](params, x[index])
        losses = F.cross_entropy(logits.flatten(0, 1), y[index].repeat(count), reduction="none")
        batch_loss = (weights[:, index] * losses.view(count, -1)).sum() / len(index)
        grads = dict(zip(params, torch.autograd.grad(batch_loss, list(params.values()))))
        with torch.no_grad():
            velocity = {k: momentum * velocity[k] + grads[k] + decay * p for k, p in params.items()}
            params = {k: p - lr * velocity[k] for k, p in params.items()}
    return {k: p.detach() for k, p in params.items()}


def same_seed_truth(
    setup: dict, subsets: int, dropped: tuple[float, ...] = DROPPED, seed: int = 2
) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """The same-seed ground truth of ``setup``'s run: for each fraction of ``dropped``,
    ``(masks (subsets, n_train) bool, outputs (subsets, n_target))``, the masks from
    ``lds_subsets`` (``seed``) and the targets' margins after retraining with the same
    initialisation and order, the dropped examples' weights 0 (``retrained``)."""
    x_target, y_target = setup["targets"]
    truth = {}
    for fraction in dropped:
        masks = influence.lds_subsets(
            len(setup["data"][0]), subsets, fraction=1 - fraction, seed=seed
        )
        logits = setup["stacked_logits"](retrained(setup, masks), x_target)
        truth[fraction] = (masks, margins_of(logits, y_target).numpy())
    return truth


def setup_run(lr: float, n_target: int, epochs: int = EPOCHS) -> dict:
    """The run at learning rate ``lr`` (``epochs`` epochs) and its ``n_target`` targets: what
    ``metagradient``, ``replay`` (``run_of``) and ``retrained`` take, and the held-out digits."""
    x, y, x_target, y_target, x_held, y_held = load_data(N_TRAIN, n_target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 10)
    ).double()
    loss = pergrad.module_loss(model, F.cross_entropy)
    order = np.random.default_rng(1)
    batches = [
        chunk
        for _ in range(epochs)
        for chunk in np.array_split(order.permutation(N_TRAIN), range(BATCH, N_TRAIN, BATCH))
    ]

    def target(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return margins_of(torch.func.functional_call(model, params, (x_target,)), y_target)

    return {
        "lr": lr,
        "loss": loss,
        "params0": loss.params(),
        "data": (x, y),
        "batches": batches,
        "optimizer": influence.sgd(lr, momentum=MOMENTUM, weight_decay=L2),
        "target": target,
        "targets": (x_target, y_target),
        "held_out": (x_held, y_held),
        "stacked_logits": stacked_logits,
    }


def check_against_replay(setup: dict) -> None:
    """The vectorised retraining equals ``influence.replay`` on one subset (or raise)."""
    mask = influence.lds_subsets(len(setup["data"][0]), 1, fraction=0.9, seed=99)
    final = influence.replay(*run_of(setup), mask[0])
    for name, value in retrained(setup, mask.astype(np.float64)).items():
        torch.testing.assert_close(value[0], final[name], rtol=1e-9, atol=1e-11)


def run_of(setup: dict) -> tuple:
    return (setup["loss"], setup["params0"], setup["data"], setup["batches"], setup["optimizer"])


def same_seed_rows(lr: float, n_target: int, subsets: int) -> tuple[list[list[str]], dict]:
    setup = setup_run(lr, n_target)
    check_against_replay(setup)

    def scores_call() -> torch.Tensor:
        return influence.metagradient(*run_of(setup), setup["target"])

    scores_call()  # warm-up
    scores, seconds = timed(scores_call)
    final, train_seconds = timed(lambda: influence.replay(*run_of(setup)))
    x_held, y_held = setup["held_out"]
    logits = torch.func.functional_call(setup["loss"].model, final, (x_held,))
    accuracy = float((logits.argmax(1) == y_held).double().mean())
    rows = []
    for dropped, (masks, outputs) in same_seed_truth(setup, subsets).items():
        per_target = influence.lds(scores, masks, outputs, per_target=True)
        check = influence.linearity_check(
            *run_of(setup), setup["target"], scores, dropped=dropped, num_drops=4
        )
        rows.append(
            [
                f"{lr:g}",
                f"{accuracy:.1%}",
                f"{dropped:.0%}",
                f"{np.nanmean(per_target):.3f}",
                f"{np.nanmin(per_target):.2f} .. {np.nanmax(per_target):.2f}",
                f"{check.relative_error:.2f}",
            ]
        )
        print("  " + " | ".join(rows[-1]), flush=True)
    timing = {"seconds": seconds, "train": train_seconds, "steps": len(setup["batches"])}
    timing["held_out"] = len(y_held)
    return rows, timing


def seed_averaged_rows(quick: bool) -> list[list[str]]:
    """Metagradient rows for attribution_lds.py's seed-averaged ``mlp-sgd`` table (its
    ``metagradient_ensemble``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import attribution_lds as peer

    data = peer.load_data(200 if quick else peer.N_TRAIN, 50 if quick else peer.N_TARGET)
    masks, outputs = peer.ground_truth("mlp-sgd", data, quick)
    rows = []
    for label, scores, seconds in peer.metagradient_ensemble(data, (1, 2 if quick else ENSEMBLE)):
        value = influence.lds(scores, masks[1::2], outputs[1::2])
        rows.append([label, f"{value:.3f}", f"{seconds:.1f}"])
        print("  " + " | ".join(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="10 targets, 8 subsets, the headline learning rate"
    )
    parser.add_argument("--out", help="also write the tables, with a machine header, here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start_load = load_average()
    n_target, subsets = (10, 8) if args.quick else (50, 64)
    rates = (HEADLINE,) if args.quick else LEARNING_RATES
    rows, timings = [], {}
    for lr in rates:
        print(f"learning rate {lr}:", flush=True)
        lr_rows, timings[lr] = same_seed_rows(lr, n_target, subsets)
        rows += lr_rows
    print("seed-averaged regime:", flush=True)
    averaged = seed_averaged_rows(args.quick)
    header = ["lr", "held-out accuracy", "dropped", "LDS (mean over targets)"]
    header += ["per-target range", "linearity_check relative error"]
    timing = timings[HEADLINE]
    per_target = timing["seconds"] / n_target
    lines = [
        "### Same-seed regime (this run)",
        "",
        markdown_table(header, rows),
        "",
        f"{n_target} targets, {subsets} subsets per fraction, {timing['steps']} steps; "
        f"accuracy on the {timing['held_out']} held-out digits. Headline: lr {HEADLINE} (momentum "
        f"{MOMENTUM}). linearity_check: 4 random drops of the row's fraction, 5 training runs.",
        "",
        f"Time at lr {HEADLINE}: metagradient of all {n_target} targets "
        f"{timing['seconds']:.2f} s, {per_target:.3f} s per target; one training run "
        f"(replay) {timing['train']:.2f} s, so a target costs "
        f"{per_target / timing['train']:.2f} training runs (the whole call "
        f"{timing['seconds'] / timing['train']:.1f}). Memory: checkpoint_every=1 keeps "
        f"{timing['steps']} copies of the parameters and the velocity (float64, 9,610 "
        f"parameters each).",
        "",
        "### Seed-averaged regime (attribution_lds.py's mlp-sgd table: lr 0.1, 200 targets, "
        "ground truth averaged over 3 training seeds, LDS on the odd half-size subsets)",
        "",
        markdown_table(["method", "LDS (odd subsets)", "seconds"], averaged),
    ]

    def header_line() -> str:
        return sentence_header(
            "Metagradient attribution, LDS (digits MLP)",
            ["torch", "numpy", "pergrad"],
            [
                "torch on 1 thread",
                f"load average {start_load} at the start, {load_average()} at the end",
            ],
        )

    publish("\n".join(lines), args.out, header_line)


if __name__ == "__main__":
    main()

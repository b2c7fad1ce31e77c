"""Metagradients on the digits MLP: the same-seed linear datamodeling score (issue 34).

Run:  python benchmarks/metagradient_lds.py [--quick] [--out PATH]

The run: scikit-learn's digits (8x8 scaled to [0, 1], no download), 1000 training and the next
targets in a fixed shuffle (as benchmarks/attribution_lds.py), an MLP 64-128-10 with tanh,
float64, PyTorch through ``pergrad.module_loss``; SGD with momentum 0.9, learning rate 0.1,
L2 1e-3 (``pergrad.influence.sgd(0.1, momentum=0.9, weight_decay=1e-3)``), 10 epochs of
batches of 32 in a seeded order. The target of each target digit: its margin ``logit_y -
logsumexp(other logits)`` at the end of the run.

Scores: ``pergrad.influence.metagradient`` of the margins (all targets in one call, vectorised
over the adjoints). Ground truth, the same-seed regime: for each drop fraction (1%, 10%, 50%)
and each of ``m`` random subsets (``lds_subsets``), ``pergrad.influence.replay`` retrains with
the same initialisation and order, the dropped examples' weights 0 (their batches keep their
size), and records the margins; the LDS is the Spearman correlation of predicted and actual
margins over the subsets, averaged over targets (``pergrad.influence.lds``).

Times are wall seconds on this machine, torch on one thread (``torch.set_num_threads(1)``: on
a shared machine two threads contend with other processes): the metagradient call (after a warm-up call on the same
run, so that one-off costs are out), per target, and as a multiple of one training run
(``replay`` without weights).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

import pergrad
from pergrad import influence
from pergrad.bench.machine import load_average
from pergrad.bench.report import markdown_table, publish, sentence_header
from pergrad.bench.timing import timed

N_TRAIN, HIDDEN, EPOCHS, BATCH, LR, MOMENTUM, L2 = 1000, 128, 10, 32, 0.1, 0.9, 1e-3
DROPPED = (0.01, 0.10, 0.50)


def load_data(n_train: int, n_target: int) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x, y = torch.tensor(digits.data[order] / 16.0), torch.tensor(digits.target[order])
    end = n_train + n_target
    return x[:n_train], y[:n_train], x[n_train:end], y[n_train:end]


def margin_of(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    others = torch.where(torch.arange(logits.shape[-1]) == label, -torch.inf, logits)
    return logits[label] - torch.logsumexp(others, 0)


def setup(n_target: int):
    x, y, x_target, y_target = load_data(N_TRAIN, n_target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 10)
    ).double()
    loss = pergrad.module_loss(model, F.cross_entropy)
    order = np.random.default_rng(1)
    batches = [
        chunk
        for _ in range(EPOCHS)
        for chunk in np.array_split(order.permutation(N_TRAIN), range(BATCH, N_TRAIN, BATCH))
    ]

    def target(params: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = torch.func.functional_call(model, params, (x_target,))
        return torch.func.vmap(margin_of)(logits, y_target)

    optimizer = influence.sgd(LR, momentum=MOMENTUM, weight_decay=L2)
    return loss, (x, y), batches, optimizer, target


def run(quick: bool) -> tuple[list[list[str]], dict]:
    n_target, subsets = (10, 8) if quick else (50, 64)
    loss, data, batches, optimizer, target = setup(n_target)
    params0 = loss.params()

    def scores_call():
        return influence.metagradient(loss, params0, data, batches, optimizer, target)

    scores_call()  # warm-up
    scores, seconds = timed(scores_call)
    final, train_seconds = timed(lambda: influence.replay(loss, params0, data, batches, optimizer))
    rows = []
    for dropped in DROPPED:
        masks = influence.lds_subsets(N_TRAIN, subsets, fraction=1 - dropped, seed=2)
        outputs = np.stack(
            [
                target(influence.replay(loss, params0, data, batches, optimizer, mask)).numpy()
                for mask in masks
            ]
        )
        per_target = influence.lds(scores, masks, outputs, per_target=True)
        rows.append(
            [
                f"{dropped:.0%}",
                f"{np.nanmean(per_target):.3f}",
                f"{np.nanmin(per_target):.2f} .. {np.nanmax(per_target):.2f}",
                str(subsets),
            ]
        )
    timing = {
        "targets": n_target,
        "steps": len(batches),
        "seconds": seconds,
        "per_target": seconds / n_target,
        "train": train_seconds,
        "accuracy": float((target(final) > 0).double().mean()),
    }
    return rows, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 targets, 8 subsets: a smoke run")
    parser.add_argument("--out", help="also write the table, with a machine header, here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start_load = load_average()
    rows, timing = run(args.quick)
    table = markdown_table(
        ["dropped", "LDS (mean over targets)", "per-target range", "subsets"], rows
    )
    notes = (
        f"{timing['targets']} targets, {timing['steps']} steps; targets' margin > 0 (correct) "
        f"for {timing['accuracy']:.0%} of them at the end of the run.\n\n"
        f"Time: metagradient of all {timing['targets']} targets {timing['seconds']:.2f} s, "
        f"{timing['per_target']:.3f} s per target; one training run (replay) "
        f"{timing['train']:.2f} s, so a target costs {timing['per_target'] / timing['train']:.2f} "
        f"training runs (the whole call {timing['seconds'] / timing['train']:.1f}). "
        f"Memory: checkpoint_every=1 keeps {timing['steps']} copies of the parameters and the "
        f"velocity (float64, 9,610 parameters each)."
    )

    def header() -> str:
        return sentence_header(
            "Metagradient attribution, same-seed LDS (digits MLP)",
            ["torch", "numpy", "pergrad"],
            [
                "torch on 1 thread",
                f"load average {start_load} at the start, {load_average()} at the end",
            ],
        )

    publish(table + "\n\n" + notes, args.out, header)


if __name__ == "__main__":
    main()

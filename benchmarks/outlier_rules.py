"""Which ``pergrad.outliers.detect`` rule finds flipped labels from gradient norms, over training.

Run:  python benchmarks/outlier_rules.py [--quick] [--seeds 3] [--out PATH]

The flipped-label task of ``examples/find_mislabeled.py``: scikit-learn's digits, 5% of the
training labels flipped to a wrong class, the same MLP (64-32-10, tanh) trained by SGD on the
noisy labels in PyTorch. At several epochs, every training example's gradient norm is computed
(``pergrad.norms.per_example_norms_of``, ghost path) and each rule of ``detect`` flags examples
at its default threshold: ``mad`` (robust z-score > 3.5, the default), ``zscore`` (> 3), ``iqr``
(above Q3 + 1.5 IQR); ``topk`` with k = the number of flipped labels is listed as a reference
(it is told how many there are, which a user does not know). For each rule and epoch: how many
examples it flags, precision (flagged that are flipped), recall (flipped that are flagged) and
F1, averaged over ``--seeds`` seeds (each its own split, flips, initialisation and batch order).
Random flagging has precision 0.05.

``--out PATH`` also writes the table with the machine and its load (``uptime``'s averages at the
start and the end) in a header.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import pergrad
from pergrad.bench import machine
from pergrad.bench.report import markdown_table, publish, titled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from find_mislabeled import BATCH, LR, init_weights, load_noisy_digits  # noqa: E402

RULES = ("mad", "zscore", "iqr", "topk")
EPOCHS = (1, 2, 3, 5, 10, 20, 30)
QUICK_EPOCHS = (1, 3)


def norms_over_training(
    seed: int, epochs: tuple[int, ...]
) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """``{epoch: (N,) gradient norms}`` of the training set at each of ``epochs``, and the
    indices of the flipped labels."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    x, y, flipped = load_noisy_digits(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    weights = init_weights(seed)
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(weights["w1"].T))
        model[2].weight.copy_(torch.from_numpy(weights["w2"].T))
        model[0].bias.zero_()
        model[2].bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    loss = pergrad.module_loss(model, F.cross_entropy)
    rng = np.random.default_rng(seed)
    norms = {}
    for epoch in range(1, max(epochs) + 1):
        order = rng.permutation(len(x))
        for start in range(0, len(x), BATCH):
            idx = order[start : start + BATCH]
            optimizer.zero_grad()
            F.cross_entropy(model(x_t[idx]), y_t[idx]).backward()
            optimizer.step()
        if epoch in epochs:
            values = pergrad.norms.per_example_norms_of(loss, loss.params(), x_t, y_t)
            norms[epoch] = values.detach().numpy().astype(np.float64)
    return norms, flipped


def scores(norms: np.ndarray, flipped: np.ndarray, rule: str) -> tuple[int, float, float, float]:
    """``(flagged, precision, recall, f1)`` of ``rule`` at its default threshold."""
    threshold = len(flipped) if rule == "topk" else None
    found = pergrad.outliers.detect(norms, method=rule, threshold=threshold)
    flagged = set(np.asarray(found.indices).tolist())
    hits = len(flagged & set(flipped.tolist()))
    precision = hits / len(flagged) if flagged else 0.0
    recall = hits / len(flipped)
    f1 = 2 * precision * recall / (precision + recall) if hits else 0.0
    return len(flagged), precision, recall, f1


def measure(seeds: int, epochs: tuple[int, ...]) -> dict[tuple[str, int], np.ndarray]:
    """``{(rule, epoch): (seeds, 4)}`` rows of ``scores``."""
    results: dict[tuple[str, int], list] = {}
    for seed in range(seeds):
        print(f"seed {seed}...", file=sys.stderr)
        norms, flipped = norms_over_training(seed, epochs)
        for epoch, values in norms.items():
            for rule in RULES:
                results.setdefault((rule, epoch), []).append(scores(values, flipped, rule))
    return {key: np.asarray(rows, dtype=np.float64) for key, rows in results.items()}


def table(results: dict[tuple[str, int], np.ndarray], epochs: tuple[int, ...]) -> str:
    header = ["epoch", "rule", "flagged", "precision", "recall", "F1"]
    rows = []
    for epoch in epochs:
        for rule in RULES:
            mean = results[(rule, epoch)].mean(0)
            name = "topk (k = #flipped, oracle)" if rule == "topk" else rule
            rows.append([str(epoch), name, f"{mean[0]:.1f}"] + [f"{v:.2f}" for v in mean[1:]])
    overall = []
    for rule in RULES:
        mean = np.concatenate([results[(rule, e)] for e in epochs]).mean(0)
        name = "topk (k = #flipped, oracle)" if rule == "topk" else rule
        overall.append(["all", name, f"{mean[0]:.1f}"] + [f"{v:.2f}" for v in mean[1:]])
    return markdown_table(header, rows + overall, "rlrrrr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, epochs 1 and 3")
    parser.add_argument("--seeds", type=int, default=3, help="seeds to average over")
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds must be a positive int; got {args.seeds}")
    seeds, epochs = (1, QUICK_EPOCHS) if args.quick else (args.seeds, EPOCHS)
    load_at_start = machine.load_average()
    results = measure(seeds, epochs)
    flipped = len(load_noisy_digits(0)[2])

    def header() -> str:
        return titled(
            "outlier_rules.py: detect's rules on the flipped-label task, over training",
            [
                f"machine: {machine.cpu_and_cores()}",
                machine.software("torch", "numpy", "pergrad"),
                f"date: {machine.timestamp()}",
                f"load average (1, 5, 15 min): {machine.load_span(load_at_start)}",
                f"command: `{machine.command_line()}` ({seeds} seed(s), epochs "
                f"{', '.join(map(str, epochs))})",
                f"task: digits, {flipped} of the training labels flipped (5%); MLP 64-32-10 "
                f"tanh, SGD lr {LR}, batch {BATCH}; means over seeds; random flagging has "
                f"precision 0.05",
            ],
        )

    publish(table(results, epochs), args.out, header)


if __name__ == "__main__":
    main()

"""What the float64 Gram route of the PyTorch ghost norms costs (issue 15).

Run:  python benchmarks/gram_precision.py [--out PATH]

For a layer applied at T positions, the ghost norm ``sum_{t,s} (a_t . a_s)(d_t . d_s)`` is
computed in float64 (float32 rounds badly where per-position gradients cancel). Side by side in
one run, medians of 7 (interleaved), on float32 inputs: the float32 Gram route it replaced, the
float64 one pergrad uses (in T x T blocks), forming the per-example gradient ``a^T d`` instead,
the layer's own forward pass as the unit of cost, and what pergrad's per-layer cost model
(``torch_layers.gram_is_cheaper``, issue 19) picks and costs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch

from pergrad._src.capture import torch_layers
from pergrad.bench.machine import cpu_model

SHAPES = [
    (16, 128, 256, 256),
    (16, 64, 256, 1024),
    (8, 128, 768, 768),
    (16, 32, 768, 768),
    (4, 512, 768, 768),
    (2, 1024, 768, 3072),
    (32, 65, 128, 512),  # ViT MLP (the small config of dp_transformers.py)
    (32, 65, 512, 128),
    (16, 128, 256, 1024),  # BERT / GPT-2 MLP (small configs)
    (8, 128, 768, 3072),  # GPT-2 small's MLP
]


def float64_gram(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch_layers._blocked_gram(a.double(), d.double())  # noqa: SLF001


def float32_gram(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return ((a @ a.transpose(-1, -2)) * (d @ d.transpose(-1, -2))).sum((1, 2, 3))


def formed(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return ((a.transpose(-1, -2) @ d) ** 2).sum((1, 2, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = [
        "| B | T | in | out | float32 Gram ms | float64 Gram ms | formed ms | layer forward ms "
        "| float64 / float32 | float64 / forward | pergrad takes | pergrad ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch, length, width_in, width_out in SHAPES:
        a = torch.randn(batch, 1, length, width_in)
        d = torch.randn(batch, 1, length, width_out)
        w = torch.randn(width_in, width_out)
        methods = {
            "f32": (float32_gram, (a, d)),
            "f64": (float64_gram, (a, d)),
            "pergrad": (torch_layers.outer_product_squared_norms, (a, d)),
            "formed": (formed, (a, d)),
            "forward": (torch.matmul, (a, w)),
        }
        times: dict[str, list[float]] = {name: [] for name in methods}
        for fn, operands in methods.values():
            fn(*operands)
        for _ in range(args.rounds):
            for name, (fn, operands) in methods.items():
                start = time.perf_counter()
                fn(*operands)
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        lines.append(
            f"| {batch} | {length} | {width_in} | {width_out} | {ms['f32']:.2f} | {ms['f64']:.2f} "
            f"| {ms['formed']:.2f} | {ms['forward']:.2f} | {ms['f64'] / ms['f32']:.2f} "
            f"| {ms['f64'] / ms['forward']:.2f} "
            f"| {'Gram' if torch_layers.gram_is_cheaper(length, width_in, width_out) else 'formed'} "
            f"| {ms['pergrad']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        header = (
            f"# gram_precision.py\n\nMachine: {cpu_model()}, {os.cpu_count()} cores, "
            f"{platform.system()}, torch {torch.__version__}, "
            f"{datetime.date.today().isoformat()}.\n\n"
        )
        with open(args.out, "w") as f:
            f.write(header + table + "\n")


if __name__ == "__main__":
    main()

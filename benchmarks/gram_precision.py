"""What the float64 Gram route of the PyTorch ghost norms costs (issue 15).

Run:  python benchmarks/gram_precision.py [--out PATH]

For a layer applied at T positions, the ghost norm ``sum_{t,s} (a_t . a_s)(d_t . d_s)`` is
computed in float64 (float32 rounds badly where per-position gradients cancel). Side by side in
one run, medians of 7 (interleaved), on float32 inputs: the float32 Gram route it replaced, the
float64 one pergrad uses (in T x T blocks), forming the per-example gradient ``a^T d`` instead,
the layer's own forward pass as the unit of cost, and what pergrad's per-layer cost model
(``cost.gram_is_cheaper``, issue 19) picks and costs.
"""

from __future__ import annotations

import argparse
import functools

import torch

from pergrad._src.capture import torch_layers, torch_norms
from pergrad.bench.report import markdown_table, publish, sentence_header
from pergrad.bench.timing import median_ms, time_interleaved

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
    return torch_norms._blocked_gram(a.double(), d.double())  # noqa: SLF001


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
    header = ["B", "T", "in", "out", "float32 Gram ms", "float64 Gram ms", "formed ms"]
    header += ["layer forward ms", "float64 / float32", "float64 / forward", "pergrad takes"]
    header.append("pergrad ms")
    rows = []
    for batch, length, width_in, width_out in SHAPES:
        a = torch.randn(batch, 1, length, width_in)
        d = torch.randn(batch, 1, length, width_out)
        w = torch.randn(width_in, width_out)
        methods = {
            "f32": functools.partial(float32_gram, a, d),
            "f64": functools.partial(float64_gram, a, d),
            "pergrad": functools.partial(torch_layers.outer_product_squared_norms, a, d),
            "formed": functools.partial(formed, a, d),
            "forward": functools.partial(torch.matmul, a, w),
        }
        times = time_interleaved(methods, args.rounds, warmup=1)
        ms = {name: median_ms(t) for name, t in times.items()}
        taken = "Gram" if torch_norms.gram_is_cheaper(length, width_in, width_out) else "formed"
        rows.append(
            [str(batch), str(length), str(width_in), str(width_out)]
            + [f"{ms[name]:.2f}" for name in ("f32", "f64", "formed", "forward")]
            + [f"{ms['f64'] / ms['f32']:.2f}", f"{ms['f64'] / ms['forward']:.2f}", taken]
            + [f"{ms['pergrad']:.2f}"]
        )
    table = markdown_table(header, rows)
    publish(table, args.out, lambda: sentence_header("gram_precision.py", ["torch"]))


if __name__ == "__main__":
    main()

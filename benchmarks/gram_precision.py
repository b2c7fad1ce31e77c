"""What the Gram routes of the PyTorch ghost norms cost (issues 15 and 36).

Run:  python benchmarks/gram_precision.py [--out PATH]

For a layer applied at T positions, the ghost norm ``sum_{t,s} (a_t . a_s)(d_t . d_s)``
rounds badly in float32 where per-position gradients cancel: pergrad computes it in float32
with a certified rounding bound where that bound is tight enough, else in float64. Side by side
in one run, medians of 7 (interleaved), on float32 inputs: a bare float32 Gram route, the
float64 one (in T x T blocks), forming the per-example gradient ``a^T d``, pergrad's certified
float32 Gram and formed routes (each with its bound; the Gram route also forming every ``T x
T`` block, as before it formed only those on and above the diagonal), the layer's own forward
pass as the unit
of cost, and what pergrad's per-layer cost model (``cost.gram_is_cheaper``, priced in the
precision the Gram route takes: ``cost.FAST_GRAM_COST`` for the certified float32 one) picks
and costs.
"""

from __future__ import annotations

import argparse
import functools

import torch

from pergrad._src.capture import cost, torch_layers, torch_norms
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
    (16, 128, 256, 768),  # BERT / GPT-2 fused q, k, v (small configs)
    (32, 65, 128, 384),  # ViT q, k, v
    (32, 65, 128, 128),
    (32, 32, 64, 192),  # pergrad.bench's transformer
    (32, 96, 256, 256),
    (8, 256, 768, 3072),  # GPT-2 small's MLP at 256 tokens (the symmetric blocks: 2 of 128)
    (2, 1024, 1024, 4096),  # a wider MLP at 1024 tokens (8 blocks of 128)
]


def float64_gram(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch_norms._blocked_gram(a.double(), d.double())  # noqa: SLF001


def float32_gram(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return ((a @ a.transpose(-1, -2)) * (d @ d.transpose(-1, -2))).sum((1, 2, 3))


def formed(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return ((a.transpose(-1, -2) @ d) ** 2).sum((1, 2, 3))


def certified(a: torch.Tensor, d: torch.Tensor, route: object) -> object:
    """pergrad's certified float32 route ``route`` (estimate and bound), a few examples at a
    time as the ghost norms run it."""
    return torch_norms._in_chunks(a, d, route, 0.0)  # noqa: SLF001


def every_block(a: torch.Tensor, d: torch.Tensor) -> object:
    """The certified float32 Gram route forming every ``T x T`` block, as before the symmetric
    blocks (``cost.SYMMETRIC_GRAM`` off while it runs)."""
    cost.SYMMETRIC_GRAM = False
    try:
        return certified(a, d, torch_norms._gram_in)  # noqa: SLF001
    finally:
        cost.SYMMETRIC_GRAM = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    torch.manual_seed(0)
    header = ["B", "T", "in", "out", "float32 Gram ms", "float64 Gram ms", "formed ms"]
    header += ["certified Gram ms", "certified formed ms", "certified Gram / formed"]
    header += ["certified Gram, every block ms", "symmetric / every block"]
    header += ["T (p + q) / p q", "layer forward ms", "float64 / float32", "pergrad takes"]
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
            "certified Gram": functools.partial(certified, a, d, torch_norms._gram_in),  # noqa: SLF001
            "certified formed": functools.partial(certified, a, d, torch_norms._formed_in),  # noqa: SLF001
            "every block": functools.partial(every_block, a, d),
            "forward": functools.partial(torch.matmul, a, w),
        }
        times = time_interleaved(methods, args.rounds, warmup=1)
        ms = {name: median_ms(t) for name, t in times.items()}
        unit = torch_norms.unit_roundoff(a.dtype)
        fast = cost.fast_gram_suffices(length, (width_in, width_out), unit)
        taken = "Gram" if cost.gram_is_cheaper(length, width_in, width_out, fast) else "formed"
        taken += f" ({'float32' if fast else 'float64'} Gram priced)"
        ratio = ms["certified Gram"] / ms["certified formed"]
        rows.append(
            [str(batch), str(length), str(width_in), str(width_out)]
            + [f"{ms[name]:.2f}" for name in ("f32", "f64", "formed")]
            + [f"{ms['certified Gram']:.2f}", f"{ms['certified formed']:.2f}", f"{ratio:.2f}"]
            + [f"{ms['every block']:.2f}", f"{ms['certified Gram'] / ms['every block']:.2f}"]
            + [f"{length * (width_in + width_out) / (width_in * width_out):.2f}"]
            + [f"{ms['forward']:.2f}", f"{ms['f64'] / ms['f32']:.2f}", taken]
            + [f"{ms['pergrad']:.2f}"]
        )
    table = markdown_table(header, rows)
    publish(table, args.out, lambda: sentence_header("gram_precision.py", ["torch"]))


if __name__ == "__main__":
    main()

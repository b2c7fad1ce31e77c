"""What each precision of the ghost norms' routes costs on a device, and the cost model's
constants measured there (issue 38).

Run:  python -m benchmarks.device_costs [--device cuda] [--quick] [--out PATH.md]

For a linear layer applied at T positions, an example's squared gradient norm is either the Gram
route ``sum_{t,s} (a_t . a_s)(d_t . d_s)`` or the formed route ``|a^T d|^2``. Side by side in
one run (medians of interleaved rounds, each call waited for on an accelerator), on float32
records of GPT-2-like shapes: the Gram matrices in float64, float32, TF32 (float32 with
``torch.backends.cuda.matmul.allow_tf32``) and bfloat16, the formed gradient in float32, the
route pergrad takes (``torch_layers.outer_product_squared_norms``, certified), and the layer's
own forward pass ``a @ W``, the unit of every ratio.

A second table gives the constants of ``pergrad/_src/capture/cost.py`` on this device: the
stall of one host read of a result (``SYNC_COST``'s time), the float32 multiply-adds per second
of a matrix product, their ratio (``SYNC_COST`` in multiply-adds), and the cost of a float64
multiply-add in float32 ones (``FLOAT64_COST`` / ``FLOAT64_ACCELERATOR_COST``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Iterator

import torch

from pergrad._src.capture import torch_layers
from pergrad._src.capture.cost import FLOAT64_ACCELERATOR_COST, FLOAT64_COST, SYNC_COST
from pergrad.bench.methods import synced
from pergrad.bench.report import describe_device, markdown_table, publish, sentence_header
from pergrad.bench.timing import median_ms, time_interleaved

SHAPES = [  # (B, T, in, out)
    (16, 128, 768, 768),  # GPT-2 small's attention projection
    (16, 128, 768, 3072),  # its MLP
    (8, 512, 768, 768),
    (8, 512, 768, 3072),
    (32, 65, 128, 512),  # ViT MLP (small config)
    (64, 16, 256, 256),  # short sequences: the formed route's ground
]
QUICK_SHAPES = [(2, 8, 16, 16), (2, 16, 32, 8)]
PRECISIONS = ("float64", "float32", "tf32", "bf16")


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def gram(a: torch.Tensor, d: torch.Tensor, precision: str) -> torch.Tensor:
    """``sum_{t,s} (a_t . a_s)(d_t . d_s)`` per example, the products in ``precision``, the
    sum in float32 (float64 for float64)."""
    dtype = {"float64": torch.float64, "bf16": torch.bfloat16}.get(precision, torch.float32)
    a, d = a.to(dtype), d.to(dtype)
    with tf32(precision == "tf32"):
        product = (a @ a.transpose(-1, -2)).float() * (d @ d.transpose(-1, -2)).float()
    return product.sum((1, 2))


def formed(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return ((a.transpose(-1, -2) @ d) ** 2).sum((1, 2))


def route_rows(device: torch.device, shapes: list[tuple[int, ...]], rounds: int) -> list[list[str]]:
    rows = []
    for batch, length, width_in, width_out in shapes:
        generator = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(batch, length, width_in, generator=generator).to(device)
        d = torch.randn(batch, length, width_out, generator=generator).to(device)
        w = torch.randn(width_in, width_out, generator=generator).to(device)
        methods = {p: functools.partial(gram, a, d, p) for p in PRECISIONS}
        methods["formed"] = functools.partial(formed, a, d)
        methods["pergrad"] = functools.partial(
            torch_layers.outer_product_squared_norms, a[:, None], d[:, None]
        )
        methods["forward"] = functools.partial(torch.matmul, a, w)
        times = time_interleaved({k: synced(v, device) for k, v in methods.items()}, rounds, 2)
        ms = {name: median_ms(t) for name, t in times.items()}
        exact = gram(a, d, "float64")
        errors = [
            float(((gram(a, d, p).double() - exact).abs() / exact.abs()).max()) for p in PRECISIONS
        ]
        rows.append(
            [str(batch), str(length), str(width_in), str(width_out), f"{ms['forward']:.3f}"]
            + [f"{ms[p] / ms['forward']:.2f}" for p in PRECISIONS]
            + [f"{ms['formed'] / ms['forward']:.2f}", f"{ms['pergrad'] / ms['forward']:.2f}"]
            + [f"{e:.0e}" for e in errors[1:]]
        )
    return rows


def sync_ms(device: torch.device, rounds: int) -> float:
    """Median time of one host read of a just-computed scalar (kernel launch, completion, copy)."""
    x = torch.ones(16, device=device)
    samples = []
    for _ in range(max(rounds, 20)):
        start = time.perf_counter()
        float((x * 2).sum())
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def madds_per_s(device: torch.device, dtype: torch.dtype, size: int, rounds: int) -> float:
    """Multiply-adds per second of a ``size``-square matrix product in ``dtype``."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    times = time_interleaved({"mm": synced(lambda: a @ a, device)}, rounds, 2)["mm"]
    return size**3 / statistics.median(times)


def constants_rows(device: torch.device, quick: bool, rounds: int) -> list[list[str]]:
    size = 256 if quick else 4096
    sync = sync_ms(device, rounds)
    float32_rate = madds_per_s(device, torch.float32, size, rounds)
    float64_rate = madds_per_s(device, torch.float64, size, rounds)
    sync_madds = sync * 1e-3 * float32_rate
    return [
        ["host read of a result (ms)", f"{sync:.4f}", "-"],
        [f"float32 multiply-adds per second ({size}^3 product)", f"{float32_rate:.3g}", "-"],
        [f"float64 multiply-adds per second ({size}^3 product)", f"{float64_rate:.3g}", "-"],
        [
            "SYNC_COST: a host read, in float32 multiply-adds",
            f"{sync_madds:.3g}",
            f"{SYNC_COST:.3g}",
        ],
        [
            "a float64 multiply-add, in float32 ones",
            f"{float32_rate / float64_rate:.2f}",
            f"{FLOAT64_ACCELERATOR_COST} (accelerators), {FLOAT64_COST} (CPU)",
        ],
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 rounds (smoke run)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rounds = 3 if args.quick else args.rounds
    shapes = QUICK_SHAPES if args.quick else SHAPES
    torch.manual_seed(0)
    header = ["B", "T", "in", "out", "forward ms"]
    header += [f"Gram {p} / forward" for p in PRECISIONS]
    header += ["formed / forward", "pergrad / forward"]
    header += [f"Gram {p} max rel. error" for p in PRECISIONS[1:]]
    routes = markdown_table(header, route_rows(device, shapes, rounds))
    constants = markdown_table(
        ["constant", "measured here", "pergrad's value"], constants_rows(device, args.quick, rounds)
    )
    text = (
        f"Device: {describe_device(device)}. Ratios to the layer's forward pass `a @ W` "
        f"(float32), medians of {rounds} interleaved rounds; errors against the float64 Gram "
        "route, on random (non-cancelling) records.\n\n"
        f"{routes}\n\n## The cost model's constants on this device\n\n{constants}"
    )
    publish(text, args.out, lambda: sentence_header("device_costs.py", ["torch"]))


if __name__ == "__main__":
    main()

"""What secure noise costs: ``pergrad.dp.SecureRandom`` against the frameworks' generators.

Run:  python benchmarks/secure_noise.py [--rounds 5] [--out PATH]

Side by side in one run, medians of ``--rounds`` (interleaved): drawing the DP-SGD noise for a
model of P parameters (float32) with ``pergrad.dp.add_noise`` from a seeded ``torch.Generator``,
from a JAX key under ``jax.jit``, and from ``SecureRandom`` (the OS's cryptographic source, two
Gaussians summed per value, on the host) for each framework.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import torch

from pergrad import dp
from pergrad.bench.report import markdown_table, publish, sentence_header
from pergrad.bench.timing import median_ms, time_interleaved

SIZES = [1_000_000, 10_000_000]


def measure(size: int, rounds: int, secure: dp.SecureRandom) -> dict[str, float]:
    """Median milliseconds of each noise source for ``size`` float32 parameters."""
    grads_t = {"w": torch.zeros(size)}
    grads_j = {"w": jnp.zeros(size)}
    generator = torch.Generator().manual_seed(0)
    key = jax.random.key(0)
    jax_key = jax.jit(lambda g, k: dp.add_noise(g, 1.0, k))
    jax_secure = jax.jit(lambda g: dp.add_noise(g, 1.0, secure))
    methods = {
        "torch": lambda: dp.add_noise(grads_t, 1.0, generator),
        "secure_torch": lambda: dp.add_noise(grads_t, 1.0, secure),
        "jax": lambda: jax.block_until_ready(jax_key(grads_j, key)),
        "secure_jax": lambda: jax.block_until_ready(jax_secure(grads_j)),
    }
    times = time_interleaved(methods, rounds, warmup=1)
    return {name: median_ms(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    secure = dp.SecureRandom()
    header = ["parameters", "torch.Generator ms", "SecureRandom (torch) ms", "JAX key, jit ms"]
    header += ["SecureRandom (JAX, jit) ms", "secure / torch", "secure / JAX"]
    rows = []
    for size in SIZES:
        ms = measure(size, args.rounds, secure)
        rows.append(
            [f"{size:,}"]
            + [f"{ms[name]:.1f}" for name in ("torch", "secure_torch", "jax", "secure_jax")]
            + [f"{ms['secure_torch'] / ms['torch']:.1f}x", f"{ms['secure_jax'] / ms['jax']:.1f}x"]
        )
    table = markdown_table(header, rows)
    publish(table, args.out, lambda: sentence_header("secure_noise.py", ["torch", "jax"]))


if __name__ == "__main__":
    main()

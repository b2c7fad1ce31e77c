"""The arithmetic of the JAX DP step against the non-private step, from XLA's own cost analysis
(issue 36): how far the ghost step can get towards the non-private step's time at all.

Run:  python -m benchmarks.dp_flops_jax [--quick] [--out PATH.md]

For the tied flax linen language model of ``benchmarks/dp_transformers_jax.py`` at several widths
and sequence lengths (4 layers, vocabulary 8192, batch 16), both steps of
``benchmarks/fsdp_memory_jax.py`` (``jax.grad`` of the batch loss, and
``pergrad.dp.private_grad_of(..., strategy="ghost")``, each then ``optax.sgd``) are traced and
the FLOP of their matrix products (``dot_general``) counted from the jaxpr. A ``cond`` counts its
cheapest branch: the certified norms' tightening (an example's norm again in float64, or formed)
runs only for examples whose rounding bound is loose; the last ratio counts it as taken for
every example. (XLA's ``cost_analysis()`` counts both branches of a ``cond``, so it reports the
tightening as always taken.) Nothing is timed, so the numbers are free of the machine's load.

Why the ratio moves with the shapes: a dense layer of ``p`` inputs and ``q`` outputs applied at
``T`` positions costs ``T p q`` multiply-adds per example for its weight gradient, while its
ghost norm costs ``min(T^2 (p + q), T p q)`` more (the Gram route or the formed gradient); the
forward and backward passes together cost about three weight gradients. So the norms add about
``min(T (p + q), p q) / (3 p q)`` of the step: for an MLP layer (``q = 4 p``) at 128 tokens,
0.21 at width 256 and 0.07 at width 768 (the table's last column: ``1 +`` that share). The
attention projections (``q = p``) and the tied output layer add more.

The committed results: ``--out benchmarks/results/cpu/dp_flops_jax.md`` (minutes of compiling).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

from benchmarks.dp_transformers_jax import FULL, QUICK, workload
from benchmarks.fsdp_memory_jax import steps
from pergrad.bench.report import markdown_table, publish, sentence_header

SHAPES = ((256, 128), (256, 512), (768, 128), (1024, 128))  # (width, tokens)


def dot_flops(eqn: Any) -> int:
    """FLOP of one ``dot_general``: 2 x batch x contracted x both free sizes."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    free_lhs = math.prod(n for i, n in enumerate(lhs) if i not in (*lhs_contract, *lhs_batch))
    free_rhs = math.prod(n for i, n in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch))
    batch = math.prod(lhs[i] for i in lhs_batch)
    return 2 * batch * math.prod(lhs[i] for i in lhs_contract) * free_lhs * free_rhs


def matmul_flops(jaxpr: Any) -> tuple[int, int]:
    """``(usual, worst)``: the matrix products' FLOP of a jaxpr, a ``cond`` counted by its
    cheapest branch (usual: the certified norms' tightening is not taken) and its dearest."""
    usual = worst = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            usual, worst = usual + dot_flops(eqn), worst + dot_flops(eqn)
        elif eqn.primitive.name == "cond":
            costs = [matmul_flops(branch.jaxpr) for branch in eqn.params["branches"]]
            usual += min(c[0] for c in costs)
            worst += max(c[1] for c in costs)
        else:
            for inner in _sub_jaxprs(eqn):
                u, w = matmul_flops(inner)
                scale = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
                usual, worst = usual + scale * u, worst + scale * w
    return usual, worst


def _sub_jaxprs(eqn: Any) -> list[Any]:
    found = []
    for param in eqn.params.values():
        for item in param if isinstance(param, (list, tuple)) else [param]:
            inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr, or a Jaxpr itself
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def costs(config: Any) -> dict[str, tuple[int, int]]:
    import jax

    work = workload("flax linen", config)
    return {
        name: matmul_flops(jax.make_jaxpr(step)(work.params, work.ids, jax.random.key(0)).jaxpr)
        for name, step in steps(work).items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny config only (smoke run)")
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args(argv)
    configs = (
        [QUICK]
        if args.quick
        else [replace(FULL, width=w, heads=w // 64, length=t) for w, t in SHAPES]
    )
    rows = []
    for config in configs:
        found = costs(config)
        (base, _), (usual, worst) = found["non-private"], found["pergrad DP"]
        p, q = config.width, 4 * config.width  # an MLP layer's
        share = min(config.length * (p + q), p * q) / (3 * p * q)
        rows.append(
            [
                str(config.width),
                str(config.length),
                f"{base / 1e9:.1f}",
                f"{usual / 1e9:.1f}",
                f"{usual / base:.2f}",
                f"{worst / base:.2f}",
                f"{1 + share:.2f}",
            ]
        )
    table = markdown_table(
        [
            "width",
            "tokens",
            "non-private GFLOP",
            "DP GFLOP",
            "DP / non-private",
            "DP / non-private, every example tightened",
            "the MLP layers' estimate",
        ],
        rows,
    )
    text = (
        "Tied flax linen LM, 4 layers, vocabulary 8192, batch 16; the matrix products' FLOP of "
        "each step's jaxpr (nothing timed; the tightening in float64 or formed, taken only for "
        f"examples whose norm's bound is loose, in the last ratio).\n\n{table}"
    )
    publish(text, args.out, lambda: sentence_header("dp_flops_jax.py", ["jax", "flax"]))


if __name__ == "__main__":
    main()

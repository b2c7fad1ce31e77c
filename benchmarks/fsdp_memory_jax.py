"""Per-device memory of the JAX DP step with the parameters sharded over N devices, against the
non-private step sharded the same way (issue 37, the JAX side of ``fsdp_memory.py``).

Run:  python -m benchmarks.fsdp_memory_jax [--quick] [--out PATH.md]

The committed results: ``--out benchmarks/results/cpu/fsdp_memory_jax.md`` (a few minutes of
compiling on 2 cores). ``--quick``: the tiny config on 1 and 2 devices, compiled without XLA's
optimisations (a smoke run).

The model is the tied flax linen language model of ``benchmarks/dp_transformers_jax.py`` (4
layers, width 256, vocabulary 8192, 128 tokens, batch 16; ``--quick``: its tiny config). For N =
1, 2, 4 and 8 devices (forced host devices of this CPU: the script re-runs itself with
``--xla_force_host_platform_device_count=8`` when JAX has fewer), the parameters are split over
a ``model`` axis of N devices with ``pergrad.dp.shard_params`` and two steps are compiled with
``jax.jit``, each ending in an ``optax.sgd`` update whose new parameters are placed as the old
ones (``out_shardings``):

* ``non-private``: ``jax.grad`` of the batch loss;
* ``pergrad DP``: ``pergrad.dp.private_grad_of(..., strategy="ghost")``: per-example clipping on
  the ghost path and Gaussian noise.

Memory is XLA's own account of the compiled program on one device
(``compiled.memory_analysis()``: what the program takes as arguments, returns and needs as
temporary buffers on each device), exact and free of timing noise; the forced host devices share
this machine's cores, so no time is reported. The parameters per device are the bytes of one
device's shards. What it shows: the parameters (arguments) per device fall as 1/N in both steps,
and the DP step's temporary buffers against the non-private step's at every N.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from benchmarks.dp_transformers_jax import FULL, QUICK, workload
from pergrad.bench.report import markdown_table, publish, sentence_header

DEVICES = (1, 2, 4, 8)
FORCED = "--xla_force_host_platform_device_count=8"
MAX_NORM, NOISE = 1.0, 1.0


def steps(work: Any) -> dict[str, Any]:
    """The two training steps ``(params, ids, key) -> new params`` on ``work``."""
    import jax
    import optax

    import pergrad

    tx = optax.sgd(1e-3)
    size = work.ids.shape[0]

    def non_private(params: Any, ids: Any, key: Any) -> Any:
        grad = jax.grad(work.loss)(params, ids)
        return optax.apply_updates(params, tx.update(grad, tx.init(params), params)[0])

    def private(params: Any, ids: Any, key: Any) -> Any:
        grad, _ = pergrad.dp.private_grad_of(
            work.loss,
            params,
            ids,
            max_norm=MAX_NORM,
            noise_multiplier=NOISE,
            rng=key,
            expected_batch_size=size,
            strategy="ghost",
        )
        return optax.apply_updates(params, tx.update(grad, tx.init(params), params)[0])

    return {"non-private": non_private, "pergrad DP": private}


def measure(config: Any, devices: tuple[int, ...]) -> list[list[str]]:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import pergrad

    work = workload("flax linen", config)
    rows = []
    for count in devices:
        mesh = Mesh(np.array(jax.devices()[:count]).reshape(1, count), ("batch", "model"))
        params = pergrad.dp.shard_params(work.params, mesh)
        (ids,) = pergrad.dp.shard_batch((work.ids,), mesh)
        like = jax.tree.map(lambda leaf: leaf.sharding, params)
        shard_bytes = sum(
            leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(params)
        )
        temps = {}
        for name, step in steps(work).items():
            compiled = (
                jax.jit(step, out_shardings=like).lower(params, ids, jax.random.key(0)).compile()
            )
            memory = compiled.memory_analysis()
            temps[name] = memory.temp_size_in_bytes
            rows.append(
                [
                    str(count),
                    name,
                    f"{shard_bytes / 2**20:.2f}",
                    f"{memory.argument_size_in_bytes / 2**20:.2f}",
                    f"{memory.output_size_in_bytes / 2**20:.2f}",
                    f"{memory.temp_size_in_bytes / 2**20:.2f}",
                    f"{temps[name] / temps['non-private']:.2f}",
                ]
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny config (smoke run)")
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args(argv)
    if FORCED not in os.environ.get("XLA_FLAGS", ""):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FORCED}".strip()
        if args.quick:  # compiling is all a smoke run does: without XLA's optimisations
            env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
            env["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
        command = [sys.executable, "-m", "benchmarks.fsdp_memory_jax", *(argv or sys.argv[1:])]
        raise SystemExit(subprocess.run(command, env=env, check=False).returncode)
    config = QUICK if args.quick else FULL
    table = markdown_table(
        [
            "devices",
            "step",
            "parameters MiB / device",
            "arguments MiB",
            "outputs MiB",
            "temporaries MiB",
            "temporaries / non-private",
        ],
        measure(config, (1, 2) if args.quick else DEVICES),
    )
    text = (
        f"Tied flax linen LM, {config.layers} layers, width {config.width}, vocabulary "
        f"{config.vocab}, {config.length} tokens, batch {config.batch_size}; the parameters "
        "sharded over N forced host devices; XLA's memory_analysis of each compiled step, per "
        f"device.\n\n{table}"
    )
    publish(text, args.out, lambda: sentence_header("fsdp_memory_jax.py", ["jax", "flax"]))


if __name__ == "__main__":
    main()

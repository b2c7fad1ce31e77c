"""What the non-finite cleaning costs: a DP-SGD step with it against the same step without it.

Run:  python benchmarks/nonfinite_cost.py [--quick] [--rounds 31] [--out PATH]

Every DP reduction of pergrad zeroes an example whose gradient is not finite (see
``pergrad.dp.clipped_sum``), with an ``isfinite`` on the norms and ``where`` passes: over the
``B x P`` per-example gradients (materialised) or over the layers' recorded inputs and output
gradients (ghost; PyTorch cleans the records only when some norm is not finite, which one
host sync per step checks). There is no switch to turn it off, so the step WITHOUT it is the
same step with the library's internals replaced, for the measurement only, by versions that
skip that work: the clip weights without ``isfinite``/``where`` (``clip_weights``, in the
module that defines ``pergrad.dp.private_grad_of``), the materialised clipped sum as a plain
``factors @ gradients`` (``clipped_sum``, there too), and the ghost record cleaning as the
identity (``ghost_torch.weighted_calls``, ``ghost_jax._weighted_rows``). On finite data both
steps compute the same update: the script checks it (``max |diff|``, same noise seed).

The step: ``pergrad.dp.private_grad_of`` (clip, sum, Gaussian noise, divide by the expected
batch size) with ``strategy="materialize"`` or ``"ghost"``, then an SGD update; JAX under
``jax.jit`` (each variant traced and compiled once), PyTorch eagerly through
``pergrad.module_loss``. Workload: an MLP 512-512-512-10 (0.53 M parameters), ReLU,
cross-entropy, batch 128 (``--quick``: 256-256-10, batch 32, 3 rounds). Side by side in one
run: medians of ``--rounds`` interleaved rounds, and the median of the per-round ratios
with / without. ``--out PATH`` also writes the markdown with a machine header (the load
average at the start and the end: the machine may be shared). PyTorch runs on
``--torch-threads`` threads (default 1): on a busy 2-core machine its two threads spun
against each other and every eager step took 20 to 60 times longer.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pergrad.bench import machine
from pergrad.bench.report import markdown_table, publish, titled
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved

FULL = dict(widths=(512, 512, 512, 10), batch_size=128, rounds=31, warmup=2)
QUICK = dict(widths=(256, 256, 10), batch_size=32, rounds=3, warmup=1)
STRATEGIES = ("materialize", "ghost")
MAX_NORM, NOISE_MULTIPLIER, LR = 1.0, 1.0, 0.1


# --- the step without the non-finite cleaning ---------------------------------------------


def plain_clip_weights(
    bk: Any, group_norms: list[Any], bounds: list[float], mask: Any, policy: Any = None
) -> Any:
    """``clip_weights`` without ``isfinite``/``where``: right for finite norms only."""
    from pergrad._src.dp.clipping import ClipWeights, clip_factors

    factors = clip_factors if policy is None else policy.factors
    ones = group_norms[0] * 0 + 1
    real = ones if mask is None else ones * mask
    weights = [factors(n, b) * real for n, b in zip(group_norms, bounds)]
    return ClipWeights(weights, real, ones > 0)  # "finite": all True for finite norms


def plain_clipped_sum(grads: Any, max_norm: float, mask: Any = None, clipping: Any = None) -> Any:
    """``pergrad.dp.clipped_sum`` (one flat bound) as ``factors @ gradients``, no cleaning."""
    from pergrad._src.dp.clipping import clip_statistics
    from pergrad._src.norms import flat_leaves

    bk, _, flat, treedef, _ = flat_leaves("plain_clipped_sum", grads)
    _, leaves, _ = bk.flatten(grads)
    norms = sum((leaf**2).sum(1) for leaf in flat) ** 0.5
    weights = plain_clip_weights(bk, [norms], [float(max_norm)], mask, clipping)
    summed = [
        (weights.weights[0] @ f_leaf).reshape(bk.shape(leaf)[1:])
        for f_leaf, leaf in zip(flat, leaves)
    ]
    return clip_statistics(bk, bk.unflatten(treedef, summed), [norms], [max_norm], weights)


@contextlib.contextmanager
def without_nonfinite_cleaning() -> Iterator[None]:
    """Within the block, pergrad's DP reductions skip the non-finite cleaning (finite data)."""
    import pergrad.dp

    # the module of the DP reductions, which looks these up when called
    reductions = importlib.import_module(pergrad.dp.private_grad_of.__module__)

    patches: list[tuple[Any, str, Any]] = [
        (reductions, "clip_weights", plain_clip_weights),
        (reductions, "clipped_sum", plain_clipped_sum),
    ]
    with contextlib.suppress(ImportError):
        from pergrad._src.strategies import ghost_torch

        patches.append((ghost_torch, "weighted_calls", lambda calls, weights: calls))
    with contextlib.suppress(ImportError):
        from pergrad._src.strategies import ghost_jax

        patches.append((ghost_jax, "_weighted_rows", lambda records, weights: records))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


# --- the steps ---------------------------------------------------------------------------


def data(
    widths: tuple[int, ...], batch_size: int
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    weights = []
    for a, b in zip(widths[:-1], widths[1:]):
        weights += [rng.normal(0, a**-0.5, (b, a)).astype(np.float32), np.zeros(b, np.float32)]
    x = rng.normal(size=(batch_size, widths[0])).astype(np.float32)
    y = rng.integers(0, widths[-1], batch_size)
    return weights, x, y


def torch_steps(widths, batch_size) -> dict[tuple[str, str], Callable[[], Any]]:
    """``(strategy, "with" | "without") -> a call of one step`` (PyTorch, eager)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import pergrad

    weights, x_np, y_np = data(widths, batch_size)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    with torch.no_grad():
        for param, value in zip(model.parameters(), weights):
            param.copy_(torch.from_numpy(value))
    loss = pergrad.module_loss(model, F.cross_entropy)
    params = {k: v.clone() for k, v in loss.params().items()}
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

    def step(strategy: str) -> Any:
        grad, _ = pergrad.dp.private_grad_of(
            loss,
            params,
            x,
            y,
            max_norm=MAX_NORM,
            noise_multiplier=NOISE_MULTIPLIER,
            rng=torch.Generator().manual_seed(0),
            expected_batch_size=float(batch_size),
            strategy=strategy,
        )
        return {k: params[k] - LR * grad[k] for k in params}

    def without(strategy: str) -> Any:
        with without_nonfinite_cleaning():
            return step(strategy)

    steps = {}
    for strategy in STRATEGIES:
        steps[strategy, "with"] = lambda s=strategy: step(s)
        steps[strategy, "without"] = lambda s=strategy: without(s)
    return steps


def jax_steps(widths, batch_size) -> dict[tuple[str, str], Callable[[], Any]]:
    """The same in JAX, under ``jax.jit``; the "without" variants traced inside the patch."""
    import jax
    import jax.numpy as jnp

    import pergrad

    weights, x_np, y_np = data(widths, batch_size)
    params = [jnp.asarray(w) for w in weights]
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)

    def loss(params, xi, yi):  # one example
        h = xi
        for i in range(0, len(params), 2):
            h = params[i] @ h + params[i + 1]
            if i + 2 < len(params):
                h = jax.nn.relu(h)
        return -jax.nn.log_softmax(h)[yi]

    def make(strategy: str) -> Callable[..., Any]:
        @jax.jit
        def step(params, x, y, key):
            grad, _ = pergrad.dp.private_grad_of(
                loss,
                params,
                x,
                y,
                max_norm=MAX_NORM,
                noise_multiplier=NOISE_MULTIPLIER,
                rng=key,
                expected_batch_size=float(batch_size),
                strategy=strategy,
            )
            return jax.tree.map(lambda p, g: p - LR * g, params, grad)

        return step

    key = jax.random.key(0)
    steps = {}
    for strategy in STRATEGIES:
        with_cleaning = make(strategy)
        jax.block_until_ready(with_cleaning(params, x, y, key))  # traced here, as it is
        without = make(strategy)
        with without_nonfinite_cleaning():
            jax.block_until_ready(without(params, x, y, key))  # traced here, patched
        for variant, fn in (("with", with_cleaning), ("without", without)):
            steps[strategy, variant] = lambda fn=fn: jax.block_until_ready(fn(params, x, y, key))
    return steps


def max_abs_diff(a: Any, b: Any) -> float:
    def leaves(tree: Any) -> list[np.ndarray]:
        values = tree.values() if isinstance(tree, dict) else tree
        return [np.asarray(v.detach() if hasattr(v, "detach") else v) for v in values]

    return max(float(np.abs(u - v).max()) for u, v in zip(leaves(a), leaves(b)))


def measure(framework: str, widths, batch_size, rounds: int, warmup: int) -> list[dict[str, Any]]:
    """One row per strategy: median ms with and without the cleaning, their paired ratio, and
    the largest difference between the two steps' updates."""
    steps = (torch_steps if framework == "torch" else jax_steps)(widths, batch_size)
    times = time_interleaved(steps, rounds, warmup)
    rows = []
    for strategy in STRATEGIES:
        with_t, without_t = times[strategy, "with"], times[strategy, "without"]
        rows.append(
            {
                "framework": framework,
                "strategy": strategy,
                "with_ms": median_ms(with_t),
                "without_ms": median_ms(without_t),
                "ratio": paired_ratio(with_t, without_t),
                "diff": max_abs_diff(steps[strategy, "with"](), steps[strategy, "without"]()),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["framework", "strategy", "step with cleaning ms", "without ms", "with / without"]
    columns.append("max abs diff of the updates")
    cells = [
        [r["framework"], r["strategy"], f"{r['with_ms']:.2f}", f"{r['without_ms']:.2f}"]
        + [f"{r['ratio']:.3f}", f"{r['diff']:.1e}"]
        for r in rows
    ]
    return markdown_table(columns, cells)


def header(args: argparse.Namespace, settings: dict[str, Any], load_at_start: str) -> str:
    import torch

    widths = "-".join(map(str, settings["widths"]))
    return titled(
        "nonfinite_cost.py: the cost of zeroing non-finite examples in a DP-SGD step",
        [
            f"machine: {machine.cpu_and_cores()}; torch threads: {torch.get_num_threads()}",
            machine.software("torch", "jax", "pergrad"),
            f"date: {machine.timestamp()}",
            f"load average (1, 5, 15 min): {machine.load_span(load_at_start)}",
            f"command: `{machine.command_line()}` ({'quick' if args.quick else 'full'} mode, "
            f"{settings['rounds']} rounds)",
            f"workload: MLP {widths}, ReLU, cross-entropy, batch {settings['batch_size']}; "
            f"one `private_grad_of` step (clip {MAX_NORM}, noise {NOISE_MULTIPLIER}) + SGD",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small MLP, batch 32, 3 rounds")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 31; quick 3)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    settings = dict(QUICK if args.quick else FULL)
    if args.rounds:
        settings["rounds"] = args.rounds
    load_at_start = machine.load_average()
    rows = []
    for framework in ("torch", "jax"):  # each timed on its own: no thread pool spills over
        print(f"timing {framework}...", file=sys.stderr)
        rows += measure(
            framework,
            settings["widths"],
            settings["batch_size"],
            settings["rounds"],
            settings["warmup"],
        )
    text = table(rows)
    publish(text, args.out, lambda: header(args, settings, load_at_start))


if __name__ == "__main__":
    main()

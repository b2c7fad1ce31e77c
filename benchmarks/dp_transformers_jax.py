"""DP-SGD step cost on small JAX transformers: pergrad against a hand-written ``vmap`` step and
jax-privacy, as ratios to a non-private step (issue 19, the JAX side of
``benchmarks/dp_transformers.py``).

Run:  python benchmarks/dp_transformers_jax.py [--quick] [--records-held] [--methods M,...]
        [--length T] [--batch-size B] [--agreement A] [--out PATH.md]

The committed results: ``python benchmarks/dp_transformers_jax.py --out
benchmarks/results/cpu/dp_transformers_jax.md``; 13 minutes on 2 cores shared with other work
(load average 6), most of it compiling (10-15 s for each private step, and again for the
check below) and jax-privacy's step on the untied model (over 20 s each). To keep it there, the
full run times 5 rounds (``--rounds``) of one batch size per model. The held per-example
gradients against the records held (issue 36), where they differ (512 tokens), in 8 minutes:
``--length 512 --batch-size 4 --methods "pergrad ghost" --records-held --rounds 7 --agreement
1e-3 --out benchmarks/results/cpu/dp_transformers_jax_held.md``.

Three causal language models as users write them, 4 layers, width 256, 4 heads, MLP 4x width,
pre-layer-norm, learned positions, vocabulary 8192, sequence 128, batch 16, float32:

* ``flax linen``: the token embedding tied to the output layer (``nn.Embed.attend``);
* ``flax linen untied``: the same with its own ``nn.Dense`` output layer;
* ``flax NNX``: the tied model written with ``flax.nnx`` (its ``Param`` state is what is
  differentiated).

An example's loss is the mean over its tokens of the next-token cross-entropy; the batch loss is
the mean over the batch's tokens (the same thing, as every example has the same length). Every
method is one ``jax.jit``-compiled training step (forward, backward, per-example clipping,
Gaussian noise, an ``optax.sgd`` update) that donates the parameters and optimizer state, as a
training loop does:

* ``non-private``: ``jax.grad`` of the batch loss, ``optax.sgd``: the unit of every ratio;
* ``pergrad ghost``: ``pergrad.dp.private_grad_of(..., strategy="ghost")``, then ``optax.sgd``;
* ``pergrad auto``: the same with the default ``strategy="auto"``; timed only when its choice
  (:func:`pergrad.norms.choose_strategy`) is not the ghost strategy, as it is otherwise the same
  program;
* ``pergrad optax``: the optax route: ``pergrad.per_example_grads`` into
  ``pergrad.dp.dpsgd`` (``optax_aggregate`` then ``optax.sgd``);
* ``pergrad ghost, records held`` (with ``--records-held``): the ghost step as before issue 36's
  held leaves: every leaf's clipped sum from its records (``capture/cost.HOLD_FORMED`` off while
  the step is traced); ``pergrad ghost`` forms, once, the per-example gradients of each dense
  or convolution leaf that are no more numbers than its cotangents (``T`` at least its input
  width: ``--length``) and takes both its norms and its clipped sum from them;
* ``vmap by hand``: what a user writes without a library: ``jax.vmap(jax.grad(loss))``, each
  example's gradient clipped by its global norm, summed, Gaussian noise, ``optax.sgd``;
* ``jax-privacy``: ``jax_privacy.clipped_grad`` (its per-example clipping, ``vmap`` inside),
  its ``noise_addition.gaussian_privatizer`` and ``optax.sgd``; reported as not installed when
  ``jax_privacy`` cannot be imported.

All: ``max_norm=1``, ``noise_multiplier=1``, expected batch size = the batch, one fixed batch.
Before timing, each private method's gradient without noise is checked against the one of
``vmap by hand`` (computed for the check when ``--methods`` leaves it out) on the same workload
(relative difference of the whole gradient, at most ``--agreement``, 1e-3 by default: pergrad's
certified norms clip by their rounding bound as well, which grows with the sequence: 1.3e-4 of
the gradient at the default 128 tokens, about 5e-4 at 512): a method that disagrees is reported, not timed. Time: every
step compiled and run once first, then the median of ``--rounds`` interleaved rounds
(:func:`pergrad.bench.timing.time_interleaved`); the ratio is the median of the per-round ratios
to the non-private step. Memory, two views:

* XLA's own: the compiled step's temporary buffers (``memory_analysis().temp_size_in_bytes``),
  exact and free of noise;
* the process's: each (workload, method) in a fresh process (``run_in_child``), which compiles its
  step (from a compilation cache the timing process filled), reads its resident memory (the
  baseline), resets the peak (``/proc/self/clear_refs``, Linux) and takes a first step and then
  one more; extra memory = peak RSS - baseline, the larger of the two is compared with the
  non-private step's. Buffers over 64 KiB go back to the OS when freed
  (``MALLOC_MMAP_THRESHOLD_``), so the peak is the step's working memory.

Prints a markdown table; ``--out PATH.md`` also writes it with the machine named. ``--quick``:
a smoke test (about 20 s on 2 idle cores, 45 s on busy ones): the tied linen model only, tiny
(1 layer, width 32, 2 examples of 8 tokens), 2 rounds, compiled for speed of compilation (no
XLA backend optimisation, the ``unsafe_rbg`` random number generator).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pergrad.bench import machine
from pergrad.bench.child import ChildFailed, run_in_child
from pergrad.bench.memory import FREED_BUFFERS_TO_THE_OS, peak_rss_over, status_mib
from pergrad.bench.report import error_summary, fmt, markdown_table, publish, titled
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved

MODELS = ("flax linen", "flax linen untied", "flax NNX")
METHODS = (
    "non-private",
    "pergrad ghost",
    "pergrad auto",
    "pergrad optax",
    "vmap by hand",
    "jax-privacy",
)
BASE, REFERENCE = "non-private", "vmap by hand"
# --records-held adds this method: pergrad's ghost step with every leaf's clipped sum taken from
# its records, none held as its formed per-example gradients (as before: capture/cost.HOLD_FORMED
# off while its step is traced, where ghost_jax reads it)
RECORDS_HELD = "pergrad ghost, records held"
PERGRAD = ("pergrad ghost", "pergrad auto", "pergrad optax")
GOAL_TIME, GOAL_MEMORY = 1.15, 1.1  # issue 19: pergrad's DP step against the non-private one
MAX_NORM, NOISE, LEARNING_RATE = 1.0, 1.0, 1e-3
AGREEMENT = 1e-3  # the largest relative difference from the hand-written step's gradient
JOB_TIMEOUT_S = 900  # one job (a workload's timing, or one method's memory) at most


@dataclass(frozen=True)
class Config:
    """Sizes of the models and of the batch."""

    width: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 8192
    length: int = 128
    batch_size: int = 16


FULL = Config()
QUICK = Config(width=32, layers=1, heads=2, vocab=128, length=8, batch_size=2)


# --------------------------------------------------------------------------------------------
# Models, batch and losses.


def next_token_loss(logits: Any, ids: Any) -> Any:
    """The mean next-token cross-entropy over the tokens of one sequence ``(T,)``, or of a
    batch ``(B, T)``."""
    import jax
    import jax.numpy as jnp

    log_probs = jax.nn.log_softmax(logits[..., :-1, :])
    return -jnp.mean(jnp.take_along_axis(log_probs, ids[..., 1:, None], axis=-1))


def linen_model(config: Config, tied: bool) -> Any:
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h: Any) -> Any:
            causal = nn.make_causal_mask(jnp.ones(h.shape[-2]))[0]
            h = h + nn.MultiHeadDotProductAttention(config.heads)(nn.LayerNorm()(h), mask=causal)
            up = nn.Dense(4 * config.width)(nn.LayerNorm()(h))
            return h + nn.Dense(config.width)(nn.gelu(up))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids: Any) -> Any:
            embed = nn.Embed(config.vocab, config.width)
            position = self.param(
                "position", nn.initializers.normal(0.02), (config.length, config.width)
            )
            h = embed(ids) + position
            for _ in range(config.layers):
                h = Block()(h)
            h = nn.LayerNorm()(h)
            return embed.attend(h) if tied else nn.Dense(config.vocab)(h)

    return LM()


def nnx_model(config: Config) -> Any:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            width = config.width
            self.norm1 = nnx.LayerNorm(width, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(config.heads, width, decode=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)

        def __call__(self, h: Any) -> Any:
            causal = nnx.make_causal_mask(jnp.ones(h.shape[-2]))[0]
            h = h + self.attention(self.norm1(h), mask=causal)
            return h + self.down(jax.nn.gelu(self.up(self.norm2(h))))

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(config.vocab, config.width, rngs=rngs)
            self.position = nnx.Param(
                0.02 * jax.random.normal(rngs.params(), (config.length, config.width))
            )
            self.blocks = nnx.List([Block(rngs) for _ in range(config.layers)])
            self.norm = nnx.LayerNorm(config.width, rngs=rngs)

        def __call__(self, ids: Any) -> Any:
            h = self.embed(ids) + self.position[...]
            for block in self.blocks:
                h = block(h)
            return self.embed.attend(self.norm(h))

    return LM(nnx.Rngs(0))


@dataclass
class Workload:
    """A model's parameters, its batch ``ids`` ``(B, T)``, and its loss ``loss(params, ids)``:
    of one example for ``ids`` of shape ``(T,)``, of the batch for ``(B, T)``."""

    model: str
    params: Any
    ids: Any
    loss: Callable[[Any, Any], Any]


def workload(model: str, config: Config) -> Workload:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(1)
    shape = (config.batch_size, config.length)
    ids = jnp.asarray(rng.integers(0, config.vocab, shape), jnp.int32)
    if model == "flax NNX":
        from flax import nnx

        graphdef, params, rest = nnx.split(nnx_model(config), nnx.Param, ...)

        def apply(params: Any, ids: Any) -> Any:
            return nnx.merge(graphdef, params, rest)(ids)

    else:
        module = linen_model(config, tied=model == "flax linen")
        params = jax.jit(module.init)(jax.random.key(0), ids[0])  # one compilation, not one per op
        apply = module.apply

    def loss(params: Any, ids: Any) -> Any:
        return next_token_loss(apply(params, ids), ids)

    return Workload(model, params, ids, loss)


# --------------------------------------------------------------------------------------------
# The methods: each a gradient and an optax transformation that makes it private.


@dataclass
class Route:
    """A method's step: ``gradient(params, ids, key)`` (the private gradient itself, or the
    per-example gradients that ``private`` clips and noises), then ``private`` (an optax
    transformation; ``optax.identity()`` when the gradient is private already), then
    ``optax.sgd``. ``strategy``: the pergrad strategy it takes, for the table."""

    gradient: Callable[[Any, Any, Any], Any]
    private: Any
    strategy: str = ""
    reason: str = ""  # why pergrad chose the strategy (``choose_strategy``'s reason)


def route(method: str, work: Workload, noise: float) -> Route:
    """``method``'s step on ``work`` with noise multiplier ``noise``."""
    import jax
    import jax.numpy as jnp
    import optax

    import pergrad
    import pergrad.dp
    import pergrad.norms

    size = work.ids.shape[0]
    if method == BASE:
        return Route(lambda params, ids, key: jax.grad(work.loss)(params, ids), optax.identity())
    if method == RECORDS_HELD:
        taken = route("pergrad ghost", work, noise)
        taken.gradient = with_cost_flag(taken.gradient, "HOLD_FORMED", False)
        return taken
    if method in ("pergrad ghost", "pergrad auto"):
        strategy = "ghost" if method == "pergrad ghost" else "auto"
        choice = pergrad.norms.choose_strategy(
            work.loss, work.params, work.ids, strategy=strategy, clipped_sum=True
        )

        def private_grad(params: Any, ids: Any, key: Any) -> Any:
            grad, _ = pergrad.dp.private_grad_of(
                work.loss,
                params,
                ids,
                max_norm=MAX_NORM,
                noise_multiplier=noise,
                rng=key,
                expected_batch_size=size,
                strategy=strategy,
            )
            return grad

        return Route(private_grad, optax.identity(), choice.strategy, choice.reason)
    if method == "pergrad optax":
        per_example = pergrad.per_example_grads(work.loss)
        private = pergrad.dp.optax_aggregate(MAX_NORM, noise, 0, expected_batch_size=size)
        taken = Route(lambda params, ids, key: per_example(params, ids), private)
        jax.eval_shape(per_example, work.params, work.ids)  # sets last_strategy
        taken.strategy = str(per_example.last_strategy)
        return taken
    if method == REFERENCE:

        def by_hand(params: Any, ids: Any, key: Any) -> Any:
            grads = jax.vmap(jax.grad(work.loss), in_axes=(None, 0))(params, ids)
            norms = jax.vmap(optax.global_norm)(grads)
            factors = jnp.minimum(1.0, MAX_NORM / norms)
            leaves, treedef = jax.tree.flatten(grads)
            keys = jax.random.split(key, len(leaves))
            noisy = [
                jnp.tensordot(factors, g, axes=1)
                + noise * MAX_NORM * jax.random.normal(k, g.shape[1:], g.dtype)
                for g, k in zip(leaves, keys)
            ]
            return jax.tree.unflatten(treedef, [g / size for g in noisy])

        return Route(by_hand, optax.identity())
    from jax_privacy import clipped_grad, noise_addition

    clipped_mean = clipped_grad(
        work.loss,
        l2_clip_norm=MAX_NORM,
        batch_argnums=1,
        keep_batch_dim=False,
        normalize_by=size,
    )
    privatizer = noise_addition.gaussian_privatizer(
        stddev=noise * clipped_mean.sensitivity(), prng_key=0
    )
    return Route(lambda params, ids, key: clipped_mean(params, ids), privatizer)


def with_cost_flag(fn: Callable[..., Any], name: str, value: bool) -> Callable[..., Any]:
    """``fn`` with pergrad's ``capture/cost.<name>`` set to ``value`` while it runs (a
    benchmark's "before" of a change that flag switches; in a jitted step, while it is
    traced), restored after."""
    from pergrad._src.capture import cost

    def flagged(*args: Any) -> Any:
        before = getattr(cost, name)
        setattr(cost, name, value)
        try:
            return fn(*args)
        finally:
            setattr(cost, name, before)

    return flagged


def missing(method: str) -> str:
    """Why ``method`` cannot run here ("" when it can): only the peer is optional."""
    if method != "jax-privacy":
        return ""
    try:
        import jax_privacy  # noqa: F401
    except ImportError as error:
        return f"not installed ({error})"
    return ""


@dataclass
class Step:
    """A compiled training step and the state it carries (its own copy of the parameters:
    the step donates them). ``call()`` takes one step and waits for it."""

    compiled: Any
    state: list[Any]
    ids: Any
    key: Any
    strategy: str

    def call(self) -> None:
        import jax

        self.state[:] = jax.block_until_ready(self.compiled(*self.state, self.ids, self.key))


def build_step(method: str, work: Workload) -> Step:
    import jax
    import jax.numpy as jnp
    import optax

    taken = route(method, work, NOISE)
    tx = optax.chain(taken.private, optax.sgd(LEARNING_RATE))

    def step(params: Any, opt_state: Any, ids: Any, key: Any) -> Any:
        updates, opt_state = tx.update(taken.gradient(params, ids, key), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = jax.tree.map(jnp.copy, work.params)
    state = [params, tx.init(params)]
    key = jax.random.key(2)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*state, work.ids, key).compile()
    return Step(compiled, state, work.ids, key, taken.strategy)


def zero_noise_gradients(methods: list[str], work: Workload) -> dict[str, list[Any]]:
    """The private gradient of each method without noise, float64 numpy leaves; one compiled
    program computes them all (each compilation takes seconds)."""
    import jax
    import numpy as np

    routes = {method: route(method, work, 0.0) for method in methods}

    def gradients(params: Any, ids: Any, key: Any) -> dict[str, Any]:
        return {
            method: taken.private.update(
                taken.gradient(params, ids, key), taken.private.init(params), params
            )[0]
            for method, taken in routes.items()
        }

    grads = jax.jit(gradients)(work.params, work.ids, jax.random.key(3))
    return {
        method: [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(grad)]
        for method, grad in grads.items()
    }


def relative_difference(got: list[Any], want: list[Any]) -> float:
    import numpy as np

    difference = sum(float(np.sum((g - w) ** 2)) for g, w in zip(got, want))
    return math.sqrt(difference / sum(float(np.sum(w**2)) for w in want))


def failure(error: BaseException) -> str:
    """``fails: <class>: <message>``, the message's first line, at most 160 characters."""
    return f"fails: {error_summary(error)}"


# --------------------------------------------------------------------------------------------
# The jobs, each in a fresh process (pergrad.bench.child.run_in_child).


def time_job(model: str, config: Config, rounds: int, agreement: float) -> dict[str, Any]:
    """Every method's step on ``model``: compiled (XLA's memory view), checked against the
    hand-written step without noise, run once, then timed in interleaved rounds."""
    work = workload(model, config)
    result: dict[str, Any] = {
        "failed": {},
        "strategy": {},
        "temp_mib": {},
        "agreement": {},
        "reason": {},
    }
    steps: dict[str, Step] = {}
    for method in METHODS:
        result["failed"][method] = missing(method)
        if result["failed"][method]:
            continue
        try:
            if method == "pergrad auto":
                chosen = route(method, work, NOISE)
                choice = chosen.strategy
                result["strategy"][method] = choice
                result["reason"][method] = chosen.reason
                if choice == result["strategy"].get("pergrad ghost"):
                    result["failed"][method] = "the same program as pergrad ghost: not run again"
                    continue
            steps[method] = build_step(method, work)
            result["strategy"][method] = steps[method].strategy
            memory = steps[method].compiled.memory_analysis()
            result["temp_mib"][method] = memory.temp_size_in_bytes / 2**20
        except Exception as error:  # a method that cannot take the model is a result
            steps.pop(method, None)
            result["failed"][method] = failure(error)
    checked = [m for m in steps if m not in (BASE, REFERENCE)]
    if checked or REFERENCE in steps:  # the hand-written step's gradient, timed or not
        grads = zero_noise_gradients([*checked, REFERENCE], work)
        want = grads.pop(REFERENCE)
        for method, got in grads.items():
            difference = relative_difference(got, want)
            result["agreement"][method] = difference
            if not difference <= agreement:
                steps.pop(method)
                result["failed"][method] = (
                    f"wrong: its gradient differs from vmap by hand's by {difference:.1e}"
                )
    for step in steps.values():
        step.call()  # the first run of a compiled step, outside the timing
    if BASE in steps:
        timed = {method: step.call for method, step in steps.items()}
        result["times_s"] = time_interleaved(timed, rounds, warmup=0)
    return result


def memory_job(model: str, config: Config, method: str) -> dict[str, Any]:
    """Extra resident memory (MiB) of a first step and of a later one, above the RSS once the
    step is compiled and its parameters, optimizer state and batch exist."""
    if not os.path.exists("/proc/self/clear_refs"):
        return {"failed": "not measured: needs Linux's /proc/self/clear_refs"}
    step = build_step(method, workload(model, config))
    baseline = status_mib("VmRSS")
    first = peak_rss_over(step.call) - baseline
    later = peak_rss_over(step.call) - baseline
    return {"first_mib": first, "later_mib": later, "baseline_mib": baseline}


def run_job(job: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    """``job`` in a fresh process; its result, or why there is none."""
    env = dict(FREED_BUFFERS_TO_THE_OS)
    if job["quick"]:  # a smoke test: compile fast, as the steps' speed does not matter
        flags = os.environ.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    try:
        return run_in_child(job_main, job, cache_dir, env=env, timeout=JOB_TIMEOUT_S)
    except ChildFailed as error:
        return {"failed": f"fails: {error.reason}"}


def job_main(job: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    """A job's process: the compilation cache shared with the other jobs, then the job."""
    import jax

    global METHODS  # the driver's (--methods, --records-held), not a fresh process's default
    METHODS = tuple(job["methods"])
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if job["quick"]:
        jax.config.update("jax_default_prng_impl", "unsafe_rbg")  # compiles faster
    config = replace(QUICK if job["quick"] else FULL, **job["sizes"])
    if job["kind"] == "time":
        return time_job(job["model"], config, job["rounds"], job["agreement"])
    try:
        return memory_job(job["model"], config, job["method"])
    except Exception as error:
        return {"failed": failure(error)}


# --------------------------------------------------------------------------------------------
# Driver: the jobs, the table.


def measure(model: str, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    """A workload's timing job, then one memory job per method that ran (two at a time: their
    resident memory is their own, and nothing is timed meanwhile)."""
    base = {"model": model, "quick": args.quick, "methods": METHODS, "sizes": sizes(args)}
    timing = {"kind": "time", "rounds": args.rounds, "agreement": args.agreement}
    timed = run_job(base | timing, cache_dir)
    if isinstance(timed["failed"], str):  # the job itself failed: so did every method
        timed["failed"] = dict.fromkeys(METHODS, timed["failed"])
    ran = [m for m in METHODS if m in timed.get("times_s", {})]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {
            m: pool.submit(run_job, base | {"kind": "memory", "method": m}, cache_dir) for m in ran
        }
        memory = {m: job.result() for m, job in jobs.items()}
    return {"model": model, "timed": timed, "memory": memory}


def sizes(args: argparse.Namespace) -> dict[str, int]:
    """The sizes ``--length`` and ``--batch-size`` set, over the configuration's."""
    chosen = {"length": args.length, "batch_size": args.batch_size}
    return {name: value for name, value in chosen.items() if value is not None}


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: times, ratios, memory, or why it is missing."""
    timed, memory = result["timed"], result["memory"]
    times = timed.get("times_s", {})
    base_memory = memory.get(BASE, {})
    base_extra = max(base_memory.get("first_mib", 0.0), base_memory.get("later_mib", 0.0))
    base_temp = timed.get("temp_mib", {}).get(BASE)
    rows = []
    for method in METHODS:
        row: dict[str, Any] = {"model": result["model"], "method": method}
        row["strategy"] = timed.get("strategy", {}).get(method, "")
        row["failed"] = timed["failed"].get(method) or ""
        if method in times:
            row["ms"] = median_ms(times[method])
            row["time_ratio"] = paired_ratio(times[method], times[BASE])
        temp = timed.get("temp_mib", {}).get(method)
        if temp is not None and method in times:
            row["temp_mib"] = temp
            row["temp_ratio"] = temp / base_temp if base_temp else None
        mem = memory.get(method, {})
        if "first_mib" in mem:
            row["first_mib"], row["later_mib"] = mem["first_mib"], mem["later_mib"]
            extra = max(mem["first_mib"], mem["later_mib"])
            row["memory_ratio"] = extra / base_extra if base_extra > 0 else None
        row["failed"] = row["failed"] or mem.get("failed", "")
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["model", "method", "pergrad strategy", "step ms", "time / non-private"]
    columns += ["extra MiB, first step", "extra MiB, later step", "memory / non-private"]
    columns += ["XLA temp MiB", "XLA temp / non-private", "note"]
    cells = []
    for r in rows:
        ms = r.get("ms")
        ms_spec = ".0f" if ms is not None and ms >= 10 else ".2f"  # quick steps take 1 ms
        cells.append(
            [r["model"], r["method"], r["strategy"], fmt(ms, ms_spec, missing="—")]
            + [fmt(r.get("time_ratio"), ".2f", "x", missing="—")]
            + [fmt(r.get(key), ".0f", missing="—") for key in ("first_mib", "later_mib")]
            + [fmt(r.get("memory_ratio"), ".2f", "x", missing="—")]
            + [fmt(r.get("temp_mib"), ".0f", missing="—")]
            + [fmt(r.get("temp_ratio"), ".2f", "x", missing="—"), r["failed"]]
        )
    return markdown_table(columns, cells)


def goal_summary(rows: list[dict[str, Any]]) -> str:
    """Where each of pergrad's routes meets the issue's goal and where it does not."""
    lines = [
        f"Goal (issue 19): pergrad's DP step within {GOAL_TIME}x the time and {GOAL_MEMORY}x "
        f"the memory of the non-private step, on every workload.",
        "",
    ]
    for r in rows:
        if r["method"] not in PERGRAD or r.get("time_ratio") is None:
            continue
        time_ok = r["time_ratio"] <= GOAL_TIME
        memory_ok = r.get("memory_ratio") is not None and r["memory_ratio"] <= GOAL_MEMORY
        verdict = "met" if time_ok and memory_ok else "NOT met"
        time_ratio, memory_ratio, temp_ratio = (
            fmt(r.get(key), ".2f", "x", missing="—")
            for key in ("time_ratio", "memory_ratio", "temp_ratio")
        )
        lines.append(
            f"- {r['model']}, {r['method']}: {verdict} (time {time_ratio}, memory "
            f"{memory_ratio}, XLA temp {temp_ratio}; strategy {r['strategy'] or '—'})."
        )
    return "\n".join(lines)


def what_it_shows(
    results: list[dict[str, Any]], rows: list[dict[str, Any]], config: Config, agreement: float
) -> str:
    """Per model, the cheapest private step and pergrad's ghost step against the hand-written
    one; how to read the two; whether the methods compute the same step."""
    by_key = {(r["model"], r["method"]): r for r in rows}
    lines = ["What this shows:", ""]
    for result in results:
        model, times = result["model"], result["timed"].get("times_s", {})
        private = [by_key[(model, m)] for m in METHODS if m != BASE and m in times]
        if not private:
            continue
        cheapest = min(private, key=lambda r: r["time_ratio"])
        line = (
            f"- {model}: the cheapest private step is {cheapest['method']} "
            f"({cheapest['time_ratio']:.2f}x the non-private step's time)"
        )
        if "pergrad ghost" in times and REFERENCE in times:
            ghost, hand = by_key[(model, "pergrad ghost")], by_key[(model, REFERENCE)]
            temps = ghost.get("temp_mib"), hand.get("temp_mib")
            temp = temps[0] / temps[1] if all(temps) else None
            ratio = paired_ratio(times["pergrad ghost"], times[REFERENCE])
            line += (
                f"; pergrad ghost takes {ratio:.2f}x the time of vmap by hand and "
                f"{fmt(temp, '.2f', 'x', missing='—')} its XLA temporary memory"
            )
        lines.append(line + ".")
        reason = result["timed"].get("reason", {}).get("pergrad auto")
        if reason:
            lines.append(f"  - pergrad auto, as `choose_strategy` gives it: {reason}")
        if "pergrad ghost" in times and RECORDS_HELD in times:
            lines.append(held_line(model, by_key, times))
    lines += [
        "- How to read it: vmap by hand forms every example's gradient (B x P numbers) with the "
        "multiplications of the batch gradient, and XLA forms them while the backward pass frees "
        "the activations: its peak memory stays near the non-private step's as long as one "
        "example's activations are about as large as the model (here "
        f"{config.length} tokens of a vocabulary of {config.vocab}); with few tokens per "
        "example the B x P numbers dominate (XLA sums a dense layer's per-example gradients "
        "without keeping them, but keeps a row lookup's: an untied token table's B V d "
        "numbers). The ghost strategy never forms them: it computes "
        "each layer's per-example norm from T x T products of the layer's inputs and of its "
        "output gradients, then the clipped sum of the weight gradients. Those products come on "
        "top of the weight gradients (which vmap's per-example gradients replace rather than "
        "add to), and with T near the layers' widths they cost half as much as the weight "
        "gradients or more: the ghost strategy's advantage is memory, not time. pergrad auto "
        "weighs both: the ghost norms' work against materialising's, then XLA's compiled "
        "temporary memory of each (its reason, per model, above).",
        "- The same step: without noise, the relative difference of each private method's "
        "gradient from vmap by hand's, on the benchmark's own batch (methods above "
        f"{agreement:g} are reported, not timed):",
    ]
    for result in results:
        agreed = result["timed"].get("agreement", {})
        listed = ", ".join(f"{m} {d:.1e}" for m, d in agreed.items())
        lines.append(f"  - {result['model']}: {listed or '—'}")
    return "\n".join(lines)


def held_line(model: str, by_key: dict[tuple[str, str], Any], times: dict[str, Any]) -> str:
    """The held per-example gradients against the records held to the end, on one model."""
    held, records = by_key[(model, "pergrad ghost")], by_key[(model, RECORDS_HELD)]

    def ratio(key: str) -> str:
        values = held.get(key), records.get(key)
        return fmt(values[0] / values[1] if all(values) else None, ".2f", "x", missing="—")

    def extra(row: dict[str, Any]) -> float | None:
        return max(row["first_mib"], row["later_mib"]) if "first_mib" in row else None

    memory = extra(held), extra(records)
    memory_ratio = memory[0] / memory[1] if all(memory) else None
    return (
        f"  - the leaves held as their formed per-example gradients (pergrad ghost) against "
        f"{RECORDS_HELD}: time {paired_ratio(times['pergrad ghost'], times[RECORDS_HELD]):.2f}x "
        f"(interleaved rounds), XLA temp {ratio('temp_mib')}, extra memory "
        f"{fmt(memory_ratio, '.2f', 'x', missing='—')}; against the non-private step, time "
        f"{fmt(records.get('time_ratio'), '.2f', 'x', missing='—')} -> "
        f"{fmt(held.get('time_ratio'), '.2f', 'x', missing='—')}, memory "
        f"{fmt(records.get('memory_ratio'), '.2f', 'x', missing='—')} -> "
        f"{fmt(held.get('memory_ratio'), '.2f', 'x', missing='—')}, XLA temp "
        f"{fmt(records.get('temp_ratio'), '.2f', 'x', missing='—')} -> "
        f"{fmt(held.get('temp_ratio'), '.2f', 'x', missing='—')}"
    )


def header(args: argparse.Namespace, config: Config) -> str:
    packages = machine.software("jax", "jaxlib", "flax", "optax", "jax-privacy", "pergrad")
    sizes = (
        f"{config.layers} layers, width {config.width}, {config.heads} heads, MLP 4x width, "
        f"vocabulary {config.vocab}, T = {config.length} tokens, B = {config.batch_size} "
        f"sequences; float32; max_norm {MAX_NORM}, noise_multiplier {NOISE}, optax.sgd"
    )
    return titled(
        "DP-SGD step cost on small JAX transformers: pergrad, by hand and jax-privacy (CPU)",
        [
            f"machine: {machine.cpu_and_cores()}; {platform.system()}, {packages}",
            f"date: {machine.timestamp()}; load average {machine.load_average()} at the end",
            f"models: {sizes}",
            f"time: median of {args.rounds} interleaved rounds of jitted steps, each compiled "
            f"and run once first; memory: XLA's temporary buffers of the compiled step, and, "
            f"each method in its own process, peak RSS above the RSS with the step compiled, "
            f"over the first step and over a later one",
            f"command: `{machine.command_line()}`",
        ],
    )


def main() -> None:
    global METHODS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", help=f"only these, comma-separated: {', '.join(MODELS)}")
    parser.add_argument(
        "--methods",
        help=f"only these and {BASE!r}, comma-separated: {', '.join(METHODS[1:])}",
    )
    parser.add_argument(
        "--records-held",
        action="store_true",
        help=f"also time {RECORDS_HELD!r}: every leaf's clipped sum from its records, none "
        "held as its formed per-example gradients (as before)",
    )
    parser.add_argument("--length", type=int, help=f"tokens per sequence (default {FULL.length})")
    parser.add_argument(
        "--batch-size", type=int, help=f"sequences per batch (default {FULL.batch_size})"
    )
    parser.add_argument(
        "--agreement",
        type=float,
        default=AGREEMENT,
        help=f"the largest relative difference from {REFERENCE!r}'s gradient (default "
        f"{AGREEMENT:g}); pergrad's certified norms clip by their rounding bound too, which "
        "grows with --length (1.3e-4 of the gradient at 128 tokens, about 5e-4 at 512)",
    )
    parser.add_argument("--out", type=Path, help="write the markdown here")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 2
    chosen_methods = list(METHODS[1:]) if args.methods is None else args.methods.split(",")
    unknown = sorted(set(chosen_methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS[1:])}")
    chosen_methods = [m for m in METHODS[1:] if m in chosen_methods]
    where = chosen_methods.index("pergrad ghost") + 1 if "pergrad ghost" in chosen_methods else 0
    extra = [RECORDS_HELD] * args.records_held
    METHODS = (BASE, *chosen_methods[:where], *extra, *chosen_methods[where:])
    config = replace(QUICK if args.quick else FULL, **sizes(args))
    chosen = args.models.split(",") if args.models else list(MODELS[:1] if args.quick else MODELS)
    started = time.perf_counter()
    results, rows = [], []
    with tempfile.TemporaryDirectory(prefix="pergrad-dp-jax-") as cache_dir:
        for model in chosen:
            results.append(measure(model, args, cache_dir))
            rows += rows_of(results[-1])
            print(table([r for r in rows if r["model"] == model]), flush=True)
    text = "\n\n".join(
        [table(rows), goal_summary(rows), what_it_shows(results, rows, config, args.agreement)]
    )
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    publish(text, args.out, lambda: header(args, config))


if __name__ == "__main__":
    main()

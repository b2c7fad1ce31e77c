"""Per-process memory and step time of DP-SGD on a small GPT-2 sharded with FSDP2 over N CPU
processes (issue 37): pergrad's ``DPOptimizer`` against the non-private FSDP2 step and against
Opacus's FSDP ghost clipping.

Run:  python benchmarks/fsdp_memory.py [--quick] [--worlds 1,2,4] [--rounds R] [--out PATH.md]
          [--mixed-precision [bfloat16|float16]] [--model-dtype bfloat16|float16]
          [--widened-whole] [--vocab V]

The committed results: ``python benchmarks/fsdp_memory.py --out
benchmarks/results/cpu/fsdp_memory.md`` (11 minutes on the 2-core machine at load 15-20). In
bfloat16 (issue 36, 2 to 3 minutes each): ``--model-dtype bfloat16 --widened-whole --worlds 1,2
--rounds 3`` (``fsdp_memory_bf16.md``), the same with ``--vocab 32768``
(``fsdp_memory_bf16_vocab32k.md``), and ``--mixed-precision --widened-whole --vocab 32768
--worlds 2 --rounds 3`` (``fsdp_memory_bf16_mixed_vocab32k.md``).

For each N in ``--worlds`` the script starts N processes of itself joined by a gloo process
group (one torch thread each). Each process builds a GPT-2 from a small Hugging Face config
(nothing downloaded; 4 layers, width 256, vocabulary 8192, untied lm head, no dropout; the same
initialisation everywhere), its own batch of ``batch`` examples of ``length`` tokens (weak
scaling: the global batch is ``N * batch``) and three steps, each on its own copy of the model:

* ``non-private``: ``zero_grad``, forward, ``backward()`` of the mean token cross-entropy,
  ``AdamW.step()``: the unit of every ratio;
* ``pergrad DP``: ``pergrad.dp.DPOptimizer(AdamW, ..., distributed=True).step(inputs, targets)``
  (strategy ``ghost-fsdp``: ghost norms, the clipped sum through FSDP's reduce-scatter, the noise
  drawn on rank 0 and scattered by shard);
* ``Opacus ghost``: ``PrivacyEngine().make_private(..., grad_sample_mode="ghost_fsdp")`` and its
  two-backward-pass criterion (``"ghost"`` when N = 1).

N > 1: every method's model is sharded the same way, ``fully_shard`` on the token and position
embeddings, on each block, on the lm head and on the root, so that the columns compare the DP
methods and not the wrapping (Opacus's own ``FSDP2Wrapper`` shards only the layers Opacus has a
rule for, and GPT-2's ``Conv1D`` projections are not among them: they would stay in the root's
group). N = 1: no FSDP and no sharding, the single-process baseline (pergrad's ``DPOptimizer``
without ``distributed``, Opacus's ``"ghost"``). ``--mixed-precision [DTYPE]``: N > 1 shards every
method's model with ``MixedPrecisionPolicy(param_dtype=DTYPE, reduce_dtype=float32)``, DTYPE
``bfloat16`` (the default) or ``float16`` (pergrad
then forms its clipped sum from the records in float32, ``torch/fsdp.py``); N = 1 stays the
float32 baseline. ``--model-dtype DTYPE``: every method's model is itself in DTYPE
(``model.to(DTYPE)``: parameters, gradients and AdamW's moments), N = 1 included, and the
single-process reference of the agreement check too. ``--widened-whole``: one more method,
``pergrad DP, widened whole``, pergrad's step with each layer rule's bfloat16 / float16 records
widened to float32 whole, as before issue 36 (``widening.WIDENED_CHUNK_NUMBERS`` raised past every
call; by default a call whose float32 copies would exceed it is widened and reduced a chunk of
examples at a time), measured in the same processes, interleaved with the others: the
before/after of that change. ``--vocab V``: the vocabulary (default 8192; the LM head's
output gradients, ``B x T x V``, grow with it). All DP steps: ``max_norm=1``,
``noise_multiplier=1``, one fixed batch (no Poisson sampling), the global expected batch size.

Per process and method, reported for the process where it is largest:

* **step ms**: the median over ``--rounds`` interleaved rounds (each round runs every method
  once, in a balanced order (each after every other equally often), after one warm-up step each; ``pergrad.bench.timing``);
* **state MiB**: counted, not measured: the bytes of the storages of the local parameter
  shards, their gradients, the optimizer state (AdamW's two moments) and the DP method's own
  buffers kept between steps (Opacus's ``summed_grad``), each storage once, after a step. With
  FSDP this is ``1/N`` of the single-process state (up to the padding of uneven shards);
* **step peak MiB**: measured: the process's peak resident memory (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before) during one step, minus its resident memory (``VmRSS``)
  just before: the step's working memory: activations, the layer weights FSDP gathers, the
  gradients before their reduce-scatter, the DP method's records; freed buffers go back to the
  OS (``MALLOC_MMAP_THRESHOLD_``), so this is the step's own peak;
* **resident MiB**: measured: ``VmRSS`` after building the method (model, sharding, optimizer)
  and its warm-up step, minus ``VmRSS`` before building it: what the method keeps resident.

The whole process's peak resident memory (``ru_maxrss``) is reported once per N: it includes
Python, torch, transformers and Opacus (a few hundred MiB), the three methods' models and the
full model each process builds before ``fully_shard`` shards it, so it is not a per-method
figure. On a CPU there is no device memory: the parameters, activations and gloo's buffers all
live in the process's resident memory, which is why both the counted and the measured figures
are given.

Without noise, one SGD step of each DP method is also compared with a single-process pergrad
step on the union of the processes' batches (computed on rank 0): the relative difference of
the updates says that the methods compute the same DP step.

Prints a markdown table; ``--out PATH.md`` also writes it under a header naming the machine,
the versions and ``uptime`` before and after (the load of the whole machine, other jobs
included). ``--quick``: a 1-layer width-32 GPT-2, N = 1 and 2, 2 rounds: a smoke test of seconds.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pergrad.bench import machine
from pergrad.bench.memory import (
    FREED_BUFFERS_TO_THE_OS,
    peak_rss_over,
    status_mib,
)
from pergrad.bench.report import error_summary, fmt, markdown_table, publish, titled
from pergrad.bench.timing import median_ms, time_interleaved

BASE, PERGRAD, OPACUS = "non-private", "pergrad DP", "Opacus ghost"
WHOLE = "pergrad DP, widened whole"  # --widened-whole
METHODS = (BASE, PERGRAD, OPACUS)
PRIVATE = (PERGRAD, WHOLE, OPACUS)
MAX_NORM, NOISE, LEARNING_RATE, NOISE_SEED = 1.0, 1.0, 1e-4, 1234
COLLECTIVE_TIMEOUT_S = 120  # a process left waiting for a failed peer raises after this
WORLD_TIMEOUT_S = 1200  # one N's processes, all methods, at most


@dataclass(frozen=True)
class Config:
    """The GPT-2 and the batch of each process."""

    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 8192
    length: int = 128
    batch: int = 4  # examples per process
    # N > 1: parameters in this dtype in the passes ("bfloat16", "float16"), float32 reduction
    mixed_precision: str | None = None
    # every method's model in this dtype ("bfloat16", "float16"); None: float32
    model_dtype: str | None = None
    # one more method, pergrad's step with the rules' records widened whole (WHOLE)
    widened_whole: bool = False

    def methods(self) -> tuple[str, ...]:
        return (BASE, PERGRAD, WHOLE, OPACUS) if self.widened_whole else METHODS

    def describe(self) -> str:
        precision = (
            f"; N > 1 sharded with MixedPrecisionPolicy(param_dtype={self.mixed_precision}, "
            f"reduce_dtype=float32)"
            if self.mixed_precision
            else ""
        )
        if self.model_dtype:
            precision += f"; the model in {self.model_dtype}"
        return (
            f"GPT-2, {self.layers} layers, width {self.width}, {self.heads} heads, vocabulary "
            f"{self.vocab}, untied lm head ({num_params(self) / 1e6:.2f} M parameters); "
            f"{self.batch} examples of {self.length} tokens per process{precision}"
        )


FULL = Config()
QUICK = Config(layers=1, width=32, heads=2, vocab=128, length=16, batch=2)


def num_params(config: Config) -> int:
    """GPT-2's parameter count: embeddings, blocks, final norm, untied lm head."""
    width = config.width
    block = 12 * width * width + 13 * width  # attention, MLP (4x), two layer norms
    embeddings = (config.vocab + config.length) * width
    return embeddings + config.layers * block + 2 * width + config.vocab * width


# --------------------------------------------------------------------------------------------
# The model, the batch and the three steps (in a worker process).


def gpt2(config: Config) -> Any:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)  # the same initialisation in every process and for every method
    gpt2_config = transformers.GPT2Config(
        vocab_size=config.vocab,
        n_positions=config.length,
        n_embd=config.width,
        n_layer=config.layers,
        n_head=config.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,  # as in the committed results (pergrad now takes ties)
    )
    model = transformers.GPT2LMHeadModel(gpt2_config).train()
    return model.to(getattr(torch, config.model_dtype)) if config.model_dtype else model


def shard(model: Any, config: Config) -> Any:
    """``fully_shard`` on the embeddings, each block, the lm head, then the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {}
    if config.mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, config.mixed_precision), reduce_dtype=torch.float32
        )
    body = model.transformer
    for module in (body.wte, body.wpe, *body.h, model.lm_head):
        fully_shard(module, **options)
    fully_shard(model, **options)
    return model


def batch(config: Config, rank: int) -> tuple[dict[str, Any], Any]:
    """Process ``rank``'s inputs (token and position ids) and next-token targets."""
    import torch

    generator = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, config.vocab, (config.batch, config.length + 1), generator=generator)
    # position ids of the batch's shape: Opacus's hooks view the inputs per example
    positions = torch.arange(config.length).expand(config.batch, -1).contiguous()
    return {"input_ids": ids[:, :-1].contiguous(), "position_ids": positions}, ids[
        :, 1:
    ].contiguous()


def flat_logits(output: Any, targets: Any) -> tuple[Any, Any]:
    return output.logits.reshape(-1, output.logits.shape[-1]), targets.reshape(-1)


def loss_fn(output: Any, targets: Any) -> Any:
    """The mean next-token cross-entropy over the batch's tokens."""
    import torch.nn.functional as F

    return F.cross_entropy(*flat_logits(output, targets))


@dataclass
class Step:
    """One method's training step, its model and what it keeps between steps."""

    call: Callable[[], Any]
    model: Any
    optimizer: Any  # the torch.optim optimizer that holds the moments
    buffers: Callable[[], list[Any]] = list  # the DP method's own tensors kept between steps
    taken: dict[str, Any] = field(default_factory=dict)  # pergrad's DPStep: strategy, clipping


def build(
    method: str, config: Config, world: int, rank: int, noise: float = NOISE, sgd: bool = False
) -> Step:
    import torch

    model = gpt2(config)
    if world > 1:
        shard(model, config)
    if sgd:  # the agreement check: the update is the private gradient itself
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    inputs, targets = batch(config, rank)
    if method == BASE:

        def plain_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(**inputs), targets).backward()
            optimizer.step()

        return Step(plain_step, model, optimizer)
    if method == PERGRAD:
        return pergrad_step(model, optimizer, inputs, targets, config, world, noise)
    if method == WHOLE:
        return widened_whole(pergrad_step(model, optimizer, inputs, targets, config, world, noise))
    return opacus_step(model, optimizer, inputs, targets, config, world, noise)


def pergrad_step(
    model: Any, optimizer: Any, inputs: Any, targets: Any, config: Config, world: int, noise: float
) -> Step:
    import torch

    import pergrad

    private = pergrad.dp.DPOptimizer(
        optimizer,
        model,
        loss_fn,
        max_norm=MAX_NORM,
        noise_multiplier=noise,
        expected_batch_size=config.batch * world,  # the global one
        generator=torch.Generator().manual_seed(NOISE_SEED),
        distributed=world > 1,
    )
    step = Step(lambda: None, model, optimizer)

    def dp_step() -> None:
        taken = private.step(inputs, targets)
        step.taken = {"strategy": taken.strategy, "clip_fraction": taken.clip_fraction}

    step.call = dp_step
    return step


def widened_whole(step: Step) -> Step:
    """pergrad's ``step`` with each rule call's low-precision records widened to float32 whole,
    as before issue 36: the chunking threshold raised past every call while it runs."""
    from pergrad._src.capture import widening

    chunked = step.call

    def whole_step() -> None:
        threshold = widening.WIDENED_CHUNK_NUMBERS
        widening.WIDENED_CHUNK_NUMBERS = float("inf")
        try:
            chunked()
        finally:
            widening.WIDENED_CHUNK_NUMBERS = threshold

    step.call = whole_step
    return step


def opacus_step(
    model: Any, optimizer: Any, inputs: Any, targets: Any, config: Config, world: int, noise: float
) -> Step:
    import torch
    from opacus import PrivacyEngine

    # the loader only tells make_private the batch size: N * batch examples in one batch, which
    # Opacus divides by the world size (its expected batch size is per process)
    global_batch = config.batch * world
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(global_batch, 1)), batch_size=global_batch
    )
    private_model, private_optimizer, criterion, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        criterion=torch.nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=noise,
        max_grad_norm=MAX_NORM,
        poisson_sampling=False,
        grad_sample_mode="ghost_fsdp" if world > 1 else "ghost",
    )
    shape = (config.batch, config.length)  # each example's loss: the mean over its tokens

    def opacus_dp_step() -> None:
        private_optimizer.zero_grad(set_to_none=True)
        criterion(*flat_logits(private_model(**inputs), targets), shape=shape).backward()
        private_optimizer.step()

    def summed_grads() -> list[Any]:
        held = getattr(private_optimizer, "grad_state", {})  # FSDP: kept until zero_grad
        kept = [state.get("summed_grad") for state in held.values()]
        kept += [getattr(p, "summed_grad", None) for p in model.parameters()]
        return [t for t in kept if t is not None]

    return Step(opacus_dp_step, model, optimizer, summed_grads)


# --------------------------------------------------------------------------------------------
# Measuring, in a worker.


def local(tensor: Any) -> Any:
    """A DTensor's local shard; any other tensor as is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def state_mib(step: Step) -> dict[str, float]:
    """MiB of the storages of the parameters, gradients, optimizer state and DP buffers held
    now, each storage counted once (FSDP's gradients are views of one reduce-scatter buffer)."""
    import torch

    params = list(step.model.parameters())
    kinds = {
        "parameters": params,
        "gradients": [p.grad for p in params if p.grad is not None],
        "optimizer": [
            value
            for per_param in step.optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        ],
        "dp buffers": step.buffers(),
    }
    seen: set[int] = set()
    sizes = {}
    for kind, tensors in kinds.items():
        total = 0
        for tensor in tensors:
            storage = local(tensor).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        sizes[kind] = total / 2**20
    sizes["total"] = sum(sizes.values())
    return sizes


def agreed(call: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(call(), None)``, or ``(None, why)`` when it raised here or on another process: every
    process learns whether all succeeded (one all-gather), so they stay in step."""
    import torch.distributed as dist

    try:
        value, error = call(), None
    except Exception as caught:  # a method that cannot run is a result
        value, error = None, error_summary(caught)
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return value, None
    return None, error or f"on rank {failed[0][0]}: {failed[0][1]}"


def measure(config: Config, world: int, rank: int, rounds: int) -> dict[str, Any]:
    """Every method's step time, state and memory in this process."""
    result: dict[str, Any] = {"failed": {}, "resident_mib": {}, "taken": {}}
    steps: dict[str, Step] = {}
    for method in config.methods():
        gc.collect()
        before = status_mib("VmRSS")

        def warmed_up(method: str = method) -> Step:
            step = build(method, config, world, rank)
            step.call()  # FSDP's lazy initialisation, the optimizer's moments
            return step

        step, error = agreed(warmed_up)
        if error is not None:
            result["failed"][method] = error
            continue
        gc.collect()
        result["resident_mib"][method] = status_mib("VmRSS") - before
        steps[method] = step
    times = time_interleaved({m: s.call for m, s in steps.items()}, rounds, warmup=0)
    result["median_ms"] = {m: median_ms(t) for m, t in times.items()}
    result["peak_mib"], result["state_mib"] = {}, {}
    for method, step in steps.items():
        gc.collect()
        before = status_mib("VmRSS")
        result["peak_mib"][method] = peak_rss_over(step.call) - before
        result["state_mib"][method] = state_mib(step)
        if step.taken:
            result["taken"][method] = step.taken
    return result


def full_params(model: Any) -> list[Any]:
    """Every parameter whole (``full_tensor()``: collective, the same order everywhere)."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]


def first_update(method: str, config: Config, world: int, rank: int) -> Any:
    """The flat update of one SGD step (lr 1) of ``method`` without noise: minus its gradient."""
    import torch

    step = build(method, config, world, rank, noise=0.0, sgd=True)
    before = full_params(step.model)
    step.call()
    return torch.cat([(a - b).flatten() for a, b in zip(full_params(step.model), before)])


def single_process_update(config: Config, world: int) -> Any:
    """pergrad's update on one process, on the union of the ``world`` processes' batches."""
    import torch

    import pergrad

    parts = [batch(config, rank) for rank in range(world)]
    inputs = {key: torch.cat([p[0][key] for p in parts]) for key in parts[0][0]}
    targets = torch.cat([p[1] for p in parts])
    model = gpt2(config)
    before = [p.detach().clone() for p in model.parameters()]
    pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        loss_fn,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        expected_batch_size=config.batch * world,
    ).step(inputs, targets)
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])


def agreement(config: Config, world: int, rank: int) -> dict[str, str]:
    """On rank 0: each DP method's noiseless update against the single-process one on the
    union of the batches, ``|u - u_ref| / |u_ref|`` (or why it did not run)."""
    updates = {}
    for method in (m for m in config.methods() if m in PRIVATE):
        update, error = agreed(lambda method=method: first_update(method, config, world, rank))
        updates[method] = update if error is None else error
    if rank != 0:
        return {}
    reference = single_process_update(config, world)
    differences = {}
    for method, update in updates.items():
        if isinstance(update, str):
            differences[method] = f"did not run: {update}"
        else:
            relative = float((update - reference).norm() / reference.norm())
            differences[method] = f"{relative:.1e}"
    return differences


def opacus_layers_without_ghost_rule() -> list[str]:
    """GPT-2's layer types with parameters that Opacus has no ghost norm rule for."""
    from opacus.grad_sample import GradSampleModuleFastGradientClippingFSDP as Module
    from transformers.pytorch_utils import Conv1D

    return [t.__name__ for t in (Conv1D,) if t not in Module.NORM_SAMPLERS]


def preload() -> None:
    """Import everything the methods use and run one tiny backward pass, so that the first
    method's resident memory is its own and not the libraries' (transformers loads its model
    modules lazily)."""
    import opacus.grad_sample  # noqa: F401
    import opacus.optimizers  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import pergrad.dp  # noqa: F401

    model = gpt2(QUICK)  # transformers' GPT-2 module, and autograd's and the kernels' set-up
    inputs, targets = batch(QUICK, 0)
    loss_fn(model(**inputs), targets).backward()
    del model
    gc.collect()


def worker(world: int, rank: int, store: str, out: str, config: Config, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")  # Opacus's and FSDP's warnings, each step
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        world_size=world,
        rank=rank,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    preload()
    result = measure(config, world, rank, rounds)
    result["agreement"] = agreement(config, world, rank)
    result["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if rank == 0:
        result["opacus_without_ghost_rule"] = opacus_layers_without_ghost_rule()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # leave together: tearing gloo down under a peer aborts it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo can abort in C++ destructors at interpreter exit


# --------------------------------------------------------------------------------------------
# The driver: N processes for each N, then the table.


def run_world(world: int, quick: bool, rounds: int, flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start ``world`` workers, wait for them, and return their results by rank (or why not).
    ``flags``: the command line's options the workers take too (:func:`worker_flags`)."""
    with tempfile.TemporaryDirectory(prefix="fsdp_memory_") as directory:
        command = [sys.executable, __file__, "--rounds", str(rounds)] + ["--quick"] * quick
        command += list(flags)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **FREED_BUFFERS_TO_THE_OS}
        store = str(Path(directory, "store"))
        processes = [
            subprocess.Popen(
                [*command, "--worker", str(world), str(rank), store, directory],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]
        try:
            outputs = [p.communicate(timeout=WORLD_TIMEOUT_S)[0] for p in processes]
        except subprocess.TimeoutExpired:
            for process in processes:
                process.kill()
            return {"failed": f"timed out after {WORLD_TIMEOUT_S} s (a collective hung?)"}
        for rank, (process, output) in enumerate(zip(processes, outputs)):
            if process.returncode != 0:
                tail = " | ".join(output.strip().splitlines()[-3:])
                return {"failed": f"rank {rank} exited with {process.returncode}: {tail}"}
        ranks = [json.loads(Path(directory, f"rank{r}.json").read_text()) for r in range(world)]
    return {"ranks": ranks}


def worker_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The options of the workload and the methods, for the worker processes."""
    flags = ["--mixed-precision", args.mixed_precision] if args.mixed_precision else []
    flags += ["--model-dtype", args.model_dtype] if args.model_dtype else []
    flags += ["--widened-whole"] if args.widened_whole else []
    flags += ["--vocab", str(args.vocab)] if args.vocab else []
    return tuple(flags)


def shown(ranks: list[dict[str, Any]]) -> list[str]:
    """The methods the processes ran (or tried to), in the table's order."""
    ran = {*ranks[0]["median_ms"], *ranks[0]["failed"]}
    return [m for m in (BASE, PERGRAD, WHOLE, OPACUS) if m in ran]


def largest(ranks: list[dict[str, Any]], key: str, method: str) -> float | None:
    """The largest value over the processes (state: its total), None where not measured."""
    values = [r[key].get(method) for r in ranks]
    values = [v["total"] if isinstance(v, dict) else v for v in values if v is not None]
    return max(values) if values else None


def ratio(value: float | None, unit: float | None) -> str:
    return fmt(value / unit if value is not None and unit else None, ".2f", "x")


def rows_of(worlds: dict[int, dict[str, Any]]) -> list[list[str]]:
    rows = []
    single = worlds.get(1, {}).get("ranks")
    for world, outcome in worlds.items():
        ranks = outcome.get("ranks")
        if ranks is None:
            rows.append([str(world), "all", *["-"] * 7, f"fails: {outcome['failed']}"])
            continue
        base = {key: largest(ranks, key, BASE) for key in ("median_ms", "peak_mib")}
        for method in shown(ranks):
            ms, peak = largest(ranks, "median_ms", method), largest(ranks, "peak_mib", method)
            state = largest(ranks, "state_mib", method)
            state_1 = largest(single, "state_mib", method) if single else None
            note = ranks[0]["failed"].get(method, "")
            taken = ranks[0]["taken"].get(method)
            if taken:
                note = f"strategy {taken['strategy']}, {taken['clip_fraction']:.0%} clipped"
            rows.append(
                [
                    str(world),
                    method,
                    fmt(ms, ".0f"),
                    ratio(ms, base["median_ms"]),
                    fmt(state, ".1f"),
                    ratio(state, state_1) + (f" (1/N = {1 / world:.2f})" if state else ""),
                    fmt(peak, ".1f"),
                    ratio(peak, base["peak_mib"]),
                    fmt(largest(ranks, "resident_mib", method), ".1f"),
                    note,
                ]
            )
    return rows


HEADER = [
    "N",
    "method",
    "step ms",
    "time / non-private",
    "state MiB",
    "state / N=1's",
    "step peak MiB",
    "peak / non-private",
    "resident MiB",
    "note",
]


def notes(worlds: dict[int, dict[str, Any]]) -> list[str]:
    lines = []
    for world, outcome in worlds.items():
        ranks = outcome.get("ranks")
        if not ranks:
            continue
        rss = max(r["max_rss_mib"] for r in ranks)
        state = ranks[0]["state_mib"]
        parts = ", ".join(
            f"{kind} {value:.1f}"
            for kind, value in state.get(PERGRAD, state.get(BASE, {})).items()
            if kind != "total"
        )
        differences = ", ".join(f"{m} {d}" for m, d in ranks[0]["agreement"].items())
        lines.append(
            f"- N={world}: whole-process peak RSS (ru_maxrss) {rss:.0f} MiB at most; pergrad's "
            f"state on rank 0 (MiB): {parts}; noiseless update against one process on the "
            f"union of the batches: {differences}"
        )
    missing = next(
        (o["ranks"][0].get("opacus_without_ghost_rule") for o in worlds.values() if "ranks" in o),
        None,
    )
    if missing:
        lines.append(
            f"- Opacus has no ghost norm rule for {', '.join(missing)} (GPT-2's attention and "
            f"MLP projections): for those layers its ghost_fsdp mode forms per-example "
            f"gradients (functorch) and takes their norms."
        )
    return lines


def summary(worlds: dict[int, dict[str, Any]]) -> list[str]:
    """pergrad's and Opacus's ratios to the non-private step, side by side, for each N."""
    lines = []
    for world, outcome in worlds.items():
        ranks = outcome.get("ranks")
        if not ranks:
            continue
        parts = []
        for method in (m for m in shown(ranks) if m in PRIVATE):
            ms = largest(ranks, "median_ms", method)
            if ms is None:
                parts.append(f"{method} did not run")
                continue
            time_ratio = ratio(ms, largest(ranks, "median_ms", BASE))
            peak_ratio = ratio(largest(ranks, "peak_mib", method), largest(ranks, "peak_mib", BASE))
            state_ratio = ratio(
                largest(ranks, "state_mib", method), largest(ranks, "state_mib", BASE)
            )
            parts.append(
                f"{method} {time_ratio} the time, {peak_ratio} the step peak, "
                f"{state_ratio} the state"
            )
        lines.append(f"- N={world}: " + "; ".join(parts) + " of the non-private step.")
    return lines


def report(worlds: dict[int, dict[str, Any]]) -> str:
    table = markdown_table(HEADER, rows_of(worlds), "rlrrrrrrr")
    return "\n".join(
        [
            "Against the non-private step of the same N (an FSDP2 step for N > 1):",
            "",
            *summary(worlds),
            "",
            table,
            "",
            *notes(worlds),
            "",
            "Step ms: median over the rounds, on the slowest process. State: counted bytes of "
            "the local shards of the parameters, gradients, AdamW moments and the DP method's "
            "buffers held between steps, on the process holding most; its ratio to N=1's is "
            "the sharding (ideal 1/N). Step peak: measured, the peak resident memory during "
            "one step above the resident memory before it (VmHWM after clear_refs), on the "
            "process where it is largest. Resident: measured, VmRSS after building the method "
            "and one warm-up step, minus VmRSS before. Each process runs one torch thread: with "
            "N=4 on 2 cores, 4 processes share 2 cores and the step times include waiting for "
            "one; the ratios to the non-private step of the same N are the comparable figures.",
        ]
    )


def uptime() -> str:
    try:
        done = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or f"load average {machine.load_average()}"
    except (OSError, subprocess.SubprocessError):
        return f"load average {machine.load_average()}"


def pergrad_source() -> str:
    """Where the measured pergrad came from: its directory, and its git commit when it is in
    a checkout (with a mark when its files differ from the commit)."""
    import pergrad

    directory = Path(pergrad.__file__).resolve().parent
    where = f"pergrad {machine.package_version('pergrad')} from {directory}"
    try:
        git = ["git", "-C", str(directory)]
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return where
    if commit.returncode != 0:
        return where
    dirty = " with uncommitted changes" if changed.stdout.strip() else ""
    return f"{where}, commit {commit.stdout.strip()}{dirty}"


def header(config: Config, args: argparse.Namespace, at_start: str) -> str:
    return titled(
        "DP-SGD on a GPT-2 sharded with FSDP2: memory and time per process (CPU, gloo)",
        [
            f"machine: {machine.cpu_and_cores()}; shared with other jobs, whose processes the "
            f"load average counts",
            machine.software("torch", "transformers", "opacus"),
            pergrad_source(),
            f"date: {machine.timestamp()}",
            f"uptime at the start: {at_start}",
            f"uptime at the end: {uptime()}",
            f"workload: {config.describe()}; AdamW; max_norm {MAX_NORM}, noise multiplier "
            f"{NOISE}; {args.rounds} timed rounds after one warm-up step; N processes over gloo, "
            f"one torch thread each",
            f"command: `{machine.command_line()}`",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, N = 1 and 2")
    parser.add_argument("--worlds", help="comma-separated numbers of processes (1,2,4)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; quick 2)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument(
        "--mixed-precision",
        nargs="?",
        const="bfloat16",
        choices=["bfloat16", "float16"],
        help="N > 1: a MixedPrecisionPolicy with param_dtype bfloat16 (the default) or float16",
    )
    parser.add_argument(
        "--model-dtype",
        choices=["bfloat16", "float16"],
        help="every method's model in this dtype (model.to(dtype)), N = 1 included",
    )
    parser.add_argument(
        "--widened-whole",
        action="store_true",
        help="also pergrad's step with the rules' low-precision records widened to float32 "
        "whole (before issue 36), interleaved with the others",
    )
    parser.add_argument("--vocab", type=int, help="the vocabulary (default 8192; quick 128)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    base = QUICK if args.quick else FULL
    config = replace(
        base,
        vocab=args.vocab or base.vocab,
        mixed_precision=args.mixed_precision,
        model_dtype=args.model_dtype,
        widened_whole=args.widened_whole,
    )
    args.rounds = args.rounds or (2 if args.quick else 5)
    if args.worker:
        world, rank, store, out = args.worker
        worker(int(world), int(rank), store, out, config, args.rounds)
        return
    worlds = [int(n) for n in (args.worlds or ("1,2" if args.quick else "1,2,4")).split(",")]
    at_start = uptime()
    results = {}
    for world in worlds:
        results[world] = run_world(world, args.quick, args.rounds, worker_flags(args))
        print(f"N={world}: done", file=sys.stderr, flush=True)
    publish(report(results), args.out, lambda: header(config, args, at_start))


if __name__ == "__main__":
    main()

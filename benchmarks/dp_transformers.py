"""DP-SGD step cost on small transformers: pergrad against Opacus, as ratios to a non-private
step (issue 19).

Run:  python benchmarks/dp_transformers.py [--quick] [--out PATH.md]

The committed results: ``python benchmarks/dp_transformers.py --out
benchmarks/results/cpu/dp_transformers.md`` (the table, and the plot ``dp_transformers.png``);
about 10-15 minutes on 2 idle cores.

Models from small Hugging Face configs (nothing downloaded), 4 layers, no dropout, in training
mode: GPT-2 (causal LM, its default tied embedding / lm-head; also an untied row), BERT
(sequence classification), Llama (causal LM) at width 256 and sequence 128 and 512, T5
(encoder-decoder, 4 layers each, its trainable relative attention bias, the lm head tied to the
shared table; 128 tokens in and 128 out) and ViT
(width 128, 32x32 images in 4x4 patches: 65 tokens). A causal LM's loss is the mean over its
tokens of the next-token cross-entropy, so an example's loss is the mean over its own tokens.
Five methods, each on its own copy of the model (same initialisation, same batch):

* ``non-private``: forward, backward, ``torch.optim.SGD`` step: the unit of every ratio;
* ``pergrad DP``: ``pergrad.dp.DPOptimizer(SGD, ...).step(x, y)``: per-example clipping,
  noise, the SGD step (and the strategy it took: ``DPStep.strategy``);
* ``pergrad low-memory``: the same with ``strategy="ghost-lowmem"`` (norms in the backward
  pass, records dropped, a second backward pass for the clipped sum);
* ``Opacus hooks``: ``PrivacyEngine().make_private(...)`` (per-example gradients in hooks);
* ``Opacus ghost``: the same with ``grad_sample_mode="ghost"`` (ghost clipping, two backward
  passes); it refuses tied parameters, and that is reported, not worked around.

All: ``max_norm=1``, ``noise_multiplier=1``, expected batch size = the batch, no Poisson
sampling (one fixed batch). Time: median of ``--rounds`` interleaved rounds
(:func:`pergrad.bench.timing.time_interleaved`, one warm-up step each) in one process per
workload; the ratio is the median of the per-round ratios to the non-private step. Memory: each
(workload, method) in its own process, forked from a parent that has imported the libraries and
run nothing: it builds the model, batch and optimizer, reads the resident memory (the
baseline), resets the peak (``/proc/self/clear_refs``, Linux) and takes a first step and then
one more; extra memory = peak RSS - baseline, over the first step and over the later ones. The
*working memory* is the later steps' extra memory less what the first step left resident that
is no tensor: library code paged in by kernels used for the first time, the libraries' own
buffers, imported modules (the RSS after the first step above the baseline, less the bytes of
the tensors alive then that were not before: 13-34 MiB, differing by method; the notes give
it). What a method keeps between
steps as tensors (gradients, Opacus's per-example gradients) stays counted. Its ratio to the
non-private step's is the memory the goal is judged on (a GPU's peak allocated memory would
likewise count only tensors); the ratio of the extra memory (the larger of the two) is given
beside it. For pergrad's low-memory mode, one more step gives each
phase's peak (forward, first and second backward pass, noise and step), in the notes. Large
buffers go back to the OS when freed (``mallopt(M_MMAP_THRESHOLD)``), so the peak is the step's
working memory.

Prints a markdown table; ``--out PATH.md`` also writes it with the machine named, and the plot
next to it (``PATH.png``). ``--quick``: tiny models, 2 rounds, a smoke test (< 1 min).
``--gpt2-small``: GPT-2 small at its real size instead (12 layers, width 768, vocabulary 50257,
tied and untied, 128 tokens, batch 8; about 15 minutes on 2 cores with ``--rounds 5``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import platform
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pergrad.bench import machine
from pergrad.bench.child import ChildFailed, run_in_child
from pergrad.bench.memory import free_buffers_to_the_os, peak_rss_over, reset_peak, status_mib
from pergrad.bench.report import error_summary, fmt, markdown_table, publish, titled
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved

METHODS = ("non-private", "pergrad DP", "pergrad low-memory", "Opacus hooks", "Opacus ghost")
PERGRAD = {"pergrad DP": "auto", "pergrad low-memory": "ghost-lowmem"}  # method -> strategy
# --float64-norms adds this method: pergrad's DP step with the norms of before issue 36 (the
# Gram route in float64, no rounding bound: capture/cost.FAST_NORMS off during its steps)
FLOAT64_NORMS = "pergrad DP, float64 norms"
# --records-held adds this method: pergrad's DP step with every layer's records held to the end
# of the backward pass, as before the held per-example gradients (capture/cost.HOLD_FORMED off)
RECORDS_HELD = "pergrad DP, records held"
# --float64-crossover adds this method: pergrad's DP step with the Gram route of each layer
# priced at float64's crossover, as before the certified float32 Gram route was priced as such
# (capture/cost.FAST_GRAM_PRICED off: Gram matrices only where 2 T (p + q) <= p q)
FLOAT64_CROSSOVER = "pergrad DP, float64 crossover"
BASE = "non-private"
PRIVATE = METHODS[1:]
GOAL_TIME, GOAL_MEMORY = 1.15, 1.1  # issue 19: pergrad's DP step against the non-private one
MAX_NORM, NOISE, LEARNING_RATE = 1.0, 1.0, 1e-3
MEMORY_LATER_STEPS = 1
JOB_TIMEOUT_S = 1800  # one job (a workload's timing, or one method's memory) at most


@dataclass(frozen=True)
class Config:
    """Sizes of the models: width, layers, heads, vocabulary (LMs and BERT)."""

    width: int = 256
    vit_width: int = 128
    layers: int = 4
    heads: int = 4
    vocab: int = 8192
    image: int = 32
    patch: int = 4


@dataclass(frozen=True)
class Workload:
    model: str  # "GPT-2", "GPT-2 untied", "BERT", "Llama", "T5" or "ViT"
    length: int  # tokens per example (ViT: patches + the class token)
    batch_size: int
    explicit_ids: bool = True  # position (and token type) ids of the batch's shape

    @property
    def name(self) -> str:
        return f"{self.model} T={self.length} B={self.batch_size}"


FULL = Config()
QUICK = Config(width=32, vit_width=32, layers=1, heads=2, vocab=128, image=8, patch=4)
# --gpt2-small: GPT-2 small at its real size (124 M parameters with the tied head)
GPT2_SMALL = Config(width=768, layers=12, heads=12, vocab=50257)


def small(model: str, explicit_ids: bool = True) -> Workload:
    """The quick run's workload of ``model``: 2 examples of 8 tokens (ViT: 8x8 images, 5)."""
    length = (QUICK.image // QUICK.patch) ** 2 + 1 if model == "ViT" else 8
    return Workload(model, length, 2, explicit_ids)


def workloads(quick: bool) -> list[Workload]:
    """The full run's batch sizes keep it near 15 minutes on 2 cores: the issue's 16 (32 for
    ViT) at sequence 128, 4 at sequence 512 (a step of 16 x 512 tokens takes seconds)."""
    if quick:
        return [small(model) for model in ("GPT-2", "BERT", "Llama", "T5", "ViT")]
    vit_length = (FULL.image // FULL.patch) ** 2 + 1
    return [
        Workload("GPT-2", 128, 16),
        Workload("GPT-2 untied", 128, 16),
        Workload("BERT", 128, 16),
        Workload("Llama", 128, 16),
        Workload("T5", 128, 16),
        Workload("GPT-2", 512, 4),
        Workload("BERT", 512, 4),
        Workload("Llama", 512, 4),
        Workload("ViT", vit_length, 32),
    ]


# --------------------------------------------------------------------------------------------
# Models, batches and losses.


def hf_model(kind: str, config: Config, length: int) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if kind.startswith("GPT-2"):
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=config.vocab,
                n_positions=length,
                n_embd=config.width,
                n_layer=config.layers,
                n_head=config.heads,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                tie_word_embeddings=kind == "GPT-2",
            )
        )
    if kind == "BERT":
        return transformers.BertForSequenceClassification(
            transformers.BertConfig(
                vocab_size=config.vocab,
                hidden_size=config.width,
                num_hidden_layers=config.layers,
                num_attention_heads=config.heads,
                intermediate_size=4 * config.width,
                max_position_embeddings=length,
                num_labels=2,
                **no_dropout,
            )
        )
    if kind == "Llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=config.vocab,
                hidden_size=config.width,
                intermediate_size=4 * config.width,
                num_hidden_layers=config.layers,
                num_attention_heads=config.heads,
                max_position_embeddings=length,
            )
        )
    if kind == "T5":
        return transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=config.vocab,
                d_model=config.width,
                d_kv=config.width // config.heads,
                d_ff=4 * config.width,
                num_layers=config.layers,
                num_heads=config.heads,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        )
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(
            image_size=config.image,
            patch_size=config.patch,
            hidden_size=config.vit_width,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            intermediate_size=4 * config.vit_width,
            num_labels=10,
            **no_dropout,
        )
    )


def is_lm(workload: Workload) -> bool:
    """A model with a loss over tokens (T5: over the decoder's)."""
    return workload.model in ("GPT-2", "GPT-2 untied", "Llama", "T5")


def batch(workload: Workload, config: Config) -> tuple[dict[str, Any], Any]:
    """The model's keyword inputs and the targets: next tokens (LMs) or labels."""
    import torch

    generator = torch.Generator().manual_seed(1)
    size = workload.batch_size
    if workload.model == "ViT":
        images = torch.randn(size, 3, config.image, config.image, generator=generator)
        return {"pixel_values": images}, torch.randint(0, 10, (size,), generator=generator)
    ids = torch.randint(0, config.vocab, (size, workload.length + 1), generator=generator)
    if workload.model == "T5":  # the decoder reads the targets shifted right, from token 0
        targets = torch.randint(1, config.vocab, (size, workload.length), generator=generator)
        start = torch.zeros(size, 1, dtype=torch.long)
        decoder_ids = torch.cat([start, targets[:, :-1]], 1)
        return {"input_ids": ids[:, :-1].contiguous(), "decoder_input_ids": decoder_ids}, targets
    # Contiguous, as a data loader's (Opacus views them), and with the batch's shape: with the
    # models' defaults (one row of position ids broadcast over the batch, BERT's token types
    # an expanded buffer) Opacus fails (see with_default_ids).
    inputs = {"input_ids": ids[:, :-1].contiguous()}
    if workload.explicit_ids:
        inputs["position_ids"] = torch.arange(workload.length).expand(size, -1).contiguous()
    if workload.explicit_ids and workload.model == "BERT":
        inputs["token_type_ids"] = torch.zeros_like(inputs["position_ids"])
    if is_lm(workload):
        return inputs, ids[:, 1:].contiguous()
    return inputs, torch.randint(0, 2, (size,), generator=generator)


def flat_logits(output: Any, targets: Any) -> tuple[Any, Any]:
    """(N, classes) logits and (N,) targets: N = B tokens x T for an LM, B otherwise."""
    logits = output.logits
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)


def loss_fn(output: Any, targets: Any) -> Any:
    """Mean cross-entropy over the batch's tokens (LM) or examples: as every example has the
    same number of tokens, the mean over examples of each example's mean over its tokens."""
    import torch.nn.functional as F

    return F.cross_entropy(*flat_logits(output, targets))


# --------------------------------------------------------------------------------------------
# The steps: each method builds its own model and optimizer and returns one training step.


@dataclass
class Step:
    call: Callable[[], Any]
    strategy: str = ""  # pergrad's DPStep.strategy, after the first step
    clip_fraction: float = math.nan  # pergrad's DPStep.clip_fraction, after the first step
    model: Any = None  # the model the step updates


def build_step(
    method: str, workload: Workload, config: Config, noise: float = NOISE, device: Any = "cpu"
) -> Step:
    """``method``'s step on its own copy of the model, the model and the batch on ``device``
    (the model initialised there: seconds less for GPT-2 small on a GPU)."""
    import torch

    torch.manual_seed(0)
    with torch.device(device):
        model = hf_model(workload.model, config, workload.length).train()
    inputs, targets = batch(workload, config)
    if torch.device(device).type != "cpu":
        inputs = {k: v.to(device) for k, v in inputs.items()}
        targets = targets.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    if method == BASE:

        def plain_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(**inputs), targets).backward()
            optimizer.step()

        step = Step(plain_step)
    elif method in PERGRAD:
        step = pergrad_step(
            model, optimizer, inputs, targets, workload.batch_size, noise, PERGRAD[method]
        )
    elif method == FLOAT64_NORMS:
        step = pergrad_step(model, optimizer, inputs, targets, workload.batch_size, noise)
        step.call = with_float64_norms(step.call)
    elif method == RECORDS_HELD:
        step = pergrad_step(model, optimizer, inputs, targets, workload.batch_size, noise)
        step.call = with_cost_flag(step.call, "HOLD_FORMED", False)
    elif method == FLOAT64_CROSSOVER:
        step = pergrad_step(model, optimizer, inputs, targets, workload.batch_size, noise)
        step.call = with_cost_flag(step.call, "FAST_GRAM_PRICED", False)
    else:
        step = opacus_step(method, model, optimizer, inputs, targets, workload, noise)
    step.model = model
    return step


def with_float64_norms(call: Callable[[], None]) -> Callable[[], None]:
    """``call`` with pergrad's ghost norms as before issue 36: float64 Gram matrices, no
    certified bound (``capture/cost.FAST_NORMS`` off during the call)."""
    return with_cost_flag(call, "FAST_NORMS", False)


def with_cost_flag(call: Callable[[], None], name: str, value: bool) -> Callable[[], None]:
    """``call`` with pergrad's ``capture/cost.<name>`` set to ``value`` while it runs (a
    benchmark's "before" of a change that flag switches), restored after."""
    from pergrad._src.capture import cost

    def flagged() -> None:
        before = getattr(cost, name)
        setattr(cost, name, value)
        try:
            call()
        finally:
            setattr(cost, name, before)

    return flagged


def pergrad_step(
    model: Any,
    optimizer: Any,
    inputs: Any,
    targets: Any,
    size: int,
    noise: float,
    strategy: str = "auto",
) -> Step:
    import pergrad

    private = pergrad.dp.DPOptimizer(
        optimizer,
        model,
        loss_fn,
        max_norm=MAX_NORM,
        noise_multiplier=noise,
        expected_batch_size=size,
        strategy=strategy,
    )
    step = Step(lambda: None)

    def dp_step() -> None:
        taken = private.step(inputs, targets)
        step.strategy, step.clip_fraction = taken.strategy, taken.clip_fraction

    step.call = dp_step
    return step


def opacus_step(
    method: str,
    model: Any,
    optimizer: Any,
    inputs: Any,
    targets: Any,
    workload: Workload,
    noise: float,
) -> Step:
    import torch
    from opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(workload.batch_size, 1)),
        batch_size=workload.batch_size,
    )
    ghost = method == "Opacus ghost"
    criterion = torch.nn.CrossEntropyLoss()
    made = PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        criterion=criterion,
        data_loader=loader,
        noise_multiplier=noise,
        max_grad_norm=MAX_NORM,
        poisson_sampling=False,
        grad_sample_mode="ghost" if ghost else "hooks",
    )
    private_model, private_optimizer = made[0], made[1]
    # Opacus's ghost criterion takes the (B, T) shape to make each example's loss the mean
    # over its tokens; the hooks take the mean loss over the batch's tokens, as the others.
    shape = (workload.batch_size, workload.length) if is_lm(workload) else None
    private_loss = (
        (lambda output: made[2](*flat_logits(output, targets), shape=shape))
        if ghost
        else (lambda output: loss_fn(output, targets))
    )

    def opacus_dp_step() -> None:
        private_optimizer.zero_grad(set_to_none=True)
        private_loss(private_model(**inputs)).backward()
        private_optimizer.step()

    return Step(opacus_dp_step)


def failure(error: BaseException) -> str:
    """``refuses: <class>: <message>`` for Opacus's refusal of tied parameters, else
    ``fails: ...``; the first line of the message, at most 160 characters."""
    summary = error_summary(error)
    return f"{'refuses' if 'tying is not supported' in summary else 'fails'}: {summary}"


# --------------------------------------------------------------------------------------------
# The jobs, each in a process forked from the driver.


def time_workload(workload: Workload, config: Config, rounds: int) -> dict[str, Any]:
    """Every method's step, timed in interleaved rounds after one warm-up step each."""
    steps: dict[str, Step] = {}
    result: dict[str, Any] = {"failed": {}, "strategy": {}, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method in METHODS:
            try:
                steps[method] = build_step(method, workload, config)
                steps[method].call()  # fails here when it fails; warm-up otherwise
            except Exception as error:  # a method that cannot take the model is a result
                steps.pop(method, None)
                result["failed"][method] = failure(error)
        result["warnings"] = sorted({str(w.message) for w in caught if is_pergrads(w)})
    if BASE not in steps:
        return result
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = time_interleaved({m: s.call for m, s in steps.items()}, rounds, warmup=0)
    result["times_s"] = times
    result["strategy"] = {m: s.strategy for m, s in steps.items() if s.strategy}
    return result


def with_default_ids(config: Config) -> dict[str, Any]:
    """What each private method does when the models make their own position and token type
    ids: ``{"<model> / <method>": "ok" or the failure}``, one step of a small batch."""
    outcomes = {}
    warnings.simplefilter("ignore")
    for model in ("GPT-2 untied", "BERT"):
        for method in PRIVATE:
            try:
                build_step(method, small(model, explicit_ids=False), config).call()
                outcomes[f"{model} / {method}"] = "ok"
            except Exception as error:
                outcomes[f"{model} / {method}"] = failure(error)
    return outcomes


def agreement(config: Config) -> dict[str, str]:
    """Without noise, each private method's first update, against pergrad's: the relative
    difference ``|u - u_pergrad| / |u_pergrad|`` (the methods compute the same DP step)."""
    import torch

    differences, clipped = {}, {}
    warnings.simplefilter("ignore")
    for workload in map(small, ("GPT-2", "GPT-2 untied", "BERT", "Llama", "T5", "ViT")):
        updates = {}
        for method in PRIVATE:
            try:
                step = build_step(method, workload, config, noise=0.0)
                before = [p.detach().clone() for p in step.model.parameters()]
                step.call()
            except Exception as error:
                differences[f"{workload.model} / {method}"] = failure(error)
                continue
            after = [p.detach() for p in step.model.parameters()]
            clipped[workload.model] = max(clipped.get(workload.model, 0.0), step.clip_fraction)
            updates[method] = torch.cat([(a - b).flatten() for a, b in zip(after, before)])
        reference = updates.pop("pergrad DP", None)
        for method, update in updates.items():
            if reference is not None:
                relative = float((update - reference).norm() / reference.norm())
                differences[f"{workload.model} / {method}"] = f"{relative:.1e}"
    differences["share of examples clipped"] = ", ".join(f"{m} {c:.0%}" for m, c in clipped.items())
    return differences


def is_pergrads(caught: warnings.WarningMessage) -> bool:
    """pergrad's own warnings (its strategy left the ghost path), not Opacus's or torch's."""
    import pergrad

    return issubclass(caught.category, pergrad.FallbackWarning) or str(caught.message).startswith(
        "DPOptimizer"
    )


def memory_of(workload: Workload, config: Config, method: str) -> dict[str, Any]:
    """Extra resident memory (MiB) of a first step and of later steps, above the RSS after
    building the model, the batch and the optimizer."""
    if not os.path.exists("/proc/self/clear_refs"):
        return {"failed": "not measured: needs Linux's /proc/self/clear_refs"}
    free_buffers_to_the_os()
    warnings.simplefilter("ignore")
    inventory: dict[str, Any] = {}

    def later_steps() -> None:
        for _ in range(MEMORY_LATER_STEPS):
            step.call()

    try:
        step = build_step(method, workload, config)
        gc.collect()
        held_before = tensor_storages(step.model)
        baseline = status_mib("VmRSS")
        first = peak_rss_over(step.call) - baseline
        gc.collect()
        before_later = status_mib("VmRSS")
        held_after = tensor_storages(step.model)
        retained = sum(n for k, n in held_after.items() if k not in held_before) / 2**20
        residue = max(0.0, before_later - baseline - retained)
        del held_before, held_after
        with recorded_bytes(inventory) if method == "pergrad DP" else contextlib.nullcontext():
            later_peak = peak_rss_over(later_steps)
        later = later_peak - baseline
        if method == "pergrad low-memory":  # one more step, its peak phase by phase
            gc.collect()
            inventory["phases_mib"] = phase_peaks(step.call, baseline)
            inventory.update(held_against_freed(step.model, workload, config))
    except Exception as error:
        return {"failed": failure(error)}
    return {
        "first_mib": first,
        "later_mib": later,
        "working_mib": later - residue,
        "retained_mib": retained,
        "residue_mib": residue,
        "baseline_mib": baseline,
        **inventory,
    }


def tensor_storages(model: Any) -> dict[int, int]:
    """The tensors alive now, each storage once (address -> bytes): those the garbage
    collector sees (an Opacus ``grad_sample``, an optimizer's state, anything a method keeps)
    and the model's parameters' ``.grad``."""
    import torch

    found: dict[int, int] = {}
    tensors = [x for x in gc.get_objects() if isinstance(x, torch.Tensor)]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for x in tensors:
        with contextlib.suppress(Exception):  # (a tensor without storage: meta, a subclass)
            storage = x.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


@contextlib.contextmanager
def recorded_bytes(inventory: dict[str, Any]) -> Iterator[None]:
    """Where pergrad's extra memory goes: the ghost step's layer records, held from the backward
    pass until every layer's norm is known, summed into ``inventory`` (MiB, each storage once)
    as the clipped sum starts: the output gradients (and the largest layer's), and the layer
    inputs (partly tensors that autograd keeps anyway, for the backward pass)."""
    from pergrad._src.capture import torch_quantities  # where the ghost step reads its records

    weighted_sums = torch_quantities.weighted_sums

    def counting(session: Any, *args: Any) -> Any:
        if not inventory:
            grads, inputs, largest = {}, {}, ("", 0)
            for name, layer_records in session.records.items():
                size = 0
                for record in layer_records:
                    if record.output_grad is not None:
                        grads[record.output_grad.untyped_storage().data_ptr()] = nbytes(
                            record.output_grad
                        )
                        size += nbytes(record.output_grad)
                    for x in record.inputs:
                        if hasattr(x, "untyped_storage") and x.is_floating_point():
                            inputs[x.untyped_storage().data_ptr()] = nbytes(x)
                largest = max(largest, (name, size), key=lambda item: item[1])
            inventory["grad_records_mib"] = sum(grads.values()) / 2**20
            inventory["input_records_mib"] = sum(inputs.values()) / 2**20
            inventory["largest_grad_record"] = (largest[0], largest[1] / 2**20)
        return weighted_sums(session, *args)

    torch_quantities.weighted_sums = counting
    try:
        yield
    finally:
        torch_quantities.weighted_sums = weighted_sums


# The low-memory mode's phases: pergrad's function (in capture/torch_passes) that ends each
LOWMEM_PHASES = {
    "forward": "forward pass",
    "_first_backward": "first backward pass (each layer's norms in its hook)",
    "_reduce_before_layout_check": "the rest of the norms",
    "second_pass": "second backward pass (each layer's clipped sum in its hook)",
}


def phase_peaks(call: Callable[[], Any], baseline: float) -> dict[str, float]:
    """The peak RSS (MiB above ``baseline``) of each phase of one step of pergrad's low-memory
    mode (:data:`LOWMEM_PHASES`, then the noise and the optimizer's step), read where the
    function that ends the phase returns."""
    from pergrad._src.capture import torch_passes  # the functions each phase ends with

    peaks: dict[str, float] = {}

    def mark(phase: str) -> None:
        peaks[phase] = max(peaks.get(phase, -math.inf), status_mib("VmHWM") - baseline)
        reset_peak()

    def marking(function: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def marked(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            finally:
                mark(phase)

        return marked

    originals = {name: getattr(torch_passes, name) for name in LOWMEM_PHASES}
    for name, phase in LOWMEM_PHASES.items():
        setattr(torch_passes, name, marking(originals[name], phase))
    try:
        reset_peak()
        call()
        mark("noise and the optimizer's step")
    finally:
        for name, function in originals.items():
            setattr(torch_passes, name, function)
    return peaks


def held_against_freed(model: Any, workload: Workload, config: Config) -> dict[str, float]:
    """What holding every hooked layer's records through the backward pass (the one-pass
    mode) costs, against what a backward pass that does not retain its graph frees (the
    low-memory mode's retains it), in MiB, from one forward pass of ``model`` on the batch:
    the layers' output gradients (each call's output size), and autograd's saved tensors
    that are no hooked layer's input (the inputs are held either way)."""
    import torch

    import pergrad
    from pergrad._src.capture.torch_plan import plan  # the layers the ghost step hooks

    loss = pergrad.module_loss(model, loss_fn)
    layers = plan(loss, loss.params()).layers
    saved: dict[int, int] = {}
    inputs: set[int] = set()
    outputs = [0]

    def keep(x: Any) -> Any:
        if x.is_floating_point():
            saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    def record(module: Any, args: Any, output: Any) -> None:
        inputs.update(a.untyped_storage().data_ptr() for a in args if torch.is_tensor(a))
        outputs[0] += output.numel() * output.element_size() if torch.is_tensor(output) else 0

    handles = [model.get_submodule(name).register_forward_hook(record) for name in layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            model(**batch(workload, config)[0])
    finally:
        for handle in handles:
            handle.remove()
    freed = sum(size for pointer, size in saved.items() if pointer not in inputs)
    return {"held_grads_mib": outputs[0] / 2**20, "freed_activations_mib": freed / 2**20}


def nbytes(x: Any) -> int:
    return x.untyped_storage().nbytes()


def in_child(job: Callable[..., dict[str, Any]], *args: Any, threads: int | None) -> dict[str, Any]:
    """``job(*args)`` in a process forked from this one (on ``threads`` torch threads, when
    given): its memory is its own; a crash is a result."""
    try:
        call = functools.partial(on_threads, threads, job, *args)
        return run_in_child(call, fork=True, timeout=JOB_TIMEOUT_S)
    except ChildFailed as error:
        return {"failed": f"fails: {error.reason}"}


def on_threads(threads: int | None, job: Callable[..., Any], *args: Any) -> Any:
    if threads:
        import torch

        torch.set_num_threads(threads)
    return job(*args)


# --------------------------------------------------------------------------------------------
# Driver: the jobs, the table, the plot.


def measure(workload: Workload, config: Config, args: argparse.Namespace) -> dict[str, Any]:
    timed = in_child(time_workload, workload, config, args.rounds, threads=args.threads)
    memory = {
        method: in_child(memory_of, workload, config, method, threads=args.threads)
        for method in METHODS
    }
    return {"workload": workload, "timed": timed, "memory": memory}


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: times, ratios and memory, or the failure."""
    timed, memory = result["timed"], result["memory"]
    times = timed.get("times_s", {})
    base_memory = memory[BASE]
    base_extra = max(base_memory.get("first_mib", 0.0), base_memory.get("later_mib", 0.0))
    base_working = base_memory.get("working_mib", 0.0)
    rows = []
    for method in METHODS:
        row: dict[str, Any] = {"workload": result["workload"], "method": method}
        row["strategy"] = timed.get("strategy", {}).get(method, "")
        row["failed"] = timed["failed"].get(method) or timed["failed"].get(BASE)
        if method in times:
            row["ms"] = median_ms(times[method])
            row["time_ratio"] = paired_ratio(times[method], times[BASE])
        mem = memory[method]
        if "first_mib" in mem:
            row["first_mib"], row["later_mib"] = mem["first_mib"], mem["later_mib"]
            row["working_mib"] = mem["working_mib"]
            extra = max(mem["first_mib"], mem["later_mib"])
            row["extra_ratio"] = extra / base_extra if base_extra > 0 else None
            working = mem["working_mib"]
            row["memory_ratio"] = working / base_working if base_working > 0 else None
        row["failed"] = row["failed"] or mem.get("failed")
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["workload", "method", "pergrad strategy", "step ms", "time / non-private"]
    columns += ["extra MiB, first step", "extra MiB, later steps", "working MiB"]
    columns += ["memory / non-private", "extra / non-private", "note"]
    cells = [
        [r["workload"].name, r["method"], r["strategy"], fmt(r.get("ms"), ".0f", missing="—")]
        + [fmt(r.get("time_ratio"), ".2f", "x", missing="—")]
        + [fmt(r.get(key), ".0f", missing="—") for key in ("first_mib", "later_mib", "working_mib")]
        + [fmt(r.get(key), ".2f", "x", missing="—") for key in ("memory_ratio", "extra_ratio")]
        + [r["failed"] or ""]
        for r in rows
    ]
    return markdown_table(columns, cells)


def goal_summary(rows: list[dict[str, Any]]) -> str:
    """Where pergrad's DP step meets the issue's goal and where it does not."""
    lines = [
        f"Goal (issue 19): pergrad's DP step within {GOAL_TIME}x the time and {GOAL_MEMORY}x "
        f"the memory of the non-private step, on every workload.",
        "",
    ]
    for r in rows:
        if r["method"] not in PERGRAD:
            continue
        name = f"{r['workload'].name}, {r['method']}"
        if r["failed"] and r.get("time_ratio") is None:
            lines.append(f"- {name}: not measured ({r['failed']}).")
            continue
        time_ok = r.get("time_ratio") is not None and r["time_ratio"] <= GOAL_TIME
        memory_ok = r.get("memory_ratio") is not None and r["memory_ratio"] <= GOAL_MEMORY
        verdict = "met" if time_ok and memory_ok else "NOT met"
        time_ratio, memory_ratio, extra_ratio = (
            fmt(r.get(key), ".2f", "x", missing="—")
            for key in ("time_ratio", "memory_ratio", "extra_ratio")
        )
        lines.append(
            f"- {name}: {verdict} (time {time_ratio}, memory {memory_ratio}; extra memory "
            f"above the baseline {extra_ratio}; strategy {r['strategy'] or '—'})."
        )
    return "\n".join(lines)


def notes(
    results: list[dict[str, Any]], agreed: dict[str, str], default_ids: dict[str, str]
) -> str:
    """pergrad's warnings, the methods' agreement, what happens with the models' own ids."""
    said: dict[str, list[str]] = {}
    for result in results:
        for message in result["timed"].get("warnings", []):
            said.setdefault(message, []).append(result["workload"].name)
    lines = ["Notes:", ""]
    lines += [
        f"- pergrad warned on {', '.join(names)}: {message}" for message, names in said.items()
    ]
    lines.append(
        "- The same step: without noise, the relative difference of each other update "
        "(pergrad's low-memory mode, Opacus) from pergrad DP's, one step of the quick run's "
        "small models (2 examples):"
    )
    lines += [f"  - {name}: {value}" for name, value in agreed.items()]
    lines += [
        "- Every method gets the same inputs: token ids, and position ids (BERT: also token "
        "type ids) of the batch's shape. With the models' own defaults (one row of position "
        "ids broadcast over the batch; BERT's token types an expanded buffer), one step of a "
        "small batch gives:"
    ]
    lines += [f"  - {name}: {outcome}" for name, outcome in default_ids.items()]
    held = [r for r in results if "grad_records_mib" in r["memory"].get("pergrad DP", {})]
    if held:
        lines.append(
            "- Where pergrad's extra memory goes (a later step): the ghost step keeps each "
            "layer's output gradient and its input from the backward pass until every layer's "
            "norm is known (one backward pass, no second one), except the layers held as their "
            "formed per-example gradients, which are fewer numbers (not counted here); the "
            "non-private step frees them layer by layer:"
        )
    for result in held:
        mem, base = result["memory"]["pergrad DP"], result["memory"][BASE]
        name, largest = mem["largest_grad_record"]
        lines.append(
            f"  - {result['workload'].name}: output gradients {mem['grad_records_mib']:.0f} MiB "
            f"(the largest, `{name}`: {largest:.0f} MiB), layer inputs "
            f"{mem['input_records_mib']:.0f} MiB (partly kept by autograd anyway); the step's "
            f"extra over the non-private one "
            f"{mem['later_mib'] - base.get('later_mib', math.nan):.0f} MiB"
        )
    kept = [
        f"{result['workload'].name}: "
        + ", ".join(
            f"{method} {result['memory'][method]['residue_mib']:.0f} "
            f"({result['memory'][method]['retained_mib']:.0f})"
            for method in METHODS
            if "residue_mib" in result["memory"][method]
        )
        for result in results
    ]
    if kept:
        lines.append(
            "- Left resident by the first step that is no tensor (MiB; library code paged in "
            "by kernels used for the first time, the libraries' own buffers, imported "
            "modules), left out of the working memory; in brackets the tensors a method keeps "
            "from one step to the next (the gradients, Opacus's per-example gradients), which "
            "stay in it:"
        )
        lines += [f"  - {line}" for line in kept]
    phased = [r for r in results if "phases_mib" in r["memory"].get("pergrad low-memory", {})]
    if phased:
        lines.append(
            "- Where pergrad's low-memory mode peaks (one more later step, the peak of each "
            "phase above the same baseline, MiB; the non-private step's peak in brackets): "
            "its first backward pass retains the graph, so every activation stays alive "
            "through it and its hooks' transients (a layer's norms) come on top. Holding "
            "layers' records instead of recomputing them (a second pass truncated above "
            "them) would not lower it where the layers' output gradients outweigh the "
            "activations that a pass not retaining its graph frees (each summed over every "
            "hooked layer, after the phases):"
        )
    for result in phased:
        low = result["memory"]["pergrad low-memory"]
        base = result["memory"][BASE]
        plain = max(base.get("first_mib", math.nan), base.get("later_mib", math.nan))
        split = ", ".join(f"{phase} {mib:.0f}" for phase, mib in low["phases_mib"].items())
        lines.append(
            f"  - {result['workload'].name}: {split} ({plain:.0f}); output gradients "
            f"{low['held_grads_mib']:.0f} MiB against {low['freed_activations_mib']:.0f} MiB "
            f"of activations"
        )
    lines.append(
        "- Opacus's ghost clipping refuses a parameter used twice in one forward pass (GPT-2's "
        "tied embedding and lm-head): reported as `refuses`, not untied; the `GPT-2 untied` "
        "row is the same model with `tie_word_embeddings=False`."
    )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Time and memory ratios of the three private methods, one group of bars per workload;
    a method that refuses or fails a workload gets a mark instead of a bar."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"].name for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.4 * len(names)), 8), sharex=True)
    panel(axes[0], rows, names, "time_ratio", GOAL_TIME, "step time / non-private step")
    panel(axes[1], rows, names, "memory_ratio", GOAL_MEMORY, "working memory / non-private's")
    axes[0].legend(fontsize=8, ncol=4, loc="upper left")
    axes[1].set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    axes[0].set_title("DP step on transformers, as a ratio to a non-private step (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def panel(
    ax: Any, rows: list[dict[str, Any]], names: list[str], key: str, goal: float, label: str
) -> None:
    from matplotlib.ticker import FuncFormatter

    by_key = {(r["workload"].name, r["method"]): r for r in rows}
    width = 0.8 / len(PRIVATE)
    for i, method in enumerate(PRIVATE):
        xs = [j + (i - (len(PRIVATE) - 1) / 2) * width for j in range(len(names))]
        values = [by_key[(name, method)].get(key) for name in names]
        ax.bar(xs, [v or 0.0 for v in values], width, label=method)
        for x, value, name in zip(xs, values, names):
            if value is None:  # "refuses" or "fails"
                note = (by_key[(name, method)]["failed"] or "—").split(":")[0]
                ax.text(x, 1.0, note, rotation=90, ha="center", va="bottom", fontsize=7)
            else:
                ax.text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=6)
    ax.axhline(goal, color="k", linestyle="--", linewidth=0.8, label=f"goal for pergrad {goal}x")
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.8)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.tick_params(axis="y", which="both", labelsize=7)
    ax.set_ylabel(label)


def header(args: argparse.Namespace, config: Config) -> str:
    import torch

    sizes = (
        f"{config.layers} layers, width {config.width} (ViT {config.vit_width}), "
        f"{config.heads} heads, MLP 4x width (Llama's gated), vocabulary {config.vocab}, "
        f"ViT {config.image}x{config.image} images in {config.patch}x{config.patch} patches; "
        f"no dropout, training mode; max_norm {MAX_NORM}, noise_multiplier {NOISE}, "
        f"torch.optim.SGD"
    )
    models = "GPT-2 small" if args.gpt2_small else "small transformers"
    threads = args.threads or torch.get_num_threads()
    return titled(
        f"DP-SGD step cost on {models}: pergrad and Opacus (CPU)",
        [
            f"machine: {machine.cpu_and_cores()}, torch threads {threads}; {platform.system()}, "
            + machine.software("torch", "transformers", "opacus", "pergrad"),
            f"date: {machine.timestamp()}; load average {machine.load_average()} at the end",
            f"models: {sizes}; T = tokens per example, B = batch size",
            f"time: median of {args.rounds} interleaved rounds after a warm-up step; memory: "
            f"each method in its own process, peak RSS above the RSS after building the model, "
            f"batch and optimizer, over the first step and over {MEMORY_LATER_STEPS} later ones; "
            f"working memory: the later steps' less what the first left resident that is no "
            f"tensor",
            f"command: `{machine.command_line()}`",
        ],
    )


def preload() -> None:
    """Import in the driver what the jobs import, so that the forked jobs share it and their
    first step's memory is the step's, not a module's. The driver itself computes nothing: a
    process forked after a parallel region of GNU OpenMP hangs in its own first one."""
    import opacus  # noqa: F401
    import torch.func  # noqa: F401
    import transformers

    import pergrad._src.strategies.ghost_torch  # noqa: F401  (imported by the first step)
    import pergrad.dp

    transformers.logging.set_verbosity_error()
    for name in (
        "GPT2LMHeadModel",
        "BertForSequenceClassification",
        "LlamaForCausalLM",
        "T5ForConditionalGeneration",
        "ViTForImageClassification",
    ):
        getattr(transformers, name)  # the modeling modules load on first access
    assert pergrad.dp.DPOptimizer
    gc.collect()
    gc.freeze()  # a job's collections then leave the shared pages alone (no copy on write)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's; 1 with --quick)"
    )
    parser.add_argument(
        "--models",
        help="only these models, comma-separated: GPT-2, GPT-2 untied, BERT, Llama, T5, ViT",
    )
    parser.add_argument(
        "--gpt2-small",
        action="store_true",
        help="GPT-2 small at its real size (12 layers, width 768, vocabulary 50257), tied and "
        "untied, T=128, B=8, instead of the small configs",
    )
    parser.add_argument(
        "--float64-norms",
        action="store_true",
        help=f"also time {FLOAT64_NORMS!r}: the ghost norms in float64 as before issue 36",
    )
    parser.add_argument(
        "--records-held",
        action="store_true",
        help=f"also time {RECORDS_HELD!r}: every layer's records held to the end of the "
        "backward pass, none reduced to its formed per-example gradients (as before)",
    )
    parser.add_argument(
        "--float64-crossover",
        action="store_true",
        help=f"also time {FLOAT64_CROSSOVER!r}: each layer's Gram route priced at float64's "
        "crossover, as before the certified float32 Gram route was priced as such",
    )
    parser.add_argument("--out", type=Path, help="write the markdown here, the plot next to it")
    args = parser.parse_args()
    global METHODS, PRIVATE
    extra = [FLOAT64_NORMS] * args.float64_norms + [RECORDS_HELD] * args.records_held
    extra += [FLOAT64_CROSSOVER] * args.float64_crossover
    METHODS = (*METHODS[:2], *extra, *METHODS[2:])
    PRIVATE = METHODS[1:]
    config = QUICK if args.quick else GPT2_SMALL if args.gpt2_small else FULL
    if args.quick:
        # Tiny models gain nothing from threads, and on a busy machine OpenMP's spinning
        # threads made the smoke run 3x slower.
        args.rounds, args.threads = 2, args.threads or 1
    chosen = (
        [Workload("GPT-2", 128, 8), Workload("GPT-2 untied", 128, 8)]
        if args.gpt2_small
        else workloads(args.quick)
    )
    if args.models:
        wanted = set(args.models.split(","))
        chosen = [w for w in chosen if w.model in wanted]
    preload()
    results, rows = [], []
    for workload in chosen:
        results.append(measure(workload, config, args))
        rows += rows_of(results[-1])
        print(table([r for r in rows if r["workload"] == workload]), flush=True)
    agreed = in_child(agreement, QUICK, threads=args.threads)
    default_ids = in_child(with_default_ids, QUICK, threads=args.threads)
    text = "\n\n".join([table(rows), goal_summary(rows), notes(results, agreed, default_ids)])
    publish(text, args.out, lambda: header(args, config))
    if args.out is not None:
        plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()

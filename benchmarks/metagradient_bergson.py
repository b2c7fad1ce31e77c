"""bergson's MAGIC beside pergrad's metagradient on the digits MLP (issue 34).

Run:  python benchmarks/metagradient_bergson.py [--quick] [--out PATH]

The run is ``metagradient_lds.py``'s headline: scikit-learn's digits, 1000 training digits, an
MLP 64-128-10 with tanh (PyTorch's initialisation, seed 0, float64), SGD with momentum 0.9 and
L2 1e-3 at learning rate 0.03, 10 epochs of batches of 32 in a seeded order (the last batch of
each epoch has 8 examples), the target of each target digit its margin at the end of the run.
Both libraries compute the same quantity, ``d margin_j(final params) / d w_i`` at ``w = 1``
with step ``t``'s loss ``sum_{i in batch t} w_i loss_i / len(batch t)``:

- pergrad: ``influence.metagradient`` of all the targets in one call (vectorised over the
  targets), and of one target per call (as bergson scores them);
- bergson: its MAGIC engine, ``bergson.magic.trainer.Trainer``: ``Trainer.train`` with
  checkpoints (its default ``save_mode="sqrt"``), then per target one ``Trainer.backward``
  through the saved trajectory from the final state, as its own per-query loop does
  (``bergson.magic.cli.compute_per_query_magic_scores``: restore the final state, the
  target's gradient as the parameters' cotangent, zero cotangents for the optimizer state and
  the weights, ``cleanup=False``); the optimizer ``torchopt.sgd(lr, momentum, weight_decay)``,
  which ``prepare_trainer`` builds for ``optimizer="sgd"``.

bergson's ``magic`` command cannot take this model: its ``prepare_trainer`` builds the model
with ``setup_model_and_peft(cfg)``, which loads ``cfg.model`` as a Hugging Face checkpoint
(``from_pretrained``), and its ``DataStream`` reads token ids from a ``datasets.Dataset``
(``pad_and_tensor(batch["input_ids"], ...)``) in batches of one fixed size (``num_batches =
n // batch_size``). Its engine takes any ``nn.Module`` whose forward returns the loss
(``accumulate_grads``: "Two output types are supported: HuggingFace ... and 'raw loss' (a
scalar loss Tensor)"), so the script drives the engine with the MLP wrapped to return the
weighted batch loss, and a small stream with ``DataStream``'s interface (``weights``, a
``Parameter`` over the training set; ``__getitem__(step)`` the batch's keyword arguments,
``example_weight`` among them). The keys avoid ``labels`` and ``shift_loss_mask``, which
``loss_denom`` reads as token sequences; with one micro-batch its ratio is 1.

Reported: the agreement of the two score matrices (Pearson correlation per target, the
largest difference relative to the largest score), the same-seed LDS of each at 1% / 10% / 50%
dropped (``metagradient_lds.same_seed_truth``: 64 subsets per fraction, the run retrained
with the same initialisation and order, the dropped examples' weights 0), and the time per
target in seconds and in training runs (one ``influence.replay`` of the run), after a
warm-up call of each. torch on one thread. ``--quick``: 2 epochs, 3 targets, 8 subsets.

Install bergson beside pergrad without letting pip replace the CPU torch (bergson's
torchvision / torchaudio pins pull a CUDA build; it imports neither):

    python -m venv venv && . venv/bin/activate
    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install --no-deps bergson
    pip install accelerate datasets jinja2 "jaxtyping>=0.3.3" ml_dtypes natsort peft petname \\
        pyarrow pyyaml simple-parsing torchopt "transformers>=5.0" "huggingface-hub>=1.13.0" \\
        numpy scipy scikit-learn
    pip install --no-deps -e .      # pergrad, from the repository root

(bitsandbytes, torchvision and torchaudio, also in bergson's requirements, are not needed
for ``import bergson.magic.trainer``.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import pergrad
from pergrad import influence
from pergrad.bench.machine import load_average
from pergrad.bench.report import markdown_table, publish, sentence_header
from pergrad.bench.timing import paired_ratio, timed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import metagradient_lds as mg  # noqa: E402

RESULT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "cpu", "metagradient_bergson.md"
)
SAVE_MODE = "sqrt"  # bergson's default (TrainingConfig.save_mode)
MISSING = (
    "metagradient_bergson.py needs bergson ({error}). Install it without its torchvision "
    "pin, which pulls a CUDA torch:\n"
    "  pip install --no-deps bergson\n"
    '  pip install accelerate datasets jinja2 "jaxtyping>=0.3.3" ml_dtypes natsort peft '
    'petname pyarrow pyyaml simple-parsing torchopt "transformers>=5.0" '
    '"huggingface-hub>=1.13.0"\n'
    "(the script's docstring gives the whole recipe)."
)


def import_bergson() -> tuple[Any, Any]:
    """bergson's MAGIC trainer module and torchopt, or exit with how to install them."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # bergson's progress bars, per step
    # torch.distributed.checkpoint saving bergson's checkpoints in one process says so each time
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        import torchopt
        from bergson.magic import trainer
    except ImportError as error:
        raise SystemExit(MISSING.format(error=error)) from None
    return trainer, torchopt


class WeightedLoss(torch.nn.Module):
    """The MLP returning step ``t``'s loss, ``sum_i w_i loss_i / len(batch)``: bergson's
    "raw loss" model."""

    def __init__(self, network: torch.nn.Module) -> None:
        super().__init__()
        self.network = network

    def forward(
        self, input_ids: torch.Tensor, targets: torch.Tensor, example_weight: torch.Tensor
    ) -> torch.Tensor:
        losses = F.cross_entropy(self.network(input_ids), targets, reduction="none")
        return (example_weight * losses).sum() / len(targets)


class RunStream:
    """The run's batches with ``bergson.magic.DataStream``'s interface: ``weights`` (one per
    training example, float64), ``requires_grad``, ``len`` (steps) and ``[step]`` (the keyword
    arguments of ``WeightedLoss``)."""

    def __init__(self, setup: dict) -> None:
        self.x, self.y = setup["data"]
        self.batches = [torch.as_tensor(b) for b in setup["batches"]]
        self.weights = torch.nn.Parameter(torch.ones(len(self.x), dtype=torch.float64))
        self.device = torch.device("cpu")

    @property
    def requires_grad(self) -> bool:
        return self.weights.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.weights.requires_grad = value

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        index = self.batches[step]
        return {
            "input_ids": self.x[index],
            "targets": self.y[index],
            "example_weight": self.weights[index],
        }


def mlp(params: dict[str, torch.Tensor]) -> torch.nn.Sequential:
    """metagradient_lds.py's MLP (float64) holding ``params``."""
    network = torch.nn.Sequential(
        torch.nn.Linear(64, mg.HIDDEN), torch.nn.Tanh(), torch.nn.Linear(mg.HIDDEN, 10)
    ).double()
    with torch.no_grad():
        for name, value in network.named_parameters():
            value.copy_(params[name])
    return network


def bergson_scores(setup: dict, checkpoints: str, targets: int) -> dict[str, Any]:
    """bergson's MAGIC scores of the first ``targets`` margins (``(n_train, targets)``), the
    seconds of its training run with checkpoints and of each target's backward, the final
    parameters' largest difference from ``influence.replay``'s."""
    trainer_module, torchopt = import_bergson()
    optimizer = setup["optimizer"]
    sgd = torchopt.sgd(
        optimizer.learning_rate, momentum=optimizer.momentum, weight_decay=optimizer.weight_decay
    )
    trainer, state = trainer_module.Trainer.initialize(WeightedLoss(mlp(setup["params0"])), sgd)
    stream = RunStream(setup)
    state, train_seconds = timed(
        lambda: trainer.train(
            state, stream, inplace=True, save_dir=checkpoints, save_mode=SAVE_MODE
        )
    )
    replayed = influence.replay(*mg.run_of(setup))
    mismatch = max(
        float((state.params[f"network.{name}"].detach() - value).abs().max())
        for name, value in replayed.items()
    )
    final = state.to("cpu").detach_()
    zeros = [
        torch.zeros_like(t)
        for t in torchopt.pytree.tree_iter(state.opt_state)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    template = mlp(setup["params0"])
    x_target, y_target = setup["targets"]

    def one_target(j: int) -> torch.Tensor:
        state.detach_()
        state.copy_(final)
        params = {
            name[len("network.") :]: value.detach().requires_grad_(True)
            for name, value in state.params.items()
        }
        logits = torch.func.functional_call(template, params, (x_target[j : j + 1],))
        margin = mg.margins_of(logits, y_target[j : j + 1]).sum()
        grads = torch.autograd.grad(margin, list(params.values()))
        cotangent = {f"network.{name}": g for name, g in zip(params, grads)}
        stream.requires_grad = True
        stream.weights.grad = None
        backward = trainer_module.BackwardState(
            cotangent, [z.clone() for z in zeros], torch.zeros_like(stream.weights)
        )
        backward = trainer.backward(
            checkpoints, stream, backward, state, cleanup=False, inplace=True, save_mode=SAVE_MODE
        )
        return backward.weight_grads.detach().clone()

    one_target(0)  # warm-up
    unit = training_run(setup)
    columns, seconds = zip(*(timed(lambda j=j: one_target(j)) for j in range(targets)))
    return {
        "scores": torch.stack(columns, 1),
        "train": train_seconds,
        "per_target": float(np.mean(seconds)),
        "unit": unit,
        "mismatch": mismatch,
        "checkpoints": sum(1 for name in os.listdir(checkpoints) if name.startswith("step_")),
    }


def pergrad_scores(setup: dict, targets: int, singles: int) -> dict[str, Any]:
    """pergrad's metagradient of all targets in one call (after a warm-up call) and of each
    of the first ``singles`` targets alone, each call paired with a training run timed just
    before it (the load of a shared machine changes from one call to the next)."""
    run = mg.run_of(setup)

    def all_targets() -> torch.Tensor:
        return influence.metagradient(*run, setup["target"])

    all_targets()  # warm-up
    unit = training_run(setup)
    scores, seconds = timed(all_targets)

    def alone(j: int) -> torch.Tensor:
        return influence.metagradient(*run, lambda params: setup["target"](params)[j])

    units, single_seconds = zip(
        *((training_run(setup), timed(lambda j=j: alone(j))[1]) for j in range(singles))
    )
    return {
        "scores": scores,
        "per_target": seconds / targets,
        "unit": unit,
        "single": float(np.median(single_seconds)),
        "single_unit": float(np.median(units)),
        "single_runs": paired_ratio(single_seconds, units),
        "singles": singles,
    }


def training_run(setup: dict) -> float:
    """The seconds of one training run (``influence.replay``), the unit of the times: taken
    just before each timing, so that a shared machine's changing load hits both alike."""
    return timed(lambda: influence.replay(*mg.run_of(setup)))[1]


def agreement(first: torch.Tensor, second: torch.Tensor) -> tuple[float, float, float]:
    """Pearson correlation per target (its minimum and mean) and the largest difference
    relative to the largest score, of two ``(n_train, k)`` score matrices."""
    rho = [np.corrcoef(first[:, j], second[:, j])[0, 1] for j in range(first.shape[1])]
    relative = float((first - second).abs().max() / first.abs().max())
    return float(np.min(rho)), float(np.mean(rho)), relative


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs, 3 targets, 8 subsets")
    parser.add_argument("--out", help=f"write the results here (default without --quick: {RESULT})")
    args = parser.parse_args()
    import_bergson()  # before any work: a missing bergson says so at once
    torch.set_num_threads(1)
    start_load = load_average()
    epochs, targets, subsets = (2, 3, 8) if args.quick else (mg.EPOCHS, 50, 64)
    setup = mg.setup_run(mg.HEADLINE, targets, epochs=epochs)
    truth = mg.same_seed_truth(setup, subsets)
    ours = pergrad_scores(setup, targets, 1 if args.quick else 5)
    print(f"pergrad: {ours['per_target']:.3f} s per target", flush=True)
    with tempfile.TemporaryDirectory() as checkpoints:
        theirs = bergson_scores(setup, checkpoints, targets)
    print(f"bergson: {theirs['per_target']:.3f} s per target", flush=True)
    low, mean, relative = agreement(ours["scores"], theirs["scores"])
    text = report(setup, truth, ours, theirs, (low, mean, relative))

    def header() -> str:
        return sentence_header(
            "pergrad's metagradient and bergson's MAGIC (digits MLP)",
            ["torch", "numpy", "bergson", "torchopt"],
            [
                f"pergrad {pergrad.__version__}",
                "torch on 1 thread",
                f"load average {start_load} at the start, {load_average()} at the end",
            ],
        )

    publish(text, args.out or (None if args.quick else RESULT), header)


def report(
    setup: dict,
    truth: dict,
    ours: dict,
    theirs: dict,
    agree: tuple[float, float, float],
) -> str:
    """The results: the table, the agreement and what the times mean."""
    targets = ours["scores"].shape[1]
    rows = []
    for name, scores, per_target, unit, runs in (
        ("pergrad metagradient, all targets in one call", ours["scores"], ours["per_target"])
        + (ours["unit"], ours["per_target"] / ours["unit"]),
        ("pergrad metagradient, one target per call", ours["scores"], ours["single"])
        + (ours["single_unit"], ours["single_runs"]),
        (f"bergson MAGIC (Trainer, save_mode={SAVE_MODE})", theirs["scores"])
        + (theirs["per_target"], theirs["unit"], theirs["per_target"] / theirs["unit"]),
    ):
        values = [influence.lds(scores, masks, outputs) for masks, outputs in truth.values()]
        rows.append(
            [name, *(f"{v:.3f}" for v in values), f"{per_target:.2f}", f"{unit:.2f}"]
            + [f"{runs:.2f}"]
        )
    header = ["method", *(f"same-seed LDS, {d:.0%} dropped" for d in truth)]
    header += ["seconds per target", "one training run (s)", "training runs per target"]
    subsets = len(next(iter(truth.values()))[0])
    low, mean, relative = agree
    return "\n".join(
        [
            markdown_table(header, rows),
            "",
            f"{targets} targets, {subsets} subsets per fraction, {len(setup['batches'])} steps, "
            f"lr {setup['lr']} (momentum {mg.MOMENTUM}, L2 {mg.L2}). The unit, one training "
            f"run (`influence.replay`), is timed just before each row's timing (the machine's "
            f"load changes during the run). The one-target-per-call row times "
            f"{ours['singles']} target(s) alone, each its own call after its own training "
            f"run: the medians of both, and of their ratios; its LDS is the all-targets call's "
            f"(the same numbers).",
            "",
            f"Agreement: Pearson correlation of the two libraries' scores per target "
            f"{low:.12f} at the lowest (mean {mean:.12f}); the largest difference "
            f"{relative:.1e} of the largest score. The final parameters of bergson's training "
            f"run differ from `influence.replay`'s by at most {theirs['mismatch']:.1e}.",
            "",
            f"bergson's training run with checkpoints ({theirs['checkpoints']} saved to disk "
            f"with torch.distributed.checkpoint, once for all targets): "
            f"{theirs['train']:.2f} s; each target's backward rematerialises the steps "
            f"between checkpoints and differentiates each step by reverse-over-reverse. "
            f"pergrad keeps every step in memory (`checkpoint_every=1`) and carries all the "
            f"targets' adjoints in one reverse pass.",
        ]
    )


if __name__ == "__main__":
    main()

"""Gradient diagnostics over training in ``transformers.Trainer``, on digits with flipped labels.

Run:  python examples/monitor_flipped_labels.py [--quick] [--out PATH]

The flipped-label task of ``examples/find_mislabeled.py``: scikit-learn's bundled digits (no
download), 5% of the training labels flipped to a wrong class, the same MLP (64-32-10, tanh,
the same initial weights) trained by plain SGD (learning rate 0.1, batches of 64), here by a
Hugging Face ``transformers.Trainer`` on the CPU. ``pergrad.norms.TrainingMonitorCallback``
measures every ``EVERY``-th step's batch on the ghost path (each example's gradient norm and the
batch's summed gradient, no per-example gradient formed) and keeps the running gradient noise
scale, the share of norms above ``MAX_NORM`` and the norms' quantiles. The script prints them
once an epoch and saves ``pergrad.plotting.training_curves`` of the whole run: by default to
``docs/images/monitor_flipped_labels.png`` (the plot in the diagnostics guide, 30 epochs);
``--quick`` trains 2 epochs, for a check in seconds (give it ``--out``).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from find_mislabeled import BATCH, HIDDEN, LR, SEED, init_weights, load_noisy_digits
from torch import nn

import pergrad
import pergrad.plotting

EPOCHS, QUICK_EPOCHS, EVERY, MAX_NORM = 30, 2, 2, 1.0
IMAGE = Path(__file__).resolve().parents[1] / "docs" / "images" / "monitor_flipped_labels.png"


class DigitsMLP(nn.Module):
    """The MLP of ``find_mislabeled.py`` with the output the Trainer expects: a dict with the
    logits, and the batch's mean loss when ``labels`` are given."""

    def __init__(self):
        super().__init__()
        weights = init_weights(SEED)
        self.hidden, self.out = nn.Linear(64, HIDDEN), nn.Linear(HIDDEN, 10)
        with torch.no_grad():
            self.hidden.weight.copy_(torch.from_numpy(weights["w1"].T))
            self.out.weight.copy_(torch.from_numpy(weights["w2"].T))
            self.hidden.bias.zero_()
            self.out.bias.zero_()

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.out(torch.tanh(self.hidden(pixels)))
        if labels is None:  # the callback's pass: it computes the loss with loss_fn
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def train(epochs: int) -> pergrad.norms.TrainingMonitorCallback:
    """Train on the noisy digits for ``epochs`` epochs; the callback holds the monitor."""
    x, y, flipped = load_noisy_digits(SEED)
    print(f"{len(x)} training digits, {len(flipped)} labels flipped\n")
    examples = [
        {"pixels": torch.from_numpy(pixels), "labels": torch.tensor(int(label))}
        for pixels, label in zip(x, y)
    ]
    callback = pergrad.norms.TrainingMonitorCallback(
        loss_fn=lambda output, labels: F.cross_entropy(output["logits"], labels),
        monitor=pergrad.norms.TrainingMonitor(smoothing=0.98),
        max_norm=MAX_NORM,
        every=EVERY,
    )
    with tempfile.TemporaryDirectory() as scratch:  # the Trainer wants a folder; it saves nothing
        args = transformers.TrainingArguments(
            scratch,
            num_train_epochs=epochs,
            per_device_train_batch_size=BATCH,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,  # plain SGD, as find_mislabeled.py trains
            seed=SEED,
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=DigitsMLP(), args=args, train_dataset=examples, callbacks=[callback]
        )
        trainer.remove_callback(transformers.PrinterCallback)  # the table below says it all
        trainer.train()
    return callback


def print_epochs(monitor: pergrad.norms.TrainingMonitor, steps_per_epoch: int) -> None:
    """The monitor's numbers at the last monitored step of each epoch."""
    history = monitor.history
    print("| epoch | step | norm q10 | q50 | q90 | clipped | noise scale (running) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, step in enumerate(history["step"]):
        last_of_epoch = i + 1 == len(history["step"]) or (
            (history["step"][i + 1] - 1) // steps_per_epoch > (step - 1) // steps_per_epoch
        )
        if last_of_epoch:
            print(
                f"| {(step - 1) // steps_per_epoch + 1} | {step} | {history['q10'][i]:.3f} "
                f"| {history['q50'][i]:.3f} | {history['q90'][i]:.3f} "
                f"| {history['clip_fraction'][i]:.2f} | {history['noise_scale'][i]:.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_EPOCHS} epochs")
    parser.add_argument("--out", type=Path, default=IMAGE, help="where to save the plot (PNG)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()

    epochs = QUICK_EPOCHS if args.quick else EPOCHS
    callback = train(epochs)
    steps_per_epoch = math.ceil(len(load_noisy_digits(SEED)[0]) / BATCH)
    print_epochs(callback.monitor, steps_per_epoch)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pergrad.plotting.training_curves(
        callback.monitor,
        path=args.out,
        max_norm=MAX_NORM,
        title=f"Digits, 5% of labels flipped: MLP trained by transformers.Trainer, {epochs} epochs",
    )
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()

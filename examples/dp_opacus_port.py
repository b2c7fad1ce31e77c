"""Opacus's MNIST example (``examples/mnist.py``), ported to pergrad.

Run:  python examples/dp_opacus_port.py [--epochs 10] [--quick]

The original trains ``SampleConvNet`` with ``PrivacyEngine().make_private(...)`` (Poisson
sampling, noise multiplier ``--sigma 1.0``, norm bound ``-c 1.0``, SGD at lr 0.1) and prints
each epoch's mean training loss and the epsilon of its PRV accountant at delta 1e-5. Here the
same network (its layers shrunk to the 8x8 digits bundled with scikit-learn: no download) is
trained through ``pergrad.dp.make_private``: the same call, returning the optimizer, the
Poisson data loader and the accountant, with the PLD accountant (numerically what PRV gives).
The training loop drops Opacus's ``zero_grad`` / ``backward`` / ``step`` for one
``optimizer.step(x, y)``, whose result carries the batch's mean loss (``DPStep.loss``), so
printing the loss needs no second forward pass.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from pergrad import dp

SIGMA, MAX_PER_SAMPLE_GRAD_NORM, LR, BATCH_SIZE, DELTA = 1.0, 1.0, 0.1, 64, 1e-5


class SampleConvNet(nn.Module):
    """Opacus's ``SampleConvNet``, for 8x8 digits: conv - pool - conv - pool - fc - fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, padding=1)  # 8x8 -> 8x8, pooled to 7x7
        self.conv2 = nn.Conv2d(16, 32, 3, 2)  # 7x7 -> 3x3, pooled to 2x2
        self.fc1 = nn.Linear(32 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))  # -> (B, 16, 8, 8)
        x = F.max_pool2d(x, 2, 1)  # -> (B, 16, 7, 7)
        x = F.relu(self.conv2(x))  # -> (B, 32, 3, 3)
        x = F.max_pool2d(x, 2, 1)  # -> (B, 32, 2, 2)
        x = x.view(-1, 32 * 2 * 2)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def load_digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1797 digits as ``(B, 1, 8, 8)`` images in [0, 1], normalised as Opacus's example
    normalises MNIST, split 75 / 25."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    images = (images - images.mean()) / images.std()
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=seed
    )
    return (
        TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)),
    )


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    images, labels = data.tensors
    with torch.no_grad():
        return float((model(images).argmax(1) == labels).float().mean())


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=None, help="fix the noise and sampling")
    parser.add_argument("--quick", action="store_true", help="1 epoch, for a smoke test")
    args = parser.parse_args(argv)
    epochs = 1 if args.quick else args.epochs
    if args.seed is not None:
        torch.manual_seed(args.seed)
    generators = {}
    if args.seed is not None:
        generators = {
            "generator": torch.Generator().manual_seed(args.seed),
            "sampler_generator": torch.Generator().manual_seed(args.seed + 1),
        }
    train_set, test_set = load_digits_split()
    model = SampleConvNet()

    optimizer, train_loader, accountant = setup = dp.make_private(
        model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0), train_set,
        F.cross_entropy, batch_size=BATCH_SIZE, epochs=epochs, noise_multiplier=SIGMA,
        max_norm=MAX_PER_SAMPLE_GRAD_NORM, delta=DELTA, **generators,
    )  # fmt: skip
    print(setup.plan)
    for epoch in range(1, epochs + 1):
        losses = []
        for images, labels in train_loader:  # Poisson batches, empty ones included
            stats = optimizer.step(images, labels)  # clip, noise, step; one forward pass
            if stats.loss is not None:
                losses.append(stats.loss)
        print(
            f"Train Epoch: {epoch} \tLoss: {np.mean(losses):.6f} "
            f"(ε = {accountant.epsilon():.2f}, δ = {DELTA})"
        )
    test_accuracy = accuracy(model, test_set)
    print(f"Test set: accuracy {test_accuracy:.3f}")
    return {"accuracy": test_accuracy, "epsilon": accountant.epsilon()}


if __name__ == "__main__":
    main()

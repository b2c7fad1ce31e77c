"""Which training digits made the model get a test digit wrong? Influence functions on digits.

Run:  python examples/influence_digits.py [--out DIR] [--num-test 4] [--top 5]

An L2-regularised softmax regression (650 parameters) is trained in PyTorch on scikit-learn's
bundled digits (no download). For a few misclassified test digits, pergrad's influence
functions score every training digit; the most helpful (largest positive score: removing it
would raise the test loss) and the most harmful (most negative: removing it would lower the
test loss) are drawn beside the test digit in a saved image grid.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from pergrad import influence

L2, EPOCHS, LR = 1e-3, 300, 0.5


def train(x, y):
    import torch

    weights = torch.zeros(64, 10, requires_grad=True)
    bias = torch.zeros(10, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], lr=LR, max_iter=EPOCHS)

    def closure():
        optimizer.zero_grad()
        loss = batch_loss({"w": weights, "b": bias}, x, y)
        loss.backward()
        return loss

    optimizer.step(closure)
    return {"w": weights.detach(), "b": bias.detach()}


def example_loss(params, x, y):
    """The DATA loss of ONE example: the regulariser is passed on its own (weight_decay)."""
    import torch

    logits = x @ params["w"] + params["b"]
    return torch.nn.functional.cross_entropy(logits[None], y[None])


def weight_decay(params):
    """The training regulariser: in the Hessian of the influence function, in no gradient."""
    return 0.5 * L2 * (params["w"] ** 2).sum()


def batch_loss(params, x, y):
    import torch

    logits = x @ params["w"] + params["b"]
    return torch.nn.functional.cross_entropy(logits, y) + weight_decay(params)


def draw_grid(path, x_train, y_train, x_test, y_test, predicted, chosen, scores, top):
    import matplotlib.pyplot as plt

    columns = 1 + 2 * top
    fig, axes = plt.subplots(len(chosen), columns, figsize=(1.3 * columns, 1.6 * len(chosen)))
    axes = np.atleast_2d(axes)
    for row, j in enumerate(chosen):
        order = np.argsort(-scores[:, j])
        panels = [("test", x_test[j], f"true {y_test[j]}\npred {predicted[j]}")]
        panels += [("help", x_train[i], f"+ label {y_train[i]}") for i in order[:top]]
        panels += [("harm", x_train[i], f"- label {y_train[i]}") for i in order[::-1][:top]]
        for ax, (kind, image, label) in zip(axes[row], panels):
            ax.imshow(
                image.reshape(8, 8), cmap={"test": "gray_r", "help": "Greens", "harm": "Reds"}[kind]
            )
            ax.set_title(label, fontsize=7)
            ax.axis("off")
    fig.suptitle(f"misclassified test digits | {top} most helpful | {top} most harmful", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--num-test", type=int, default=4)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0
    )
    xt_train, yt_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    xt_test, yt_test = torch.from_numpy(x_test), torch.from_numpy(y_test)
    params = train(xt_train, yt_train)
    predicted = (xt_test @ params["w"] + params["b"]).argmax(1).numpy()
    wrong = np.flatnonzero(predicted != y_test)
    print(
        f"test accuracy {(predicted == y_test).mean():.3f}; {len(wrong)} misclassified test digits"
    )
    chosen = wrong[: args.num_test]
    scores = influence.influence_function(
        example_loss,
        params,
        (xt_train, yt_train),
        (xt_test[chosen], yt_test[chosen]),
        damping=1e-3,
        solver="cg",
        regularizer=weight_decay,
    ).numpy()
    for column, j in enumerate(chosen):
        helpful = np.argsort(-scores[:, column])[: args.top]
        harmful = np.argsort(scores[:, column])[: args.top]
        print(
            f"test #{j} (true {y_test[j]}, predicted {predicted[j]}): most helpful training labels "
            f"{y_train[helpful].tolist()}, most harmful {y_train[harmful].tolist()}"
        )
    path = args.out / "influence_digits.png"
    full_scores = np.zeros((len(x_train), len(x_test)))
    full_scores[:, chosen] = scores
    draw_grid(path, x_train, y_train, x_test, y_test, predicted, chosen, full_scores, args.top)
    print(f"image grid: {path}")


if __name__ == "__main__":
    main()

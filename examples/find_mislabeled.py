"""Find mislabeled training examples from their per-example gradients, in PyTorch and in JAX.

Run:  python examples/find_mislabeled.py [--out DIR]

scikit-learn's bundled digits (8x8 images, no download); 5% of the training labels are flipped
to a wrong class. A small MLP is trained on the noisy labels for a few epochs, then every
training example is scored by its gradient norm (large: the model disagrees with its label) and
by the cosine of its gradient with the mean gradient (low: it pulls against the rest). Ranking by
each score, we report precision and recall at k = number of flipped labels against the random
baseline (precision = 5%), for both frameworks, and save a histogram of the norms with the
flagged examples marked.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import pergrad
from pergrad import norms, outliers, plotting

FLIP_FRACTION, HIDDEN, EPOCHS, BATCH, LR, SEED = 0.05, 32, 30, 64, 0.1, 0


def load_noisy_digits(seed: int = SEED):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, _, y_train, _ = train_test_split(x, digits.target, test_size=0.25, random_state=seed)
    rng = np.random.default_rng(seed)
    flipped = rng.choice(len(y_train), size=int(FLIP_FRACTION * len(y_train)), replace=False)
    noisy = y_train.copy()
    noisy[flipped] = (y_train[flipped] + rng.integers(1, 10, size=len(flipped))) % 10
    return x_train, noisy, np.sort(flipped)


def init_weights(seed: int = SEED):
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0, 64**-0.5, size=(64, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, HIDDEN**-0.5, size=(HIDDEN, 10)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def minibatches(n: int, epochs: int, seed: int = SEED):
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n, BATCH):
            yield order[start : start + BATCH]


def torch_scores(x, y):
    """Train in PyTorch; per-example gradient norms and cosines on the training set."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(64, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 10))
    weights = init_weights()
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(weights["w1"].T))
        model[2].weight.copy_(torch.from_numpy(weights["w2"].T))
        model[0].bias.zero_()
        model[2].bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    for idx in minibatches(len(x), EPOCHS):
        optimizer.zero_grad()
        F.cross_entropy(model(x_t[idx]), y_t[idx]).backward()
        optimizer.step()
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss, chunk_size=512)(loss.params(), x_t, y_t)
    return norms.per_example_norms(grads), norms.cosine_to_mean(grads)


def jax_scores(x, y):
    """Train in JAX; per-example gradient norms and cosines on the training set."""
    import jax
    import jax.numpy as jnp

    def loss(params, x, y):  # ONE example
        hidden = jnp.tanh(x @ params["w1"] + params["b1"])
        return -jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])[y]

    def batch_loss(params, x, y):
        return jax.vmap(loss, in_axes=(None, 0, 0))(params, x, y).mean()

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(batch_loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)

    params = {k: jnp.asarray(v) for k, v in init_weights().items()}
    x_j, y_j = jnp.asarray(x), jnp.asarray(y)
    for idx in minibatches(len(x), EPOCHS):
        params = step(params, x_j[idx], y_j[idx])
    grads = jax.jit(pergrad.per_example_grads(loss))(params, x_j, y_j)
    return norms.per_example_norms(grads), norms.cosine_to_mean(grads)


def precision_recall_at_k(ranking: np.ndarray, flipped: np.ndarray) -> tuple[float, float]:
    k = len(flipped)
    hits = len(set(ranking[:k].tolist()) & set(flipped.tolist()))
    return hits / k, hits / len(flipped)


def report(framework: str, grad_norms, cosines, flipped: np.ndarray) -> list[str]:
    k = len(flipped)
    by_norm = outliers.detect(grad_norms, method="topk", threshold=k)
    by_cosine = outliers.detect(cosines, method="topk", threshold=k, direction="low")
    rows = []
    by_alignment = outliers.detect(cosines, method="topk", threshold=k, direction="high")
    ranked = (
        ("gradient norm (high)", by_norm),
        ("cosine to mean (low)", by_cosine),
        ("cosine to mean (high)", by_alignment),
    )
    for score, result in ranked:
        ranking = np.asarray(
            result.indices.cpu() if hasattr(result.indices, "cpu") else result.indices
        )
        precision, recall = precision_recall_at_k(ranking, flipped)
        rows.append(
            f"| {framework} | {score} | {k} | {precision:.2f} | {recall:.2f} | {FLIP_FRACTION:.2f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"), help="where to save the plot")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    x, y, flipped = load_noisy_digits()
    print(f"{len(x)} training digits, {len(flipped)} labels flipped ({FLIP_FRACTION:.0%})\n")
    table = [
        "| framework | ranked by | k | precision@k | recall@k | random precision |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    torch_norms, torch_cosines = torch_scores(x, y)
    table += report("PyTorch", torch_norms, torch_cosines, flipped)
    jax_norms, jax_cosines = jax_scores(x, y)
    table += report("JAX", jax_norms, jax_cosines, flipped)
    print("\n".join(table))

    print("\nPyTorch norms:", norms.summarize(torch_norms, threshold=1.0))
    found = outliers.detect(torch_norms, method="mad")
    path = args.out / "mislabeled_norms.png"
    plotting.norm_histogram(torch_norms, outliers=found, path=path, log_scale=True)
    caught = len(set(found.indices.tolist()) & set(flipped.tolist()))
    print(f"MAD rule flags {len(found)} examples, {caught} of them flipped; histogram: {path}")


if __name__ == "__main__":
    main()

"""DP-SGD on scikit-learn's digits, in JAX (optax) and in PyTorch (torch.optim), at several epsilons.

Run:  python examples/dp_sgd_digits.py [--epochs 40] [--quick]

A 64-32-10 MLP is trained on the 1347 training digits (8x8, no download) with Poisson-sampled
batches, per-example clipping and Gaussian noise calibrated by ``pergrad.dp.noise_multiplier_for``
for epsilon 1, 3 and 8 at delta 1e-5, and without privacy (the same optimizer, no clipping or
noise). It prints the test accuracy of each run and the epsilon the accountant reports.
"""

from __future__ import annotations

import argparse
import logging
import secrets

import numpy as np

from pergrad import dp

HIDDEN, DELTA, SAMPLE_RATE, MAX_NORM, LR = 32, 1e-5, 0.05, 1.0, 0.5
EPSILONS = (1.0, 3.0, 8.0)


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=seed)


def init_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0, 64**-0.5, size=(64, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, HIDDEN**-0.5, size=(HIDDEN, 10)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def train_jax(data, noise_multiplier: float | None, steps: int, seed: int) -> float:
    """DP-SGD with optax; ``noise_multiplier=None`` trains without privacy."""
    import jax
    import jax.numpy as jnp
    import optax

    import pergrad

    x_train, x_test, y_train, y_test = data
    n = len(x_train)

    def loss(params, x, y):  # ONE example
        hidden = jnp.tanh(x @ params["w1"] + params["b1"])
        return -jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])[y]

    private = noise_multiplier is not None
    aggregate = dp.optax_aggregate(
        MAX_NORM if private else 1e9,
        noise_multiplier or 0.0,
        key=seed,
        expected_batch_size=SAMPLE_RATE * n,
    )
    tx = optax.chain(aggregate, optax.sgd(LR))
    per_example = pergrad.per_example_grads(loss)

    @jax.jit
    def step(params, state, x, y, mask):
        grads = per_example(params, x, y)
        updates, state = tx.update(grads, state, params, mask=mask)
        return optax.apply_updates(params, updates), state

    params = {k: jnp.asarray(v) for k, v in init_weights(seed).items()}
    state = tx.init(params)
    size = dp.max_batch_size_for(n, SAMPLE_RATE)
    for indices in dp.poisson_batches(n, SAMPLE_RATE, steps, seed=seed):
        padded, mask = dp.pad_batch(indices, size)  # one shape: jit compiles once
        params, state = step(params, state, x_train[padded], y_train[padded], mask)
    hidden = jnp.tanh(x_test @ params["w1"] + params["b1"])
    predictions = jnp.argmax(hidden @ params["w2"] + params["b2"], axis=1)
    return float((np.asarray(predictions) == y_test).mean())


def train_torch(data, noise_multiplier: float | None, steps: int, seed: int) -> float:
    """DP-SGD with DPOptimizer around torch.optim.SGD; None trains without privacy."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    x_train, x_test, y_train, y_test = data
    n = len(x_train)
    weights = init_weights(seed)
    model = nn.Sequential(nn.Linear(64, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 10))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(weights["w1"].T))
        model[2].weight.copy_(torch.from_numpy(weights["w2"].T))
        model[0].bias.zero_()
        model[2].bias.zero_()
    private = noise_multiplier is not None
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        F.cross_entropy,
        max_norm=MAX_NORM if private else 1e9,
        noise_multiplier=noise_multiplier or 0.0,
        expected_batch_size=SAMPLE_RATE * n,
        generator=torch.Generator().manual_seed(seed),
    )
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    sampler = dp.PoissonBatchSampler(
        n, SAMPLE_RATE, steps, generator=torch.Generator().manual_seed(seed)
    )
    collate = dp.collate_with_empty_batches(dataset)  # Poisson batches can be empty
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    for x, y in loader:
        optimizer.step(x, y)
    with torch.no_grad():
        predictions = model(torch.from_numpy(x_test)).argmax(1).numpy()
    return float((predictions == y_test).mean())


def main() -> None:
    # dp-accounting logs a warning for each RDP order it skips at low noise; they are harmless.
    logging.getLogger("absl").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=None, help="default: a secure random seed")
    parser.add_argument("--quick", action="store_true", help="2 epochs, for a smoke run")
    args = parser.parse_args()
    epochs = 2 if args.quick else args.epochs
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    data = load_digits_split()
    n = len(data[0])
    steps = int(epochs / SAMPLE_RATE)
    print(
        f"{n} training digits, Poisson sampling rate {SAMPLE_RATE} (expected batch "
        f"{SAMPLE_RATE * n:.0f}), {steps} steps = {epochs} epochs, clip {MAX_NORM}, "
        f"delta {DELTA}\n"
    )
    print(
        "| epsilon (target) | noise multiplier | epsilon (accountant) | JAX test acc | PyTorch test acc |"
    )
    print("| --- | --- | --- | --- | --- |")
    for target in (*EPSILONS, None):
        if target is None:
            noise, spent, label = None, float("inf"), "non-private"
        else:
            noise = dp.noise_multiplier_for(
                target_epsilon=target, delta=DELTA, sample_rate=SAMPLE_RATE, steps=steps
            )
            spent = dp.epsilon(
                noise_multiplier=noise, sample_rate=SAMPLE_RATE, steps=steps, delta=DELTA
            )
            label = f"{target:g}"
        jax_accuracy = train_jax(data, noise, steps, seed)
        torch_accuracy = train_torch(data, noise, steps, seed)
        noise_text = "-" if noise is None else f"{noise:.3f}"
        spent_text = "inf" if noise is None else f"{spent:.3f}"
        print(
            f"| {label} | {noise_text} | {spent_text} | {jax_accuracy:.3f} | {torch_accuracy:.3f} |"
        )


if __name__ == "__main__":
    main()

"""JAX's DP-SGD example (``examples/differentially_private_sgd.py``), ported to pergrad.

Run:  python examples/dp_jax_port.py [--epochs 20] [--quick]

The original trains a small CNN on MNIST with DP-SGD written by hand: ``vmap(grad)`` of the
loss of one example, a hand-written clip of each gradient, Gaussian noise, and an RDP epsilon
computed afterwards for its fixed noise multiplier (1.1) and norm bound (1.0). Here the same
model (shrunk to the 8x8 digits bundled with scikit-learn: no download) and the same
``stax``-style layers are trained through ``pergrad.dp.make_private_optax``: one call gives the
private optax transformation, the Poisson loader of padded ``(x, y, mask)`` batches and the
accountant, all at one sample rate. What the original wrote by hand (clipping, noise,
normalising, the sampling, the accounting) is gone; what is left is the model and the loss of
ONE example. The accountant is PLD (Opacus's PRV's numbers); the original's RDP figure is
printed beside it.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pergrad
from pergrad import dp

LEARNING_RATE, NOISE_MULTIPLIER, L2_NORM_CLIP, BATCH_SIZE, DELTA = 0.15, 1.1, 1.0, 64, 1e-5


def load_digits_split(seed: int = 0):
    """The 1797 digits, 8x8 in [0, 1] with a channel axis (1, 8, 8), split 75 / 25."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    return train_test_split(images, digits.target, test_size=0.25, random_state=seed)


def init_params(seed: int = 0, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """The original's conv - relu - conv - relu - dense - relu - dense, sized for 8x8 inputs."""
    rng = np.random.default_rng(seed)

    def he(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return rng.normal(0.0, (2.0 / fan_in) ** 0.5, size=shape).astype(dtype)

    return {
        "conv1": he((16, 1, 3, 3), 9),  # 8x8 -> 4x4 (stride 2, SAME)
        "conv1_b": np.zeros(16, dtype),
        "conv2": he((32, 16, 3, 3), 144),  # 4x4 -> 2x2 (stride 1, VALID)
        "conv2_b": np.zeros(32, dtype),
        "dense1": he((128, 32), 128),
        "dense1_b": np.zeros(32, dtype),
        "dense2": he((32, 10), 32),
        "dense2_b": np.zeros(10, dtype),
    }


def predict(params, images):
    """Logits of a batch of images ``(B, 1, 8, 8)`` -> ``(B, 10)``."""
    dims = ("NCHW", "OIHW", "NCHW")
    h = jax.lax.conv_general_dilated(
        images, params["conv1"], (2, 2), "SAME", dimension_numbers=dims
    )
    h = jax.nn.relu(h + params["conv1_b"][:, None, None])
    h = jax.lax.conv_general_dilated(h, params["conv2"], (1, 1), "VALID", dimension_numbers=dims)
    h = jax.nn.relu(h + params["conv2_b"][:, None, None])
    h = jax.nn.relu(h.reshape(h.shape[0], -1) @ params["dense1"] + params["dense1_b"])
    return h @ params["dense2"] + params["dense2_b"]


def loss(params, image, label):
    """The cross-entropy of ONE example (image ``(1, 8, 8)``, integer label): the model is run
    on a batch of one, as the original's ``vmap`` of its batch loss did."""
    logits = predict(params, image[None])[0]
    return -jax.nn.log_softmax(logits)[label]


def make_step(tx):
    """One DP-SGD step: per-example gradients, then the private aggregate (clip, sum, noise,
    divide by the expected batch size) and SGD, as ``tx`` chains them."""

    @jax.jit
    def step(params, state, images, labels, mask):
        grads = pergrad.per_example_grads(loss)(params, images, labels)
        updates, state = tx.update(grads, state, params, mask=mask)
        return optax.apply_updates(params, updates), state

    return step


def accuracy(params, images, labels) -> float:
    return float(jnp.mean(jnp.argmax(predict(params, images), axis=1) == labels))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="fix the noise and sampling")
    parser.add_argument("--quick", action="store_true", help="1 epoch, for a smoke test")
    args = parser.parse_args(argv)
    epochs = 1 if args.quick else args.epochs
    x_train, x_test, y_train, y_test = load_digits_split()

    tx, loader, accountant = setup = dp.make_private_optax(
        x_train, y_train,
        batch_size=BATCH_SIZE, epochs=epochs, noise_multiplier=NOISE_MULTIPLIER,
        delta=DELTA, max_norm=L2_NORM_CLIP, optimizer=optax.sgd(LEARNING_RATE),
        key=args.seed, seed=args.seed,
    )  # fmt: skip
    print(setup.plan)
    params = jax.tree_util.tree_map(jnp.asarray, init_params())
    state, step = tx.init(params), make_step(tx)
    for epoch in range(1, epochs + 1):
        for images, labels, mask in loader:  # padded Poisson batches: one jit compilation
            params, state = step(params, state, images, labels, mask)
        print(
            f"epoch {epoch}: test accuracy {accuracy(params, x_test, y_test):.3f}, "
            f"epsilon {accountant.epsilon():.3f} (pld) at delta {DELTA:g}"
        )
    rdp = dp.epsilon(NOISE_MULTIPLIER, setup.sample_rate, accountant.steps, DELTA, accountant="rdp")
    print(
        f"after {accountant.steps} steps: epsilon {accountant.epsilon():.3f} (pld), {rdp:.3f} (rdp)"
    )
    return {"accuracy": accuracy(params, x_test, y_test), "epsilon": accountant.epsilon()}


if __name__ == "__main__":
    main()

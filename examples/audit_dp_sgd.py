"""Audit DP-SGD on scikit-learn's digits: a correct implementation passes, broken ones are caught.

Run:  python examples/audit_dp_sgd.py [--canaries 1000] [--steps 100]

A 64-32-10 MLP is trained with DP-SGD written with pergrad in JAX (per-example gradients,
``pergrad.dp.private_mean``: clip, sum, Gaussian noise) on the 1347 training digits, Poisson
sample rate 0.05, clip 1, delta 1e-5. 1000 white-box gradient canaries
(``pergrad.dp.GradientCanaries``: one parameter coordinate each, norm 1) are each included by
a fair coin and injected as extra examples' gradients in the steps that sample them. After
training, each canary is scored by how far the parameters moved against it, relative to a
reference run without canaries (independent noise and batches), and
``pergrad.dp.audit`` turns the scores into a lower bound on epsilon at significance 0.05
(Steinke, Nasr & Jagielski 2023), next to the accountant's epsilon for the claimed noise.

Four implementations are audited: two correct ones (noise multiplier 1 and 2), one that
forgets the noise while claiming noise 2, and one that forgets to clip (noise 2, still scaled
to the clipping bound), audited with canaries of norm 100. A lower bound
above the claim means the implementation leaks more than it says. Each audit is two training
runs: about 6 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from pergrad import dp

HIDDEN, DELTA, SAMPLE_RATE, MAX_NORM, LR = 32, 1e-5, 0.05, 1.0, 0.5


def load_digits_train(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, _, y_train, _ = train_test_split(x, digits.target, test_size=0.25, random_state=seed)
    return x_train, y_train


def init_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0, 64**-0.5, size=(64, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, HIDDEN**-0.5, size=(HIDDEN, 10)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def make_trainer(data, steps: int, noise_multiplier: float, clipping: bool):
    """``run(canaries, seed) -> final params``: DP-SGD in JAX, canaries injected if given."""
    import jax
    import jax.numpy as jnp

    import pergrad

    x_train, y_train = data
    n = len(x_train)

    def loss(params, x, y):  # ONE example
        hidden = jnp.tanh(x @ params["w1"] + params["b1"])
        return -jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])[y]

    per_example = jax.jit(pergrad.per_example_grads(loss))

    @jax.jit
    def apply(params, grads, mask, key):
        if clipping:
            update, _ = dp.private_mean(
                grads, MAX_NORM, noise_multiplier, key, SAMPLE_RATE * n, mask
            )
        else:  # the bug under audit: no clipping, noise still scaled to the clipping bound
            summed = dp.clipped_sum(grads, 1e9, mask).sum  # a bound no gradient reaches
            noisy = dp.add_noise(summed, noise_multiplier * MAX_NORM, key)
            update = jax.tree.map(lambda v: v / (SAMPLE_RATE * n), noisy)
        return jax.tree.map(lambda p, u: p - LR * u, params, update)

    def run(canaries, seed: int):
        params = {k: jnp.asarray(v) for k, v in init_weights().items()}
        key = jax.random.key(seed)
        size = dp.max_batch_size_for(n, SAMPLE_RATE)
        for step, indices in enumerate(dp.poisson_batches(n, SAMPLE_RATE, steps, seed=seed)):
            padded, mask = dp.pad_batch(indices, size)
            grads, mask = per_example(params, x_train[padded], y_train[padded]), jnp.asarray(mask)
            if canaries is not None:  # padded too, so that jax.jit compiles once
                pad = dp.max_batch_size_for(canaries.num_included, SAMPLE_RATE)
                grads, mask = canaries.inject(grads, mask, step, pad_to=pad)
            key, noise_key = jax.random.split(key)
            params = apply(params, grads, mask, noise_key)
        return params

    return run


def audit_one(data, args, noise_multiplier, claimed_noise, clipping=True, canary_norm=1.0):
    import jax.numpy as jnp

    run = make_trainer(data, args.steps, noise_multiplier, clipping)
    initial = {k: jnp.asarray(v) for k, v in init_weights().items()}
    canaries = dp.GradientCanaries(
        initial, args.canaries, sample_rate=SAMPLE_RATE, seed=args.seed, norm=canary_norm
    )

    def train(canaries):
        # The reference run has no canaries and its own seed: independent of the audited
        # run's noise and batches, as the bound's soundness requires.
        reference = run(None, seed=args.seed + 1)
        return canaries.scores(run(canaries, seed=args.seed + 2), reference=reference)

    return dp.audit(
        train,
        canaries,
        noise_multiplier=claimed_noise,
        sample_rate=SAMPLE_RATE,
        steps=args.steps,
        delta=DELTA,
    )


def main() -> None:
    # dp-accounting logs a warning for each RDP order it skips at low noise; they are harmless.
    logging.getLogger("absl").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the auditor's seed (coins)")
    args = parser.parse_args()
    data = load_digits_train()
    print(
        f"{len(data[0])} training digits, Poisson sampling rate {SAMPLE_RATE}, {args.steps} "
        f"steps, clip {MAX_NORM}, delta {DELTA}; {args.canaries} gradient canaries, "
        "significance 0.05\n"
    )
    print(
        "| implementation | claimed noise | claimed epsilon | lower bound | ceiling | AUROC "
        "| verdict | seconds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    cases = [
        ("correct", dict(noise_multiplier=1.0, claimed_noise=1.0)),
        ("correct", dict(noise_multiplier=2.0, claimed_noise=2.0)),
        ("no noise", dict(noise_multiplier=0.0, claimed_noise=2.0)),
        (
            "no clipping (canaries of norm 100)",
            dict(noise_multiplier=2.0, claimed_noise=2.0, clipping=False, canary_norm=100.0),
        ),
    ]
    for name, settings in cases:
        start = time.perf_counter()
        report = audit_one(data, args, **settings)
        verdict = "VIOLATED" if report.violated else "passes"
        print(
            f"| {name} | {settings['claimed_noise']:g} | {report.epsilon:.3f} "
            f"| {report.epsilon_lower_bound:.3f} | {report.ceiling:.3f} | {report.auroc:.3f} "
            f"| {verdict} | {time.perf_counter() - start:.1f} |"
        )


if __name__ == "__main__":
    main()

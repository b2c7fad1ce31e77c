"""Audit DP-SGD on scikit-learn's digits: a correct implementation passes, broken ones are caught.

Run:  python examples/audit_dp_sgd.py [--canaries 1000] [--steps 100]

A 64-32-10 MLP is trained with DP-SGD written with pergrad in JAX (per-example gradients,
``pergrad.dp.private_mean``: clip, sum, Gaussian noise) on the 1347 training digits, Poisson
sample rate 0.05, clip 1, delta 1e-5. 1000 white-box gradient canaries
(``pergrad.dp.GradientCanaries``: one parameter coordinate each, norm 1) are each included by
a fair coin and injected as extra examples' gradients in the steps that sample them. After
training, each canary is scored by how far the parameters moved against it, relative to a
reference run without canaries and without noise (its own batches; one run, shared by every
audit), and ``pergrad.dp.audit`` turns the scores into a lower bound on epsilon at
significance 0.05 (Steinke, Nasr & Jagielski 2023), next to the accountant's epsilon for the
claimed noise.

Six implementations are audited: two correct ones (noise multiplier 1 and 2), and four broken
ones that each claim noise 2:

* no noise at all;
* no clipping (the noise still scaled to the clipping bound), audited with canaries of norm 100;
* noise per micro-batch: gradient accumulation over 64 micro-batches that gives each
  micro-batch noise of std ``sigma * C / 64``, as if standard deviations added up (variances
  do: the step's noise is ``sigma * C / 8``);
* noise over the batch size: the noise is calibrated to the mean over the realised Poisson
  batch (std ``sigma * C / |B|``) but added to the clipped SUM: ``|B|`` times too small.

A lower bound above the claim means the implementation leaks more than it says. Each audit is
one training run: a second or two on 2 CPU cores, most of it compiling its step.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from pergrad import dp

HIDDEN, DELTA, SAMPLE_RATE, MAX_NORM, LR = 32, 1e-5, 0.05, 1.0, 0.5
MICRO_BATCHES = 64


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


# The implementations under audit: the step's private mean gradient from per-example
# gradients (leaves (B, ...)), their padding mask, the noise multiplier and a JAX key.


def correct(grads, mask, noise_multiplier, key, expected_batch_size):
    return dp.private_mean(grads, MAX_NORM, noise_multiplier, key, expected_batch_size, mask)[0]


def without_clipping(grads, mask, noise_multiplier, key, expected_batch_size):
    summed = dp.clipped_sum(grads, 1e9, mask).sum  # a bound no gradient reaches
    noisy = dp.add_noise(summed, noise_multiplier * MAX_NORM, key)
    return {name: value / expected_batch_size for name, value in noisy.items()}


def noise_per_micro_batch(grads, mask, noise_multiplier, key, expected_batch_size):
    """64 micro-batches (example i in micro-batch i mod 64), each clipped sum noised with
    sigma * C / 64 before they are accumulated: the step's noise is sigma * C / 8."""
    clipped = dp.clip(grads, MAX_NORM)
    batch_size = mask.shape[0]
    membership = np.arange(batch_size) % MICRO_BATCHES == np.arange(MICRO_BATCHES)[:, None]
    membership = membership.astype(np.float32) * mask  # (64, B); padding in no micro-batch
    micro_sums = {
        name: (membership @ value.reshape(batch_size, -1)).reshape(-1, *value.shape[1:])
        for name, value in clipped.items()
    }
    noisy = dp.add_noise(micro_sums, noise_multiplier / MICRO_BATCHES * MAX_NORM, key)
    return {name: value.sum(0) / expected_batch_size for name, value in noisy.items()}


def noise_over_batch_size(grads, mask, noise_multiplier, key, expected_batch_size):
    """Noise of std sigma * C / |B| (the realised batch's mean's sensitivity) on the SUM."""
    import jax.numpy as jnp

    clipped = dp.clipped_sum(grads, MAX_NORM, mask)
    unit = dp.add_noise({name: jnp.zeros_like(v) for name, v in clipped.sum.items()}, 1.0, key)
    std = noise_multiplier * MAX_NORM / clipped.count
    return {
        name: (value + std * unit[name]) / expected_batch_size
        for name, value in clipped.sum.items()
    }


class Trainer:
    """``run(implementation, noise_multiplier, canaries, seed) -> final params``: DP-SGD in JAX.

    Per-example gradients and each (implementation, noise multiplier)'s step are compiled
    once; Poisson batches and canary rows are padded to one shape each so that nothing
    recompiles. Noise keys are ``rbg`` keys, which compile several times faster on the CPU
    than the default threefry (use a key from a secure seed for real training)."""

    def __init__(self, data, steps: int, num_canaries: int):
        import jax
        import jax.numpy as jnp

        import pergrad

        self.x_train, self.y_train = data
        self.n, self.num_steps = len(self.x_train), steps
        self.size = dp.max_batch_size_for(self.n, SAMPLE_RATE)
        self.canary_rows = dp.max_batch_size_for(num_canaries, SAMPLE_RATE)

        def loss(params, x, y):  # ONE example
            hidden = jnp.tanh(x @ params["w1"] + params["b1"])
            return -jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])[y]

        self.per_example = jax.jit(pergrad.per_example_grads(loss))
        self.steps = {}

    def step(self, implementation, noise_multiplier):
        import jax

        if (implementation, noise_multiplier) not in self.steps:

            def step(params, grads, mask, key):  # the update, and the key of the next step
                key, noise_key = jax.random.split(key)
                update = implementation(
                    grads, mask, noise_multiplier, noise_key, SAMPLE_RATE * self.n
                )
                return jax.tree.map(lambda p, u: p - LR * u, params, update), key

            self.steps[implementation, noise_multiplier] = jax.jit(step)
        return self.steps[implementation, noise_multiplier]

    def run(self, implementation, noise_multiplier, canaries, seed: int):
        import jax
        import jax.numpy as jnp

        step = self.step(implementation, noise_multiplier)
        params = {k: jnp.asarray(v) for k, v in init_weights().items()}
        key = jax.random.key(seed, impl="rbg")
        batches = dp.poisson_batches(self.n, SAMPLE_RATE, self.num_steps, seed=seed)
        for index, indices in enumerate(batches):
            padded, mask = dp.pad_batch(indices, self.size)
            grads = self.per_example(params, self.x_train[padded], self.y_train[padded])
            if canaries is not None:  # padded too, so that jax.jit compiles once
                grads, mask = canaries.inject(grads, mask, index, pad_to=self.canary_rows)
            else:  # the same shape: masked rows of zeros
                grads = {
                    k: jnp.concatenate([g, jnp.zeros((self.canary_rows, *g.shape[1:]))])
                    for k, g in grads.items()
                }
                mask = np.concatenate([mask, np.zeros(self.canary_rows, bool)])
            params, key = step(params, grads, jnp.asarray(mask), key)
        return params


def audit_one(
    trainer, reference, args, implementation, noise_multiplier, claimed_noise, canary_norm=1.0
):
    import jax.numpy as jnp

    initial = {k: jnp.asarray(v) for k, v in init_weights().items()}
    canaries = dp.GradientCanaries(
        initial, args.canaries, sample_rate=SAMPLE_RATE, seed=args.seed, norm=canary_norm
    )

    def train(canaries):
        # The reference run has no canaries, no noise and its own seed: independent of the
        # audited run's coins, noise and batches, as the bound's soundness requires.
        final = trainer.run(implementation, noise_multiplier, canaries, seed=args.seed + 2)
        return canaries.scores(final, reference=reference)

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
    trainer = Trainer(data, args.steps, args.canaries)
    reference = trainer.run(correct, 0.0, None, seed=args.seed + 1)
    cases = [
        ("correct", correct, dict(noise_multiplier=1.0, claimed_noise=1.0)),
        ("correct", correct, dict(noise_multiplier=2.0, claimed_noise=2.0)),
        ("no noise", correct, dict(noise_multiplier=0.0, claimed_noise=2.0)),
        (
            "no clipping (canaries of norm 100)",
            without_clipping,
            dict(noise_multiplier=2.0, claimed_noise=2.0, canary_norm=100.0),
        ),
        (
            "noise per micro-batch (64, std / 64 each)",
            noise_per_micro_batch,
            dict(noise_multiplier=2.0, claimed_noise=2.0),
        ),
        (
            "noise over the batch size (std / B, on the sum)",
            noise_over_batch_size,
            dict(noise_multiplier=2.0, claimed_noise=2.0),
        ),
    ]
    for name, implementation, settings in cases:
        start = time.perf_counter()
        report = audit_one(trainer, reference, args, implementation, **settings)
        verdict = "VIOLATED" if report.violated else "passes"
        print(
            f"| {name} | {settings['claimed_noise']:g} | {report.epsilon:.3f} "
            f"| {report.epsilon_lower_bound:.3f} | {report.ceiling:.3f} | {report.auroc:.3f} "
            f"| {verdict} | {time.perf_counter() - start:.1f} |"
        )


if __name__ == "__main__":
    main()

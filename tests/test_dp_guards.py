"""Guards against the silent DP mistakes (issue 33): each misuse raises or warns with a message
that names the fix, and the correct use is silent.

- ``DPTrainer`` with amplified banded noise draws the cyclic Poisson batches its accounting
  assumes (each example only in the steps of its group), and refuses a mechanism accounted
  without sampling;
- ``DPOptimizer``'s realised-batch-size warning names the right ``expected_batch_size`` for
  Poisson and for cyclic Poisson sampling;
- noise calibrated for the sum: ``add_noise`` refuses a whole ``ClippedSum``, and the recipe it
  documents (noise the sum, then divide) is what ``private_mean`` does, with the variance of
  noise on the sum;
- ``private_grad_of`` with a stateful mechanism needs ``noise_state=`` and threads it: the
  noise of its steps has the mechanism's covariance across steps;
- ``benchmarks/dp_correlated_accuracy.py --quick`` runs and writes its tables.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import pergrad
from pergrad import dp
from pergrad._src.errors import PergradTypeError, PergradValueError

REPO_ROOT = Path(__file__).resolve().parent.parent

torch = pytest.importorskip("torch", reason="the guards of DPOptimizer and DPTrainer")
pytest.importorskip("dp_accounting", reason="the accountants use dp-accounting")


def cyclic_mechanism(steps=6, min_separation=3, sample_rate=0.5):
    return dp.toeplitz([1.0, 0.5], steps=steps, min_separation=min_separation,
                       sample_rate=sample_rate)  # fmt: skip


# --- DPTrainer and cyclic Poisson sampling ---------------------------------------------------

N, DIM = 30, 4


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(DIM, 3)

    def forward(self, x):
        return self.linear(x)


def tiny_dataset():
    generator = torch.Generator().manual_seed(0)
    xs = torch.randn(N, DIM, generator=generator)
    ys = torch.randint(0, 3, (N,), generator=generator)
    return [{"x": x, "labels": y} for x, y in zip(xs, ys)]


def tiny_trainer(tmp_path, max_steps=-1, **dp_args):
    transformers = pytest.importorskip("transformers", reason="DPTrainer is a Trainer")
    transformers.logging.set_verbosity_error()
    args = transformers.TrainingArguments(
        str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=0.1,
        optim="sgd", lr_scheduler_type="constant", report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, logging_steps=1000, remove_unused_columns=False,
    )  # fmt: skip
    dp_args.setdefault("noise_multiplier", 1.0)
    return dp.DPTrainer(
        model=Tiny(), args=args, train_dataset=tiny_dataset(),
        loss_fn=torch.nn.functional.cross_entropy, max_norm=1.0, delta=1e-5,
        sampling_generator=torch.Generator().manual_seed(1),
        noise_generator=torch.Generator().manual_seed(2), report_loss=False, **dp_args,
    )  # fmt: skip


def test_dp_trainer_draws_cyclic_poisson_batches_for_amplified_banded_noise(tmp_path):
    """Each example is drawn only in the steps of one residue class modulo min_separation
    (plain Poisson sampling over the whole dataset, which the trainer drew before, puts an
    example in any step), the sum is divided by one group's expected share, and the steps are
    the mechanism's."""
    groups, rate, steps = 3, 0.5, 12
    mech = cyclic_mechanism(steps=steps, min_separation=groups, sample_rate=rate)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.PrivacyWarning)
        trainer = tiny_trainer(tmp_path, noise=mech)
    assert trainer.args.max_steps == steps
    assert trainer.dp_optimizer.expected_batch_size == pytest.approx(N * rate / groups)
    batches = list(trainer.get_train_dataloader().batch_sampler)
    assert len(batches) == steps
    residues: dict[int, set[int]] = {}
    for step, batch in enumerate(batches):
        for index in batch:
            residues.setdefault(index, set()).add(step % groups)
    assert residues, "no example was drawn"
    assert all(len(seen) == 1 for seen in residues.values()), residues
    trainer.train()
    assert trainer.accountant.steps == steps


def test_dp_trainer_refuses_a_mechanism_accounted_without_sampling(tmp_path):
    mech = dp.blt([0.9], [0.4], steps=8, participations=2, min_separation=4)
    with pytest.raises(PergradValueError, match=r"(?s)Poisson batches.*min_separation=b"):
        tiny_trainer(tmp_path, noise=mech)


def test_dp_trainer_refuses_a_run_the_cyclic_mechanism_does_not_cover(tmp_path):
    mech = cyclic_mechanism(steps=6)
    with pytest.raises(PergradValueError, match=r"max_steps=7 .*leave it unset"):
        tiny_trainer(tmp_path, max_steps=7, noise=mech)
    with pytest.raises(PergradValueError, match=r"sample_rate=0.25 .*leave"):
        tiny_trainer(tmp_path, noise=mech, sample_rate=0.25)


def test_dp_trainer_with_gaussian_noise_still_samples_the_whole_dataset(tmp_path):
    """The default path is unchanged: Poisson over all examples, divided by rate * N."""
    trainer = tiny_trainer(tmp_path, max_steps=40, sample_rate=0.2)
    assert trainer.dp_optimizer.expected_batch_size == pytest.approx(0.2 * N)
    steps_of = {}
    for step, batch in enumerate(trainer.get_train_dataloader().batch_sampler):
        for index in batch:
            steps_of.setdefault(index, set()).add(step % 3)
    assert any(len(seen) > 1 for seen in steps_of.values())


# --- DPOptimizer's realised-batch-size warning -------------------------------------------------


def make_optimizer(accountant, **kwargs):
    model = torch.nn.Linear(DIM, 2)
    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, torch.nn.functional.mse_loss,
        max_norm=1.0, noise_multiplier=1.0, accountant=accountant, **kwargs,
    )  # fmt: skip


def test_realised_batch_size_warning_names_the_cyclic_expected_batch_size():
    mech = cyclic_mechanism(min_separation=3, sample_rate=0.5)
    accountant = dp.Accountant(1.0, delta=1e-5, noise=mech)
    with pytest.warns(pergrad.PrivacyWarning) as record:
        make_optimizer(accountant, noise=mech)
    message = str(record[0].message)
    assert "expected_batch_size=len(dataset) * sample_rate / min_separation" in message
    assert "len(dataset) * 0.5 / 3" in message and "cyclic Poisson" in message
    sampler = dp.CyclicPoissonBatchSampler(N, noise=mech)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.PrivacyWarning)
        make_optimizer(accountant, noise=mech, expected_batch_size=sampler.expected_batch_size)


def test_realised_batch_size_warning_for_plain_poisson_sampling_is_unchanged():
    accountant = dp.Accountant(1.0, 0.01, 1e-5)
    with pytest.warns(pergrad.PrivacyWarning) as record:
        make_optimizer(accountant)
    message = str(record[0].message)
    assert "expected_batch_size=sample_rate * len(dataset)" in message
    assert "min_separation" not in message


# --- noise calibrated for the sum ------------------------------------------------------------


def clipped_problem(batch=6, width=5):
    grads = {"w": torch.randn(batch, width, generator=torch.Generator().manual_seed(3))}
    return grads, dp.clipped_sum(grads, 1.0)


def test_add_noise_refuses_a_whole_clipped_sum_and_names_the_recipe():
    _, clipped = clipped_problem()
    with pytest.raises(PergradTypeError, match=r"(?s)clipped\.sum.*private_mean") as error:
        dp.add_noise(clipped, 1.0, torch.Generator().manual_seed(0))
    assert "noise_multiplier * clipped.sensitivity" in str(error.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.add_noise(clipped.sum, 1.0, torch.Generator().manual_seed(0))


def test_private_mean_is_noise_on_the_sum_then_divided():
    """The recipe the guard names is private_mean's, draw for draw."""
    grads, clipped = clipped_problem()
    sigma, expected = 1.3, 4.0
    got, _ = dp.private_mean(grads, 1.0, sigma, torch.Generator().manual_seed(7), expected)
    noisy = dp.add_noise(clipped.sum, sigma * clipped.sensitivity, torch.Generator().manual_seed(7))
    torch.testing.assert_close(got["w"], noisy["w"] / expected)


def test_private_mean_noise_has_the_std_of_noise_on_the_sum():
    """On zero gradients the noisy mean's std is sigma * max_norm / expected_batch_size: noise
    calibrated for the sum, then divided (noise on the mean would be expected_batch_size times
    larger; a std divided before being added to the sum, that many times smaller)."""
    sigma, max_norm, expected = 2.0, 0.5, 8.0
    grads = {"w": torch.zeros(3, 200_000)}
    mean, _ = dp.private_mean(grads, max_norm, sigma, torch.Generator().manual_seed(0), expected)
    assert float(mean["w"].std()) == pytest.approx(sigma * max_norm / expected, rel=0.01)


# --- private_grad_of and the noise's state ----------------------------------------------------


def zero_gradient_loss(in_features=100, out_features=200):
    """A module loss whose per-example gradients are exactly 0 (inputs of zeros), so that what
    private_grad_of returns is its noise alone; ``in_features * out_features`` coordinates."""
    torch.manual_seed(0)
    model = torch.nn.Linear(in_features, out_features, bias=False)
    loss = pergrad.module_loss(model, lambda out, y: (out - y).pow(2).sum())
    return loss, torch.zeros(2, in_features), torch.zeros(2, out_features)


def test_private_grad_of_refuses_a_stateful_mechanism_without_its_state():
    loss, x, y = zero_gradient_loss(3, 2)
    mech = dp.toeplitz([1.0, 0.5], steps=3)
    with pytest.raises(PergradValueError, match=r"noise_state=noise_state") as error:
        dp.private_grad_of(loss, loss.params(), x, y, max_norm=1.0, noise_multiplier=1.0,
                           rng=torch.Generator(), noise=mech)  # fmt: skip
    assert "noise.init(params)" in str(error.value)


def test_private_grad_of_refuses_adaptive_clipping_with_correlated_noise():
    loss, x, y = zero_gradient_loss(3, 2)
    mech = dp.toeplitz([1.0, 0.5], steps=3)
    with pytest.raises(PergradValueError, match=r"independent Gaussian noise"):
        dp.private_grad_of(loss, loss.params(), x, y, max_norm=1.0, noise_multiplier=1.0,
                           rng=torch.Generator(), noise=mech,
                           noise_state=mech.init(loss.params()),
                           clipping=dp.adaptive(count_noise_std=10.0))  # fmt: skip


def test_private_grad_of_keeps_its_two_results_without_a_state():
    loss, x, y = zero_gradient_loss(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = dp.private_grad_of(loss, loss.params(), x, y, max_norm=1.0,
                                    noise_multiplier=1.0, rng=torch.Generator(),
                                    noise=dp.gaussian())  # fmt: skip
    assert len(result) == 2
    _, _, state = dp.private_grad_of(loss, loss.params(), x, y, max_norm=1.0,
                                     noise_multiplier=1.0, rng=torch.Generator(),
                                     noise_state=())  # fmt: skip
    assert state == ()


def test_private_grad_of_threads_the_state_the_noise_has_the_mechanisms_covariance():
    """Step t's noise on many zero-gradient coordinates: its covariance across the steps is
    sensitivity^2 * M M^T, M the inverse of the lower-triangular Toeplitz matrix of the
    coefficients, computed here with numpy (restarting the state at every call would give
    independent draws, covariance sensitivity^2 * I)."""
    coefs, steps, sigma, max_norm, expected = [1.0, 0.6, 0.3], 4, 1.5, 0.5, 3.0
    mech = dp.toeplitz(coefs, steps=steps)
    loss, x, y = zero_gradient_loss()
    params = loss.params()
    state = mech.init(params)
    generator = torch.Generator().manual_seed(0)
    draws = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(steps):
            grad, _, state = dp.private_grad_of(
                loss, params, x, y, max_norm=max_norm, noise_multiplier=sigma, rng=generator,
                expected_batch_size=expected, noise=mech, noise_state=state,
            )  # fmt: skip
            draws.append(grad["weight"].flatten().double().numpy() * expected)
    strategy = np.zeros((steps, steps))
    for i in range(steps):
        for j, c in enumerate(coefs):
            if i + j < steps:
                strategy[i + j, i] = c
    noising = np.linalg.inv(strategy)
    scale = sigma * max_norm * math.sqrt(sum(c * c for c in coefs))  # one participation
    want = scale**2 * noising @ noising.T
    got = np.cov(np.stack(draws))
    np.testing.assert_allclose(got, want, atol=0.04 * scale**2)
    with pytest.raises(PergradValueError, match=r"steps=4"):
        dp.private_grad_of(loss, params, x, y, max_norm=max_norm, noise_multiplier=sigma,
                           rng=generator, noise=mech, noise_state=state)  # fmt: skip


def test_private_grad_of_noise_state_goes_through_jax_jit():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    mech = dp.toeplitz([1.0, 0.5], steps=2)

    def loss(params, x):  # one example
        return jnp.sum(params["w"] * x)

    params, xs = {"w": jnp.ones(3)}, jnp.ones((2, 3))

    @jax.jit
    def step(params, state, key):
        grad, _, state = dp.private_grad_of(loss, params, xs, max_norm=1.0,
                                            noise_multiplier=1.0, rng=key,
                                            expected_batch_size=2.0, noise=mech,
                                            noise_state=state)  # fmt: skip
        return grad, state

    state = mech.init(params)
    for i in range(2):
        grad, state = step(params, state, jax.random.key(i))
        assert bool(jnp.all(jnp.isfinite(grad["w"])))
    assert int(state.step) == 2
    grad, _ = step(params, state, jax.random.key(2))  # past the run: NaN, as documented
    assert bool(jnp.all(jnp.isnan(grad["w"])))


# --- the benchmark's quick mode ------------------------------------------------------------


@pytest.mark.slow  # about 25 s: calibrations and four short training runs
def test_dp_correlated_accuracy_benchmark_quick_run(tmp_path):
    """benchmarks/dp_correlated_accuracy.py --quick: a row per method at epsilon 8, each
    calibrated to it, and the step cost of both models."""
    pytest.importorskip("sklearn", reason="the benchmark trains on scikit-learn's digits")
    out = tmp_path / "dp_correlated_accuracy.md"
    command = [sys.executable, "benchmarks/dp_correlated_accuracy.py", "--quick", "--out",
               str(out)]  # fmt: skip
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert text.startswith("# dp_correlated_accuracy.py")
    assert "- load average (1, 5, 15 min): " in text and "(quick mode" in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows]
    accuracy = {row[1].split(" (")[0]: row for row in rows if len(row) == 10}
    assert set(accuracy) == {"method", "---", "DP-SGD", "banded, amplified", "BLT", "non-private"}
    for method in ("DP-SGD", "banded, amplified", "BLT"):
        row = accuracy[method]
        assert row[0] == "8" and float(row[3]) == pytest.approx(8.0, abs=0.01), row
        assert 0.0 <= float(row[8].split(" ± ")[0]) <= 1.0
    costs = [row for row in rows if len(row) == 9 and row[0].startswith("MLP")]
    assert [row[0] for row in costs] == ["MLP 64-32-10", "MLP 64-1024-1024-10"]

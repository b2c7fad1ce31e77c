"""Audits of pergrad's own DP training paths, each run the way a user would: PyTorch's
``DPOptimizer`` (ghost and materialised strategies), JAX's ``optax_aggregate`` transform
(materialised per-example gradients) and ``private_grad_of`` (ghost). Each correct run stays
below its claim; each run with the noise off is caught. ``DPOptimizer`` with correlated noise
(banded Toeplitz, BLT) stays below the mechanism's claim, and is caught with the sensitivity
under-stated or the noising matrix scaled down (the section's comment has the setting).

Gradient canaries reach the optax transform as extra rows of per-example gradients
(``GradientCanaries.inject``). ``DPOptimizer`` and ``private_grad_of`` compute their
gradients from the model and the batch, so a canary cannot be handed to them as a gradient;
it goes in as an EXAMPLE whose gradient is the canary: the model's first layer is
``pre = W1 x`` (no bias), and a canary example has the input ``x = e_j`` and a loss linear in
that layer's output, ``<pre, e_k>``. Its gradient is ``e_k e_j^T``: the Dirac canary on
``W1[k, j]`` (norm 1, nothing on any other parameter), computed by the path under audit
(ghost norms from the layer's input and output gradient, or materialised), clipped, summed and
noised with the data's examples. The canaries live on ``W1``'s coordinates
(``GradientCanaries({"w1": ...})``), and the data examples (digits, cross-entropy) carry
``u = 0``.

Setting: 1797 digits, a 64-32-10 MLP with a bias-free first layer, Poisson sample rate 0.05,
50 steps, clip 1, delta 1e-5; 1000 canaries (ceiling ``epsilon_lower_bound_ceiling(1000,
1e-5)`` = 5.06, above both claims: noise 1, epsilon 3.18; noise 2, epsilon 0.88). Each audit
is one run, scored against a reference run of the same framework without canaries and without
noise (its own batches), shared by the module, as in ``test_dp_audit_canaries.py``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pergrad import dp

pytest.importorskip("scipy", reason="the audit statistics use scipy.stats")

SAMPLE_RATE, STEPS, MAX_NORM, LR, HIDDEN, NUM_CANARIES = 0.05, 50, 1.0, 0.5, 32, 1000


@pytest.fixture(autouse=True)
def _quiet_accounting():
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's skipped RDP orders
    pytest.importorskip("dp_accounting", reason="the claim comes from the accountant")


def digits():
    sklearn_datasets = pytest.importorskip("sklearn.datasets", reason="digits ship with sklearn")
    data = sklearn_datasets.load_digits()
    return (data.data / 16.0).astype(np.float32), data.target


def initial_weights():
    """``w1`` is ``(HIDDEN, 64)``, as ``nn.Linear(64, HIDDEN).weight``: ``pre = w1 @ x``."""
    rng = np.random.default_rng(0)
    return {
        "w1": rng.normal(0, 64**-0.5, (HIDDEN, 64)).astype(np.float32),
        "w2": rng.normal(0, HIDDEN**-0.5, (10, HIDDEN)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def canary_examples(canaries, step):
    """This step's sampled canaries as examples: inputs ``e_j`` and loss vectors ``e_k`` for
    the canary on ``w1[k, j]``; ``(x, u)`` numpy, ``(rows, 64)`` and ``(rows, HIDDEN)``."""
    ids = canaries.sampled(step)
    coordinates = canaries.unit_directions(ids).argmax(1)  # Dirac: the one nonzero entry
    rows, columns = np.divmod(coordinates, 64)
    x, u = np.zeros((ids.size, 64), np.float32), np.zeros((ids.size, HIDDEN), np.float32)
    x[np.arange(ids.size), columns] = canaries.norm
    u[np.arange(ids.size), rows] = 1.0
    return x, u


def w1_canaries(w1):
    return dp.GradientCanaries({"w1": w1}, NUM_CANARIES, sample_rate=SAMPLE_RATE, seed=7)


def audit(canaries, run, reference, noise_multiplier, claimed_noise, keys=("w1",), **claim):
    """``dp.audit`` of ``run(canaries, noise_multiplier) -> final params`` (seed 202), the
    canaries scored on the parameters ``keys``; the claim is ``claimed_noise`` with ``claim``
    (default: Poisson sampling at ``SAMPLE_RATE`` for ``STEPS`` steps)."""

    def train(canaries):
        final = run(canaries, noise_multiplier)
        return canaries.scores(
            {k: final[k] for k in keys}, reference={k: reference[k] for k in keys}
        )

    claim = claim or {"sample_rate": SAMPLE_RATE, "steps": STEPS}
    return dp.audit(train, canaries, noise_multiplier=claimed_noise, delta=1e-5, **claim)


# --- PyTorch: DPOptimizer ------------------------------------------------------------------


class TorchRunner:
    """DP-SGD with ``pergrad.dp.DPOptimizer`` around ``torch.optim.SGD``, on one thread."""

    def __init__(self):
        torch = pytest.importorskip("torch", reason="the PyTorch path")
        nn, functional = torch.nn, torch.nn.functional
        self.torch = torch
        x, y = digits()
        self.x, self.y, self.n = torch.from_numpy(x), torch.from_numpy(y), len(x)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(64, HIDDEN, bias=False)
                self.fc2 = nn.Linear(HIDDEN, 10)

            def forward(self, x):
                pre = self.fc1(x)
                return self.fc2(torch.tanh(pre)), pre

        def loss_fn(output, y, u):
            logits, pre = output  # a canary's loss is linear in pre: its gradient is u x^T
            data = functional.cross_entropy(logits, y, reduction="none")
            return torch.where(u.any(-1), (pre * u).sum(-1), data).mean()

        self.net, self.loss_fn = Net, loss_fn

    def model(self):
        model = self.net()
        weights = initial_weights()
        with self.torch.no_grad():
            model.fc1.weight.copy_(self.torch.from_numpy(weights["w1"]))
            model.fc2.weight.copy_(self.torch.from_numpy(weights["w2"]))
            model.fc2.bias.copy_(self.torch.from_numpy(weights["b2"]))
        return model

    def run(self, canaries, noise_multiplier, strategy, seed=202, noise=None):
        torch = self.torch
        model = self.model()
        optimizer = dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR),
            model,
            self.loss_fn,
            max_norm=MAX_NORM,
            noise_multiplier=noise_multiplier,
            expected_batch_size=SAMPLE_RATE * self.n,
            generator=torch.Generator().manual_seed(seed),
            strategy=strategy,
            noise=noise,
        )
        for step, batch in enumerate(dp.poisson_batches(self.n, SAMPLE_RATE, STEPS, seed=seed)):
            batch = torch.as_tensor(batch)
            x, y = self.x[batch], self.y[batch]
            u = torch.zeros(len(batch), HIDDEN)
            if canaries is not None:
                x_canary, u_canary = canary_examples(canaries, step)
                x = torch.cat([x, torch.from_numpy(x_canary)])
                y = torch.cat([y, torch.zeros(len(u_canary), dtype=y.dtype)])
                u = torch.cat([u, torch.from_numpy(u_canary)])
            optimizer.step(x, y, u)
        return {
            "w1": model.fc1.weight.detach().clone(),
            "w2": model.fc2.weight.detach().clone(),
            "b2": model.fc2.bias.detach().clone(),
        }


@pytest.fixture(scope="module")
def torch_runner():
    """The runner and its reference run (materialised, no canaries, no noise, seed 101), with
    torch on one thread: on this tiny model threads only contend on a busy machine."""
    torch = pytest.importorskip("torch", reason="the PyTorch path")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = TorchRunner()
        yield runner, runner.run(None, 0.0, "materialize", seed=101)
    finally:
        torch.set_num_threads(threads)


def test_a_canary_example_has_the_dirac_canary_as_its_gradient(torch_runner):
    """The premise of the module: through ``clipped_sum_of`` (DPOptimizer's reduction), a
    canary example's clipped gradient is ``norm * e_k e_j^T`` on ``w1`` and zero elsewhere."""
    torch = pytest.importorskip("torch", reason="the PyTorch path")
    import pergrad

    runner, _ = torch_runner
    model = runner.model()
    canaries = w1_canaries(model.fc1.weight.detach())
    step = next(step for step in range(STEPS) if canaries.sampled(step).size)
    x, u = canary_examples(canaries, step)
    loss = pergrad.module_loss(model, runner.loss_fn)
    for strategy in ("ghost", "materialize"):
        for row in range(min(len(x), 3)):
            clipped = pergrad.dp.clipped_sum_of(
                loss,
                loss.params(),
                torch.from_numpy(x[row : row + 1]),
                torch.zeros(1, dtype=torch.long),
                torch.from_numpy(u[row : row + 1]),
                max_norm=MAX_NORM,
                strategy=strategy,
            )
            expected = canaries.norm * canaries.unit_directions(
                canaries.sampled(step)[row : row + 1]
            )
            np.testing.assert_allclose(
                clipped.sum["fc1.weight"].numpy().ravel(), expected[0], atol=1e-6
            )
            assert not clipped.sum["fc2.weight"].any() and not clipped.sum["fc2.bias"].any()


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_torch_dp_optimizer_stays_below_its_claim(torch_runner, strategy):
    runner, reference = torch_runner
    canaries = w1_canaries(runner.model().fc1.weight.detach())
    report = audit(
        canaries, lambda c, s: runner.run(c, s, strategy), reference, 1.0, claimed_noise=1.0
    )  # claim: epsilon 3.18
    assert report.ceiling > report.epsilon  # 1000 canaries could have refuted the claim
    assert not report.violated, str(report)
    assert report.epsilon_lower_bound < report.epsilon


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_torch_dp_optimizer_without_noise_is_caught(torch_runner, strategy):
    runner, reference = torch_runner
    canaries = w1_canaries(runner.model().fc1.weight.detach())
    report = audit(
        canaries, lambda c, s: runner.run(c, s, strategy), reference, 0.0, claimed_noise=2.0
    )  # claim: epsilon 0.88
    assert report.violated, str(report)


# --- PyTorch: DPOptimizer with correlated noise ------------------------------------------------
#
# A mechanism made for one run is accounted as ONE Gaussian release of the noise multiplier for
# the participation pattern it was made for. The canaries take part in every step
# (``sample_rate=1.0``) and the mechanisms are made for that (``participations=STEPS``): each
# canary's signal then adds up in the final weights as the prefix sums' noise does, so the
# final model shows nearly all of the release's signal-to-noise ratio (0.98 of it for the
# banded strategy, 0.84 for the BLT: ``STEPS / (||C 1|| ||M^T 1||)``). The run is exactly a
# Gaussian mechanism, so the audit uses the Gaussian trade-off curve (``method="f-dp"``).
# Claim: noise 1.5, epsilon 2.98 (mu 0.67); the broken runs reach mu 8 (the sensitivity of one
# participation, ||coefs|| = 1.27 instead of ||C 1|| = 16.0) and mu 2.2 (the noise a quarter of
# M z), which 1000 canaries refute.

CORRELATED_NOISE = 1.5
BANDED_COEFS = [1.0, 0.6, 0.4, 0.3]
BLT_DECAYS, BLT_SCALES = [0.9], [0.5]


def banded(participations=STEPS):
    return dp.toeplitz(BANDED_COEFS, steps=STEPS, participations=participations)


def blt_mechanism():
    return dp.blt(BLT_DECAYS, BLT_SCALES, steps=STEPS, participations=STEPS)


class QuarterNoiseBLT(dp.BLTNoise):
    """A broken BLT: its noise is a quarter of ``M z`` (the noising coefficients scaled down),
    while its sensitivity, and so the claim, are those of the right mechanism."""

    def _next_draw(self, z, buffers, in_place):
        draw, buffers = super()._next_draw(z, buffers, in_place)
        return draw * 0.25, buffers


def correlated_audit(torch_runner, run_noise, claim_noise):
    """``dp.audit`` of ``DPOptimizer(noise=run_noise)`` (ghost) against the claim of
    ``claim_noise``, canaries in every step, scored on ``w1``."""
    runner, reference = torch_runner
    canaries = dp.GradientCanaries(
        {"w1": runner.model().fc1.weight.detach()}, NUM_CANARIES, sample_rate=1.0, seed=7
    )

    def run(canaries, noise_multiplier):
        return runner.run(canaries, noise_multiplier, "ghost", noise=run_noise)

    return audit(
        canaries,
        run,
        reference,
        CORRELATED_NOISE,
        CORRELATED_NOISE,
        noise=claim_noise,
        method="f-dp",
    )


def test_the_correlated_noise_setting_is_as_stated():
    """The numbers the section's comment relies on, from the matrices."""
    for mech, ratio in ((banded(), 0.98), (blt_mechanism(), 0.84)):
        strategy, noising = mech.strategy_matrix(), mech.noising_matrix()
        ones = np.ones(STEPS)
        assert mech.sensitivity() == pytest.approx(np.linalg.norm(strategy @ ones))  # every step
        final = STEPS / (np.linalg.norm(strategy @ ones) * np.linalg.norm(noising.T @ ones))
        assert final == pytest.approx(ratio, abs=0.005)
    assert banded(participations=1).sensitivity() == pytest.approx(np.linalg.norm(BANDED_COEFS))
    claim = dp.epsilon(noise_multiplier=CORRELATED_NOISE, delta=1e-5, noise=banded())
    assert claim == pytest.approx(2.98, abs=0.01)
    assert dp.epsilon(noise_multiplier=CORRELATED_NOISE, delta=1e-5, noise=blt_mechanism()) == claim
    scaled = QuarterNoiseBLT(BLT_DECAYS, BLT_SCALES, STEPS, participations=STEPS)
    assert scaled.sensitivity() == blt_mechanism().sensitivity()


@pytest.mark.parametrize("mechanism", [banded, blt_mechanism], ids=["banded", "blt"])
def test_torch_correlated_noise_stays_below_its_claim(torch_runner, mechanism):
    report = correlated_audit(torch_runner, mechanism(), mechanism())
    assert report.ceiling > report.epsilon  # 1000 canaries could have refuted the claim
    assert not report.violated and report.epsilon_lower_bound < report.epsilon, str(report)


def test_torch_correlated_noise_with_the_sensitivity_understated_is_caught(torch_runner):
    """The noise of a mechanism made for one participation, in a run whose examples take part
    in every step (the claim is made for that)."""
    report = correlated_audit(torch_runner, banded(participations=1), banded())
    assert report.violated, str(report)


def test_torch_correlated_noise_with_the_noising_matrix_scaled_down_is_caught(torch_runner):
    broken = QuarterNoiseBLT(BLT_DECAYS, BLT_SCALES, STEPS, participations=STEPS)
    report = correlated_audit(torch_runner, broken, blt_mechanism())
    assert report.violated, str(report)


def test_audit_refuses_canaries_outside_the_mechanisms_participation_pattern():
    """Before any training: Poisson canaries (rate 0.05, so some join two steps in a row)
    against a mechanism made for one participation, or for cyclic Poisson sampling."""

    def train(canaries):
        raise AssertionError("the audit trained before checking the canaries")

    torch = pytest.importorskip("torch", reason="canaries over torch parameters")
    params = {"w1": torch.from_numpy(initial_weights()["w1"])}
    poisson = dp.GradientCanaries(params, NUM_CANARIES, sample_rate=SAMPLE_RATE, seed=7)
    with pytest.raises(ValueError, match=r"at most 1 steps at least 1 apart") as caught:
        dp.audit(train, poisson, noise_multiplier=1.0, delta=1e-5, noise=banded(1))
    assert "take part in up to " in str(caught.value) and "sample_rate=1.0" in str(caught.value)
    separated = dp.toeplitz(BANDED_COEFS, steps=STEPS, participations=5, min_separation=10)
    every_step = dp.GradientCanaries(params, NUM_CANARIES, sample_rate=1.0, seed=7)
    with pytest.raises(ValueError, match="1 step\\(s\\) apart at the closest"):
        dp.audit(train, every_step, noise_multiplier=1.0, delta=1e-5, noise=separated)
    cyclic = dp.toeplitz(BANDED_COEFS, steps=STEPS, min_separation=4, sample_rate=0.2)
    with pytest.raises(ValueError, match="cyclic Poisson sampling over 4 groups"):
        dp.audit(train, poisson, noise_multiplier=1.0, delta=1e-5, noise=cyclic)
    with pytest.raises(ValueError, match="steps=10 disagrees with noise="):
        dp.audit(train, every_step, noise_multiplier=1.0, steps=10, delta=1e-5, noise=banded())
    with pytest.raises(ValueError, match="audit: method must be 'one-run' or 'f-dp'"):
        dp.audit(train, every_step, noise_multiplier=1.0, delta=1e-5, noise=banded(), method="x")


# --- JAX: optax_aggregate and private_grad_of -------------------------------------------------


class JaxRunner:
    """DP-SGD in JAX, Poisson batches padded to one shape (``jax.jit`` compiles once per path
    and noise multiplier). Noise keys are ``rbg`` keys, which compile faster than threefry."""

    def __init__(self):
        jax = pytest.importorskip("jax", reason="the JAX path")
        pytest.importorskip("optax", reason="the optax transform")
        import pergrad

        self.jax, jnp = jax, jax.numpy
        x, y = digits()
        self.x, self.y, self.n = jnp.asarray(x), jnp.asarray(y), len(x)
        self.size = dp.max_batch_size_for(self.n, SAMPLE_RATE)
        self.canary_rows = dp.max_batch_size_for(NUM_CANARIES, SAMPLE_RATE)

        def loss(params, xi, yi, ui):  # one example
            pre = params["w1"] @ xi
            logits = params["w2"] @ jnp.tanh(pre) + params["b2"]
            data = -jax.nn.log_softmax(logits)[yi]
            return jnp.where(ui.any(), pre @ ui, data)  # a canary: linear in pre

        self.loss = loss
        self.per_example = jax.jit(pergrad.per_example_grads(loss))
        self.compiled = {}

    def params(self):
        return {k: self.jax.numpy.asarray(v) for k, v in initial_weights().items()}

    def batches(self, canaries, seed, with_canary_examples):
        """Each step's padded data indices and mask, and its canaries as padded examples
        ``(x, u, mask)`` (all-padding when there are none or they go in as gradients)."""
        jnp = self.jax.numpy
        pad = self.canary_rows
        for step, batch in enumerate(dp.poisson_batches(self.n, SAMPLE_RATE, STEPS, seed=seed)):
            indices, mask = dp.pad_batch(batch, self.size)
            x_canary = np.zeros((pad, 64), np.float32)
            u_canary = np.zeros((pad, HIDDEN), np.float32)
            canary_mask = np.zeros(pad, bool)
            if canaries is not None and with_canary_examples:
                x_rows, u_rows = canary_examples(canaries, step)
                x_canary[: len(x_rows)], u_canary[: len(u_rows)] = x_rows, u_rows
                canary_mask[: len(x_rows)] = True
            yield step, indices, jnp.asarray(mask), (x_canary, u_canary, canary_mask)

    def run_private_grad(self, canaries, noise_multiplier, seed=202):
        """``pergrad.dp.private_grad_of`` with the ghost strategy, then plain SGD."""
        jax, jnp = self.jax, self.jax.numpy
        if ("ghost", noise_multiplier) not in self.compiled:

            @jax.jit
            def step(params, x, y, u, mask, key):
                grad, _ = dp.private_grad_of(
                    self.loss,
                    params,
                    x,
                    y,
                    u,
                    max_norm=MAX_NORM,
                    noise_multiplier=noise_multiplier,
                    rng=key,
                    expected_batch_size=SAMPLE_RATE * self.n,
                    mask=mask,
                    strategy="ghost",
                )
                return jax.tree.map(lambda p, g: p - LR * g, params, grad)

            self.compiled["ghost", noise_multiplier] = step
        step = self.compiled["ghost", noise_multiplier]
        params, key = self.params(), jax.random.key(seed, impl="rbg")
        for _, indices, mask, (x_c, u_c, mask_c) in self.batches(canaries, seed, True):
            x = jnp.concatenate([self.x[indices], x_c])
            y = jnp.concatenate([self.y[indices], jnp.zeros(len(x_c), self.y.dtype)])
            u = jnp.concatenate([jnp.zeros((len(indices), HIDDEN)), u_c])
            key, noise_key = jax.random.split(key)
            params = step(params, x, y, u, jnp.concatenate([mask, mask_c]), noise_key)
        return params

    def run_optax(self, canaries, noise_multiplier, seed=202, noise=None):
        """``pergrad.dp.optax_aggregate`` (with the mechanism ``noise``) on materialised
        per-example gradients (the canaries injected as gradient rows), chained with
        ``optax.sgd``."""
        import optax

        jax, jnp = self.jax, self.jax.numpy
        tx = optax.chain(
            dp.optax_aggregate(
                MAX_NORM,
                noise_multiplier,
                jax.random.key(seed, impl="rbg"),
                expected_batch_size=SAMPLE_RATE * self.n,
                noise=noise,
            ),
            optax.sgd(LR),
        )
        if ("optax", noise_multiplier, noise) not in self.compiled:

            @jax.jit
            def step(params, state, grads, mask):
                updates, state = tx.update(grads, state, params, mask=mask)
                return optax.apply_updates(params, updates), state

            self.compiled["optax", noise_multiplier, noise] = step
        step = self.compiled["optax", noise_multiplier, noise]
        every_step = canaries.sample_rate == 1.0  # every included canary, every step
        pad = canaries.num_included if every_step else self.canary_rows
        params = self.params()
        state = tx.init(params)
        no_u = jnp.zeros((self.size, HIDDEN))
        for index, indices, mask, _ in self.batches(canaries, seed, False):
            grads = self.per_example(params, self.x[indices], self.y[indices], no_u)
            grads, mask = canaries.inject(grads, mask, index, pad_to=pad)
            params, state = step(params, state, grads, mask)
        return params


@pytest.fixture(scope="module")
def jax_runner():
    """The runner and its reference run (``private_grad_of``, no canaries, no noise, seed 101)."""
    runner = JaxRunner()
    return runner, runner.run_private_grad(None, 0.0, seed=101)


def test_jax_private_grad_of_ghost_stays_below_its_claim_and_is_caught_without_noise(
    jax_runner,
):
    runner, reference = jax_runner
    canaries = w1_canaries(runner.params()["w1"])
    correct = audit(canaries, runner.run_private_grad, reference, 1.0, claimed_noise=1.0)
    assert correct.ceiling > correct.epsilon  # 1000 canaries could have refuted the claim
    assert not correct.violated and correct.epsilon_lower_bound < correct.epsilon, str(correct)
    broken = audit(canaries, runner.run_private_grad, reference, 0.0, claimed_noise=2.0)
    assert broken.violated, str(broken)


def test_jax_optax_aggregate_stays_below_its_claim_and_is_caught_without_noise(jax_runner):
    runner, reference = jax_runner
    canaries = dp.GradientCanaries(
        runner.params(), NUM_CANARIES, sample_rate=SAMPLE_RATE, seed=7
    )  # on every parameter: injected as gradients, they need no example to carry them
    every = ("w1", "w2", "b2")
    correct = audit(canaries, runner.run_optax, reference, 1.0, claimed_noise=1.0, keys=every)
    assert correct.ceiling > correct.epsilon  # 1000 canaries could have refuted the claim
    assert not correct.violated and correct.epsilon_lower_bound < correct.epsilon, str(correct)
    broken = audit(canaries, runner.run_optax, reference, 0.0, claimed_noise=2.0, keys=every)
    assert broken.violated, str(broken)


@pytest.mark.slow(reason="two JAX audit runs, 500 canary rows a step: about 30 s on 2 busy cores")
def test_jax_optax_aggregate_correlated_noise_stays_below_its_claim_and_is_caught(jax_runner):
    """``optax_aggregate(noise=mech)``, canaries injected in every step (the setting of the
    PyTorch correlated-noise audits above): the BLT run stays below its claim, the banded run
    with the sensitivity of one participation is caught."""
    runner, reference = jax_runner
    canaries = dp.GradientCanaries(runner.params(), NUM_CANARIES, sample_rate=1.0, seed=7)
    every = ("w1", "w2", "b2")

    def audit_of(run_noise, claim_noise):
        def run(canaries, noise_multiplier):
            return runner.run_optax(canaries, noise_multiplier, noise=run_noise)

        return audit(
            canaries,
            run,
            reference,
            CORRELATED_NOISE,
            CORRELATED_NOISE,
            keys=every,
            noise=claim_noise,
            method="f-dp",
        )

    correct = audit_of(blt_mechanism(), blt_mechanism())
    assert correct.ceiling > correct.epsilon
    assert not correct.violated and correct.epsilon_lower_bound < correct.epsilon, str(correct)
    broken = audit_of(banded(participations=1), banded())
    assert broken.violated, str(broken)

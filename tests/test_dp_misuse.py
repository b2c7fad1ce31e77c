"""Silent misuses of the DP API become errors or warnings that name the fix (issue 35): a mask
forgotten after ``pad_batch``, a batch loss given where the loss of one example is expected,
and dp_accounting's "failed to converge" log lines on every epsilon."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

import pergrad
from pergrad import dp
from pergrad._src.errors import PergradValueError

jax = pytest.importorskip("jax", reason="the misuses are shown on JAX first")
jnp = pytest.importorskip("jax.numpy", reason="the misuses are shown on JAX first")


def logistic_loss(params, x, y):  # the loss of ONE example
    logit = x @ params["w"] + params["b"]
    return jnp.logaddexp(0.0, logit) - y * logit


def logistic_data(n: int = 40):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    params = {"w": jnp.asarray([0.5, -0.2, 0.1]), "b": jnp.zeros(())}
    return params, jnp.asarray(x), jnp.asarray(y)


def privacy_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, pergrad.PrivacyWarning)]


# --- a mask forgotten after pad_batch ------------------------------------------------------


def test_optax_update_without_the_mask_of_pad_batch_warns_and_names_the_fix():
    optax = pytest.importorskip("optax", reason="the optax path")
    params, x, y = logistic_data()
    tx = dp.optax_aggregate(max_norm=1.0, noise_multiplier=0.0, key=0, expected_batch_size=4.0)
    state = tx.init(params)
    padded, mask = dp.pad_batch(np.array([3, 7, 11]), max_batch_size=6)
    grads = pergrad.per_example_grads(logistic_loss)(params, x[padded], y[padded])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        forgotten, _ = tx.update(grads, state, params)
    (message,) = privacy_warnings(record)
    assert "no mask" in message and "mask=mask" in message and "pad_batch" in message
    # what the warning is about: the padding (three copies of example 0) moved the update
    masked, _ = tx.update(grads, state, params, mask=jnp.asarray(mask))
    assert not np.allclose(forgotten["w"], masked["w"])
    del optax


def test_the_mask_given_after_pad_batch_gives_no_warning_under_jit():
    params, x, y = logistic_data()
    tx = dp.optax_aggregate(max_norm=1.0, noise_multiplier=0.0, key=0, expected_batch_size=4.0)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y, mask):
        grads = pergrad.per_example_grads(logistic_loss)(params, x, y)
        return tx.update(grads, state, params, mask=mask)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for batch in ([1, 2], [5, 6, 7], []):
            padded, mask = dp.pad_batch(np.array(batch, dtype=np.int64), max_batch_size=5)
            step(params, state, x[padded], y[padded], jnp.asarray(mask))
    assert privacy_warnings(record) == []


def test_ghost_clipped_sum_of_without_the_mask_warns_and_other_sizes_do_not():
    params, x, y = logistic_data()
    padded, _ = dp.pad_batch(np.array([0, 4]), max_batch_size=6)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dp.clipped_sum_of(logistic_loss, params, x[padded], y[padded], max_norm=1.0)
    (message,) = privacy_warnings(record)
    assert message.startswith("clipped_sum_of: got no mask for a batch of 6 examples")
    dp.pad_batch(np.array([0, 4]), max_batch_size=6)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dp.clipped_sum_of(logistic_loss, params, x[:5], y[:5], max_norm=1.0)  # not padded
    assert privacy_warnings(record) == []


def test_torch_clipped_sum_without_the_mask_of_pad_batch_warns():
    torch = pytest.importorskip("torch", reason="the torch path")
    grads = {"w": torch.randn(6, 3)}
    dp.pad_batch(np.array([2, 3]), max_batch_size=6)
    with pytest.warns(pergrad.PrivacyWarning, match=r"clipped_sum\(\.\.\., mask=mask\)"):
        dp.clipped_sum(grads, 1.0)


# --- a batch loss where the loss of one example is expected ---------------------------------


def conv_batch_loss(params, images, labels):
    """A loss of the WHOLE batch: images (B, 1, 8, 8)."""
    out = jax.lax.conv_general_dilated(
        images, params["kernel"], (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    logits = out.reshape(images.shape[0], -1) @ params["w"]
    return jnp.mean((logits[:, 0] - labels) ** 2)


def test_a_jax_batch_loss_is_refused_naming_the_batch_axis_and_the_contract():
    params = {"kernel": jnp.ones((2, 1, 3, 3)), "w": jnp.ones((128, 3))}
    images, labels = jnp.ones((5, 1, 8, 8)), jnp.zeros(5)
    for call in (
        lambda: pergrad.per_example_grads(conv_batch_loss)(params, images, labels),
        lambda: dp.clipped_sum_of(conv_batch_loss, params, images, labels, max_norm=1.0),
    ):
        with pytest.raises(PergradValueError) as raised:
            call()
        message = str(raised.value)
        assert "ONE example" in message and "axis 0, of size 5" in message
        assert "argument 1 ('images') of shape (1, 8, 8) (the batch's (5, 1, 8, 8))" in message
        assert "convolution requires lhs and rhs ndim to be equal" in message  # the cause
        assert "x[None]" in message
        assert isinstance(raised.value.__cause__, TypeError)


def test_a_torch_batch_loss_is_refused_the_same_way():
    torch = pytest.importorskip("torch", reason="the torch path")

    def batch_loss(params, x, y):  # x (B, 1, 3): written for the batch (flatten(1))
        return torch.nn.functional.cross_entropy(x.flatten(1) @ params["w"], y)

    params = {"w": torch.ones(3, 4)}
    with pytest.raises(PergradValueError, match=r"ONE example.*axis 0, of size 6") as raised:
        pergrad.per_example_grads(batch_loss)(params, torch.ones(6, 1, 3), torch.zeros(6).long())
    assert "Expected input batch_size (1)" in str(raised.value.__cause__)  # torch's own words


def test_the_loss_of_one_example_with_the_batch_axis_added_back_works():
    params = {"kernel": jnp.ones((2, 1, 3, 3)), "w": jnp.ones((128, 3))}
    images, labels = jnp.ones((5, 1, 8, 8)), jnp.arange(5.0)

    def one_example(params, image, label):  # the fix the message shows
        return conv_batch_loss(params, image[None], label[None])

    grads = pergrad.per_example_grads(one_example)(params, images, labels)
    expected = jax.grad(conv_batch_loss)(params, images[3:4], labels[3:4])
    np.testing.assert_allclose(grads["w"][3], expected["w"], rtol=1e-6)


def test_a_failure_of_vmap_alone_still_falls_back_to_the_loop():
    # nonzero without a size cannot run under vmap (a tracer's shape), but runs on one
    # concrete example: the vmap failure must reach the fallback, not this error
    def loss(w, x):
        positive = x[jnp.nonzero(x > 0)[0]]
        return jnp.sum(w * positive.sum())

    x = jnp.asarray([[1.0, -2.0, 3.0], [-1.0, 4.0, 0.5]])
    with pytest.warns(pergrad.FallbackWarning):
        grads = pergrad.per_example_grads(loss)(jnp.asarray(2.0), x)
    np.testing.assert_allclose(grads, [4.0, 4.5])


# --- dp_accounting's "failed to converge" log lines ----------------------------------------


def converge_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "failed to converge" in r.getMessage()]


@pytest.fixture
def caplog(caplog):
    """pytest's caplog, also attached to the absl logger itself: a library imported earlier in
    the run (absl's own handler) may stop absl's records from propagating to the root logger,
    where caplog listens."""
    absl_logger = logging.getLogger("absl")
    level, propagate = absl_logger.level, absl_logger.propagate
    absl_logger.addHandler(caplog.handler)
    absl_logger.setLevel(logging.WARNING)
    absl_logger.propagate = False  # each record once, through the handler attached here
    yield caplog
    absl_logger.removeHandler(caplog.handler)
    absl_logger.setLevel(level)
    absl_logger.propagate = propagate


def test_epsilon_prints_no_convergence_warnings_that_dp_accounting_logs(caplog):
    dpa = pytest.importorskip("dp_accounting", reason="the accounting")
    caplog.set_level(logging.WARNING)
    event = dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(0.5))
    reference = dpa.rdp.RdpAccountant().compose(event, 100).get_epsilon(1e-5)
    assert converge_records(caplog)  # dp_accounting itself logs them for this setting
    caplog.clear()
    spent = dp.epsilon(noise_multiplier=0.5, sample_rate=0.05, steps=100, delta=1e-5)
    sigma = dp.noise_multiplier_for(target_epsilon=25.0, delta=1e-5, sample_rate=0.05, steps=100)
    assert converge_records(caplog) == []
    assert spent == pytest.approx(reference, rel=1e-12) and sigma < 0.5


def test_other_absl_warnings_still_get_through(caplog):
    pytest.importorskip("dp_accounting", reason="the accounting")
    from pergrad._src.dp.accounting import quiet_convergence_warnings

    caplog.set_level(logging.WARNING)
    absl_logger = logging.getLogger("absl")
    with quiet_convergence_warnings():
        absl_logger.warning("_compute_log_a_frac failed to converge after %d iterations", 1000)
        absl_logger.warning("Negative Renyi divergence of %s", -1.0)
    assert [r.getMessage() for r in caplog.records] == ["Negative Renyi divergence of -1.0"]
    absl_logger.warning("_compute_log_a_frac failed to converge after %d iterations", 1000)
    assert len(converge_records(caplog)) == 1  # outside the accounting, nothing is filtered

"""Privacy accounting: pergrad's epsilon / noise_multiplier_for / Accountant against dp_accounting."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pergrad._src.dp.accounting import Accountant, epsilon, noise_multiplier_for

dpa = pytest.importorskip("dp_accounting", reason="privacy accounting needs dp-accounting")

# The classic MNIST DP-SGD setting (Abadi et al. 2016; TF Privacy's tutorial): batches of 256
# of 60000 examples, noise multiplier 1.1, 60 epochs, delta 1e-5.
MNIST = dict(noise_multiplier=1.1, sample_rate=256 / 60000, steps=60 * 60000 // 256, delta=1e-5)


def direct_epsilon(noise_multiplier, sample_rate, steps, delta, accountant):
    """The reference: dp_accounting called directly, as its documentation shows."""
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier)), steps
    )
    fresh = dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()
    return fresh.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_equals_dp_accounting_called_directly(accountant):
    got = epsilon(**MNIST, accountant=accountant)
    assert isinstance(got, float)
    assert got == pytest.approx(direct_epsilon(**MNIST, accountant=accountant), rel=1e-12)


def test_epsilon_of_the_mnist_setting_is_in_the_known_range():
    # TF Privacy's tutorial reported 3.01 with the older RDP -> (eps, delta) conversion;
    # dp-accounting 0.6 uses the tighter conversion (Canonne et al. 2020) and gives 2.60. PLD
    # is tighter still. A loose sanity range: the exact check is the comparison above.
    rdp = epsilon(**MNIST, accountant="rdp")
    assert 2.3 < rdp < 3.1
    assert epsilon(**MNIST, accountant="pld") < rdp


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_no_steps_is_zero_epsilon_and_no_noise_is_infinite(accountant):
    assert epsilon(1.1, 0.01, 0, 1e-5, accountant) == 0.0
    assert epsilon(0.0, 0.01, 10, 1e-5, accountant) == math.inf


def test_epsilon_grows_with_steps_and_sample_rate_and_shrinks_with_noise():
    base = dict(noise_multiplier=1.0, sample_rate=0.01, steps=1000, delta=1e-5)
    by_steps = [epsilon(**{**base, "steps": steps}) for steps in (10, 100, 1000, 10000)]
    by_noise = [epsilon(**{**base, "noise_multiplier": s}) for s in (0.6, 0.8, 1.0, 2.0, 4.0)]
    by_rate = [epsilon(**{**base, "sample_rate": q}) for q in (0.001, 0.01, 0.1, 1.0)]
    assert by_steps == sorted(by_steps) and len(set(by_steps)) == len(by_steps)
    assert by_noise == sorted(by_noise, reverse=True) and len(set(by_noise)) == len(by_noise)
    assert by_rate == sorted(by_rate) and len(set(by_rate)) == len(by_rate)


@pytest.mark.parametrize("target", [0.5, 3.0, 8.0])
def test_noise_multiplier_for_round_trips_through_epsilon_rdp(target):
    setting = dict(delta=1e-5, sample_rate=256 / 60000, steps=MNIST["steps"])
    tolerance = 1e-3
    sigma = noise_multiplier_for(target, **setting, tolerance=tolerance)
    reached = epsilon(sigma, setting["sample_rate"], setting["steps"], setting["delta"])
    assert reached <= target  # never more privacy spent than asked
    assert reached == pytest.approx(target, rel=1e-2)
    # The smallest such noise, within the tolerance: a little less noise overshoots.
    less = epsilon(sigma - 2 * tolerance, setting["sample_rate"], setting["steps"], 1e-5)
    assert less > target


def test_noise_multiplier_for_round_trips_through_epsilon_pld():
    tolerance = 1e-3
    sigma = noise_multiplier_for(1.0, 1e-5, 0.02, 500, "pld", tolerance=tolerance)
    assert epsilon(sigma, 0.02, 500, 1e-5, "pld") <= 1.0
    assert epsilon(sigma - 2 * tolerance, 0.02, 500, 1e-5, "pld") > 1.0
    # PLD is tighter than RDP, so it needs less noise for the same target.
    assert sigma < noise_multiplier_for(1.0, 1e-5, 0.02, 500, "rdp")


def test_noise_multiplier_for_zero_steps_needs_no_noise():
    assert noise_multiplier_for(1.0, 1e-5, 0.01, 0) == 0.0


def test_noise_multiplier_for_unreachable_target_says_so():
    # Full-batch steps, a million of them, and epsilon 0.001: beyond noise 2**20.
    with pytest.raises(ValueError, match=r"target_epsilon=0\.001 cannot be reached"):
        noise_multiplier_for(1e-3, 1e-5, 1.0, 10**6)


def test_accountant_tracks_steps_and_matches_epsilon():
    accountant = Accountant(noise_multiplier=1.1, sample_rate=256 / 60000, delta=1e-5)
    assert accountant.steps == 0 and accountant.epsilon() == 0.0
    accountant.step()
    accountant.step(99)
    assert accountant.steps == 100
    assert accountant.epsilon() == epsilon(1.1, 256 / 60000, 100, 1e-5)
    accountant.step(900)  # the cached value must not survive a step
    assert accountant.epsilon() == pytest.approx(
        direct_epsilon(1.1, 256 / 60000, 1000, 1e-5, "rdp")
    )


def test_accountant_repr_shows_its_settings_and_steps():
    accountant = Accountant(1.1, 0.01, 1e-5, "pld")
    accountant.step(7)
    text = repr(accountant)
    for part in ("noise_multiplier=1.1", "sample_rate=0.01", "delta=1e-05", "'pld'", "steps=7"):
        assert part in text


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=500), max_size=5))
def test_accountant_steps_add_up(increments):
    accountant = Accountant(1.0, 0.01, 1e-5)
    for n in increments:
        accountant.step(n)
    assert accountant.steps == sum(increments)
    assert accountant.epsilon() == epsilon(1.0, 0.01, sum(increments), 1e-5)


def test_fixed_size_sampling_matches_dp_accounting_replace_one():
    steps = 1000
    fresh = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    event = dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(60000, 256, dpa.GaussianDpEvent(1.1)), steps
    )
    expected = fresh.compose(event).get_epsilon(1e-5)
    got = epsilon(1.1, 256 / 60000, steps, 1e-5, sampling="fixed", num_examples=60000)
    assert got == pytest.approx(expected, rel=1e-12)
    accountant = Accountant(1.1, 256 / 60000, 1e-5, sampling="fixed", num_examples=60000)
    accountant.step(steps)
    assert accountant.epsilon() == pytest.approx(expected, rel=1e-12)
    assert "sampling='fixed'" in repr(accountant)


def test_fixed_size_sampling_with_pld_names_the_accountant_that_supports_it():
    with pytest.raises(
        ValueError, match=r"accountant='pld' does not support sampling='fixed'.*'rdp'"
    ):
        Accountant(1.1, 256 / 60000, 1e-5, "pld", sampling="fixed", num_examples=60000)


def test_fixed_size_sampling_needs_a_whole_batch_size():
    with pytest.raises(ValueError, match="needs num_examples"):
        epsilon(1.1, 0.01, 10, 1e-5, sampling="fixed")
    with pytest.raises(ValueError, match=r"whole number.*batch_size / num_examples"):
        epsilon(1.1, 0.01, 10, 1e-5, sampling="fixed", num_examples=150)


GOOD = dict(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=1e-5)
BAD_EPSILON_ARGUMENTS = [
    ("noise_multiplier", -0.5, ValueError, r"noise_multiplier must be finite and >= 0.*-0\.5"),
    ("noise_multiplier", math.inf, ValueError, r"noise_multiplier must be finite.*inf"),
    ("noise_multiplier", math.nan, ValueError, r"noise_multiplier must be a number, got nan"),
    ("noise_multiplier", "1.0", TypeError, r"noise_multiplier must be a real number, got str"),
    ("sample_rate", 0.0, ValueError, r"sample_rate must be in \(0, 1\].*0\.0"),
    ("sample_rate", 1.5, ValueError, r"sample_rate must be in \(0, 1\].*1\.5"),
    ("sample_rate", None, TypeError, r"sample_rate must be a real number, got NoneType"),
    ("steps", -1, ValueError, r"steps must be >= 0, got -1"),
    ("steps", 14062.5, TypeError, r"steps must be an int, got float 14062\.5.*math\.ceil"),
    ("steps", True, TypeError, r"steps must be an int, got bool"),
    ("delta", 0.0, ValueError, r"delta must be in \(0, 1\).*0\.0"),
    ("delta", 1.0, ValueError, r"delta must be in \(0, 1\).*1\.0"),
    ("accountant", "moments", ValueError, r"accountant must be 'rdp' or 'pld', got 'moments'"),
    ("sampling", "shuffle", ValueError, r"sampling must be 'poisson' or 'fixed', got 'shuffle'"),
]


@pytest.mark.parametrize(("name", "value", "error", "message"), BAD_EPSILON_ARGUMENTS)
def test_epsilon_rejects_bad_input_naming_the_argument(name, value, error, message):
    with pytest.raises(error, match=r"^epsilon: " + message):
        epsilon(**{**GOOD, name: value})


@pytest.mark.parametrize(("name", "value", "error", "message"), BAD_EPSILON_ARGUMENTS)
def test_accountant_rejects_bad_input_naming_the_argument(name, value, error, message):
    if name == "steps":
        with pytest.raises(error, match=r"^Accountant.step: " + message.replace("steps", "n")):
            Accountant(1.0, 0.01, 1e-5).step(value)
        return
    arguments = {k: v for k, v in GOOD.items() if k != "steps"}
    with pytest.raises(error, match=r"^Accountant: " + message):
        Accountant(**{**arguments, name: value})


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0.0, ValueError, r"target_epsilon must be finite and > 0, got 0\.0"),
        (-1.0, ValueError, r"target_epsilon must be finite and > 0, got -1\.0"),
        (math.inf, ValueError, r"target_epsilon must be finite and > 0, got inf"),
        ("3", TypeError, r"target_epsilon must be a real number, got str"),
    ],
)
def test_noise_multiplier_for_rejects_bad_targets(value, error, message):
    with pytest.raises(error, match=r"^noise_multiplier_for: " + message):
        noise_multiplier_for(value, 1e-5, 0.01, 10)


def test_noise_multiplier_for_rejects_bad_tolerance():
    with pytest.raises(ValueError, match=r"tolerance must be finite and > 0, got 0"):
        noise_multiplier_for(1.0, 1e-5, 0.01, 10, tolerance=0)


def test_missing_dp_accounting_asks_to_install_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # makes `import dp_accounting` fail
    with pytest.raises(ImportError, match=r"pip install 'pergrad\[dp\]'"):
        epsilon(**GOOD)


def test_importing_the_module_does_not_import_dp_accounting():
    code = "import sys, pergrad._src.dp.accounting; assert 'dp_accounting' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_epsilon_agrees_with_opacus_rdp_accountant():
    accountants = pytest.importorskip(
        "opacus.accountants", reason="the cross-check against Opacus needs opacus installed"
    )
    opacus = accountants.RDPAccountant()
    opacus.history = [(MNIST["noise_multiplier"], MNIST["sample_rate"], MNIST["steps"])]
    # Same RDP bound and conversion; Opacus has fewer orders (up to 63, dp_accounting up to
    # 1024), which does not matter where the best order is small, as here (Opacus 1.6: 2.5966).
    assert opacus.get_epsilon(MNIST["delta"]) == pytest.approx(epsilon(**MNIST), rel=1e-6)

"""Poisson sampling of batches, padding to a fixed size, and the PyTorch batch sampler.

The statistical tests run with fixed seeds, so they are deterministic; their thresholds are
chosen so that over random seeds each would fail with probability below about 1e-6 (the
false-alarm rate), using the normal approximation to the binomial (counts of ~1000 here).
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pergrad._src.dp.sampling import max_batch_size_for, pad_batch, poisson_batches

FALSE_ALARM = 1e-6


def two_sided_z(alpha: float) -> float:
    """z with P(|N(0, 1)| > z) = alpha, by bisection on erfc (no scipy needed)."""
    low, high = 0.0, 40.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if math.erfc(middle / math.sqrt(2)) > alpha else (low, middle)
    return high


def assert_poisson_inclusion(batches: list[np.ndarray], num_examples: int, sample_rate: float):
    """Checks that each example is in each batch independently with probability sample_rate.

    Each example's count over T batches is Binomial(T, q): mean T q, variance T q (1 - q).
    Three checks, each with false-alarm rate <= FALSE_ALARM:
      1. every example's count within z sigma of T q, with z Bonferroni-corrected over the N
         examples (a biased example fails);
      2. the chi-square statistic sum of squared z-scores ~ chi2(N), via Wilson-Hilferty (counts
         that are too even, e.g. round-robin batches, fail);
      3. the variance of the batch sizes vs N q (1 - q) (correlated inclusion, e.g. fixed-size
         batches, fails); the sample variance of T draws has relative sd ~ sqrt(2 / T).
    """
    steps = len(batches)
    counts = np.bincount(np.concatenate(batches), minlength=num_examples)
    mean, std = steps * sample_rate, math.sqrt(steps * sample_rate * (1 - sample_rate))
    z_scores = (counts - mean) / std
    worst = np.abs(z_scores).max()
    assert worst < two_sided_z(FALSE_ALARM / num_examples), f"max |z| {worst:.2f}"

    chi2 = float(np.sum(z_scores**2))
    wh_mean, wh_std = 1 - 2 / (9 * num_examples), math.sqrt(2 / (9 * num_examples))
    wh_z = ((chi2 / num_examples) ** (1 / 3) - wh_mean) / wh_std
    assert abs(wh_z) < two_sided_z(FALSE_ALARM), f"chi2 {chi2:.1f} with {num_examples} dof"

    sizes = np.array([len(batch) for batch in batches])
    ratio = sizes.var(ddof=1) / (num_examples * sample_rate * (1 - sample_rate))
    assert abs(ratio - 1) < two_sided_z(FALSE_ALARM) * math.sqrt(2 / steps), f"ratio {ratio}"


def test_each_example_is_included_with_the_sample_rate():
    batches = list(poisson_batches(num_examples=100, sample_rate=0.25, steps=4000, seed=0))
    assert len(batches) == 4000
    assert_poisson_inclusion(batches, 100, 0.25)


def test_the_checks_catch_fixed_size_batches():
    # The independent reference that the test can fail: shuffled fixed-size batches have
    # the right per-example rate but no batch-size variance.
    rng = np.random.default_rng(0)
    batches = [rng.choice(100, size=25, replace=False) for _ in range(4000)]
    with pytest.raises(AssertionError, match="ratio"):
        assert_poisson_inclusion(batches, 100, 0.25)


def test_batches_are_sorted_distinct_int64_indices_in_range():
    for batch in poisson_batches(50, 0.3, steps=200, seed=1):
        assert batch.dtype == np.int64 and batch.ndim == 1
        assert np.all(np.diff(batch) > 0)
        assert batch.size == 0 or (batch[0] >= 0 and batch[-1] < 50)


def test_empty_batches_are_yielded_not_skipped():
    # P(empty) = 0.9**3 = 0.73 per step.
    batches = list(poisson_batches(num_examples=3, sample_rate=0.1, steps=100, seed=2))
    assert len(batches) == 100
    empty = [batch for batch in batches if batch.size == 0]
    assert 40 < len(empty) < 100
    assert all(batch.shape == (0,) and batch.dtype == np.int64 for batch in empty)


def test_sample_rate_one_takes_every_example_and_zero_steps_yield_nothing():
    assert all(np.array_equal(b, np.arange(7)) for b in poisson_batches(7, 1.0, 5, seed=0))
    assert list(poisson_batches(7, 0.5, 0, seed=0)) == []


def test_seeded_batches_are_reproducible_and_unseeded_ones_are_not():
    def draw(seed):
        return np.concatenate(
            [np.append(batch, -1) for batch in poisson_batches(1000, 0.5, 3, seed=seed)]
        )

    assert np.array_equal(draw(123), draw(123))
    assert not np.array_equal(draw(123), draw(124))
    assert not np.array_equal(draw(None), draw(None))  # fresh secure seeds (P(equal) ~ 2**-3000)


def test_pad_batch_pads_with_index_zero_and_masks_the_padding():
    padded, mask = pad_batch(np.array([3, 5, 9]), max_batch_size=5)
    assert padded.tolist() == [3, 5, 9, 0, 0] and padded.dtype == np.int64
    assert mask.tolist() == [True, True, True, False, False] and mask.dtype == np.bool_
    padded, mask = pad_batch([], max_batch_size=4)  # an empty Poisson batch
    assert padded.tolist() == [0, 0, 0, 0] and not mask.any()


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=10**6), unique=True, max_size=40),
    st.integers(min_value=0, max_value=20),
)
def test_pad_batch_round_trips(indices, extra):
    max_batch_size = len(indices) + extra
    padded, mask = pad_batch(np.array(indices, dtype=np.int64), max_batch_size)
    assert padded.shape == mask.shape == (max_batch_size,)
    assert padded[mask].tolist() == indices
    assert np.all(padded[~mask] == 0)
    assert mask.sum() == len(indices) and np.all(mask[: len(indices)])


def test_pad_batch_overflow_suggests_max_batch_size_for():
    with pytest.raises(
        ValueError, match=r"4 examples, more than max_batch_size=3.*max_batch_size_for"
    ):
        pad_batch([1, 2, 3, 4], max_batch_size=3)


@pytest.mark.parametrize(
    ("indices", "max_batch_size", "error", "message"),
    [
        (np.zeros((2, 2), dtype=int), 4, ValueError, r"indices must be 1-D.*\(2, 2\)"),
        (np.array([0.0, 1.0]), 4, TypeError, r"indices must be integers, got dtype float64"),
        ([1, 2], 2.5, TypeError, r"max_batch_size must be an int, got float 2\.5"),
        ([1, 2], -1, ValueError, r"max_batch_size must be >= 0, got -1"),
    ],
)
def test_pad_batch_rejects_bad_input(indices, max_batch_size, error, message):
    with pytest.raises(error, match=r"^pad_batch: " + message):
        pad_batch(indices, max_batch_size)


def exact_upper_tail(num_examples: int, sample_rate: float, size: int) -> float:
    """P(Binomial(N, q) > size), summed term by term with exact binomial coefficients."""
    return sum(
        math.comb(num_examples, k) * sample_rate**k * (1 - sample_rate) ** (num_examples - k)
        for k in range(size + 1, num_examples + 1)
    )


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=1, max_value=80),
    st.floats(min_value=0.01, max_value=0.99),
    st.sampled_from([0.3, 1e-2, 1e-4, 1e-6, 1e-9]),
)
def test_max_batch_size_for_is_the_smallest_safe_size(num_examples, sample_rate, overflow):
    size = max_batch_size_for(num_examples, sample_rate, overflow)
    assert 0 <= size <= num_examples
    assert exact_upper_tail(num_examples, sample_rate, size) <= overflow * (1 + 1e-9)
    if size > 0:
        assert exact_upper_tail(num_examples, sample_rate, size - 1) > overflow


@pytest.mark.parametrize(
    ("num_examples", "sample_rate", "overflow"),
    [(60000, 256 / 60000, 1e-6), (60000, 256 / 60000, 1e-6 / 14062), (10**6, 0.5, 1e-9)],
)
def test_max_batch_size_for_large_datasets_matches_scipy(num_examples, sample_rate, overflow):
    stats = pytest.importorskip("scipy.stats", reason="scipy is the reference binomial tail")
    size = max_batch_size_for(num_examples, sample_rate, overflow)
    assert stats.binom.sf(size, num_examples, sample_rate) <= overflow
    assert stats.binom.sf(size - 1, num_examples, sample_rate) > overflow


def test_max_batch_size_for_the_mnist_setting_and_full_batches():
    assert max_batch_size_for(60000, 256 / 60000) == 335  # mean 256, std 16: ~4.9 std above
    assert max_batch_size_for(10, 1.0) == 10


BAD_SAMPLING_INPUTS = [
    (dict(num_examples=0), ValueError, r"num_examples must be >= 1, got 0"),
    (dict(num_examples=10.0), TypeError, r"num_examples must be an int, got float"),
    (dict(sample_rate=0.0), ValueError, r"sample_rate must be in \(0, 1\].*got 0\.0"),
    (dict(sample_rate=2), ValueError, r"sample_rate must be in \(0, 1\].*got 2"),
    (dict(sample_rate="0.1"), TypeError, r"sample_rate must be a real number.*got str"),
    (dict(steps=-3), ValueError, r"steps must be >= 0, got -3"),
    (dict(steps=2.0), TypeError, r"steps must be an int, got float 2\.0"),
    (dict(seed=1.5), TypeError, r"seed must be an int or None.*got float 1\.5"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_SAMPLING_INPUTS)
def test_poisson_batches_rejects_bad_input_when_called(change, error, message):
    arguments = {"num_examples": 10, "sample_rate": 0.1, "steps": 5, "seed": 0, **change}
    with pytest.raises(error, match=r"^poisson_batches: " + message):
        poisson_batches(**arguments)  # no iteration needed: the call itself checks


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(num_examples=-1), ValueError, r"num_examples must be >= 1, got -1"),
        (dict(sample_rate=0), ValueError, r"sample_rate must be in \(0, 1\]"),
        (dict(overflow_probability=0.0), ValueError, r"overflow_probability must be in \(0, 1\)"),
        (dict(overflow_probability=1.0), ValueError, r"overflow_probability must be in \(0, 1\)"),
        (dict(overflow_probability=None), TypeError, r"overflow_probability must be a real"),
    ],
)
def test_max_batch_size_for_rejects_bad_input(change, error, message):
    arguments = {"num_examples": 10, "sample_rate": 0.1, **change}
    with pytest.raises(error, match=r"^max_batch_size_for: " + message):
        max_batch_size_for(**arguments)


def test_importing_sampling_does_not_import_torch():
    code = (
        "import sys, pergrad.dp as dp; assert 'torch' not in sys.modules; "
        "dp.PoissonBatchSampler; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- PyTorch ------------------------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the DataLoader sampler needs torch")


def test_torch_sampler_includes_each_example_with_the_sample_rate(torch):
    from pergrad._src.torch.sampling import PoissonBatchSampler

    sampler = PoissonBatchSampler(100, 0.25, steps=4000, generator=torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert len(sampler) == len(batches) == 4000
    assert all(isinstance(batch, list) for batch in batches)
    assert_poisson_inclusion([np.array(batch, dtype=np.int64) for batch in batches], 100, 0.25)


def test_torch_sampler_in_a_data_loader_yields_every_batch_including_empty_ones(torch):
    from pergrad._src.torch.sampling import PoissonBatchSampler, collate_with_empty_batches

    features = torch.arange(12.0).reshape(4, 3)
    labels = torch.arange(4)
    dataset = torch.utils.data.TensorDataset(features, labels)
    sampler = PoissonBatchSampler(4, 0.2, steps=50, generator=torch.Generator().manual_seed(3))
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_with_empty_batches(dataset)
    )
    expected = list(PoissonBatchSampler(4, 0.2, 50, generator=torch.Generator().manual_seed(3)))
    seen = list(loader)
    assert len(seen) == 50 and any(len(indices) == 0 for indices in expected)
    for (x, y), indices in zip(seen, expected):
        assert x.shape == (len(indices), 3) and x.dtype == features.dtype
        assert y.shape == (len(indices),) and y.dtype == labels.dtype
        assert torch.equal(x, features[indices]) and torch.equal(y, labels[indices])


def test_collate_with_empty_batches_keeps_dicts_and_strings(torch):
    from pergrad._src.torch.sampling import collate_with_empty_batches

    dataset = [{"image": torch.zeros(2, 5), "name": "a", "label": 1}]
    empty = collate_with_empty_batches(dataset)([])
    assert set(empty) == {"image", "name", "label"}
    assert empty["image"].shape == (0, 2, 5) and empty["label"].shape == (0,)
    assert empty["name"] == []


def test_torch_sampler_rejects_bad_input(torch):
    from pergrad._src.torch.sampling import PoissonBatchSampler

    with pytest.raises(TypeError, match=r"^PoissonBatchSampler: generator must be a torch"):
        PoissonBatchSampler(10, 0.1, 5, generator=0)
    with pytest.raises(ValueError, match=r"^PoissonBatchSampler: sample_rate must be in"):
        PoissonBatchSampler(10, 1.1, 5)
    with pytest.raises(ValueError, match=r"^PoissonBatchSampler: steps must be >= 0"):
        PoissonBatchSampler(10, 0.1, -5)

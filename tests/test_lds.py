"""``pergrad.influence.lds`` and ``lds_subsets`` (issue 21): the linear datamodeling score
against its definition (a Spearman correlation computed here from numpy ranks), on outputs
that the scores predict perfectly, in reverse, or not at all."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pergrad import influence

pytest.importorskip("scipy", reason="lds ranks with scipy (the influence extra)")

N_TRAIN, N_TARGETS, M = 40, 30, 24


def data(seed: int = 0):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(N_TRAIN, N_TARGETS))
    masks = influence.lds_subsets(N_TRAIN, M, seed=seed)
    return rng, scores, masks


def spearman_by_hand(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of the ranks (continuous data: no ties)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_outputs_the_scores_predict_exactly_give_one_and_reversed_minus_one():
    _, scores, masks = data()
    predicted = masks @ scores
    # a monotone transform of the prediction keeps every rank
    assert influence.lds(scores, masks, np.exp(predicted / 10)) == pytest.approx(1.0)
    assert influence.lds(scores, masks, -predicted) == pytest.approx(-1.0)


def test_per_target_values_are_spearman_correlations():
    rng, scores, masks = data(1)
    outputs = masks @ scores + rng.normal(scale=3.0, size=(M, N_TARGETS))
    per = influence.lds(scores, masks, outputs, per_target=True)
    expected = [spearman_by_hand(masks @ scores[:, j], outputs[:, j]) for j in range(N_TARGETS)]
    np.testing.assert_allclose(per, expected, rtol=1e-12)
    assert influence.lds(scores, masks, outputs) == pytest.approx(np.mean(expected))
    assert 0.1 < np.mean(expected) < 0.99  # noisy but informative


def test_random_scores_score_near_zero():
    rng = np.random.default_rng(2)
    truth = rng.normal(size=(200, 300))
    masks = influence.lds_subsets(200, 64, seed=2)
    outputs = masks @ truth
    random_scores = rng.normal(size=(200, 300))
    assert abs(influence.lds(random_scores, masks, outputs)) < 0.05
    assert influence.lds(truth, masks, outputs) == pytest.approx(1.0)


@settings(max_examples=25, deadline=None)
@given(
    scale=st.floats(0.01, 100.0),
    shift=st.floats(-100.0, 100.0),
    seed=st.integers(0, 2**16),
)
def test_invariant_to_scaling_and_shifting_each_targets_scores(scale, shift, seed):
    """Every subset has the same size, so a constant added to a target's scores moves every
    prediction equally; a positive scale keeps the ranks."""
    rng, scores, masks = data(seed)
    outputs = masks @ scores + rng.normal(size=(M, N_TARGETS))
    moved = scores * scale + shift
    np.testing.assert_allclose(
        influence.lds(moved, masks, outputs, per_target=True),
        influence.lds(scores, masks, outputs, per_target=True),
        atol=1e-9,
    )


def test_torch_scores_and_0_1_masks_are_accepted():
    torch = pytest.importorskip("torch")
    _, scores, masks = data(3)
    outputs = masks @ scores
    assert influence.lds(torch.tensor(scores), masks.astype(int), outputs) == pytest.approx(1.0)


def test_a_constant_target_is_nan_and_skipped():
    _, scores, masks = data(4)
    outputs = masks @ scores
    outputs[:, 0] = 1.0
    per = influence.lds(scores, masks, outputs, per_target=True)
    assert np.isnan(per[0]) and np.allclose(per[1:], 1.0)
    assert influence.lds(scores, masks, outputs) == pytest.approx(1.0)


def test_subsets_are_exact_size_and_reproducible():
    masks = influence.lds_subsets(11, 50, fraction=0.3, seed=7)
    assert masks.shape == (50, 11) and masks.dtype == bool
    assert (masks.sum(1) == 3).all()
    np.testing.assert_array_equal(masks, influence.lds_subsets(11, 50, fraction=0.3, seed=7))
    assert not np.array_equal(masks, influence.lds_subsets(11, 50, fraction=0.3, seed=8))
    # every example is in about 30% of the subsets
    many = influence.lds_subsets(10, 4000, fraction=0.3, seed=0)
    np.testing.assert_allclose(many.mean(0), 0.3, atol=0.03)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_train": 0}, "num_train must be a positive int"),
        ({"num_subsets": 2.5}, "num_subsets must be a positive int"),
        ({"fraction": 1.0}, "fraction must be a number strictly between 0 and 1"),
        ({"num_train": 2, "fraction": 0.1}, "gives subsets of 0 examples"),
    ],
)
def test_bad_subset_arguments_are_named(kwargs, message):
    arguments = {"num_train": 10, "num_subsets": 5, **kwargs}
    with pytest.raises(ValueError, match=message):
        influence.lds_subsets(**arguments)


def test_bad_lds_arguments_are_named():
    _, scores, masks = data(5)
    outputs = masks @ scores
    with pytest.raises(ValueError, match=r"subsets must have one column per training example"):
        influence.lds(scores, masks[:, :-1], outputs)
    with pytest.raises(ValueError, match=r"outputs must be \(m, n_targets\) = \(24, 30\)"):
        influence.lds(scores, masks, outputs.T)
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        influence.lds(scores, masks * 2, outputs)
    with pytest.raises(ValueError, match="scores must be a 2-D numeric array"):
        influence.lds(scores[:, 0], masks, outputs)
    with pytest.raises(ValueError, match="outputs holds NaN"):
        influence.lds(scores, masks, outputs * np.nan)
    with pytest.raises(ValueError, match="at least 3 subsets"):
        influence.lds(scores, masks[:2], outputs[:2])
    with pytest.raises(ValueError, match="every target's predictions or outputs are constant"):
        influence.lds(scores, masks, np.ones_like(outputs))

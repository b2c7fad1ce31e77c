"""pergrad.testing's assertions pass on a right loss and fail on a wrong one."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad import testing

RNG = np.random.default_rng(4)


def setup(fw):
    w, x, y = RNG.normal(size=3), RNG.normal(size=(8, 3)), RNG.normal(size=8)
    return fw.array(w), fw.array(x), fw.array(y)


def loss_of_one(w, x, y):
    return ((x * w).sum() - y) ** 2


def test_mean_and_sum_assertions_pass_on_a_consistent_loss(fw):
    w, x, y = setup(fw)

    def mean_loss(w, x, y):
        return ((fw.matmul(x, w) - y) ** 2).mean()

    def sum_loss(w, x, y):
        return ((fw.matmul(x, w) - y) ** 2).sum()

    testing.assert_mean_equals_batch_grad(loss_of_one, mean_loss, w, x, y, rtol=1e-4, atol=1e-5)
    testing.assert_sum_equals_batch_grad(loss_of_one, sum_loss, w, x, y, rtol=1e-4, atol=1e-5)
    testing.assert_matches_loop(loss_of_one, w, x, y)


def test_mean_assertion_catches_a_wrong_batch_loss(fw):
    w, x, y = setup(fw)

    def sum_loss(w, x, y):  # summed instead of averaged: B times too large
        return ((fw.matmul(x, w) - y) ** 2).sum()

    with pytest.raises(AssertionError, match="mean of per-example gradients vs the batch"):
        testing.assert_mean_equals_batch_grad(loss_of_one, sum_loss, w, x, y)

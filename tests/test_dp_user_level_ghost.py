"""User-level clipping by the PyTorch ghost strategy (``capture/torch_users.py``): each user's
summed gradient's norm from its examples' layer records side by side, no per-example gradient
of a layer with a rule formed.

The reference is independent of pergrad: each user's gradient from ``torch.autograd.grad`` of
the user's summed loss (a loop over users), clipped and summed by hand in float64.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from pergrad import dp  # noqa: E402
from pergrad._src.capture import torch_quantities  # noqa: E402
from pergrad._src.dp.from_loss import clipped_sum_run  # noqa: E402
from pergrad._src.errors import PergradValueError  # noqa: E402

USERS = np.array([4, 0, 4, 7, 0, 4, 9, 7, 4, 12])  # unsorted, not contiguous, one singleton


class Tokens(nn.Module):
    """Embedding -> per-token linear layers (several positions per example) -> mean -> head."""

    def __init__(self, vocab: int = 13, width: int = 6, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x):
        h = torch.tanh(self.mix(self.embed(x)))
        return self.head(self.norm(h)).mean(1)


class Scaled(nn.Module):
    """A layer without a ghost rule: its per-example gradients are formed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * self.scale


def conv_net():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 4),
        Scaled(4),
        nn.Linear(4, 3),
    )


def models():
    torch.manual_seed(0)
    return {
        "tokens": (Tokens(), lambda n: torch.randint(0, 13, (n, 5)), 13),
        "tied": (Tokens(tied=True), lambda n: torch.randint(0, 13, (n, 5)), 13),
        "conv": (conv_net(), lambda n: torch.randn(n, 2, 6, 6), 3),
    }


def squared_error(output, target):
    return ((output - target) ** 2).sum(1).mean()


def user_reference(model, x, y, user_ids, max_norm, mask=None):
    """Sum over users of min(1, C / |G_u|) G_u, G_u by autograd of the user's summed loss."""
    real = np.ones(len(user_ids), bool) if mask is None else np.asarray(mask, bool)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in zip(names, params)}
    for user in np.unique(user_ids[real]):
        rows = torch.from_numpy((user_ids == user) & real)
        out = model(x[rows])
        grads = torch.autograd.grad(((out - y[rows]) ** 2).sum(), params)
        norm = float(sum((g.double() ** 2).sum() for g in grads).sqrt())
        factor = min(1.0, max_norm / max(norm, 1e-300))
        for n, g in zip(names, grads):
            total[n] += factor * g.double()
    return total, len(np.unique(user_ids[real]))


def run(model, x, y, user_ids, max_norm, strategy="ghost", mask=None, **kwargs):
    loss = pergrad.module_loss(model, squared_error)
    return clipped_sum_run(
        loss,
        loss.params(),
        x,
        y,
        max_norm=max_norm,
        strategy=strategy,
        user_ids=torch.as_tensor(user_ids),
        mask=None if mask is None else torch.as_tensor(mask),
        **kwargs,
    )


@pytest.mark.parametrize("name", ["tokens", "tied", "conv"])
@pytest.mark.parametrize("masked", [False, True])
def test_ghost_equals_per_user_autograd_reference(name, masked):
    model, inputs, width = models()[name]
    model = model.double()
    x, y = inputs(len(USERS)), torch.randn(len(USERS), width, dtype=torch.float64)
    if x.is_floating_point():
        x = x.double()
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], bool) if masked else None
    expected, num_users = user_reference(model, x, y, USERS, 0.2, mask)
    found = run(model, x, y, USERS, 0.2, mask=mask)
    assert found.strategy == "ghost"
    assert float(found.clipped.count) == num_users
    assert float(found.clipped.clip_fraction) > 0  # the bound is met somewhere
    for n, value in expected.items():
        torch.testing.assert_close(found.clipped.sum[n], value, rtol=1e-9, atol=1e-12)


def test_no_per_example_gradient_of_a_layer_with_a_rule_is_formed(monkeypatch):
    """The rules' per_example is never called for the linear and embedding layers: their users'
    norms come from regrouped records."""
    model, inputs, width = models()["tokens"]
    formed = []
    original = torch_quantities.rule_for

    def spying(module):
        rule = original(module)

        class Spy:
            def __getattr__(self, attr):
                if attr == "per_example":

                    def per_example(layer, calls):
                        formed.append(type(layer).__name__)
                        return rule.per_example(layer, calls)

                    return per_example
                return getattr(rule, attr)

        return Spy()

    monkeypatch.setattr(torch_quantities, "rule_for", spying)
    x, y = inputs(len(USERS)), torch.randn(len(USERS), width)
    run(model, x, y, USERS, 1.0)
    assert "Linear" not in formed and "Embedding" not in formed
    assert "LayerNorm" in formed  # a norm layer's gradients are formed (small), then summed


def test_long_sequences_take_the_gram_route_over_the_users_positions():
    """A layer whose per-user records favour Gram matrices (few positions, wide layer) and one
    that favours forming: both against the reference, in float32 with the certified bound."""
    torch.manual_seed(1)
    for width, positions in ((48, 3), (4, 40)):
        model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Flatten(), nn.LazyLinear(2))
        x = torch.randn(len(USERS), positions, width)
        model(x)  # materialise the lazy layer
        y = torch.randn(len(USERS), 2)
        expected, _ = user_reference(model, x, y, USERS, 0.5)
        found = run(model, x, y, USERS, 0.5)
        for n, value in expected.items():
            torch.testing.assert_close(found.clipped.sum[n].double(), value, rtol=2e-4, atol=1e-6)


def test_cancelling_examples_of_one_user_stay_within_the_bound():
    """Two examples of one user whose gradients nearly cancel: in float32 the user's norm is
    tiny next to its examples', so a rounding error could leave it unclipped; the certified
    bound (or float64) must keep the user's contribution within max_norm."""
    torch.manual_seed(2)
    layer = nn.Linear(16, 16, bias=False)
    a = torch.randn(1, 8, 16) * 30
    x = torch.cat([a, a * (1 + 1e-6)])  # the second example's gradient is minus the first's
    # y chosen so that the output gradients of the two examples are opposite: the user's
    # gradient is the difference of two nearly equal large gradients
    with torch.no_grad():
        out = layer(x)
    y = torch.cat([out[:1] + 1.0, out[1:] - 1.0])
    model = nn.Sequential(layer, nn.Flatten())
    ids = np.array([3, 3])
    found = run(model, x, y.flatten(1), ids, 1e-3)
    contribution = float(found.clipped.sum["0.weight"].double().norm())
    assert contribution <= 1e-3 * (1 + 1e-6)  # what is released: within the bound
    loss = pergrad.module_loss(model, squared_error)
    each = pergrad.norms.per_example_norms_of(loss, loss.params(), x, y.flatten(1))
    assert float(each.min()) > 1e4 * float(found.clipped.norms[0])  # they do cancel


def test_a_user_with_a_nonfinite_example_contributes_nothing_and_padding_is_left_out():
    model, inputs, width = models()["conv"]
    x, y = inputs(len(USERS)), torch.randn(len(USERS), width)
    x[2, 0, 0, 0] = float("nan")  # user 4 (rows 0, 2, 5, 8)
    x[6, 0, 0, 0] = float("inf")  # user 9 (row 6): masked out, so it is padding
    mask = np.ones(len(USERS), bool)
    mask[6] = False
    found = run(model, x, y, USERS, 0.5, mask=mask)
    keep = (USERS != 4) & mask
    expected, _ = user_reference(model, x, y, USERS, 0.5, mask=keep)
    for n, value in expected.items():
        torch.testing.assert_close(found.clipped.sum[n].double(), value, rtol=2e-4, atol=1e-6)
    assert int(found.clipped.nonfinite) == 1  # user 4; the padded row is no user's


@settings(max_examples=6, deadline=None)
@given(
    ids=st.lists(st.integers(0, 4), min_size=0, max_size=9),
    max_norm=st.floats(0.05, 3.0),
    seed=st.integers(0, 2**16),
)
def test_ghost_matches_the_formed_users_sum_and_each_user_is_bounded(ids, max_norm, seed):
    torch.manual_seed(seed)
    ids = np.array(ids, np.int64)
    model = Tokens().double()
    x, y = torch.randint(0, 13, (len(ids), 4)), torch.randn(len(ids), 13, dtype=torch.float64)
    ghost = run(model, x, y, ids, max_norm).clipped
    formed = run(model, x, y, ids, max_norm, strategy="materialize").clipped
    assert float(ghost.count) == len(np.unique(ids))
    for n, value in formed.sum.items():
        torch.testing.assert_close(ghost.sum[n], value, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ghost.norms, formed.norms, rtol=1e-9, atol=1e-12)
    for user in np.unique(ids):  # each user alone is within the bound
        alone = run(model, x[ids == user], y[ids == user], ids[ids == user], max_norm).clipped
        total = float(sum((v**2).sum() for v in alone.sum.values()).sqrt())
        assert total <= max_norm * (1 + 1e-9)


def test_dp_optimizer_takes_the_ghost_path_without_a_fallback_warning():
    torch.manual_seed(3)
    model = Tokens()
    x, y = torch.randint(0, 13, (len(USERS), 5)), torch.randn(len(USERS), 13)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected, num_users = user_reference(model, x, y, USERS, 0.5)
    opt = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        squared_error,
        max_norm=0.5,
        noise_multiplier=0.0,
        expected_batch_size=4.0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        stats = opt.step(x, y, user_ids=torch.from_numpy(USERS))
    assert stats.batch_size == num_users
    assert stats.strategy == "ghost"
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            (before[n] - p.detach()).double(), expected[n] / 4.0, rtol=2e-4, atol=1e-6
        )


def test_auto_falls_back_to_formed_users_sums_and_says_so(monkeypatch):
    """A call "auto" does not give the ghost strategy (an LSTM, a layer without a rule, whose
    per-example gradients are over the budget, here set to 0): "auto" forms the per-example
    gradients, summed per user, and DPOptimizer says so once."""
    from pergrad._src.capture import cost

    monkeypatch.setattr(cost, "MAX_FORMED_NUMBERS", 0)
    torch.manual_seed(4)

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(3, 4, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    model = Recurrent()
    x, y = torch.randn(len(USERS), 5, 3), torch.randn(len(USERS), 2)
    found = run(model, x, y, USERS, 0.5, strategy="auto")
    assert found.strategy == "materialize"
    assert "ghost" in found.choice.reason
    expected, _ = user_reference(model, x, y, USERS, 0.5)
    for n, value in expected.items():
        torch.testing.assert_close(found.clipped.sum[n].double(), value, rtol=2e-4, atol=1e-6)
    opt = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        squared_error,
        max_norm=0.5,
        noise_multiplier=0.0,
        expected_batch_size=4.0,
    )
    with pytest.warns(pergrad.FallbackWarning, match="user-level"):
        opt.step(x, y, user_ids=torch.from_numpy(USERS))


@pytest.mark.parametrize("strategy", ["chunked", "ghost-lowmem"])
def test_strategies_that_clip_examples_are_refused_by_name(strategy):
    model, inputs, width = models()["tokens"]
    x, y = inputs(len(USERS)), torch.randn(len(USERS), width)
    with pytest.raises(PergradValueError, match=f"strategy='{strategy}' cannot clip by user"):
        run(model, x, y, USERS, 1.0, strategy=strategy)


def test_empty_batch_and_nothing_mutated():
    model, inputs, width = models()["tokens"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    empty = run(model, inputs(0), torch.randn(0, width), np.zeros(0, np.int64), 1.0).clipped
    assert float(empty.count) == 0
    assert all(float(v.abs().sum()) == 0 for v in empty.sum.values())
    run(model, inputs(len(USERS)), torch.randn(len(USERS), width), USERS, 1.0)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]) and p.grad is None
    assert not model._forward_hooks and not model.embed._forward_hooks


def test_an_infinite_max_norm_is_refused_not_a_nan_sum():
    """max_norm=inf made every clip factor inf / inf (nan sums); it would make the noise
    infinite too. Refused by name, on every clipping entry point."""
    import math

    model, inputs, width = models()["tokens"]
    x, y = inputs(len(USERS)), torch.randn(len(USERS), width)
    loss = pergrad.module_loss(model, squared_error)
    with pytest.raises(PergradValueError, match="max_norm must be a positive number, finite"):
        dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=math.inf)
    grads = pergrad.per_example_grads(loss)(loss.params(), x, y)
    with pytest.raises(PergradValueError, match="max_norm must be a positive number, finite"):
        dp.clipped_sum(grads, math.inf)
    with pytest.raises(PergradValueError, match="max_norm must be a positive number, finite"):
        run(model, x, y, USERS, math.inf)


def test_adaptive_clipping_counts_users_within_the_bound(monkeypatch):
    """Adaptive clipping at user level: the bound moves by the count of USERS within it (the
    count's noise set to 0 here), by the closed-form geometric update."""
    import math

    from pergrad._src.dp.clipping_policies import AdaptiveClipping

    monkeypatch.setattr(AdaptiveClipping, "noisy_counts", lambda self, counts, rng: counts)
    torch.manual_seed(6)
    model = Tokens()
    x, y = torch.randint(0, 13, (len(USERS), 5)), torch.randn(len(USERS), 13)
    params = list(model.parameters())
    norms = []
    for user in np.unique(USERS):
        rows = torch.from_numpy(np.equal(USERS, user))
        grads = torch.autograd.grad(((model(x[rows]) - y[rows]) ** 2).sum(), params)
        norms.append(float(sum((g.double() ** 2).sum() for g in grads).sqrt()))
    ordered = sorted(norms)
    bound = (ordered[2] + ordered[3]) / 2  # 3 users within it, 2 not, none near it
    policy = dp.adaptive(count_noise_std=2.0, target_quantile=0.7, learning_rate=0.3)
    opt = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        squared_error,
        max_norm=bound,
        noise_multiplier=0.0,
        expected_batch_size=4.0,
        clipping=policy,
    )
    stats = opt.step(x, y, user_ids=torch.from_numpy(USERS))
    within, count = sum(n <= bound for n in norms), len(norms)
    expected = bound * math.exp(-0.3 * ((within - count / 2) / 4.0 + 0.5 - 0.7))
    assert stats.batch_size == count and 0 < within < count
    assert opt.max_norm == pytest.approx(expected, rel=1e-6)

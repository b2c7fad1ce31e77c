"""Norms and clipped sums without materialising per-example gradients (``pergrad._src.capture.rules``).

Every result is checked against the materialised reference:
``pergrad.norms.per_example_norms(pergrad.per_example_grads(fn)(*args))`` and
``pergrad.dp.clipped_sum(pergrad.per_example_grads(fn)(*args), max_norm)``, which
``tests/test_torch_zoo.py`` / ``tests/test_jax_zoo.py`` check against a Python loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pergrad
from pergrad._src.api.reductions import choose_strategy, per_example_norms_of
from pergrad._src.dp.from_loss import clipped_sum_of

RTOL = 1e-5  # relative to the largest entry of the reference


def assert_close(actual: Any, expected: Any, rtol: float = RTOL) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


def assert_clipped_sums_close(
    actual: Any, expected: Any, to_numpy: Callable, mask: Any = None
) -> None:
    norms = to_numpy(expected.norms)
    assert_close(to_numpy(actual.norms), norms)
    # Not expected.clip_fraction: clipped_sum counts "bound / norm < 1", which float32 rounding
    # makes true for some norms below the bound.
    real = np.ones_like(norms) if mask is None else to_numpy(mask).astype(np.float64)
    clip_fraction = ((norms > expected.sensitivity) * real).sum() / max(real.sum(), 1)
    assert float(actual.clip_fraction) == pytest.approx(clip_fraction)
    assert float(actual.count) == float(expected.count)
    assert actual.sensitivity == expected.sensitivity
    for name in expected.sum:
        assert_close(to_numpy(actual.sum[name]), to_numpy(expected.sum[name]))


class NoFallback:
    """Turn a ``FallbackWarning`` into an error: the strategy must run as chosen."""

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", pergrad.FallbackWarning)

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


# --- PyTorch ------------------------------------------------------------------------------------

torch = pytest.importorskip("torch", reason="most of these tests exercise the PyTorch backend")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def t_numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy()


def sum_of_squares(out, target):
    return ((out - target) ** 2).sum()


class TwiceShared(nn.Module):
    """One Linear applied twice: its per-example gradient is the sum over both calls."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


class ConvTwice(nn.Module):
    """One Conv2d applied twice (padding keeps the shape): the sum over both calls, in both the
    Gram (few output positions) and the formed branch of the conv rule."""

    def __init__(self, channels: int = 3, kernel: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel, padding=kernel // 2)
        self.head = nn.Linear(channels * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(torch.tanh(self.conv(x)))).flatten(1))


class TwoViews(nn.Module):
    """An nn.Bilinear of the two halves of the last axis (any leading axes: positions)."""

    def __init__(self, in1: int, in2: int, out: int, features: int):
        super().__init__()
        self.in1 = in1
        self.bilinear = nn.Bilinear(in1, in2, out)
        self.head = nn.Linear(features, 3)

    def forward(self, x):
        return self.head(
            torch.tanh(self.bilinear(x[..., : self.in1], x[..., self.in1 :])).flatten(1)
        )


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1, stride=2)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x), inplace=True), 2)  # in place on conv1's output
        return self.fc(F.relu(self.conv2(x)).flatten(1))


class Tokens(nn.Module):
    """Embedding -> LayerNorm / RMSNorm over (B, T, d) -> Linear on the tokens -> mean."""

    def __init__(self, norm: nn.Module, padding_idx: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(7, 6, padding_idx=padding_idx)
        self.norm = norm
        self.proj = nn.Linear(6, 3)

    def forward(self, tokens):
        return self.proj(self.norm(self.embed(tokens))).mean(1)


def warmed_batchnorm() -> nn.Module:
    body = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    body.train()
    with torch.no_grad():  # running statistics far from (0, 1), so the buffers matter
        for _ in range(3):
            body(torch.randn(16, 2, 6, 6) * 3 + 2)
    return nn.Sequential(body.eval(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def floats(*shape):
    return lambda batch_size: torch.randn(batch_size, *shape)


def tokens(length, vocab):
    return lambda batch_size: torch.randint(0, vocab, (batch_size, length))


@dataclass
class Case:
    model: Callable[[], nn.Module]
    inputs: Callable[[int], Any]
    loss: str = "ce"  # "ce": cross-entropy on the output's 3 classes; "sse": sum of squares
    rule: str = "linear"  # a ghost rule the model must use
    float64: bool = False  # float32 cancellation would put 1e-5 out of reach (see the case)


def head(*body: nn.Module, features: int) -> nn.Module:
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(features, 3))


GHOST_ZOO = {
    "linear_2d": Case(lambda: nn.Sequential(nn.Linear(6, 3)), floats(6)),
    # T^2 = 9 <= 4 x 5: Gram matrices. Sums of products of both signs over the tokens cancel:
    # float64 keeps the comparison at 1e-5.
    "linear_sequence_gram": Case(
        lambda: head(nn.Linear(4, 5), features=15), floats(3, 4), float64=True
    ),
    # T^2 = 36 > 3 x 2: the per-example gradient of this layer is formed instead.
    "linear_sequence_outer": Case(lambda: head(nn.Linear(3, 2), features=12), floats(6, 3)),
    "conv1d_stride_pad_dilation": Case(
        lambda: head(nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2), features=16),
        floats(3, 9),
        rule="conv",
    ),
    "conv1d_groups_same_circular": Case(
        lambda: head(
            nn.Conv1d(4, 6, 4, padding="same", groups=2, padding_mode="circular"), features=42
        ),
        floats(4, 7),
        rule="conv",
    ),
    "conv2d_stride_pad_dilation": Case(
        lambda: head(nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2), features=36),
        floats(3, 7, 7),
        rule="conv",
    ),
    "conv2d_groups_reflect": Case(
        lambda: head(
            nn.Conv2d(4, 6, (3, 2), groups=2, padding=(1, 1), padding_mode="reflect"),
            features=6 * 5 * 6,
        ),
        floats(4, 5, 5),
        "sse",
        rule="conv",
    ),
    "conv2d_depthwise_no_bias": Case(
        lambda: head(nn.Conv2d(4, 4, 3, groups=4, bias=False), features=64),
        floats(4, 6, 6),
        rule="conv",
    ),
    "conv3d_stride_groups": Case(
        lambda: head(nn.Conv3d(2, 4, 2, stride=(1, 2, 1), groups=2), features=4 * 3 * 2 * 3),
        floats(2, 4, 4, 4),
        rule="conv",
    ),
    "conv_transpose1d_stride_output_padding": Case(
        lambda: head(
            nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), features=4 * 10
        ),
        floats(3, 5),
        rule="conv",
    ),
    "conv_transpose2d_groups_dilation_no_bias": Case(
        lambda: head(
            nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, dilation=2, bias=False),
            features=6 * 11 * 11,
        ),
        floats(4, 4, 4),
        "sse",
        rule="conv",
    ),
    "conv_transpose3d": Case(
        lambda: head(nn.ConvTranspose3d(2, 3, 2), features=3 * 4 * 4 * 4),
        floats(2, 3, 3, 3),
        rule="conv",
    ),
    "embedding_padding_idx": Case(
        lambda: Tokens(nn.LayerNorm(6), padding_idx=0), tokens(8, 7), rule="embedding"
    ),
    "layer_norm_sequence": Case(lambda: Tokens(nn.LayerNorm(6)), tokens(5, 7), rule="layer_norm"),
    "layer_norm_2d": Case(
        lambda: nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 3)),
        floats(5),
        rule="layer_norm",
    ),
    "rms_norm": Case(lambda: Tokens(nn.RMSNorm(6)), tokens(5, 7), rule="rms_norm"),
    "group_norm": Case(
        lambda: head(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), features=36),
        floats(2, 5, 5),
        rule="group_norm",
    ),
    "instance_norm_affine": Case(
        # no conv bias: instance norm removes it, its gradient is rounding noise
        lambda: head(
            nn.Conv2d(2, 4, 3, bias=False), nn.InstanceNorm2d(4, affine=True), features=36
        ),
        floats(2, 5, 5),
        rule="instance_norm",
    ),
    "batch_norm_eval": Case(warmed_batchnorm, floats(2, 6, 6), "sse", rule="batch_norm_eval"),
    "bilinear": Case(lambda: TwoViews(3, 4, 5, features=5), floats(7), rule="bilinear"),
    # 2 T (6 + 5 + 5) <= 6 x 5 x 5 up to T = 4: Gram matrices (float64: they cancel, as above)
    "bilinear_sequence_gram": Case(
        lambda: TwoViews(5, 5, 6, features=18), floats(3, 10), rule="bilinear", float64=True
    ),
    # T = 6 > 4: the per-example gradient of the weight is formed
    "bilinear_sequence_formed": Case(
        lambda: TwoViews(5, 5, 6, features=36), floats(6, 10), rule="bilinear"
    ),
    "mlp": Case(
        lambda: nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        ),
        floats(8),
    ),
    "small_cnn": Case(SmallCNN, floats(1, 8, 8), rule="conv"),
    "layer_called_twice": Case(TwiceShared, floats(4)),
    # T = 2 x 16 positions; T^2 = 1024 > p q = 27 x 3: formed per example
    "conv_called_twice_formed": Case(ConvTwice, floats(3, 4, 4), rule="conv"),
    # T^2 = 1024 < p q = 24 x 5 x 5 x 24: Gram matrices (float64: they cancel, as above)
    "conv_called_twice_gram": Case(
        lambda: ConvTwice(24, 5), floats(24, 4, 4), rule="conv", float64=True
    ),
}

BATCH = 6


def make(case: Case) -> tuple[Any, tuple[Any, ...]]:
    """A module_loss and its arguments (params, X, Y) for ``case``, seeded."""
    torch.manual_seed(0)
    if case.float64:
        torch.set_default_dtype(torch.float64)
    try:
        model = case.model()
        x = case.inputs(BATCH)
        with torch.no_grad():
            out = model(x)
        if case.loss == "ce":
            loss = pergrad.module_loss(model, F.cross_entropy)
            y = torch.randint(0, out.shape[-1], (BATCH,))
        else:
            loss = pergrad.module_loss(model, sum_of_squares)
            y = torch.randn_like(out)
    finally:
        torch.set_default_dtype(torch.float32)
    return loss, (loss.params(), x, y)


def materialized(loss: Any, args: tuple[Any, ...], **kwargs: Any) -> Any:
    return pergrad.per_example_grads(loss, **kwargs)(*args)


def median_norm(grads: Any) -> float:
    """Half-way between the two middle norms: no example sits at the bound, where float
    rounding decides whether it counts as clipped."""
    ordered = pergrad.norms.per_example_norms(grads).sort().values
    middle = len(ordered) // 2
    return float(ordered[middle - 1] + ordered[middle]) / 2


@pytest.mark.parametrize("name", list(GHOST_ZOO))
def test_ghost_zoo_matches_materialized(name):
    case = GHOST_ZOO[name]
    loss, args = make(case)
    grads = materialized(loss, args)
    choice = choose_strategy(loss, *args)
    assert choice.strategy == "ghost", choice
    assert case.rule in choice.layers.values()
    bound = median_norm(grads)  # about half the examples are clipped
    with NoFallback():
        norms = per_example_norms_of(loss, *args)
        per_layer = per_example_norms_of(loss, *args, per_layer=True)
        clipped = clipped_sum_of(loss, *args, max_norm=bound)
    assert_close(t_numpy(norms), t_numpy(pergrad.norms.per_example_norms(grads)))
    expected_per_layer = pergrad.norms.per_example_norms(grads, per_layer=True)
    assert set(per_layer) == set(expected_per_layer)
    for key, value in expected_per_layer.items():
        assert_close(t_numpy(per_layer[key]), t_numpy(value))
    squares = sum(v**2 for v in per_layer.values())
    assert_close(t_numpy(squares), t_numpy(norms**2))
    expected = pergrad.dp.clipped_sum(grads, bound)
    assert 0 < float(clipped.clip_fraction) < 1
    assert_clipped_sums_close(clipped, expected, t_numpy)


@pytest.mark.parametrize("name", list(GHOST_ZOO))
def test_hooks_per_example_grads_of_the_ghost_zoo_match_vmap(name):
    """Each family's ``per_example`` function (the "hooks" strategy of per_example_grads)
    against torch.func's vmap of the loss of one example."""
    loss, args = make(GHOST_ZOO[name])
    with NoFallback():
        hooked = pergrad.per_example_grads(loss, strategy="hooks")(*args)
    expected = materialized(loss, args, strategy="vmap")
    assert set(hooked) == set(expected)
    for key, value in expected.items():
        assert_close(t_numpy(hooked[key]), t_numpy(value))


@pytest.mark.parametrize("strategy", ["chunked", "materialize"])
def test_other_strategies_match_on_torch_models(strategy):
    loss, args = make(GHOST_ZOO["small_cnn"])
    grads = materialized(loss, args)
    choice = choose_strategy(loss, *args, strategy=strategy, chunk_size=4)
    assert (choice.strategy, choice.chunk_size) == (strategy, 4)
    with NoFallback():
        norms = per_example_norms_of(loss, *args, strategy=strategy, chunk_size=4)
        clipped = clipped_sum_of(loss, *args, max_norm=1.0, strategy=strategy, chunk_size=4)
    assert_close(t_numpy(norms), t_numpy(pergrad.norms.per_example_norms(grads)))
    assert_clipped_sums_close(clipped, pergrad.dp.clipped_sum(grads, 1.0), t_numpy)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` with ``add_zero_attn`` (which its ghost rule does not cover, so
    it runs alone as a generic unit) between two Linear layers, with a padding mask (a keyword
    argument batched by example) and a causal mask (shared, (T, T))."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True, add_zero_attn=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, x, padding):
        h = self.embed(x)
        causal = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).triu(diagonal=1)
        out = self.attn(h, h, h, key_padding_mask=padding, attn_mask=causal, need_weights=False)
        return self.fc(out[0].mean(1))


def attention_problem(batch: int = 5) -> tuple[Any, tuple[Any, ...]]:
    torch.manual_seed(0)
    loss = pergrad.module_loss(Attention(), F.cross_entropy, num_inputs=2)
    padding = torch.zeros(batch, 4, dtype=torch.bool)
    padding[1, 3:] = padding[2, 2:] = True  # examples 1 and 2 padded
    return loss, (loss.params(), torch.randn(batch, 4, 5), padding, torch.randint(0, 3, (batch,)))


def test_a_shared_input_the_size_of_the_batch_falls_back_under_auto():
    """With B = T = 4 the (T, T) causal mask looks batched: running the layer alone then fails,
    and auto says so and takes the chunked strategy (the same numbers)."""
    loss, args = attention_problem(batch=4)
    grads = materialized(loss, args)
    with pytest.warns(pergrad.FallbackWarning, match="'attn'.*could not vectorise it alone"):
        norms = per_example_norms_of(loss, *args)
    assert_close(t_numpy(norms), t_numpy(pergrad.norms.per_example_norms(grads)))


def test_a_layer_without_a_rule_runs_alone_and_the_rest_stays_ghost():
    loss, args = attention_problem()
    choice = choose_strategy(loss, *args)
    assert choice.strategy == "ghost", choice
    assert choice.layers == {"embed": "linear", "attn": "generic", "fc": "linear"}
    grads = materialized(loss, args)
    expected_norms = pergrad.norms.per_example_norms(grads, per_layer=True)
    bound = median_norm(grads)
    for _ in range(2):  # the first (checked) run and a later one
        with NoFallback():
            per_layer = per_example_norms_of(loss, *args, per_layer=True)
            clipped = clipped_sum_of(loss, *args, max_norm=bound)
        for name, value in expected_norms.items():
            assert_close(t_numpy(per_layer[name]), t_numpy(value))
        assert_clipped_sums_close(clipped, pergrad.dp.clipped_sum(grads, bound), t_numpy)


def test_auto_takes_chunked_when_layers_without_rules_are_large(monkeypatch):
    from pergrad._src.capture import cost

    loss, args = attention_problem()
    monkeypatch.setattr(cost, "MAX_FORMED_NUMBERS", 10)
    choice = choose_strategy(loss, *args)
    assert choice.strategy == "chunked"
    assert "the layers without a ghost rule would need 840 per-example numbers" in choice.reason
    with NoFallback():  # an explicit request still runs them alone
        norms = per_example_norms_of(loss, *args, strategy="ghost")
    expected = pergrad.norms.per_example_norms(materialized(loss, args))
    assert_close(t_numpy(norms), t_numpy(expected))


def test_a_parameter_of_the_model_itself_goes_generic_and_the_rest_stays_ghost():
    """Issue 19: the root's own parameter runs through the generic path (the root run alone,
    only its bare parameters differentiated); its Linear keeps the ghost rule."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)
            self.scale = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.fc(x) * self.scale

    torch.manual_seed(0)
    loss = pergrad.module_loss(Scaled(), F.cross_entropy)
    args = (loss.params(), torch.randn(5, 6), torch.randint(0, 3, (5,)))
    choice = choose_strategy(loss, *args)
    assert choice.strategy == "ghost" and not choice.unsupported
    assert choice.layers == {"fc": "linear", "": "generic"}
    grads = materialized(loss, args)
    with NoFallback():
        norms = per_example_norms_of(loss, *args)
        forced = per_example_norms_of(loss, *args, strategy="ghost")
    expected = t_numpy(pergrad.norms.per_example_norms(grads))
    assert_close(t_numpy(norms), expected)
    assert_close(t_numpy(forced), expected)


def test_chunked_falls_back_to_a_loop_where_vmap_fails():
    """torch.func cannot vmap nn.GRU (torch 2.13): one example at a time, same numbers."""

    class LastStep(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0][:, -1]

    torch.manual_seed(0)
    loss = pergrad.module_loss(LastStep(), sum_of_squares)
    args = (loss.params(), torch.randn(4, 5, 3), torch.randn(4, 4))
    with pytest.warns(pergrad.FallbackWarning):
        grads = materialized(loss, args)
    with pytest.warns(pergrad.FallbackWarning, match="one example at a time"):
        norms = per_example_norms_of(loss, *args)
    with pytest.warns(pergrad.FallbackWarning):
        clipped = clipped_sum_of(loss, *args, max_norm=1.0)
    assert_close(t_numpy(norms), t_numpy(pergrad.norms.per_example_norms(grads)))
    assert_clipped_sums_close(clipped, pergrad.dp.clipped_sum(grads, 1.0), t_numpy)


def test_a_tied_embedding_and_projection_are_ghosted():
    """Issue 19: the tie's cross term comes from the two layers' records (tests/test_tied_ghost.py
    has the rest: padding, repeated ids, cancellation, a tie without a cross rule)."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 5, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, tokens):
            return self.out(self.embed(tokens).mean(1))

    torch.manual_seed(0)
    loss = pergrad.module_loss(Tied(), F.cross_entropy)
    args = (loss.params(), torch.randint(0, 5, (4, 3)), torch.randint(0, 5, (4,)))
    choice = choose_strategy(loss, *args)
    assert choice.strategy == "ghost" and "tied" in choice.reason
    assert choice.layers == {"embed": "embedding", "out": "linear"}
    expected = pergrad.norms.per_example_norms(materialized(loss, args))
    assert_close(t_numpy(per_example_norms_of(loss, *args)), t_numpy(expected))


class OutsideUse(nn.Module):
    """``fc.weight`` is used by the parent, not through ``fc``: the hooks never see it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return F.linear(x, self.fc.weight)


class BatchOnAxisTwo(nn.Module):
    """A Linear that sees (1, T, B, d): neither its axis 0 nor its axis 1 (time-first, which a
    linear rule takes) is the batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.transpose(0, 1).unsqueeze(0)).mean((0, 1))


@pytest.mark.parametrize(
    "model, match",
    [(OutsideUse, "used outside the forward pass"), (BatchOnAxisTwo, "batch of 4 on axis 0")],
)
def test_what_hooks_cannot_see_falls_back_under_auto_and_fails_under_ghost(model, match):
    torch.manual_seed(0)
    loss = pergrad.module_loss(model(), F.cross_entropy)
    args = (loss.params(), torch.randn(4, 5, 4) if model is BatchOnAxisTwo else torch.randn(4, 4))
    args = (*args, torch.randint(0, 3, (4,)))
    assert choose_strategy(loss, *args).strategy == "ghost"  # only visible while running
    with pytest.warns(pergrad.FallbackWarning, match=match):
        norms = per_example_norms_of(loss, *args)
    expected = pergrad.norms.per_example_norms(materialized(loss, args))
    assert_close(t_numpy(norms), t_numpy(expected))
    with pytest.raises(ValueError, match=match):
        clipped_sum_of(loss, *args, max_norm=1.0, strategy="ghost")


def test_frozen_parameters_and_a_shared_model_input():
    """A frozen layer is left out; a shared (in_axes=None) model input reaches every example."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = nn.Linear(5, 5)
            self.fc = nn.Linear(5, 3)
            self.frozen.requires_grad_(False)

        def forward(self, x, scale):
            return self.fc(self.frozen(x) * scale)

    torch.manual_seed(0)
    loss = pergrad.module_loss(Scaled(), F.cross_entropy, num_inputs=2)
    args = (loss.params(), torch.randn(6, 5), torch.randn(5), torch.randint(0, 3, (6,)))
    in_axes = (None, 0, None, 0)
    assert set(args[0]) == {"fc.weight", "fc.bias"}
    grads = materialized(loss, args, in_axes=in_axes)
    with NoFallback():
        norms = per_example_norms_of(loss, *args, in_axes=in_axes, strategy="ghost")
        clipped = clipped_sum_of(loss, *args, in_axes=in_axes, max_norm=0.5, strategy="ghost")
    assert_close(t_numpy(norms), t_numpy(pergrad.norms.per_example_norms(grads)))
    assert_clipped_sums_close(clipped, pergrad.dp.clipped_sum(grads, 0.5), t_numpy)


@pytest.mark.parametrize("strategy", ["ghost", "chunked"])
def test_mask_leaves_padding_out(strategy):
    loss, args = make(GHOST_ZOO["mlp"])
    mask = torch.tensor([True, False, True, True, False, True])
    grads = materialized(loss, args)
    clipped = clipped_sum_of(loss, *args, max_norm=0.5, mask=mask, strategy=strategy)
    expected = pergrad.dp.clipped_sum(grads, 0.5, mask=mask)
    assert float(clipped.count) == 4
    assert_clipped_sums_close(clipped, expected, t_numpy, mask)


def per_group_bounds(params: dict, grads: Any) -> dict:
    """A bound per parameter, each near the median of that parameter's per-example norms, so
    every group clips some examples and not others; a layer's weight and bias differ."""
    norms = pergrad.norms.per_example_norms(grads, per_layer=True)
    return {name: float(norms[name].median()) * (0.9 if "bias" in name else 1.1) for name in params}


@pytest.mark.parametrize("strategy", ["auto", "ghost", "chunked"])
def test_per_group_bounds_without_materializing(strategy):
    loss, args = make(GHOST_ZOO["small_cnn"])
    grads = materialized(loss, args)
    bounds = per_group_bounds(args[0], grads)
    mask = torch.tensor([True, True, False, True, True, True])
    with NoFallback():
        clipped = clipped_sum_of(loss, *args, max_norm=bounds, mask=mask, strategy=strategy)
    expected = pergrad.dp.clipped_sum(grads, bounds, mask=mask)
    assert choose_strategy(loss, *args, strategy=strategy).strategy != "materialize"
    assert len(clipped.norms) == len(bounds)  # one (B,) norm per group
    for actual_norms, expected_norms in zip(clipped.norms, expected.norms):
        assert_close(t_numpy(actual_norms), t_numpy(expected_norms))
    assert clipped.sensitivity == pytest.approx(expected.sensitivity)
    assert float(clipped.count) == 5
    assert 0 < float(clipped.clip_fraction) <= 1
    for name in expected.sum:
        assert_close(t_numpy(clipped.sum[name]), t_numpy(expected.sum[name]))


def test_per_group_bounds_as_a_prefix_of_the_parameters():
    """Two groups of two parameters each (one per layer), given as a list prefix; a plain
    function of the parameters, so the chunked strategy, one weighted backward per group."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def grouped(p, x, y):  # parameters as a list of two dicts: a pytree prefix of two bounds
        return loss({**p[0], **p[1]}, x, y)

    params = loss.params()
    split = [
        {k: v for k, v in params.items() if k.startswith("0.")},
        {k: v for k, v in params.items() if k.startswith("2.")},
    ]
    grads = pergrad.per_example_grads(grouped)(split, x, y)
    expected = pergrad.dp.clipped_sum(grads, [0.2, 0.4])
    clipped = clipped_sum_of(grouped, split, x, y, max_norm=[0.2, 0.4])
    assert choose_strategy(grouped, split, x, y).strategy == "chunked"
    for part, expected_part in zip(clipped.sum, expected.sum):
        for name in expected_part:
            assert_close(t_numpy(part[name]), t_numpy(expected_part[name]))
    assert clipped.sensitivity == pytest.approx((0.2**2 + 0.4**2) ** 0.5)


def test_plain_torch_function_goes_chunked():
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}

    def loss(p, x, y):
        return ((torch.tanh(x @ p["w"] + p["b"]) - y) ** 2).sum()

    args = (params, torch.randn(7, 4), torch.randn(7, 3))
    choice = choose_strategy(loss, *args)
    assert choice.strategy == "chunked" and "module_loss" in choice.reason
    grads = materialized(loss, args)
    assert_close(
        t_numpy(per_example_norms_of(loss, *args, chunk_size=3)),
        t_numpy(pergrad.norms.per_example_norms(grads)),
    )
    assert_clipped_sums_close(
        clipped_sum_of(loss, *args, max_norm=1.0, chunk_size=3),
        pergrad.dp.clipped_sum(grads, 1.0),
        t_numpy,
    )


def test_empty_batch():
    loss, (params, x, y) = make(GHOST_ZOO["mlp"])
    args = (params, x[:0], y[:0])
    assert choose_strategy(loss, *args).strategy == "materialize"
    assert per_example_norms_of(loss, *args).shape == (0,)
    clipped = clipped_sum_of(loss, *args, max_norm=1.0)
    assert float(clipped.count) == 0 and float(clipped.clip_fraction) == 0
    assert all(float(v.abs().sum()) == 0 for v in clipped.sum.values())


FORCED_REDUCE_STRATEGIES = ("ghost", "ghost-lowmem", "chunked", "materialize")


@pytest.mark.parametrize("strategy", FORCED_REDUCE_STRATEGIES)
@pytest.mark.parametrize("name", list(GHOST_ZOO))
def test_every_forced_strategy_takes_an_empty_batch(name, strategy):
    """An empty Poisson batch is ordinary DP input: every strategy, named, on every layer
    family, gives (0,) norms in the parameters' dtype and zero sums shaped like them (this
    raised a raw IndexError / torch.cat error under ghost, ghost-lowmem and chunked)."""
    loss, (params, x, y) = make(GHOST_ZOO[name])
    args = (params, x[:0], y[:0])
    norms = per_example_norms_of(loss, *args, strategy=strategy)
    dtype = next(iter(params.values())).dtype
    assert norms.shape == (0,) and norms.dtype == dtype
    per_layer = per_example_norms_of(loss, *args, per_layer=True, strategy=strategy)
    assert set(per_layer) == set(params)
    assert all(v.shape == (0,) for v in per_layer.values())
    clipped = clipped_sum_of(loss, *args, max_norm=1.0, strategy=strategy)
    assert float(clipped.count) == 0 and clipped.norms.shape == (0,)
    assert set(clipped.sum) == set(params)
    for key, value in clipped.sum.items():
        assert value.shape == params[key].shape and value.dtype == params[key].dtype, key
        assert float(value.abs().sum()) == 0, key


@pytest.mark.parametrize("strategy", FORCED_REDUCE_STRATEGIES)
def test_issue_reproduction_conv1d_empty_batch(strategy):
    model = nn.Conv1d(4, 5, 3)
    loss = pergrad.module_loss(model, lambda out: out.sum())
    x = torch.randn(0, 4, 10)
    assert per_example_norms_of(loss, loss.params(), x, strategy=strategy).shape == (0,)
    clipped = clipped_sum_of(loss, loss.params(), x, max_norm=1.0, strategy=strategy)
    assert (
        clipped.sum["weight"].shape == (5, 4, 3) and float(clipped.sum["weight"].abs().sum()) == 0
    )


@pytest.mark.parametrize("strategy", FORCED_REDUCE_STRATEGIES)
def test_forced_strategy_on_an_empty_batch_still_refuses_what_it_cannot_take(strategy):
    """The empty batch skips the work, not the assessment: a loss that is not a module_loss
    is still refused by name under the PyTorch ghost strategies."""
    model = nn.Linear(3, 2)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        return torch.func.functional_call(model, p, (x.unsqueeze(0),)).sum()

    args = (params, torch.randn(0, 3))
    if strategy.startswith("ghost"):
        with pytest.raises(ValueError, match=f"strategy='{strategy}' cannot handle this call"):
            per_example_norms_of(loss, *args, strategy=strategy)
    else:
        assert per_example_norms_of(loss, *args, strategy=strategy).shape == (0,)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4),  # B
    st.integers(1, 3),  # G
    st.integers(1, 7),  # T
    st.integers(1, 5),  # p
    st.integers(1, 5),  # q
    st.sampled_from([1, 200, 2**27]),  # bytes per block of Gram matrices: 1 x 1 blocks to whole
)
def test_outer_product_squared_norms_equal_the_formed_gradient(
    batch, groups, positions, p, q, block_bytes
):
    """Both branches (Gram matrices where they are cheaper, in blocks of T; the formed a^T d
    otherwise), float64."""
    from pergrad._src.capture import cost, torch_layers, torch_norms

    generator = torch.Generator().manual_seed(batch * 1000 + positions * 10 + p)
    a = torch.randn(batch, groups, positions, p, generator=generator, dtype=torch.float64)
    d = torch.randn(batch, groups, positions, q, generator=generator, dtype=torch.float64)
    formed = torch.einsum("bgtp,bgtq->bgpq", a, d)
    expected = (formed**2).sum((1, 2, 3))
    saved = torch_norms.GRAM_BLOCK_BYTES
    torch_norms.GRAM_BLOCK_BYTES = block_bytes
    try:
        result = torch_layers.outer_product_squared_norms(a, d)
    finally:
        torch_norms.GRAM_BLOCK_BYTES = saved
    result, _ = cost.split(result)  # the estimate of a certified pair
    assert_close(t_numpy(result), t_numpy(expected), rtol=1e-12)


def test_the_gram_route_is_taken_where_it_is_cheaper():
    """The measured cost model (benchmarks/gram_precision.py): GPT-2-like shapes."""
    from pergrad._src.capture.cost import gram_is_cheaper

    assert gram_is_cheaper(64, 256, 1024)  # measured 6.2 ms Gram vs 16.1 ms formed
    assert gram_is_cheaper(32, 768, 768)  # 1.8 vs 30.8
    assert not gram_is_cheaper(128, 256, 256)  # 8.2 vs 2.4
    assert not gram_is_cheaper(1024, 768, 768)
    # the certified float32 Gram route against the certified formed one (gram_precision.md)
    assert gram_is_cheaper(128, 256, 1024, fast=True)  # 4.47 vs 6.06 ms
    assert gram_is_cheaper(128, 256, 768, fast=True)  # 3.49 vs 5.46
    assert gram_is_cheaper(96, 256, 256, fast=True)  # 2.47 vs 2.61
    assert not gram_is_cheaper(128, 256, 1024)  # the same layer at float64's price
    assert not gram_is_cheaper(128, 256, 256, fast=True)  # 3.08 vs 1.81
    assert not gram_is_cheaper(65, 128, 128, fast=True)  # 0.63 vs 0.46


def test_the_fast_gram_price_leaves_room_for_cancellation():
    """A GPT-2 LM head (256 x 8192 at 128 tokens) may take the certified float32 Gram route,
    but its bound leaves little room for positions that cancel (its examples came out loose in
    a DP step), so its route is priced at float64's crossover: formed. Its q, k, v layers are
    priced as the fast route."""
    from pergrad._src.capture import cost

    unit = cost.FLOAT32_UNIT
    assert cost.fast_gram_suffices(128, (256, 8192), unit)
    assert not cost.fast_gram_priced(128, (256, 8192))
    assert not cost.gram_is_cheaper(128, 256, 8192, cost.fast_gram_priced(128, (256, 8192)))
    assert cost.fast_gram_priced(128, (256, 768))
    assert cost.gram_is_cheaper(128, 256, 768, cost.fast_gram_priced(128, (256, 768)))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(1, 5), st.sampled_from([None, 0]))
def test_embedding_rule_equals_the_scattered_gradient(batch, length, vocab, padding_idx):
    from pergrad._src.capture import cost
    from pergrad._src.capture.torch_layers import LayerCall, embedding_squared_norms

    generator = torch.Generator().manual_seed(batch * 100 + length * 10 + vocab)
    layer = nn.Embedding(vocab, 3, padding_idx=padding_idx)
    indices = torch.randint(0, vocab, (batch, length), generator=generator)
    grads = torch.randn(batch, length, 3, generator=generator, dtype=torch.float64)
    scattered = torch.zeros(batch, vocab, 3, dtype=torch.float64)
    for b in range(batch):
        for t in range(length):
            if indices[b, t] != padding_idx:
                scattered[b, indices[b, t]] += grads[b, t]
    got = embedding_squared_norms(layer, [LayerCall((indices,), grads)])["weight"]
    got, _ = cost.split(got)  # the estimate of a certified pair
    assert_close(t_numpy(got), t_numpy((scattered**2).sum((1, 2))), rtol=1e-12)


# --- the model is left as it was ------------------------------------------------------------------


def model_state(model: nn.Module) -> dict:
    return {
        "training": [m.training for m in model.modules()],
        "hooks": [
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            for m in model.modules()
        ],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def assert_same_state(model: nn.Module, before: dict) -> None:
    after = model_state(model)
    for key in ("training", "hooks", "requires_grad"):
        assert after[key] == before[key], key
    assert all(a is b for a, b in zip(after["grads"], before["grads"])), "grad replaced"
    for grad in after["grads"]:
        assert torch.equal(grad, torch.full_like(grad, 7.0))
    for a, b in zip(after["params"], before["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", ["ghost", "chunked"])
def test_model_untouched_after_success_and_failure(strategy):
    loss, args = make(GHOST_ZOO["small_cnn"])
    model = loss.model
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = model_state(model)
    per_example_norms_of(loss, *args, strategy=strategy)
    clipped_sum_of(loss, *args, max_norm=1.0, strategy=strategy)
    assert_same_state(model, before)

    def failing(output, target):
        raise RuntimeError("loss_fn failed on purpose")

    broken = pergrad.module_loss(model, failing)
    with pytest.raises(RuntimeError, match="on purpose"):
        clipped_sum_of(broken, *args, max_norm=1.0, strategy=strategy)
    with pytest.raises(ValueError):  # targets of the wrong batch size
        clipped_sum_of(loss, args[0], args[1], args[2][:3], max_norm=1.0, strategy=strategy)
    assert_same_state(model, before)


def test_a_loss_fn_that_vmap_cannot_batch_is_looped_over_the_rows():
    def data_dependent(out, y):  # .item() cannot run under vmap
        return F.cross_entropy(out, y) * (2.0 if y.item() == 0 else 1.0)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    loss = pergrad.module_loss(model, data_dependent)
    args = (loss.params(), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    with NoFallback():  # (the layer hooks: one plain pass, no vmap to fail)
        grads = materialized(loss, args)
    with NoFallback():
        clipped = clipped_sum_of(loss, *args, max_norm=0.5, strategy="ghost")
    assert_clipped_sums_close(clipped, pergrad.dp.clipped_sum(grads, 0.5), t_numpy)


def test_ghost_runs_the_model_once_on_the_whole_batch():
    """Once per call; the first call of a layout runs the batch once more before its plain pass
    and a few examples alone after it (its checks: the weighted run's backward pass summarises
    the rows that the plain pass then checks, so neither retains its graph)."""
    from pergrad._src.capture.torch_checks import LOSS_CHECKS

    loss, args = make(GHOST_ZOO["mlp"])
    seen = []
    handle = loss.model.register_forward_pre_hook(lambda m, inputs: seen.append(inputs[0].shape))
    try:
        clipped_sum_of(loss, *args, max_norm=1.0)
        first, seen[:] = list(seen), []
        clipped_sum_of(loss, *args, max_norm=1.0)
    finally:
        handle.remove()
    assert first == [(BATCH, 8), (BATCH, 8)] + [(1, 8)] * min(BATCH, LOSS_CHECKS)
    assert seen == [(BATCH, 8)]


def test_the_first_call_retains_no_graph_and_leaves_no_records_behind(monkeypatch):
    """The first call of a layout checks its rows on a second run of the batch, so no backward
    pass keeps its graph (which held every activation through the first step: the first
    step's peak memory was the step's largest); and nothing of either run outlives the call,
    even with the garbage collector off (a record and its output's tensor hook referring to
    each other would)."""
    import gc

    from pergrad._src.capture.torch_engine import LayerRecord

    retained = []

    def recording(original):
        def call(*args, **kwargs):
            retained.append(bool(kwargs.get("retain_graph")))
            return original(*args, **kwargs)

        return call

    for name in ("grad", "backward"):  # the first pass streams its gradients (backward)
        monkeypatch.setattr(torch.autograd, name, recording(getattr(torch.autograd, name)))
    loss, args = make(GHOST_ZOO["mlp"])
    gc.collect()
    before = {id(x) for x in gc.get_objects() if isinstance(x, LayerRecord)}  # other tests'
    gc.disable()
    try:
        clipped_sum_of(loss, *args, max_norm=1.0, strategy="ghost")
        alive = sum(isinstance(x, LayerRecord) and id(x) not in before for x in gc.get_objects())
    finally:
        gc.enable()
    assert len(retained) == 2 and not any(retained), retained  # the pass, the check's pass
    assert alive == 0


def test_the_first_calls_check_runs_before_any_sum_is_formed(monkeypatch):
    """The first call of a layout runs the batch twice (its row check); the second run must
    not happen while the clipped sums (a model's worth) are held, or the first step's peak
    memory is a model above every later step's (GPT-2 small: 1.28x a non-private step against
    1.01x). Every run of the batch comes before the sums are formed."""
    from pergrad._src.strategies import ghost_torch

    formed = []
    reduce = ghost_torch._reduce

    def observing(*args, **kwargs):
        result = reduce(*args, **kwargs)
        formed.append(True)
        return result

    monkeypatch.setattr(ghost_torch, "_reduce", observing)
    loss, args = make(GHOST_ZOO["mlp"])
    runs_after_sums = []
    handle = loss.model.register_forward_pre_hook(
        lambda m, inputs: runs_after_sums.append(bool(formed) and inputs[0].shape[0] == BATCH)
    )
    try:
        clipped_sum_of(loss, *args, max_norm=1.0, strategy="ghost")
    finally:
        handle.remove()
    assert formed and len(runs_after_sums) > 2  # the first call, its check included
    assert not any(runs_after_sums), runs_after_sums


def test_the_first_pass_never_holds_the_whole_batch_gradient(monkeypatch):
    """The first call checks its norms against the batch gradient; each parameter's gradient
    is reduced to its squared norm as the backward pass finishes it, and dropped, so the pass
    never holds a model's worth of gradients beside its records (the first step's peak
    memory). Each gradient handed to the reduction must be gone by the next one."""
    import weakref

    from pergrad._src.capture import torch_verify

    seen: list[weakref.ref] = []
    alive_at_each: list[int] = []
    squared_norm = torch_verify.squared_norm

    def observing(grad):
        alive_at_each.append(sum(ref() is not None for ref in seen))
        seen.append(weakref.ref(grad))
        return squared_norm(grad)

    monkeypatch.setattr(torch_verify, "squared_norm", observing)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    loss = pergrad.module_loss(model, lambda out, y: F.mse_loss(out, y))
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 8)
    clipped_sum_of(loss, loss.params(), x, y, max_norm=1.0, strategy="ghost")
    assert len(alive_at_each) == 8  # every weight and bias reached the check
    assert max(alive_at_each) == 0, alive_at_each


# --- bad input ----------------------------------------------------------------------------------


def bad_calls():
    loss, args = make(GHOST_ZOO["mlp"])

    def plain(p, x, y):
        return (x @ p["0.weight"].T).sum()

    gru = pergrad.module_loss(nn.GRU(3, 4, batch_first=True), lambda out, y: out[0].sum())
    gru_args = (gru.params(), torch.randn(2, 5, 3), torch.zeros(2))
    return [
        (lambda: per_example_norms_of(loss, *args, strategy="fast"), "strategy must be one of"),
        (lambda: per_example_norms_of(loss, *args, chunk_size=0), "chunk_size must be a positive"),
        (lambda: clipped_sum_of(loss, *args, max_norm=0.0), "max_norm must be a positive"),
        (lambda: clipped_sum_of(loss, *args, max_norm=-1), "max_norm must be a positive"),
        (lambda: clipped_sum_of(loss, *args, max_norm=True), "max_norm must be a positive"),
        (lambda: per_example_norms_of(plain, *args, strategy="ghost"), "pergrad.module_loss"),
        (lambda: per_example_norms_of(gru, *gru_args, strategy="ghost"), "no ghost rule for GRU"),
        (
            lambda: per_example_norms_of(loss, *args, argnums=(0,), strategy="ghost"),
            "differentiates the parameters only",
        ),
        (
            lambda: clipped_sum_of(loss, *args, max_norm=1.0, mask=torch.ones(3)),
            r"mask must be a \(6,\) array",
        ),
        (lambda: per_example_norms_of(loss, *args, per_layer="yes"), "per_layer must be"),
    ]


@pytest.mark.parametrize("index", range(10))
def test_bad_input(index):
    call, match = bad_calls()[index]
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# --- JAX ----------------------------------------------------------------------------------------


def jax_mlp():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(0)  # numpy's: jax.random compiles once per array shape

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(0.0, scale, shape), jnp.float32)

    params = {
        "hidden": {"w": normal(5, 8, scale=0.6), "b": jnp.full(8, 0.1)},
        "out": {"w": normal(8, 3, scale=0.6), "b": jnp.zeros(3)},
    }

    def loss(p, x, y):
        h = jnp.tanh(x @ p["hidden"]["w"] + p["hidden"]["b"])
        logits = h @ p["out"]["w"] + p["out"]["b"]
        return -jax.nn.log_softmax(logits)[y]

    x = normal(10, 5)
    y = jnp.asarray(rng.integers(0, 3, 10), jnp.int32)
    return loss, (params, x, y)


def jax_conv():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(1)  # numpy's: jax.random compiles once per array shape

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(0.0, scale, shape), jnp.float32)

    params = {
        "kernel": normal(4, 2, 3, 3, scale=0.4),  # OIHW
        "dense": normal(4 * 3 * 3, 3, scale=0.3),
    }

    def loss(p, image, y):  # image (2, 7, 7): one example
        out = jax.lax.conv_general_dilated(
            image[None], p["kernel"], window_strides=(2, 2), padding=((1, 1), (1, 1))
        )
        features = jax.nn.relu(out).reshape(-1)[: 4 * 3 * 3]
        return jnp.sum((features @ p["dense"] - y) ** 2)

    x = normal(9, 2, 7, 7)
    y = normal(9, 3)
    return loss, (params, x, y)


def j_numpy(x: Any) -> np.ndarray:
    return np.asarray(x)


@pytest.mark.parametrize("workload", [jax_mlp, jax_conv])
@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_jax_chunked_matches_materialized(workload, chunk_size):
    loss, args = workload()
    grads = pergrad.per_example_grads(loss)(*args)
    choice = choose_strategy(loss, *args, chunk_size=chunk_size, strategy="chunked")
    assert choice.strategy == "chunked"
    assert choice.chunk_size == (chunk_size or args[1].shape[0])  # small model: whole batch
    norms = per_example_norms_of(loss, *args, chunk_size=chunk_size, strategy="chunked")
    assert_close(norms, pergrad.norms.per_example_norms(grads))
    per_layer = per_example_norms_of(
        loss, *args, per_layer=True, chunk_size=chunk_size, strategy="chunked"
    )
    import jax

    expected_per_layer = pergrad.norms.per_example_norms(grads, per_layer=True)
    jax.tree_util.tree_map(assert_close, per_layer, expected_per_layer)
    squares = sum(leaf**2 for leaf in jax.tree_util.tree_leaves(per_layer))
    assert_close(squares, norms**2)
    # halfway between two norms (an odd batch's median is one example's norm: rounding would
    # decide whether it clips)
    ordered = np.sort(np.asarray(pergrad.norms.per_example_norms(grads)))
    bound = float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    clipped = clipped_sum_of(loss, *args, max_norm=bound, chunk_size=chunk_size, strategy="chunked")
    expected = pergrad.dp.clipped_sum(grads, bound)
    assert_clipped_sums_close(clipped._replace(sum={}), expected._replace(sum={}), j_numpy)
    jax.tree_util.tree_map(assert_close, clipped.sum, expected.sum)


def test_jax_under_jit_with_a_mask_and_tuple_argnums():
    jax = pytest.importorskip("jax")
    loss, (params, x, y) = jax_mlp()
    mask = np.arange(10) % 3 != 0

    @jax.jit
    def step(p, x, y, mask):
        return clipped_sum_of(loss, p, x, y, max_norm=0.5, chunk_size=3, mask=mask)

    clipped = step(params, x, y, mask)
    expected = pergrad.dp.clipped_sum(pergrad.per_example_grads(loss)(params, x, y), 0.5, mask)
    assert float(clipped.count) == float(expected.count) == 6
    jax.tree_util.tree_map(assert_close, clipped.sum, expected.sum)

    def split_loss(hidden, out, x, y):
        return loss({"hidden": hidden, "out": out}, x, y)

    split_args = (params["hidden"], params["out"], x, y)
    norms = per_example_norms_of(split_loss, *split_args, argnums=(0, 1), per_layer=True)
    expected_norms = pergrad.norms.per_example_norms(
        pergrad.per_example_grads(split_loss, argnums=(0, 1))(*split_args), per_layer=True
    )
    assert isinstance(norms, tuple)
    jax.tree_util.tree_map(assert_close, norms, expected_norms)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"noise_multiplier": -1.0}, "private_grad_of: noise_multiplier must be a number >= 0"),
        ({"expected_batch_size": 0}, "private_grad_of: expected_batch_size must be a positive"),
        ({"max_norm": -2.0}, "clipped_sum_of: max_norm must be a positive number"),
    ],
)
def test_private_grad_of_bad_input(kwargs, match):
    loss, args = make(GHOST_ZOO["mlp"])
    settings = {"max_norm": 1.0, "noise_multiplier": 1.0, "rng": torch.Generator(), **kwargs}
    with pytest.raises(ValueError, match=match):
        pergrad.dp.private_grad_of(loss, *args, **settings)


def test_private_grad_of_equals_private_mean_of_materialized_grads():
    loss, args = make(GHOST_ZOO["small_cnn"])
    grad, stats = pergrad.dp.private_grad_of(
        loss,
        *args,
        max_norm=0.5,
        noise_multiplier=0.0,
        rng=torch.Generator(),
        expected_batch_size=8.0,
    )
    expected, _ = pergrad.dp.private_mean(
        materialized(loss, args), 0.5, 0.0, torch.Generator(), 8.0
    )
    for name in expected:
        assert_close(t_numpy(grad[name]), t_numpy(expected[name]))
    assert float(stats.count) == BATCH

"""Layer layouts the capture must not guess: every strategy equals a loop, or refuses clearly.

A generator of models whose layers see the batch where PyTorch code puts it in practice:
batch-first, time-first (``nn.MultiheadAttention``'s and ``nn.LSTM``'s default), ``T == B``
(a time-first layer then has the batch size on axis 0), ``T == 1``, position ids broadcast
against the batch (shared, ``(1, T)`` or ``(T,)``), permuted axes, a convolution along the batch
axis, packed sequences. Hypothesis draws the sizes, ``T == B`` and ``T == 1`` among them.

For every model and strategy, the result is compared with ``_reference.torch_module_loop_grads``
(ordinary ``.backward()`` on a copy of the model, one example at a time): per-example norms,
clipped sums, per-example gradients, and a zero-noise ``DPOptimizer`` step (the DP guarantee:
the step must be the clip-then-sum of the loop, so no example contributes more than the bound).
A forced strategy may refuse a layout with a ``ValueError`` that says so; ``"auto"`` must
always give the loop's numbers. Issue 15's three reproductions are regression tests at the end.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="these tests exercise the PyTorch capture")

from torch import nn  # noqa: E402
from torch.nn.utils import rnn as rnn_utils  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402

WIDTH, VOCAB = 3, 7


def abs_mean(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The loss: the output's mean absolute value, times the example's weight ``(1,)``."""
    return out.abs().mean() * weight.sum()


# --- the layouts: each makes (model, inputs) from (batch, steps) ------------------------------


class TimeFirstLinear(nn.Module):  # issue 15, A
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4)

    def forward(self, x):  # x (B, T, D)
        return self.fc(x.transpose(0, 1)).transpose(0, 1)


class PermutedLinear(nn.Module):
    """A (B, H, T, D) input run as (T, B, H, D)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4)

    def forward(self, x):  # x (B, 2, T, D)
        return self.fc(x.permute(2, 0, 1, 3)).permute(1, 2, 0, 3)


class LinearOnSharedPositions(nn.Module):
    """A linear layer applied to a shared (T, D) table, added to every example."""

    def __init__(self):
        super().__init__()
        self.table = nn.Linear(WIDTH, WIDTH)
        self.fc = nn.Linear(WIDTH, 2)

    def forward(self, x):  # x (B, T, D)
        steps = x.shape[1]
        positions = torch.linspace(0, 1, steps * WIDTH, dtype=x.dtype).reshape(steps, WIDTH)
        return self.fc(torch.tanh(x + self.table(positions)))


class TimeFirstEmbedding(nn.Module):  # issue 15, B (with T == 1)
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)

    def forward(self, ids):  # ids (B, T)
        return self.emb(ids.transpose(0, 1)).transpose(0, 1)


class PositionEmbedding(nn.Module):
    """Token embeddings plus position embeddings of shared ids: ``(1, T)`` or ``(T,)``."""

    def __init__(self, leading_one: bool):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 4)
        self.positions = nn.Embedding(16, 4)
        self.leading_one = leading_one
        self.fc = nn.Linear(4, 2)

    def forward(self, ids):  # ids (B, T)
        steps = torch.arange(ids.shape[1])
        steps = steps[None] if self.leading_one else steps
        return self.fc(torch.tanh(self.tokens(ids) + self.positions(steps)))


class ConvAlongTheBatch(nn.Module):
    """A pointwise convolution whose batch axis is the time axis and whose length axis is the
    batch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(WIDTH, 2, kernel_size=1)

    def forward(self, x):  # x (B, T, D) -> conv over (T, D, B)
        return self.conv(x.permute(1, 2, 0)).permute(2, 0, 1)


class ChannelsLastConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(WIDTH, 2, kernel_size=1)

    def forward(self, x):  # x (B, T, D) -> (B, D, T)
        return self.conv(x.transpose(1, 2))


class TimeFirstLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.fc(self.norm(x.transpose(0, 1)).transpose(0, 1))


class Attention(nn.Module):
    """``nn.MultiheadAttention`` (its ghost rule reads the layout from ``batch_first``),
    batch-first or time-first."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first)
        self.embed = nn.Linear(WIDTH, 4)
        self.batch_first = batch_first

    def forward(self, x):  # x (B, T, D)
        h = self.embed(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        out = self.attn(h, h, h, need_weights=False)[0]
        return out if self.batch_first else out.transpose(0, 1)


class TimeFirstLSTM(nn.Module):  # issue 15, C
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(WIDTH, 4)

    def forward(self, x):
        return self.lstm(x.transpose(0, 1))[0].transpose(0, 1)


class PackedLSTM(nn.Module):
    """Variable-length sequences packed for the LSTM; the lengths are a per-example input."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(WIDTH, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x, lengths):
        packed = rnn_utils.pack_padded_sequence(
            x, lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        _, (hidden, _) = self.lstm(packed)
        return self.fc(hidden[-1])


@dataclass(frozen=True)
class Layout:
    make: Callable[[], nn.Module]
    inputs: str = "dense"  # "dense" (B, T, D), "ids" (B, T), "4d" (B, 2, T, D), "packed"


LAYOUTS = {
    "linear/batch-first": Layout(lambda: nn.Sequential(nn.Linear(WIDTH, 4), nn.Tanh())),
    "linear/time-first": Layout(TimeFirstLinear),
    "linear/permuted": Layout(PermutedLinear, "4d"),
    "linear/shared-positions": Layout(LinearOnSharedPositions),
    "embedding/batch-first": Layout(lambda: nn.Embedding(VOCAB, 4), "ids"),
    "embedding/time-first": Layout(TimeFirstEmbedding, "ids"),
    "embedding/position-ids-(1,T)": Layout(lambda: PositionEmbedding(True), "ids"),
    "embedding/position-ids-(T,)": Layout(lambda: PositionEmbedding(False), "ids"),
    "conv1d/channels-last": Layout(ChannelsLastConv),
    "conv1d/along-the-batch": Layout(ConvAlongTheBatch),
    "layernorm/time-first": Layout(TimeFirstLayerNorm),
    "attention/batch-first": Layout(lambda: Attention(True)),
    "attention/time-first": Layout(lambda: Attention(False)),
    "lstm/time-first": Layout(TimeFirstLSTM),
    "lstm/packed": Layout(PackedLSTM, "packed"),
}


def inputs_for(layout: Layout, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The model's inputs for ``batch`` examples of ``steps`` steps."""
    generator = torch.Generator().manual_seed(seed)
    if layout.inputs == "ids":
        return [torch.randint(0, VOCAB, (batch, steps), generator=generator)]
    if layout.inputs == "4d":
        return [torch.randn(batch, 2, steps, WIDTH, generator=generator, dtype=torch.float64)]
    x = torch.randn(batch, steps, WIDTH, generator=generator, dtype=torch.float64)
    if layout.inputs == "packed":
        return [x, torch.randint(1, steps + 1, (batch,), generator=generator)]
    return [x]


# --- the draw: sizes, with the coincidences the capture must not fall for ---------------------


@st.composite
def sizes(draw: st.DrawFn) -> tuple[int, int, int]:
    batch = draw(st.integers(1, 4))
    steps = draw(st.sampled_from(["equal to B", "one", "other"]))
    steps = {"equal to B": batch, "one": 1, "other": draw(st.integers(1, 5))}[steps]
    return batch, steps, draw(st.integers(0, 2**16))


def problem(name: str, batch: int, steps: int, seed: int):
    """``(model, loss, batch arguments (inputs, then weights), loop reference)``."""
    layout = LAYOUTS[name]
    torch.manual_seed(seed)
    model = layout.make().double()
    inputs = inputs_for(layout, batch, steps, seed)
    weights = torch.rand(batch, dtype=torch.float64) + 0.5
    loss = pergrad.module_loss(model, abs_mean, num_inputs=len(inputs))
    reference = torch_module_loop_grads(model, abs_mean, inputs, [weights])
    return model, loss, [*inputs, weights], reference


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten(1) for g in grads.values()], dim=1)


def reference_clipped_sum(reference: dict, max_norm: float) -> tuple[torch.Tensor, dict]:
    norms = flat(reference).norm(dim=1)
    factors = (max_norm / norms.clamp(min=1e-300)).clamp(max=1.0)
    return norms, {k: torch.tensordot(factors, g, dims=1) for k, g in reference.items()}


def a_bound(reference: dict) -> float:
    """A bound that clips some examples and not others (or any, when all norms are zero)."""
    norms = flat(reference).norm(dim=1)
    return float(norms.median()) or 1.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=1e-7, atol=1e-9)


def run_or_refuse(strategy: str, compute: Callable[[], object]) -> object | None:
    """The result, or None where a forced strategy refused the layout with a clear error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto's fallbacks say what they did; not checked here
        if strategy == "auto":
            return compute()
        try:
            return compute()
        except ValueError as err:
            assert f"strategy='{strategy}'" in str(err), err
            return None


SETTINGS = settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
RUNS: dict[str, int] = {"matched": 0, "refused": 0}


@pytest.mark.parametrize("strategy", ["auto", "ghost", "ghost-lowmem", "chunked", "materialize"])
@pytest.mark.parametrize("name", list(LAYOUTS))
@SETTINGS
@given(drawn=sizes())
def test_norms_and_clipped_sums_equal_the_loop(name, strategy, drawn):
    _, loss, inputs, reference = problem(name, *drawn)
    params = loss.params()
    norms = run_or_refuse(
        strategy,
        lambda: pergrad.norms.per_example_norms_of(loss, params, *inputs, strategy=strategy),
    )
    bound = a_bound(reference)
    clipped = run_or_refuse(
        strategy,
        lambda: pergrad.dp.clipped_sum_of(loss, params, *inputs, max_norm=bound, strategy=strategy),
    )
    expected_norms, expected_sum = reference_clipped_sum(reference, bound)
    for result in (norms, clipped):
        RUNS["matched" if result is not None else "refused"] += 1
    if norms is not None:
        assert_close(norms, expected_norms)
    if clipped is not None:
        assert_close(clipped.norms, expected_norms)
        for key, value in expected_sum.items():
            assert_close(clipped.sum[key], value)


@pytest.mark.parametrize("strategy", ["auto", "vmap", "hooks", "loop"])
@pytest.mark.parametrize("name", list(LAYOUTS))
@SETTINGS
@given(drawn=sizes())
def test_per_example_grads_equal_the_loop(name, strategy, drawn):
    _, loss, inputs, reference = problem(name, *drawn)
    fn = pergrad.per_example_grads(loss, strategy=strategy)
    grads = run_or_refuse(strategy, lambda: fn(loss.params(), *inputs))
    RUNS["matched" if grads is not None else "refused"] += 1
    if grads is not None:
        for key, value in reference.items():
            assert_close(grads[key], value)


@pytest.mark.parametrize("strategy", ["auto", "ghost", "ghost-lowmem", "chunked", "materialize"])
@pytest.mark.parametrize("name", list(LAYOUTS))
@SETTINGS
@given(drawn=sizes())
def test_a_zero_noise_dp_step_is_the_loops_clip_then_sum(name, strategy, drawn):
    """The DP guarantee: the step moves the parameters by the loop's sum of clipped gradients
    (each example's contribution at most ``max_norm``), divided by the batch size."""
    model, _, batch, reference = problem(name, *drawn)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    bound = a_bound(reference)
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        abs_mean,
        max_norm=bound,
        noise_multiplier=0.0,
        num_inputs=len(batch) - 1,
        strategy=strategy,
    )
    stepped = run_or_refuse(strategy, lambda: optimizer.step(*batch))
    RUNS["matched" if stepped is not None else "refused"] += 1
    if stepped is None:
        return
    _, expected_sum = reference_clipped_sum(reference, bound)
    for key, param in model.named_parameters():
        assert_close((before[key] - param.detach()) * len(batch[-1]), expected_sum[key])


def test_the_generator_ran_every_combination():
    """Printed for the record (``pytest -s``): how many (layout, strategy) runs matched the loop
    and how many a forced strategy refused. Zero silent mismatches: any would have failed."""
    if not RUNS["matched"]:
        pytest.skip("run with the generator tests above (this one only reports their count)")
    print(f"\nlayout generator: {RUNS}")
    assert RUNS["matched"] > RUNS["refused"]


# --- issue 15's reproductions -------------------------------------------------------------------


def reproduction(model: nn.Module, x: torch.Tensor):
    """``(loss, batch arguments, loop reference)`` for a model of one input."""
    weights = torch.ones(x.shape[0], dtype=x.dtype if x.is_floating_point() else torch.float32)
    loss = pergrad.module_loss(model, abs_mean)
    return loss, [x, weights], torch_module_loop_grads(model, abs_mean, [x], [weights])


def test_issue_15_a_time_first_linear_with_t_equal_to_b():
    torch.manual_seed(0)
    model = TimeFirstLinear().double()
    loss, batch, reference = reproduction(model, torch.randn(2, 2, WIDTH, dtype=torch.float64))
    with pytest.warns(pergrad.FallbackWarning, match="'fc'.*other examples"):
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *batch)
    assert_close(norms, flat(reference).norm(dim=1))
    with pytest.raises(ValueError, match="strategy='ghost' cannot handle.*'fc'"):
        pergrad.norms.per_example_norms_of(loss, loss.params(), *batch, strategy="ghost")
    with pytest.raises(ValueError, match="strategy='hooks' cannot handle.*'fc'"):
        pergrad.per_example_grads(loss, strategy="hooks")(loss.params(), *batch)


def test_issue_15_a_dp_step_no_longer_lets_an_example_past_the_bound():
    torch.manual_seed(0)
    model = TimeFirstLinear().double()
    _, batch, reference = reproduction(model, torch.randn(2, 2, WIDTH, dtype=torch.float64))
    bound = float(flat(reference).norm(dim=1).min()) * 0.9  # both examples clipped
    _, expected_sum = reference_clipped_sum(reference, bound)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        abs_mean,
        max_norm=bound,
        noise_multiplier=0.0,
    )
    with pytest.warns(pergrad.FallbackWarning):
        optimizer.step(*batch)
    for key, param in model.named_parameters():
        assert_close((before[key] - param.detach()) * 2, expected_sum[key])


def test_issue_15_b_an_embedding_with_a_leading_axis_of_one_is_not_taken_for_positions():
    torch.manual_seed(0)
    loss, batch, reference = reproduction(TimeFirstEmbedding(), torch.randint(0, VOCAB, (3, 1)))
    with pytest.warns(pergrad.FallbackWarning, match="'emb'"):
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *batch)
    torch.testing.assert_close(norms, flat(reference).norm(dim=1))


def test_issue_15_c_clipped_sums_of_a_time_first_lstm_fall_back_to_a_loop():
    torch.manual_seed(0)
    loss, batch, reference = reproduction(TimeFirstLSTM(), torch.randn(3, 5, WIDTH))
    with pytest.warns(pergrad.FallbackWarning):
        clipped = pergrad.dp.clipped_sum_of(loss, loss.params(), *batch, max_norm=1.0)
    norms, expected_sum = reference_clipped_sum(reference, 1.0)
    torch.testing.assert_close(clipped.norms, norms, rtol=1e-4, atol=1e-6)
    for key, value in expected_sum.items():
        torch.testing.assert_close(clipped.sum[key], value, rtol=1e-4, atol=1e-6)


def test_a_layout_is_checked_again_at_a_new_batch_size():
    """The check is per layout, batch size included: a model first seen with T != B (ghost,
    the time-first layer's batch found on its axis 1) and then with T == B (axis 0 has the
    batch size) is checked, not waved through."""
    torch.manual_seed(0)
    model = TimeFirstLinear().double()
    loss, wide, wide_reference = reproduction(model, torch.randn(4, 2, WIDTH, dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *wide)
    assert_close(norms, flat(wide_reference).norm(dim=1))
    _, square, reference = reproduction(model, wide[0][:2])
    with pytest.warns(pergrad.FallbackWarning, match="other examples"):
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *square)
    assert_close(norms, flat(reference).norm(dim=1))


@pytest.mark.parametrize("block", [1, 7])
def test_rows_compared_a_few_numbers_at_a_time_keep_both_verdicts(monkeypatch, block):
    """The first call's row check reads an output gradient a block of rows at a time (an LM
    head's B x T x V would otherwise be copied whole, several times): with blocks of one row,
    or of rows that do not divide the batch, a time-first layer is still refused and a row-local
    model still passes, with the loop's norms."""
    from pergrad._src.capture import torch_checks

    monkeypatch.setattr(torch_checks, "ROW_BLOCK_NUMBERS", block)
    torch.manual_seed(0)
    model = TimeFirstLinear().double()
    loss, batch, _ = reproduction(model, torch.randn(2, 2, WIDTH, dtype=torch.float64))
    with pytest.raises(ValueError, match="'fc'.*other examples"):
        pergrad.norms.per_example_norms_of(loss, loss.params(), *batch, strategy="ghost")
    model = nn.Sequential(nn.Linear(WIDTH, 9), nn.Tanh(), nn.Linear(9, 3)).double()
    loss, batch, reference = reproduction(model, torch.randn(5, WIDTH, dtype=torch.float64))
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *batch, strategy="ghost")
    assert_close(norms, flat(reference).norm(dim=1))

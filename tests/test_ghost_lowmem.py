"""The low-memory ghost strategy (``strategy="ghost-lowmem"``, PyTorch, issue 19).

Each layer's norms are computed in the backward pass as soon as its output gradients are in,
and the gradients are dropped; a second backward pass through the retained graph gives them
again, and each layer's hook turns them into its clip-weighted sum and drops them. What is
checked here, against a loop of single-example autograd gradients (``_reference.py``) or
pergrad's other strategies:

- the loop's results on a first call (the layout checks, done on row summaries and on the
  second pass) and on later ones;
- what it is for: no layer's output gradients held past its hook;
- what the checks must still catch (a parameter used outside its layer);
- an example whose gradient is not finite contributes nothing, also in a model that draws
  random numbers;
- bad calls say what to pass instead.

(Mixed precision: ``test_dp_mixed_precision.py``, where the clip bound must hold exactly.)

The layout property tests (``test_layouts_torch.py``) and the Hugging Face models
(``test_hf_transformers.py``) run it too.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the low-memory ghost strategy is PyTorch's")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from pergrad._src.capture import torch_checks, torch_session  # noqa: E402
from test_ghost import OutsideUse  # noqa: E402  (fc.weight used by the parent, not by fc)

pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

LOWMEM = "ghost-lowmem"
B = 6


class TiedLM(nn.Module):
    """A tied table (its cross term), a layer of its own, and a bare parameter (run alone)."""

    def __init__(self, vocab: int = 30, width: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, 1, width) * 0.1)
        self.mix = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.norm(torch.tanh(self.mix(self.emb(tokens) + self.pos))))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_problem(seed: int = 0):
    torch.manual_seed(seed)
    model = TiedLM().double()
    tokens = torch.randint(0, 30, (B, 5))
    targets = torch.randint(0, 30, (B, 5))
    return model, tokens, targets


def loop_clipped_sum(model, loss_fn, inputs, targets, max_norm, skip=()):
    """Norms and the clipped sum of the loop's per-example gradients (``skip``: left out)."""
    grads = torch_module_loop_grads(model, loss_fn, inputs, targets)
    flat = torch.cat([torch.as_tensor(g).reshape(B, -1) for g in grads.values()], 1)
    norms = flat.norm(dim=1)
    factors = (max_norm / norms).clamp(max=1.0)
    factors[list(skip)] = 0.0
    return norms, {
        k: torch.tensordot(factors, torch.as_tensor(g).nan_to_num(), dims=1)
        for k, g in grads.items()
    }


def assert_close(got, want, rtol=1e-9):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


def test_first_and_later_calls_equal_the_loop():
    model, tokens, targets = lm_problem()
    loss = pergrad.module_loss(model, lm_loss)
    norms, want = loop_clipped_sum(model, lm_loss, [tokens], [targets], max_norm=1.0)
    max_norm = float(norms.median())
    norms, want = loop_clipped_sum(model, lm_loss, [tokens], [targets], max_norm=max_norm)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), tokens, targets, strategy=LOWMEM)
    assert choice.strategy == LOWMEM
    assert set(choice.layers.values()) == {"embedding", "linear", "layer_norm", "generic"}
    for call in ("first", "later"):
        got = pergrad.dp.clipped_sum_of(
            loss, loss.params(), tokens, targets, max_norm=max_norm, strategy=LOWMEM
        )
        assert_close(got.norms, norms)
        assert 0 < float(got.clip_fraction) < 1, call
        for name, value in want.items():
            assert_close(got.sum[name], value)
    assert len(loss.checked_layouts) == 1  # the first call checked the layout, once


def test_norms_alone_equal_the_loop_and_keep_no_graph():
    model, tokens, targets = lm_problem(1)
    loss = pergrad.module_loss(model, lm_loss)
    norms, _ = loop_clipped_sum(model, lm_loss, [tokens], [targets], max_norm=1.0)
    for _ in range(2):
        got = pergrad.norms.per_example_norms_of(
            loss, loss.params(), tokens, targets, strategy=LOWMEM
        )
        assert_close(got, norms)


def test_per_group_bounds_equal_the_one_pass_ghost():
    model, tokens, targets = lm_problem(2)
    loss = pergrad.module_loss(model, lm_loss)
    bounds = {name: 0.2 + 0.1 * k for k, name in enumerate(loss.params())}
    got, want = (
        pergrad.dp.clipped_sum_of(
            loss, loss.params(), tokens, targets, max_norm=bounds, strategy=strategy
        )
        for strategy in (LOWMEM, "materialize")
    )
    for name in want.sum:
        assert_close(got.sum[name], want.sum[name], rtol=1e-9)


class Deep(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum(-1)


def most_output_gradients_held(strategy: str, monkeypatch) -> int:
    """The most layer records holding an output gradient after a layer's tensor hook has run,
    over a backward pass."""
    held, seen = [0], []
    capturing = torch_session.capturing

    def watching(modules, batch_size):
        context = capturing(modules, batch_size)
        records = context.__enter__()
        seen.append(records)

        class Context:
            def __enter__(self):
                return records

            def __exit__(self, *exc):
                return context.__exit__(*exc)

        return Context()

    receive = torch_checks.GradientSlot.receive

    def counting(self, grad):
        receive(self, grad)
        alive = sum(r.output_grad is not None for rs in seen[-1].values() for r in rs)
        held[0] = max(held[0], alive)

    monkeypatch.setattr(torch_session, "capturing", watching)
    monkeypatch.setattr(torch_checks.GradientSlot, "receive", counting)
    torch.manual_seed(0)
    model = Deep()
    loss = pergrad.module_loss(model, lambda out, y: (out - y).pow(2).mean())
    x, y = torch.randn(B, 3, 16), torch.randn(B, 3)
    for _ in range(2):  # a first call (its checks) and a later one
        pergrad.dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=0.1, strategy=strategy)
    return held[0]


def test_no_layers_output_gradients_are_held_past_its_hook(monkeypatch):
    """What the strategy is for: the one-pass ghost strategy holds every layer's output
    gradients until the end of the backward pass; the low-memory one releases each layer's
    in its hook, once its norms are computed."""
    assert most_output_gradients_held(LOWMEM, monkeypatch) == 0
    assert most_output_gradients_held("ghost", monkeypatch) == 4


def test_a_parameter_used_outside_its_layer_is_caught_on_the_second_pass():
    torch.manual_seed(0)
    loss = pergrad.module_loss(OutsideUse(), F.cross_entropy)
    x, y = torch.randn(B, 4), torch.randint(0, 3, (B,))
    with pytest.raises(ValueError, match="strategy='ghost-lowmem'.*used outside the forward"):
        pergrad.dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=0.01, strategy=LOWMEM)


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_a_non_finite_example_adds_nothing_even_with_dropout(bad_value):
    """The bad example's rows of the records are zeroed before each layer's sum, as in the
    one-pass strategy; both passes run the dropout masks of the one forward pass, so under
    the same seed the two strategies agree."""
    torch.manual_seed(0)
    model = Noisy().double().train()
    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    x[2, 1] = bad_value
    loss = pergrad.module_loss(model, F.cross_entropy)
    results = {}
    for strategy in ("ghost", LOWMEM, LOWMEM):
        torch.manual_seed(7)
        results[strategy] = pergrad.dp.clipped_sum_of(
            loss, loss.params(), x, y, max_norm=0.05, strategy=strategy
        )
    got, want = results[LOWMEM], results["ghost"]
    assert float(got.nonfinite) == 1.0 and not np.isfinite(float(got.norms[2]))
    assert_close(got.norms[[0, 1, 3, 4, 5]], want.norms[[0, 1, 3, 4, 5]])
    for name in want.sum:
        assert torch.isfinite(got.sum[name]).all()
        assert_close(got.sum[name], want.sum[name])


def test_a_non_finite_example_adds_nothing_to_the_loops_sum():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    x[4, 0] = float("nan")
    loss = pergrad.module_loss(model, F.cross_entropy)
    _, want = loop_clipped_sum(model, F.cross_entropy, [x], [y], max_norm=0.3, skip=[4])
    got = pergrad.dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=0.3, strategy=LOWMEM)
    assert float(got.nonfinite) == 1.0
    for name, value in want.items():
        assert_close(got.sum[name], value)


def test_dp_optimizer_reports_the_strategy_and_steps_like_the_loop():
    model, tokens, targets = lm_problem(3)
    norms, want = loop_clipped_sum(model, lm_loss, [tokens], [targets], max_norm=0.5)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        lm_loss,
        max_norm=0.5,
        noise_multiplier=0.0,
        strategy=LOWMEM,
    )
    step = optimizer.step(tokens, targets)
    assert step.strategy == LOWMEM
    for name, param in model.named_parameters():
        assert_close((before[name] - param.detach()) * B, want[name])


def test_bad_calls_name_the_strategy_and_what_to_pass():
    def plain(params, x):
        return (params["w"] * x).sum()

    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match="strategy='ghost-lowmem'.*module_loss.*'ghost'"):
        pergrad.dp.clipped_sum_of(plain, params, torch.ones(B, 3), max_norm=1.0, strategy=LOWMEM)
    jnp = pytest.importorskip("jax.numpy", reason="the JAX refusal needs JAX")

    def jax_loss(params, x):
        return (params["w"] * x).sum()

    with pytest.raises(ValueError, match="strategy='ghost-lowmem'.*XLA"):
        pergrad.dp.clipped_sum_of(
            jax_loss, {"w": jnp.ones(3)}, jnp.ones((B, 3)), max_norm=1.0, strategy=LOWMEM
        )

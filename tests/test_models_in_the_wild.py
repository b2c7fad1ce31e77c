"""Per-example gradients of models as users bring them, where plain ``vmap(grad)`` breaks.

Every model is checked against ordinary training code run one example at a time
(``_reference.torch_module_loop_grads``: ``loss.backward()`` on a copy of the model), and the
strategy each one gets is asserted, so that a regression to a slower path is caught.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint as checkpoint  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402

B = 4


def assert_matches(got: dict, want: dict, rtol: float = 1e-4) -> None:
    """Relative error <= rtol per parameter; a parameter whose exact gradient is zero (an
    attention key's bias) holds rounding noise, so the floor is 1e-6 of the whole gradient."""
    assert set(got) <= set(want)
    floor = 1e-6 * torch.linalg.vector_norm(torch.cat([w.flatten() for w in want.values()]))
    for name, g in got.items():
        w = want[name]
        assert g.shape == w.shape, name
        error = torch.linalg.vector_norm(g - w)
        assert error <= rtol * torch.linalg.vector_norm(w) + floor, (
            f"{name}: error {error:.2e}, norm {torch.linalg.vector_norm(w):.2e}"
        )


def state_of(model: nn.Module) -> dict:
    """What a call must leave as it found: modes, flags, hooks, .grad, requires_grad, values."""
    return {
        "training": [m.training for m in model.modules()],
        "checkpointing": getattr(model, "is_gradient_checkpointing", None),
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
        "grad": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "values": [p.detach().clone() for p in model.parameters()],
    }


def assert_same_state(before: dict, after: dict) -> None:
    for key in ("training", "checkpointing", "hooks", "requires_grad"):
        assert before[key] == after[key], key
    for a, b in zip(before["grad"], after["grad"]):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(before["values"], after["values"]):
        assert torch.equal(a, b)


def run(loss, *args, strategy: str = "auto", **kwargs):
    """Per-example gradients and the strategy taken, FallbackWarnings recorded."""
    fn = pergrad.per_example_grads(loss, strategy=strategy, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = fn(loss.params(), *args)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, pergrad.FallbackWarning)]
    return grads, fn.last_strategy, fallbacks


# --- small PyTorch patterns -------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.inner = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.use_reentrant = use_reentrant

    def block(self, h):
        return self.norm(torch.tanh(self.inner(h)))

    def forward(self, x):
        h = self.embed(x)
        h = checkpoint.checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        h[:, 0] += 1.0
        h = self.act(h)
        return self.fc2(h)


class Cube(torch.autograd.Function):
    """A custom Function written the old way: no setup_context, no vmap rule."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(Cube.apply(self.fc1(x)))


class BranchPerBatch(nn.Module):
    """``if`` on a value of the whole input: for one example, a per-example branch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        if x.sum() > 0:
            h = 2 * h
        return self.fc2(torch.tanh(h))


class TiedLM(nn.Module):
    """Input embedding shared with the output layer, as in GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 5, generator=g), torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize(
    "model_fn, expected",
    [
        (lambda: Checkpointed(use_reentrant=False), "hooks"),
        (lambda: Checkpointed(use_reentrant=True), "hooks"),
        (InPlace, "hooks"),
        (CustomFunction, "hooks"),
        (BranchPerBatch, "loop"),
    ],
    ids=["checkpoint", "checkpoint-reentrant", "in-place", "autograd-function", "branch"],
)
def test_patterns_match_the_loop(model_fn, expected):
    torch.manual_seed(0)
    model = model_fn()
    X, Y = data()
    if expected == "loop":  # make sure the examples really take different branches
        assert len({bool(X[i].sum() > 0) for i in range(B)}) == 2
    before = state_of(model)
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads, strategy, fallbacks = run(loss, X, Y)
    assert strategy == expected
    # the hooks come first for a module_loss: a warning only where a slower route was taken
    assert len(fallbacks) == (expected == "loop")
    if expected == "loop":
        assert f"strategy '{expected}'" in fallbacks[0]
    assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [X], [Y]))
    assert_same_state(before, state_of(model))


@pytest.mark.parametrize("strategy", ["hooks", "loop"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_every_strategy(strategy, use_reentrant):
    torch.manual_seed(1)
    model = Checkpointed(use_reentrant)
    X, Y = data(1)
    loss = pergrad.module_loss(model, F.cross_entropy)
    if strategy == "loop" and use_reentrant:
        # torch's own rule: reentrant checkpointing cannot be differentiated with autograd.grad
        with pytest.raises(ValueError, match=r"use_reentrant=True.*strategy='hooks'"):
            run(loss, X, Y, strategy=strategy)
        return
    grads, taken, fallbacks = run(loss, X, Y, strategy=strategy)
    assert taken == strategy and not fallbacks
    assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [X], [Y]))


def clipped_loop_reference(want: dict, max_norm: float) -> tuple[torch.Tensor, dict]:
    """Norms and the clipped sum of the loop's per-example gradients."""
    norms = torch.linalg.vector_norm(
        torch.cat([g.reshape(g.shape[0], -1) for g in want.values()], 1), dim=1
    )
    factors = torch.clamp(max_norm / norms, max=1.0)
    return norms, {n: torch.einsum("b,b...->...", factors, g) for n, g in want.items()}


@pytest.mark.parametrize("chunk_size", [None, 3], ids=["one chunk", "chunks of 3"])
@pytest.mark.parametrize("strategy", ["auto", "chunked"])
def test_reentrant_checkpointing_norms_and_clipped_sums(strategy, chunk_size):
    # torch's vmap and autograd.grad both refuse reentrant checkpointing: the chunked strategy
    # takes the layer hooks' per-example gradients chunk by chunk (a second pass for the sum)
    torch.manual_seed(9)
    model = Checkpointed(use_reentrant=True)
    X, Y = data(9)
    X = torch.cat([X, 3 * X[:3]])  # 7 examples: chunks of 3, 3 and 1; some clipped, some not
    Y = torch.cat([Y, Y[:3]])
    loss = pergrad.module_loss(model, F.cross_entropy)
    before = state_of(model)
    norms_want, sum_want = clipped_loop_reference(
        torch_module_loop_grads(model, F.cross_entropy, [X], [Y]), 3.0
    )
    assert 0 < int((norms_want > 3.0).sum()) < len(X)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norms = pergrad.norms.per_example_norms_of(
            loss, loss.params(), X, Y, strategy=strategy, chunk_size=chunk_size
        )
        clipped = pergrad.dp.clipped_sum_of(
            loss, loss.params(), X, Y, max_norm=3.0, strategy=strategy, chunk_size=chunk_size
        )
    said = " ".join(str(w.message) for w in caught if w.category is pergrad.FallbackWarning)
    assert "layer hooks" in said and "one example at a time" not in said
    if strategy == "auto":  # the ghost strategy said why it could not, and what to do
        assert "use_reentrant=True" in said and "use_reentrant': False" in said
    torch.testing.assert_close(norms, norms_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clipped.norms, norms_want, rtol=1e-5, atol=1e-6)
    assert_matches(clipped.sum, sum_want, rtol=1e-5)
    assert_same_state(before, state_of(model))


@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem"])
def test_ghost_refuses_reentrant_checkpointing_with_the_fix(strategy):
    torch.manual_seed(10)
    model = Checkpointed(use_reentrant=True)
    X, Y = data(10)
    loss = pergrad.module_loss(model, F.cross_entropy)
    before = state_of(model)
    with pytest.raises(ValueError, match=r"use_reentrant=True.*'use_reentrant': False"):
        pergrad.dp.clipped_sum_of(loss, loss.params(), X, Y, max_norm=1.0, strategy=strategy)
    assert_same_state(before, state_of(model))


def test_tied_weights_get_the_sum_of_both_uses():
    torch.manual_seed(2)
    model = TiedLM()
    tokens = torch.randint(0, 11, (B, 7))
    loss = pergrad.module_loss(model, lm_loss)
    assert list(loss.params()) == ["embed.weight", "mix.weight", "mix.bias"]
    want = torch_module_loop_grads(model, lm_loss, [tokens], [tokens])
    for strategy in ("vmap", "hooks"):
        grads, taken, _ = run(loss, tokens, tokens, strategy=strategy)
        assert taken == strategy
        assert_matches(grads, want)
    # and the shared weight really gets two contributions: the embedding's rows alone differ
    only_lookup = torch.zeros_like(want["embed.weight"])
    assert not torch.allclose(want["embed.weight"], only_lookup)


class Sneaky(nn.Module):
    """A parameter used outside its layer too: the hooks' sum check fails on it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x) + F.linear(x, self.fc.weight)


def test_hooks_refuse_a_parameter_used_outside_its_layer():
    torch.manual_seed(3)
    model = Sneaky()
    X, Y = data(3)
    loss = pergrad.module_loss(model, F.cross_entropy)
    for _ in range(2):  # a layout refused on its first call is checked again, not trusted
        with pytest.raises(ValueError, match=r"'fc.weight'.*do not add up"):
            run(loss, X, Y, strategy="hooks")


def test_auto_takes_the_loop_when_hooks_cannot_cover_a_layer():
    class Recurrent(nn.Module):
        def __init__(self, cls) -> None:
            super().__init__()
            self.rnn = cls(5, 6, batch_first=True)
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    X = torch.randn(B, 7, 5)
    _, Y = data()
    for cls, expected in ((nn.LSTM, "vmap"), (nn.GRU, "loop"), (nn.RNN, "loop")):
        torch.manual_seed(4)
        model = Recurrent(cls)
        loss = pergrad.module_loss(model, F.cross_entropy)
        grads, taken, fallbacks = run(loss, X, Y)
        assert taken == expected, cls
        if expected == "loop":
            assert "no layer rule for" in fallbacks[0] and cls.__name__ in fallbacks[0]
        assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [X], [Y]))


def test_later_calls_reuse_the_strategy_without_warning():
    torch.manual_seed(5)
    model = BranchPerBatch()
    loss = pergrad.module_loss(model, F.cross_entropy)
    fn = pergrad.per_example_grads(loss)
    X, Y = data(5)
    with pytest.warns(pergrad.FallbackWarning) as caught:
        fn(loss.params(), X, Y)
    # the reason is the warning's: what the hooks and vmap could not do
    assert fn.last_strategy == "loop" and fn.last_strategy.reason
    assert fn.last_strategy.reason in str(caught[0].message)
    X2, Y2 = data(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = fn(loss.params(), X2, Y2)
    assert fn.last_strategy == "loop"
    assert fn.last_strategy.reason.startswith("an earlier call of this function fell back")
    assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [X2], [Y2]))


def test_auto_takes_vmap_quietly_where_the_hooks_fail_their_checks():
    """The hooks are tried ahead of vmap for speed only: a parameter used outside its layer
    fails their first-call check, and vmap (as fast as before the hooks came first) takes the
    call without a warning; the reason says why, and later calls start from vmap."""

    torch.manual_seed(3)
    model = Sneaky()
    loss = pergrad.module_loss(model, F.cross_entropy)
    fn = pergrad.per_example_grads(loss)
    for seed in (3, 4):
        X, Y = data(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            grads = fn(loss.params(), X, Y)
        assert fn.last_strategy == "vmap"
        assert "do not add up" in fn.last_strategy.reason
        assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [X], [Y]))


def test_hooks_chunked_and_value_and_grads():
    torch.manual_seed(6)
    model = Checkpointed(use_reentrant=False)
    loss = pergrad.module_loss(model, F.cross_entropy)
    X, Y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    fn = pergrad.value_and_per_example_grads(loss, strategy="hooks", chunk_size=3)
    losses, grads = fn(loss.params(), X, Y)
    assert fn.last_strategy == "hooks" and fn.last_strategy.reason == "requested"
    want_losses = torch.stack(
        [F.cross_entropy(model(X[i : i + 1]), Y[i : i + 1]) for i in range(7)]
    ).detach()
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [X], [Y]))


def test_nothing_changes_after_a_failure():
    torch.manual_seed(7)
    model = Checkpointed(use_reentrant=True).train()
    model.embed.weight.grad = torch.ones_like(model.embed.weight)
    before = state_of(model)

    def broken_loss(output, y):
        raise RuntimeError("boom in the user's loss")

    loss = pergrad.module_loss(model, broken_loss)
    X, Y = data(7)
    with pytest.raises(RuntimeError, match="boom"):
        pergrad.per_example_grads(loss, strategy="hooks")(loss.params(), X, Y)
    assert_same_state(before, state_of(model))


def test_dropout_under_hooks_needs_randomness():
    class Dropping(Checkpointed):
        def forward(self, x):
            return super().forward(F.dropout(x, 0.5, self.training))

    model = Dropping(use_reentrant=False).train()
    loss = pergrad.module_loss(model, F.cross_entropy)
    X, Y = data(8)
    with pytest.raises(ValueError, match="randomness"):
        pergrad.per_example_grads(loss, strategy="hooks")(loss.params(), X, Y)
    grads = pergrad.per_example_grads(loss, strategy="hooks", randomness="different")(
        loss.params(), X, Y
    )
    # each example's own mask: the first layer's weight gradient is zero on dropped inputs
    for i in range(B):
        kept = grads["embed.weight"][i].abs().sum(0) > 0
        assert 0 < int(kept.sum()) <= 5


# --- bad input ----------------------------------------------------------------------------------


def test_bad_strategy_names_the_argument():
    with pytest.raises(ValueError, match=r"strategy must be one of .*'hooks'.*got 'fast'"):
        pergrad.per_example_grads(lambda w, x: (w * x).sum(), strategy="fast")


def test_vmap_strategy_refuses_what_it_cannot_batch():
    model = CustomFunction()
    loss = pergrad.module_loss(model, F.cross_entropy)
    X, Y = data()
    with pytest.raises(ValueError, match=r"strategy='vmap'.*could not vectorise.*strategy='auto'"):
        pergrad.per_example_grads(loss, strategy="vmap")(loss.params(), X, Y)


def test_hooks_strategy_needs_a_module_loss_and_rules():
    w = torch.randn(3)
    with pytest.raises(ValueError, match="module_loss"):
        pergrad.per_example_grads(lambda w, x: (w * x).sum(), strategy="hooks")(
            w, torch.randn(B, 3)
        )
    model = nn.Sequential(nn.GRU(5, 4, batch_first=True))
    loss = pergrad.module_loss(model, lambda out, y: (out[0] * y).sum())
    with pytest.raises(ValueError, match=r"'0'.*no layer rule for GRU"):
        pergrad.per_example_grads(loss, strategy="hooks")(
            loss.params(), torch.randn(B, 2, 5), torch.randn(B, 2, 4)
        )


def test_hooks_strategy_on_jax_says_it_is_pytorch_only():
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(ValueError, match="module_loss.*on jax"):
        pergrad.per_example_grads(lambda w, x: (w * x).sum(), strategy="hooks")(
            jnp.ones(3), jnp.ones((B, 3))
        )


class MixesExamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0, keepdim=True))


@pytest.mark.parametrize("first_batch", [0, 1])
def test_a_first_call_too_small_to_check_does_not_switch_the_check_off(first_batch):
    torch.manual_seed(9)
    model = MixesExamples()
    loss = pergrad.module_loss(model, F.cross_entropy)
    fn = pergrad.per_example_grads(loss, strategy="hooks")
    X, Y = data(9)
    fn(loss.params(), X[:first_batch], Y[:first_batch])
    with pytest.raises(ValueError, match="depends on (the )?other examples|examples interact"):
        fn(loss.params(), X, Y)


def test_auto_loops_when_the_batched_pass_fails():
    class OneExampleOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(5, 4)
            self.b = nn.Linear(4, 3)

        def forward(self, x):
            h = self.a(x)
            if float(h.sum()) > 1e9:  # data-dependent: vmap fails
                h = h * 0
            return self.b(h.reshape(1, -1))  # written for a batch of one

    torch.manual_seed(10)
    model = OneExampleOnly()
    X, Y = data(10)
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads, taken, fallbacks = run(loss, X, Y)
    assert taken == "loop" and "batched pass failed" in fallbacks[0]
    assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [X], [Y]))


def test_a_mapping_pytrees_cannot_split_is_refused():
    from collections import UserDict

    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            return self.fc(x)

    model = Keywords()
    loss = pergrad.module_loss(model, F.cross_entropy)
    X, Y = data(11)
    with pytest.raises(TypeError, match=r"UserDict.*dict\(batch\)"):
        pergrad.per_example_grads(loss)(loss.params(), UserDict(x=X), Y)
    grads = pergrad.per_example_grads(loss)(loss.params(), {"x": X}, Y)
    assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [{"x": X}], [Y]))


def test_hooks_on_3d_and_transposed_convolutions():
    """The layer rules of Conv3d and ConvTranspose*d form per-example gradients for the hooks
    strategy too (checked against a backward() loop)."""
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Conv3d(2, 3, 2, stride=(1, 2, 1)),
        nn.Tanh(),
        nn.Flatten(1, 2),  # (B, 3 * 2, 1, 2): the depth folded into the channels
        nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
        nn.Flatten(),
        nn.Linear(4 * 2 * 4, 3),
    )
    loss = pergrad.module_loss(model, F.cross_entropy)
    X, Y = torch.randn(B, 2, 3, 3, 3), torch.randint(0, 3, (B,))
    fn = pergrad.per_example_grads(loss, strategy="hooks")
    grads = fn(loss.params(), X, Y)
    assert fn.last_strategy == "hooks"
    assert_matches(grads, torch_module_loop_grads(model, F.cross_entropy, [X], [Y]))

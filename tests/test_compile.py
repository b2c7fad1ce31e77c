"""pergrad on ``torch.compile`` d models (issue 36): a compiled model, or one whose layers are
compiled in place, gives the DP step, the per-example gradients and their norms of the eager
model, and is left as it was.

The backends ``"eager"`` and ``"aot_eager"`` need no C++ compiler (dynamo's tracing, graph
breaks and guards included: what pergrad's hooks meet); ``"inductor"`` builds C++ kernels and
is skipped, with the reason, where this machine cannot.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import pergrad  # noqa: E402

pytestmark = pytest.mark.cpu_only("compiles for the CPU; the GPU check is a benchmark run")

BATCH, FEATURES, CLASSES = 5, 6, 3
# Small enough that every example is clipped (the update depends on each example's norm).
MAX_NORM = 0.05
NO_COMPILER_BACKENDS = ("eager", "aot_eager")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch: no cached graph or recompile count leaks between them."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, CLASSES)
    ).double()


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, FEATURES, dtype=torch.float64, generator=generator)
    return x, torch.randint(0, CLASSES, (BATCH,), generator=generator)


def compiled_whole(backend: str) -> tuple[nn.Module, nn.Module]:
    """``torch.compile(model)``: an ``OptimizedModule`` over the model (its parameter names
    gain ``_orig_mod.``), and the model under it."""
    model = make_model()
    return torch.compile(model, backend=backend), model


def compiled_layers(backend: str) -> tuple[nn.Module, nn.Module]:
    """Each layer compiled in place (``nn.Module.compile``): the names stay, the calls compile."""
    model = make_model()
    for layer in model:
        layer.compile(backend=backend)
    return model, model


COMPILERS = {"whole": compiled_whole, "layers": compiled_layers}


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What a pergrad call must leave as it was: values, flags, grads and hooks of every
    module."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {
            n: [
                len(getattr(m, kind))
                for kind in (
                    "_forward_hooks",
                    "_forward_pre_hooks",
                    "_backward_hooks",
                    "_backward_pre_hooks",
                )
            ]
            for n, m in model.named_modules()
        },
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert after["requires_grad"] == before["requires_grad"]
    assert after["grads"] == before["grads"]
    assert after["training"] == before["training"]
    assert after["hooks"] == before["hooks"]
    for name, value in before["params"].items():
        assert torch.equal(after["params"][name], value), name


def dp_optimizer(model: nn.Module, strategy: str = "ghost") -> Any:
    """A noiseless ``DPOptimizer`` over SGD for ``model``, clipping every example (``MAX_NORM``)."""
    return pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model,
        F.cross_entropy,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        expected_batch_size=BATCH,
        strategy=strategy,
    )


def dp_update(model: nn.Module, strategy: str) -> list[torch.Tensor]:
    """The parameters after one noiseless DP-SGD step of ``model`` on the batch."""
    private = dp_optimizer(model, strategy)
    taken = private.step(*make_batch())
    assert taken.clip_fraction == 1.0  # the clipping is exercised, not a no-op
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
@pytest.mark.parametrize("how", list(COMPILERS))
@pytest.mark.parametrize("backend", NO_COMPILER_BACKENDS)
def test_dp_step_of_a_compiled_model_equals_the_eager_one(
    backend: str, how: str, strategy: str
) -> None:
    start = [p.detach().clone() for p in make_model().parameters()]
    expected = dp_update(make_model(), strategy)
    compiled, _ = COMPILERS[how](backend)
    got = dp_update(compiled, strategy)
    assert not all(torch.equal(a, b) for a, b in zip(expected, start))  # the step moved
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("how", list(COMPILERS))
@pytest.mark.parametrize("backend", NO_COMPILER_BACKENDS)
def test_per_example_grads_and_norms_of_a_compiled_model(backend: str, how: str) -> None:
    x, y = make_batch()
    eager_loss = pergrad.module_loss(make_model(), F.cross_entropy)
    expected = pergrad.per_example_grads(eager_loss)(eager_loss.params(), x, y)
    expected_norms = pergrad.norms.per_example_norms_of(eager_loss, eager_loss.params(), x, y)

    compiled, inner = COMPILERS[how](backend)
    before = snapshot(inner)
    loss = pergrad.module_loss(compiled, F.cross_entropy)
    grads = pergrad.per_example_grads(loss)(loss.params(), x, y)
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), x, y, strategy="ghost")
    assert_unchanged(before, snapshot(inner))

    # torch.compile(model) prefixes the names with "_orig_mod."; the order is the model's.
    assert len(grads) == len(expected)
    for got, want in zip(grads.values(), expected.values()):
        assert got.shape == want.shape and got.shape[0] == BATCH
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-10, atol=1e-12)
    loop = torch.stack(
        [torch.cat([g[i].reshape(-1) for g in expected.values()]).norm() for i in range(BATCH)]
    )
    torch.testing.assert_close(norms, loop, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", NO_COMPILER_BACKENDS)
def test_dp_step_leaves_the_compiled_model_as_it_was(backend: str) -> None:
    compiled, inner = compiled_whole(backend)
    before = snapshot(inner)
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.0)  # the values stay too
    private = pergrad.dp.DPOptimizer(
        optimizer,
        compiled,
        F.cross_entropy,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        expected_batch_size=BATCH,
    )
    private.step(*make_batch())
    after = snapshot(inner)
    after["grads"] = before["grads"]  # .grad holds the private gradient, as an optimizer's
    assert_unchanged(before, after)
    # and the compiled model still runs plain (no pergrad hook left in its graphs)
    torch.testing.assert_close(compiled(make_batch()[0]), make_model()(make_batch()[0]))


def dp_updates(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], strategy: str = "ghost"
) -> list[list[torch.Tensor]]:
    """The parameters after each of several noiseless DP-SGD steps of ``model`` (every example
    clipped)."""
    private = dp_optimizer(model, strategy)
    updates = []
    for x, y in batches:
        assert private.step(x, y).clip_fraction == 1.0
        updates.append([p.detach().clone() for p in model.parameters()])
    return updates


def batches(sizes: tuple[int, ...] = (BATCH, BATCH, BATCH)) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(size, FEATURES, dtype=torch.float64, generator=generator),
            torch.randint(0, CLASSES, (size,), generator=generator),
        )
        for size in sizes
    ]


@pytest.fixture
def in_graphs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each capture of a ``torch.compile(model)`` came from whole graphs
    (``torch_compiled.capture`` gave records) or took the eager capture (as a first run of a
    layout does: its checks run eagerly)."""
    from pergrad._src.capture import torch_compiled

    taken: list[bool] = []
    original = torch_compiled.capture

    def spy(*args: Any, **kwargs: Any) -> Any:
        found = original(*args, **kwargs)
        if isinstance(args[0].model, torch._dynamo.eval_frame.OptimizedModule):
            taken.append(found is not None)
        return found

    monkeypatch.setattr(torch_compiled, "capture", spy)
    return taken


@pytest.mark.parametrize("backend", NO_COMPILER_BACKENDS)
def test_dp_steps_of_a_compiled_model_run_in_whole_graphs_and_equal_the_eager_ones(
    backend: str, in_graphs: list[bool]
) -> None:
    """The first step checks the layout eagerly; the next ones capture the compiled model's
    records in whole graphs, with the eager model's update (every example clipped), and a
    new batch size (Poisson sampling) compiles its probes' shapes and stays exact."""
    steps = batches((BATCH, BATCH, BATCH - 1, BATCH))
    expected = dp_updates(make_model(), steps)
    compiled, inner = compiled_whole(backend)
    before = snapshot(inner)
    got = dp_updates(compiled, steps)
    assert in_graphs == [False, True, True, True]  # the first step: eager, checked
    for got_step, expected_step in zip(got, expected):
        for a, b in zip(got_step, expected_step):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    after = snapshot(inner)
    after["grads"], after["params"] = before["grads"], before["params"]  # the optimizer's
    assert_unchanged(before, after)


def test_the_hot_path_of_a_compiled_ghost_step_is_one_graph(in_graphs: list[bool]) -> None:
    """After the first (eager, checking) step, a step compiles ONE graph with no break (the
    norm pass: the model with every layer's probe), and a later one compiles nothing."""
    from torch._dynamo.utils import counters

    counted = []
    compiled, _ = compiled_whole("aot_eager")
    private = dp_optimizer(compiled, "ghost")
    for x, y in batches():
        counters.clear()
        private.step(x, y)
        counted.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    assert in_graphs == [False, True, True]
    assert counted == [(0, 0), (1, 0), (0, 0)]


def test_norms_of_a_compiled_model_in_whole_graphs_equal_the_loop(in_graphs: list[bool]) -> None:
    x, y = make_batch()
    eager_loss = pergrad.module_loss(make_model(), F.cross_entropy)
    grads = pergrad.per_example_grads(eager_loss)(eager_loss.params(), x, y)
    loop = torch.stack(
        [torch.cat([g[i].reshape(-1) for g in grads.values()]).norm() for i in range(BATCH)]
    )
    loss = pergrad.module_loss(compiled_whole("aot_eager")[0], F.cross_entropy)
    for _ in range(2):  # the first call checks the layout, the second runs in whole graphs
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), x, y, strategy="ghost")
        torch.testing.assert_close(norms, loop, rtol=1e-10, atol=1e-12)
    assert in_graphs == [False, True]


def test_a_dropped_layer_record_takes_the_eager_capture(
    monkeypatch: pytest.MonkeyPatch, in_graphs: list[bool]
) -> None:
    """A compiled run that misses a layer call's record (here: a hook that records nothing for
    the last layer, as a graph reused without pergrad's hooks would) is not used: the step
    takes the eager capture and its norms count every layer."""
    from pergrad._src.capture import torch_compiled

    original = torch_compiled._probe_hook

    def forgetful(size: int, axes: Any, name: str, module: nn.Module, args: Any, out: Any) -> Any:
        if name.endswith(".3"):
            return out
        return original(size, axes, name, module, args, out)

    monkeypatch.setattr(torch_compiled, "_probe_hook", forgetful)
    x, y = make_batch()
    eager_loss = pergrad.module_loss(make_model(), F.cross_entropy)
    expected = pergrad.norms.per_example_norms_of(eager_loss, eager_loss.params(), x, y)
    loss = pergrad.module_loss(compiled_whole("aot_eager")[0], F.cross_entropy)
    for _ in range(3):
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), x, y, strategy="ghost")
        torch.testing.assert_close(norms, expected, rtol=1e-10, atol=1e-12)
    assert in_graphs == [False, False, False]


def test_a_graph_compiled_before_the_dp_steps_is_not_reused_without_records(
    in_graphs: list[bool],
) -> None:
    """The user's compiled model called before pergrad's steps (its graphs traced without
    pergrad's hooks, which dynamo does not guard on) and between them: the steps stay exact,
    and the model's own calls stay plain."""
    steps = batches()
    expected = dp_updates(make_model(), steps)
    compiled, _ = compiled_whole("aot_eager")
    x = make_batch()[0]
    plain = compiled(x).detach()
    torch.testing.assert_close(plain, make_model()(x))
    got = dp_updates(compiled, steps)
    assert in_graphs == [False, True, True]
    for a, b in zip(got[-1], expected[-1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    model_after = make_model()
    for p, value in zip(model_after.parameters(), got[-1]):
        p.data.copy_(value)
    torch.testing.assert_close(compiled(x), model_after(x))  # no probe left in its graph


class TokensWithABreak(nn.Module):
    """Token and position embeddings (the positions one ``(1, T)`` row shared by the batch,
    broadcast: pergrad expands them per example), a graph break of the model's own between
    its layers, and a linear head over the mean of the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(11, 8)
        self.positions = nn.Embedding(4, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        hidden = self.tokens(ids) + self.positions(positions)
        torch._dynamo.graph_break()
        return self.head(torch.tanh(hidden).mean(1))


def test_shared_positions_and_a_break_of_the_models_own_stay_exact(
    in_graphs: list[bool],
) -> None:
    """The records of a compiled run cut by the model's own graph break are complete (two
    graphs, pergrad's probes in both), and a lookup broadcast over the batch gets its
    per-example output gradients: the steps equal the eager model's."""
    generator = torch.Generator().manual_seed(3)
    steps = [
        (torch.randint(0, 11, (BATCH, 4), generator=generator), torch.randint(0, CLASSES, (BATCH,)))
        for _ in range(3)
    ]

    def model() -> nn.Module:
        torch.manual_seed(0)
        return TokensWithABreak().double()

    expected = dp_updates(model(), steps)
    got = dp_updates(torch.compile(model(), backend="aot_eager"), steps)
    assert in_graphs == [False, True, True]
    for a, b in zip(got[-1], expected[-1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_model_whose_layers_are_compiled_in_place_keeps_the_eager_capture(
    in_graphs: list[bool],
) -> None:
    """``layer.compile()``: each layer a graph of its own, the hooks outside them: the
    compiled capture does not apply, and the steps equal the eager ones."""
    from pergrad._src.capture import torch_compiled
    from pergrad._src.capture.torch_plan import ownership

    steps = batches()
    expected = dp_updates(make_model(), steps)
    model, _ = compiled_layers("aot_eager")
    got = dp_updates(model, steps)
    assert in_graphs == []  # (not a torch.compile(model))
    for a, b in zip(got[-1], expected[-1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    whole = torch.compile(compiled_layers("aot_eager")[0], backend="aot_eager")
    owners = ownership(whole, dict(whole.named_parameters()), {})
    assert "compiled on its own" in torch_compiled.why_not(whole, owners)
    layers = {name: "linear" for name in ("_orig_mod.0", "_orig_mod.3")}
    assert "compiled on its own" in torch_compiled.describe(whole, layers)
    plain = compiled_whole("aot_eager")[0]
    assert "whole graphs" in torch_compiled.describe(plain, layers)
    tables = {**layers, "_orig_mod.1": "position-bias"}
    assert "position-bias tables" in torch_compiled.describe(plain, tables)
    assert torch_compiled.describe(make_model(), {"0": "linear"}) is None


class RMSNormLike(nn.Module):
    """The attributes of a Hugging Face RMS norm (``weight``, ``variance_epsilon``: pergrad
    finds its rule by them and checks each call's formula). ``shift_at``: a batch size at which
    it adds 0.1 to its output (then not an RMS norm, which its rule must refuse)."""

    def __init__(self, width: int, shift_at: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.variance_epsilon = 1e-6
        self.shift_at = shift_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * x_hat
        return out + 0.1 if x.shape[0] == self.shift_at else out


def rms_model(shift_at: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 8), nn.Tanh(), RMSNormLike(8, shift_at), nn.Linear(8, CLASSES)
    ).double()


def test_an_rms_norm_checked_by_its_rule_runs_in_whole_graphs(in_graphs: list[bool]) -> None:
    """A layer whose rule checks each call (Hugging Face's RMS norms: Llama, Mistral, Gemma)
    no longer cuts the compiled graph: its check runs on the eager run of each layout, and the
    steps after the first are one graph without a break, with the eager model's updates."""
    from torch._dynamo.utils import counters

    from pergrad._src.capture import torch_compiled

    steps = batches()
    expected = dp_updates(rms_model(), steps)
    compiled = torch.compile(rms_model(), backend="aot_eager")
    private = dp_optimizer(compiled, "ghost")
    counted = []
    for x, y in steps:
        counters.clear()
        assert private.step(x, y).clip_fraction == 1.0
        counted.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    assert in_graphs == [False, True, True]
    assert counted == [(0, 0), (1, 0), (0, 0)]
    for a, b in zip(compiled.parameters(), expected[-1]):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)
    layers = {"_orig_mod.0": "linear", "_orig_mod.2": "hf_rms_norm", "_orig_mod.3": "linear"}
    assert "whole graphs" in torch_compiled.describe(compiled, layers)


def test_a_call_its_rule_refuses_in_a_new_compiled_layout_is_refused() -> None:
    """A layer that passes its rule's check at one batch size and computes something else at
    another (Poisson sampling's next size): the compiled capture checks the eager run of the
    new layout before it compiles, the eager capture takes the step, and it refuses the layer
    (as the eager model's step does), instead of clipping by norms of the wrong gradient."""

    def steps_of(model: nn.Module) -> str:
        private = dp_optimizer(model, "ghost")
        for x, y in batches((BATCH, BATCH)):
            private.step(x, y)
        with pytest.raises(ValueError, match="strategy='ghost' cannot handle") as refused:
            private.step(*batches((BATCH - 1,))[0])
        return str(refused.value)

    eager = steps_of(rms_model(shift_at=BATCH - 1))
    compiled = steps_of(torch.compile(rms_model(shift_at=BATCH - 1), backend="aot_eager"))
    assert "does not compute weight * x" in eager
    assert "does not compute weight * x" in compiled


class AttentionNet(nn.Module):
    """A linear embedding, ``nn.MultiheadAttention`` (whose rule records its projections' inputs
    and the parameter values of the pass: a ``record``), and a linear head over the mean; with
    ``uses_weights`` set, the loss reads the attention weights too (which the rule must
    refuse)."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, CLASSES)
        self.need_weights, self.uses_weights = need_weights, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        attended, weights = self.attn(h, h, h, need_weights=self.need_weights)
        logits = self.head(attended.mean(1))
        return logits + 3 * weights[:, :, :1].sum(1) if self.uses_weights else logits


def attention_model(need_weights: bool) -> nn.Module:
    torch.manual_seed(0)
    return AttentionNet(need_weights).double()


def token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    return [
        (
            torch.randn(BATCH, 4, FEATURES, dtype=torch.float64, generator=generator),
            torch.randint(0, CLASSES, (BATCH,), generator=generator),
        )
        for _ in range(3)
    ]


def counted_dp_steps(
    model: nn.Module, steps: list[Any], strategy: str = "ghost"
) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """Dynamo's (graphs compiled, graph breaks) in each of noiseless DP steps of ``model``
    (every example clipped), and the parameters after them."""
    from torch._dynamo.utils import counters

    private = dp_optimizer(model, strategy)
    counted = []
    for x, y in steps:
        counters.clear()
        assert private.step(x, y).clip_fraction == 1.0
        counted.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
    return counted, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("need_weights", [False, True], ids=["weights-off", "weights-unused"])
def test_multihead_attention_runs_in_whole_graphs(
    need_weights: bool, in_graphs: list[bool]
) -> None:
    """``nn.MultiheadAttention``, whose rule records more than its positional inputs: its
    record is traced into the compiled graph, the probe added to the attention's output (and,
    with ``need_weights=True``, the module's default, another to the weights, whose gradient is
    all zeros where the loss does not use them), and the steps after the first are one graph
    without a break, with the eager model's updates."""
    steps = token_batches()
    _, expected = counted_dp_steps(attention_model(need_weights), steps)
    counted, got = counted_dp_steps(
        torch.compile(attention_model(need_weights), backend="aot_eager"), steps
    )
    assert in_graphs == [False, True, True]
    assert counted == [(0, 0), (1, 0), (0, 0)]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    loss = pergrad.module_loss(torch.compile(attention_model(need_weights)), F.cross_entropy)
    assert "whole graphs" in pergrad.norms.choose_strategy(loss, loss.params(), *steps[0]).reason


def test_attention_weights_the_loss_uses_refuse_the_rule_compiled(in_graphs: list[bool]) -> None:
    """The loss reads the attention weights from the third step on (the model's flag, which
    dynamo guards on: it compiles again), after two that did not: in whole graphs, their
    probe's gradient is not zero, and the ghost strategy refuses the call (as for the eager
    model) instead of leaving that path out of the norms."""
    steps = token_batches()
    inner = attention_model(True)
    model = torch.compile(inner, backend="aot_eager")
    private = dp_optimizer(model, "ghost")
    for x, y in steps[:2]:
        private.step(x, y)
    inner.uses_weights = True
    with pytest.raises(ValueError, match="attention weights"):
        private.step(*steps[2])
    assert in_graphs == [False, True, True]  # the refused step's records came from graphs


class TokenEmbedding(nn.Module):
    """A projection with a class token prepended and position embeddings added, all owned by
    one module (as a ViT's embeddings): the two bare parameters make it a generic unit, run
    alone over the examples, its projection keeping its own rule inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, 8)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.positions = nn.Parameter(0.5 * torch.randn(1, 5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.proj(x)
        return torch.cat([self.cls.expand(len(x), -1, -1), tokens], 1) + self.positions


class TokenModel(nn.Module):
    """The embeddings above, a linear head over the mean token, and a learnable temperature
    of the model itself (a unit: the model under the compiled one)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = TokenEmbedding()
        self.head = nn.Linear(8, CLASSES)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)).mean(1)) / self.temperature


def test_generic_units_run_in_whole_graphs(in_graphs: list[bool]) -> None:
    """Parameters no layer rule owns (a class token and position embeddings beside a
    projection; a temperature of the model itself) are generic units: their arguments and
    first output are recorded inside the compiled graph with a probe on that output, so the
    steps after the first are one graph without a break, with the eager model's updates."""
    from pergrad._src.capture import torch_compiled

    def model() -> nn.Module:
        torch.manual_seed(0)
        return TokenModel().double()

    steps = token_batches()
    _, expected = counted_dp_steps(model(), steps)
    compiled = torch.compile(model(), backend="aot_eager")
    counted, got = counted_dp_steps(compiled, steps)
    assert in_graphs == [False, True, True]
    assert counted == [(0, 0), (1, 0), (0, 0)]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    loss = pergrad.module_loss(compiled, F.cross_entropy)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), *steps[0])
    assert {choice.layers[n] for n in ("_orig_mod", "_orig_mod.embed")} == {"generic"}
    assert "whole graphs" in torch_compiled.describe(compiled, choice.layers)


def inductor_or_skip() -> None:
    """Skip, with the reason, where inductor cannot build a kernel on this machine (no C++
    compiler, no Python headers): a limit of the machine, not of pergrad."""
    try:
        torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(3))
    except Exception as err:  # whatever inductor's build raises
        pytest.skip(f"torch.compile(backend='inductor') fails on this machine: {err!r:.200}")


@pytest.mark.slow(reason="inductor compiles C++ kernels for each graph: about 20-60 s on 2 cores")
def test_dp_steps_of_an_inductor_compiled_model_equal_the_eager_ones(in_graphs: list[bool]) -> None:
    inductor_or_skip()
    steps = batches()
    expected = dp_updates(make_model(), steps)
    compiled, _ = compiled_whole("inductor")
    got = dp_updates(compiled, steps)
    assert in_graphs == [False, True, True]
    for got_step, expected_step in zip(got, expected):
        for a, b in zip(got_step, expected_step):
            # inductor may fuse and reorder float64 arithmetic: close, not bit-equal
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.slow(reason="the benchmark's quick run compiles 3 models with aot_eager: ~30 s")
def test_dp_compile_benchmark_quick_run(tmp_path) -> None:
    """benchmarks/dp_compile.py --quick: every method has a row, and the compiled DP steps
    report their graphs and graph breaks."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "dp_compile.md"
    command = [sys.executable, "benchmarks/dp_compile.py", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=root, check=True, capture_output=True, timeout=600)
    text = out.read_text()
    for method in ("non-private compiled", "pergrad DP compiled", "pergrad DP ghost compiled"):
        assert f"| {method} |" in text
        assert f"/ {method}:" in text  # its graph-break line
    assert "fails" not in text and "not timed" not in text
    assert "load average" in text

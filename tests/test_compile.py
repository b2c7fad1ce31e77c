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


def dp_update(model: nn.Module, strategy: str) -> list[torch.Tensor]:
    """The parameters after one noiseless DP-SGD step of ``model`` on the batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    private = pergrad.dp.DPOptimizer(
        optimizer,
        model,
        F.cross_entropy,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        expected_batch_size=BATCH,
        strategy=strategy,
    )
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


def test_the_graph_breaks_of_a_compiled_ghost_step_are_the_untraced_hooks() -> None:
    """pergrad's capture hook stores each layer's output gradient (a side effect dynamo cannot
    keep in a graph): the graph breaks there, but at a hook dynamo does not try to trace (no
    failed attempt, no recompilation of the hook for each layer), and nowhere else."""
    from torch._dynamo.utils import counters

    counters.clear()
    dp_update(compiled_whole("aot_eager")[0], "ghost")
    reasons = list(counters["graph_break"])
    assert reasons  # the hooks do break the graph: this test watches where
    for reason in reasons:
        assert "torch.compiler.disable" in reason and "capturing.<locals>.hook" in reason, reason


def inductor_or_skip() -> None:
    """Skip, with the reason, where inductor cannot build a kernel on this machine (no C++
    compiler, no Python headers): a limit of the machine, not of pergrad."""
    try:
        torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(3))
    except Exception as err:  # whatever inductor's build raises
        pytest.skip(f"torch.compile(backend='inductor') fails on this machine: {err!r:.200}")


@pytest.mark.slow(reason="inductor compiles C++ kernels for each graph: about 20-60 s on 2 cores")
def test_dp_step_of_an_inductor_compiled_model_equals_the_eager_one() -> None:
    inductor_or_skip()
    expected = dp_update(make_model(), "ghost")
    compiled, _ = compiled_whole("inductor")
    got = dp_update(compiled, "ghost")
    for a, b in zip(got, expected):
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

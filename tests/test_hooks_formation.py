"""How the ``"hooks"`` strategy forms per-example gradients from its records
(``capture/torch_layers.py``, ``capture/torch_rules/norms.py``), and that a call lets go of
them: each family's gradients against a loop over the examples, for the layouts its rule
handles apart (several token axes, a layer called twice, no bias, a padding row, repeated
rows); and the pass's records, graph and outputs freed when the call returns."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402

B = 5


class Shared(nn.Module):
    """A linear layer on two token axes, called twice; a bias-free one; an embedding with a
    padding row, looked up twice; a LayerNorm called twice and one without a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 6, padding_idx=0)
        self.mix = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.plain_norm = nn.LayerNorm(6, bias=False)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens, others):  # tokens (B, 2, 4), others (B, 3)
        h = self.norm(self.mix(self.embed(tokens)))  # (B, 2, 4, 6)
        h = self.mix(torch.tanh(h)) * torch.sigmoid(self.gate(h))
        extra = self.norm(self.embed(others)).sum(1)  # (B, 6)
        pooled = self.plain_norm(h.mean((1, 2)) + extra)
        return self.head(pooled)


def assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12, msg=name)


@pytest.fixture
def shared_case():
    torch.manual_seed(0)
    model = Shared().double()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 9, (B, 2, 4), generator=generator)
    tokens[0, 0, :2] = 0  # the padding row, which gets no gradient
    tokens[1, 1, :] = 3  # one row looked up at every position of an example
    others = torch.randint(0, 9, (B, 3), generator=generator)
    y = torch.randint(0, 3, (B,), generator=generator)
    return model, tokens, others, y


def test_every_family_layout_against_the_loop(shared_case):
    """The checked first call, then two light ones: each the loop's gradients."""
    model, tokens, others, y = shared_case
    loss = pergrad.module_loss(model, F.cross_entropy, num_inputs=2)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    want = torch_module_loop_grads(model, F.cross_entropy, [tokens, others], [y])
    for _ in range(3):
        assert_close(grads(loss.params(), tokens, others, y), want)


def test_the_bench_transformer_against_the_loop():
    """The workload whose time the formation was tuned on: two embeddings, five linear
    layers, two LayerNorms."""
    from pergrad.bench import workloads

    workload = workloads.WORKLOADS["transformer"]
    model, x, y = workloads.build(workload, 4)
    model = model.double()
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    want = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
    for _ in range(2):  # checked, then light
        assert_close(grads(loss.params(), x, y), want)


def test_a_call_lets_go_of_its_records_and_graph(shared_case):
    """Each hooked output holds its graph, and its tensor hook holds the record keeping it:
    a cycle through autograd's objects that the collector cannot break. A call must drop it
    (else every call's activations stay in memory for good)."""
    model, tokens, others, y = shared_case
    loss = pergrad.module_loss(model, F.cross_entropy, num_inputs=2)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    outputs = []

    def keep(module, args, output):
        outputs.append(weakref.ref(output))

    handle = model.mix.register_forward_hook(keep)
    try:
        for _ in range(3):  # the first call (checks, example 0 alone) and light ones
            grads(loss.params(), tokens, others, y)
    finally:
        handle.remove()
    gc.collect(0)  # the youngest generation only: the pass must not need the collector
    assert outputs and all(ref() is None for ref in outputs)


def test_a_refused_call_lets_go_of_its_records_too():
    """A parameter used outside its layer fails the first call's sum check (raised under
    strategy="hooks"); its pass's outputs are freed all the same."""

    from test_models_in_the_wild import Sneaky  # (fc: 5 -> 3, its weight also used outside)

    torch.manual_seed(2)
    model = Sneaky().double()
    outputs = []
    model.fc.register_forward_hook(lambda m, a, o: outputs.append(weakref.ref(o)))
    loss = pergrad.module_loss(model, F.cross_entropy)
    x = torch.randn(B, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (B,))
    with pytest.raises(ValueError):
        pergrad.per_example_grads(loss, strategy="hooks")(loss.params(), x, y)
    gc.collect(0)  # the youngest generation only: the pass must not need the collector
    assert outputs and all(ref() is None for ref in outputs)


class Untied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 7)
        self.head = nn.Linear(7, 7, bias=False)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))


def lm_loss(logits, tokens):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def test_a_weight_tied_between_calls_is_planned_anew():
    """Which layers use each parameter is kept between calls (the plan walks the model); tying
    the head to the embedding after two calls must be seen: the tied weight then gets the sum
    of both uses' gradients, as the loop does."""
    torch.manual_seed(3)
    model = Untied().double()
    loss = pergrad.module_loss(model, lm_loss)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    tokens = torch.randint(0, 7, (B, 4), generator=torch.Generator().manual_seed(6))
    for _ in range(2):
        assert_close(
            grads(loss.params(), tokens, tokens),
            torch_module_loop_grads(model, lm_loss, [tokens], [tokens]),
        )
    model.head.weight = model.embed.weight
    assert_close(
        grads(loss.params(), tokens, tokens),
        torch_module_loop_grads(model, lm_loss, [tokens], [tokens]),
    )


@pytest.mark.slow(reason="a subprocess run of benchmarks/hooks_split.py, 2 rounds: ~10 s")
def test_hooks_split_benchmark_runs(tmp_path) -> None:
    """benchmarks/hooks_split.py: the calls, the floor and every hooked layer's rule reported."""
    out = tmp_path / "hooks_split.md"
    command = [sys.executable, "benchmarks/hooks_split.py", "--rounds", "2", "--out", str(out)]
    root = Path(__file__).resolve().parents[1]
    subprocess.run(command, check=True, cwd=root, capture_output=True, timeout=600)
    first = [line.split(" | ")[0][2:] for line in out.read_text().splitlines()[4:]]
    for row in ("batch grad", "hooks", "floor (batch grad + write B x P)"):
        assert row in first
    for layer in ("embed", "pos", "qkv", "proj", "ln1", "ff1", "ff2", "ln2", "head"):
        assert any(line.startswith(f"rule: {layer} (") for line in first)

"""Rules run on chunks of examples where widening their low-precision records is large.

``rules._in_precision`` widens a bfloat16 / float16 call to float32 before its rule runs; past
``widening.WIDENED_WHOLE_NUMBERS`` numbers it widens and reduces a chunk of examples at a time
(issue 36: an LM head's vocabulary-wide output gradients copied whole in float32). The thresholds
are lowered here so that tiny layers are chunked. References: the same rule on the whole call
(the same operations, example by example), each example's gradient of the layer in float64
from the same records, and a float64 loop of single-example gradients of a model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the layer rules are PyTorch's")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from pergrad._src.capture import cost, rules, torch_norms, torch_rules, widening  # noqa: E402, F401
from pergrad._src.capture.torch_layers import LayerCall  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

BATCH, POSITIONS, WIDTH, VOCAB = 7, 5, 8, 64
# an LM head's call widens T (D + V) = 360 numbers an example, 2520 for the batch: 800 makes
# chunks of 2 examples (2, 2, 2, 1) and leaves the 8 x 8 layers (560 numbers at most) whole
LOWERED = 800


@pytest.fixture
def chunk_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The threshold lowered; each chunked rule call's examples per chunk, as it runs."""
    sizes: list[int] = []
    chunked = widening._chunked

    def spy(fn: Any, layer: Any, calls: Any, args: Any, chunk: int, summed: bool) -> Any:
        sizes.append(chunk)
        return chunked(fn, layer, calls, args, chunk, summed)

    monkeypatch.setattr(widening, "_chunked", spy)
    monkeypatch.setattr(widening, "WIDENED_CHUNK_NUMBERS", LOWERED)
    monkeypatch.setattr(widening, "WIDENED_WHOLE_NUMBERS", LOWERED)
    return sizes


def unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(widening, "WIDENED_CHUNK_NUMBERS", 2**40)
    monkeypatch.setattr(widening, "WIDENED_WHOLE_NUMBERS", 2**40)


def estimate_and_bound(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A rule's squared norms as ``(estimate, bound)`` (bound 0 for a plain tensor)."""
    if isinstance(value, cost.Certified):
        return value.estimate, value.bound
    return value, torch.zeros_like(value)


# float32 layers with the bfloat16 records autocast gives them: (layer, its input)
LAYERS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "lm head": lambda: (nn.Linear(WIDTH, VOCAB), torch.randn(BATCH, POSITIONS, WIDTH)),
    "embedding": lambda: (nn.Embedding(16, 32), torch.randint(0, 16, (BATCH, 12))),
    "conv": lambda: (nn.Conv1d(WIDTH, 32, 3), torch.randn(BATCH, WIDTH, 12)),
    "layer norm": lambda: (nn.LayerNorm(VOCAB), torch.randn(BATCH, POSITIONS, VOCAB)),
}


def layer_calls(name: str) -> tuple[nn.Module, list[LayerCall]]:
    torch.manual_seed(0)
    layer, x = LAYERS[name]()
    if x.is_floating_point():
        x = x.to(torch.bfloat16)
    with torch.no_grad():
        out = layer(x.float() if x.is_floating_point() else x)
    return layer, [LayerCall((x,), torch.randn_like(out).to(torch.bfloat16))]


def float64_grads(layer: nn.Module, call: LayerCall) -> dict[str, torch.Tensor]:
    """Each example's gradient of ``<layer(x_b), d_b>``, the layer in float64 on the records
    as they are: ``{param: (B, *shape)}``."""
    wide = copy.deepcopy(layer).double()
    (x,), d = call.inputs, call.output_grad.double()
    grads: dict[str, list[torch.Tensor]] = {name: [] for name, _ in wide.named_parameters()}
    for b in range(BATCH):
        row = x[b : b + 1].double() if x.is_floating_point() else x[b : b + 1]
        found = torch.autograd.grad((wide(row) * d[b : b + 1]).sum(), list(wide.parameters()))
        for name, g in zip(grads, found):
            grads[name].append(g)
    return {name: torch.stack(g) for name, g in grads.items()}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_on_chunks_equals_the_whole_call_and_the_float64_gradients(
    name: str, monkeypatch: pytest.MonkeyPatch, chunk_sizes: list[int]
) -> None:
    layer, calls = layer_calls(name)
    rule = rules.rule_for(layer)
    weights = torch.linspace(0.1, 1.0, BATCH)  # each example its own weight
    chunked = (
        rule.squared_norms(layer, calls),
        rule.per_example(layer, calls),
        rule.weighted_sum(layer, calls, weights),
    )
    assert len(chunk_sizes) == 3 and 1 <= min(chunk_sizes) < BATCH, chunk_sizes
    unchunked(monkeypatch)
    norms, grads, sums = (
        rule.squared_norms(layer, calls),
        rule.per_example(layer, calls),
        rule.weighted_sum(layer, calls, weights),
    )
    assert len(chunk_sizes) == 3  # not chunked
    exact = float64_grads(layer, calls[0])
    assert set(chunked[0]) == set(exact)
    for key, g in exact.items():
        exact_squared = (g**2).reshape(BATCH, -1).sum(1)
        estimate, bound = estimate_and_bound(chunked[0][key])
        want_estimate, want_bound = estimate_and_bound(norms[key])
        # the same operations on each example: each one's estimate and bound as the whole's
        torch.testing.assert_close(estimate, want_estimate, rtol=1e-6, atol=0)
        torch.testing.assert_close(bound, want_bound, rtol=1e-6, atol=0)
        tolerance = bound.double() + 1e-5 * exact_squared  # certified, or float32 rounding
        assert ((estimate.double() - exact_squared).abs() <= tolerance).all(), key
        torch.testing.assert_close(chunked[1][key], grads[key], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(chunked[1][key].double(), g, rtol=1e-5, atol=1e-6)
        weighted = torch.tensordot(weights.double(), g, dims=1)
        torch.testing.assert_close(chunked[2][key], sums[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(chunked[2][key].double(), weighted, rtol=1e-5, atol=1e-6)


def test_float32_calls_are_never_chunked(
    monkeypatch: pytest.MonkeyPatch, chunk_sizes: list[int]
) -> None:
    """Nothing to widen, nothing to save: a float32 call runs whole, however large."""
    layer, calls = layer_calls("lm head")
    (x,), d = calls[0].inputs, calls[0].output_grad
    calls = [LayerCall((x.float(),), d.float())]
    rule = rules.rule_for(layer)
    rule.squared_norms(layer, calls)
    rule.weighted_sum(layer, calls, torch.ones(BATCH))
    assert chunk_sizes == []


def test_a_weighted_sum_is_chunked_only_where_that_saves_memory(
    chunk_sizes: list[int],
) -> None:
    """Chunks of a weighted sum hold two parameter-sized sums at once: a table of 64 x 32
    numbers is more than its chunks save (2688 numbers widened, 768 at a time)."""
    torch.manual_seed(0)
    layer = nn.Embedding(VOCAB, 32)
    ids = torch.randint(0, VOCAB, (BATCH, 12))
    calls = [LayerCall((ids,), torch.randn(BATCH, 12, 32).to(torch.bfloat16))]
    rule = rules.rule_for(layer)
    rule.squared_norms(layer, calls)
    assert chunk_sizes == [2]
    rule.weighted_sum(layer, calls, torch.ones(BATCH))
    assert chunk_sizes == [2]


def test_a_call_with_another_input_is_widened_whole(chunk_sizes: list[int]) -> None:
    """A bilinear layer's second input may be shared by the batch: not sliced."""
    torch.manual_seed(0)
    layer = nn.Bilinear(WIDTH, WIDTH, VOCAB)
    x1, x2 = (torch.randn(BATCH, POSITIONS, WIDTH).to(torch.bfloat16) for _ in range(2))
    calls = [LayerCall((x1, x2), torch.randn(BATCH, POSITIONS, VOCAB).to(torch.bfloat16))]
    rules.rule_for(layer).squared_norms(layer, calls)
    assert chunk_sizes == []


def test_deferred_norms_of_chunks_replay_and_tighten_as_the_whole_call(
    monkeypatch: pytest.MonkeyPatch, chunk_sizes: list[int]
) -> None:
    """A ghost step's norms defer their tightening (``torch_norms.deferred_tightening``): each
    chunk's certified pairs are checked with the other layers' (of other lengths), and the
    loose ones computed again from the replayed chunks: the whole call's values."""
    layer, calls = layer_calls("lm head")
    (a,), d = calls[0].inputs, calls[0].output_grad
    # examples 1 and 4: their positions' gradients cancel (one input, output gradients d, -d,
    # d, -d, 0): a zero gradient, whose fast bound is loose against any estimate
    a, d = a.clone(), d.clone()
    for b in (1, 4):
        a[b] = a[b, :1]
        d[b, ::2], d[b, 1::2], d[b, -1] = d[b, 0], -d[b, 0], 0
    calls = [LayerCall((a,), d)]
    rule = rules.rule_for(layer)
    with torch_norms.deferred_tightening() as found:
        rule.squared_norms(layer, calls)
    assert chunk_sizes == [2]
    other = cost.Certified(torch.ones(BATCH), torch.zeros(BATCH))  # another layer's pair
    counts, _, order = torch_norms.loose_counts([other, *found])
    read = dict(zip(order, counts.tolist()))
    loose = [read[k + 1] for k in range(len(found))]
    assert sum(loose) >= 2, loose  # the cancelling examples are loose
    with torch_norms.replayed(found, loose):
        tightened = rule.squared_norms(layer, calls)
    assert chunk_sizes == [2, 2]
    unchunked(monkeypatch)
    want = rule.squared_norms(layer, calls)
    for key, value in want.items():
        for got, expected in zip(estimate_and_bound(tightened[key]), estimate_and_bound(value)):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


class TinyLM(nn.Module):
    """Token embeddings, one hidden layer and an LM head whose output gradients, vocabulary
    wide, are the call chunked."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, POSITIONS + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def float64_loop(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> list[Any]:
    """Each example's gradient of a float64 copy of the model, one example at a time."""
    wide = copy.deepcopy(model).double()
    return [
        torch.autograd.grad(token_loss(wide(ids[b : b + 1]), targets[b : b + 1]), wide.parameters())
        for b in range(BATCH)
    ]


def test_bfloat16_lm_norms_and_clipped_sum_on_chunks(
    monkeypatch: pytest.MonkeyPatch, chunk_sizes: list[int]
) -> None:
    """A bfloat16 model: its head's calls chunked; the norms as unchunked (bit for bit: each
    example's operations are the same), the clipped sum as unchunked to bfloat16 rounding, both
    as a float64 loop's to bfloat16's (the model's own rounding: 3%, as in
    test_dp_mixed_precision.py; a wrong clip factor or a lost chunk is off by more)."""
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    ids, targets = lm_batch()
    loss = pergrad.module_loss(model, token_loss)
    max_norm = 0.5

    def reduced() -> Any:
        return pergrad.dp.clipped_sum_of(loss, loss.params(), ids, targets, max_norm=max_norm)

    clipped = reduced()
    assert chunk_sizes == [2, 2], chunk_sizes  # the head's norms and weighted sum
    unchunked(monkeypatch)
    want = reduced()
    assert len(chunk_sizes) == 2
    assert torch.equal(clipped.norms, want.norms)
    summed = clipped.sum
    for key, value in want.sum.items():
        torch.testing.assert_close(summed[key], value, rtol=2**-7, atol=2**-12)
    grads = float64_loop(model, ids, targets)
    names = [name for name, _ in model.named_parameters()]
    exact = torch.stack([sum((g**2).sum() for g in example) for example in grads]).sqrt()
    torch.testing.assert_close(clipped.norms.double(), exact, rtol=3e-2, atol=0)
    scale = (max_norm / exact).clamp(max=1)
    for k, name in enumerate(names):
        want = sum(scale[b] * grads[b][k] for b in range(BATCH))
        error = (summed[name].double() - want).norm()
        assert error <= 3e-2 * want.norm() + 1e-3, (name, error, want.norm())


def test_each_example_adds_at_most_max_norm_on_chunks(chunk_sizes: list[int]) -> None:
    """Under autocast (float32 parameters, bfloat16 records), each example's share of the
    clipped sum, chunked, is within the bound to float32 rounding: the first and last of a
    chunk of 2, and the last chunk's only one."""
    torch.manual_seed(0)
    model = TinyLM()
    ids, targets = lm_batch()
    loss = pergrad.module_loss(model, token_loss)
    max_norm = 1e-3  # every example clipped
    for b in (0, 3, BATCH - 1):
        mask = torch.arange(BATCH) == b
        with torch.autocast("cpu", dtype=torch.bfloat16):
            clipped = pergrad.dp.clipped_sum_of(
                loss, loss.params(), ids, targets, max_norm=max_norm, mask=mask
            )
        share = torch.stack([g.double().norm() for g in clipped.sum.values()]).norm()
        assert max_norm * 0.99 <= share <= max_norm * (1 + 1e-5), (b, share)
    assert chunk_sizes == [2, 2] * 3, chunk_sizes

"""Host synchronisations of the ghost DP step, counted on the CPU (issue 38).

On an accelerator each read of a device value on the host (``bool(tensor)``, ``.item()``,
``.tolist()``, ``nonzero``, ``torch.unique``) stalls Python until the device has caught up.
The ghost step reads what it must know (which layers' certified norms to tighten, whether a
tied parameter's uses cancel, whether every norm is finite) in one read after every layer's
norms (``capture/torch_quantities.squared_norms``), and the step's statistics in one more
(``torch/dp_step.host_numbers``); ``capture/cost.DEFERRED_READS`` off restores a read where each
arises. :class:`pergrad.bench.host_syncs.HostSyncs` counts them on any device.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch's host reads")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from pergrad._src.capture import cost, torch_norms  # noqa: E402
from pergrad._src.capture.torch_layers import distinct_slots  # noqa: E402
from pergrad.bench.host_syncs import HostSyncs  # noqa: E402

VOCAB, WIDTH, LENGTH, BATCH = 40, 12, 6, 4
# the norms' flags and the step's statistics
STEADY_STATE_SYNCS = 2


def test_host_syncs_counts_each_kind_of_read_once() -> None:
    x = torch.arange(6.0) - 2
    with HostSyncs() as syncs:
        (x * 2).sum()  # no read
        bool(x.any())
        x.tolist()
        float(x[0])
        x.nonzero()
        x[x > 0]  # boolean indexing: its shape depends on the values
        torch.unique(x)
    assert syncs.count == 6
    assert {op for op, _, _ in syncs.top_sites()} == {
        "__bool__",
        "tolist",
        "__float__",
        "nonzero",
        "index",
        "_unique2",
    }


class TiedLM(nn.Module):
    """GPT-2's shape in small: a tied embedding and head, dense layers applied at every
    position (their certified norms are tightened where loose), a layer norm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(LENGTH, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape)
        h = self.emb(tokens) + self.pos(positions)
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(self.norm(h))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def dp_steps(steps: int, noise: float = 0.0) -> tuple[nn.Module, pergrad.dp.DPOptimizer, tuple]:
    """The model, its DPOptimizer (the ghost strategy) and the batch, after ``steps`` steps."""
    torch.manual_seed(0)
    model = TiedLM()
    private = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        lm_loss,
        max_norm=0.05,
        noise_multiplier=noise,
        expected_batch_size=BATCH,
        strategy="ghost",
    )
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=generator)
    batch = (ids[:, :-1], ids[:, 1:])
    for _ in range(steps):
        private.step(*batch)
    return model, private, batch


def test_steady_state_ghost_dp_step_reads_the_host_twice(monkeypatch) -> None:
    _, private, batch = dp_steps(2)  # the first call's checks read more, once
    with HostSyncs(within="pergrad") as syncs:
        taken = private.step(*batch)
    assert taken.strategy == "ghost" and taken.clip_fraction > 0
    assert syncs.count == STEADY_STATE_SYNCS, syncs.top_sites()
    # one read a layer, as before: the count tells them apart
    monkeypatch.setattr(cost, "DEFERRED_READS", False)
    with HostSyncs(within="pergrad") as syncs:
        private.step(*batch)
    assert syncs.count >= STEADY_STATE_SYNCS + 4, syncs.top_sites()


def test_deferred_reads_give_the_same_update_bit_for_bit(monkeypatch) -> None:
    updates = []
    for deferred in (True, False):
        monkeypatch.setattr(cost, "DEFERRED_READS", deferred)
        model, _, _ = dp_steps(3, noise=1.0)
        updates.append([p.detach().clone() for p in model.parameters()])
    for deferred, before in zip(*updates):
        assert torch.equal(deferred, before)


def cancelling_linear(cancel: float) -> tuple[pergrad.ModuleLoss, tuple[torch.Tensor, ...]]:
    """A linear layer whose per-example gradient ``sum_t a_t v_t^T`` cancels to ``cancel``
    times its terms in the first example (its second half of positions repeats the first with
    the loss weights negated and shrunk), not in the others (the same weights again)."""
    generator = torch.Generator().manual_seed(2)
    a = torch.randn(BATCH, LENGTH // 2, WIDTH, generator=generator)
    v = torch.randn(BATCH, LENGTH // 2, WIDTH, generator=generator)
    shrink = -torch.ones(BATCH, 1, 1)  # the same terms twice: nothing cancels
    shrink[0] = 1 - cancel
    inputs = torch.cat([a, a], 1)
    weights = torch.cat([v, -shrink * v], 1)
    layer = nn.Linear(WIDTH, WIDTH, bias=False)
    return pergrad.module_loss(layer, lambda out, w: (out * w).sum()), (inputs, weights)


def test_a_loose_norm_is_tightened_as_before(monkeypatch) -> None:
    loss, args = cancelling_linear(cancel=1e-5)
    a, v = (x.double() for x in args)
    exact = torch.einsum("btp,btq->bpq", a, v).flatten(1).norm(dim=1)
    pergrad.norms.per_example_norms_of(loss, loss.params(), *args, strategy="ghost")  # checks
    routes = float64_routes(monkeypatch)  # each computation of the norms: float64 or not
    norms = {}
    for deferred in (True, False):
        monkeypatch.setattr(cost, "DEFERRED_READS", deferred)
        routes.clear()
        norms[deferred] = pergrad.norms.per_example_norms_of(
            loss, loss.params(), *args, strategy="ghost"
        )
        # the fast route once (its deferred result is replayed), then the loose example again
        assert routes == [False, True], (deferred, routes)
    assert torch.equal(norms[True], norms[False])
    # the first example's float32 estimate would be far off: it was computed again in float64
    np.testing.assert_allclose(norms[True].double(), exact, rtol=1e-5)


@pytest.mark.parametrize("size", [1, 2, 9, 64])
def test_distinct_slots_are_unique_padded(size: int) -> None:
    keys = torch.randint(0, 7, (size,), generator=torch.Generator().manual_seed(size))
    distinct, inverse = torch.unique(keys, return_inverse=True)
    slot_keys, slot_of_position = distinct_slots(keys)
    assert torch.equal(slot_of_position, inverse)
    assert torch.equal(slot_keys[: len(distinct)], distinct)
    assert not slot_keys[len(distinct) :].any()


class CancellingLayer(nn.Module):
    """A linear layer (its weight's per-example gradient ``sum_t a_t v_t^T`` does not depend
    on the weight) and a second one after it, whose norms stay tight."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH, bias=False)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.first(inputs) + self.second(torch.tanh(inputs))


def loose_dp_steps(
    steps: int, noise: float = 0.0, nonfinite: bool = False
) -> tuple[nn.Module, pergrad.dp.DPOptimizer]:
    """A model whose first layer has a loose certified norm at every step (the first
    example's positions cancel, :func:`cancelling_linear`'s records) and its DPOptimizer
    (the ghost strategy), after ``steps`` steps on that batch (with ``nonfinite``, the last
    example's input has an inf from the second step on: the first call's checks compare
    each example's loss alone with the batch's)."""
    inputs, weights = loose_batch()
    torch.manual_seed(0)
    model = CancellingLayer()
    private = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        lambda out, w: (out * w).sum(),
        max_norm=0.5,
        noise_multiplier=noise,
        expected_batch_size=BATCH,
        strategy="ghost",
        generator=torch.Generator().manual_seed(3),
    )
    private.step(inputs, weights)
    for _ in range(steps - 1):
        private.step(*loose_batch(nonfinite))
    return model, private


def loose_batch(nonfinite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cancelling_linear`'s records, the cancelling example second (rows found by
    position, not the first); with ``nonfinite``, the last example's input has an inf."""
    _, args = cancelling_linear(cancel=1e-5)
    inputs, weights = (x.roll(1, 0) for x in args)
    if nonfinite:
        inputs[-1, 0, 0] = float("inf")
    return inputs, weights


def float64_routes(monkeypatch) -> list[bool]:
    """Record, for each computation of a dense layer's norms, whether it ran in float64 (the
    loose rows again) or not."""
    routes: list[bool] = []
    in_chunks = torch_norms._in_chunks
    monkeypatch.setattr(
        torch_norms,
        "_in_chunks",
        lambda *args, **kwargs: (
            routes.append(kwargs.get("wide", False)) or in_chunks(*args, **kwargs)
        ),
    )
    return routes


@pytest.mark.parametrize("nonfinite", [False, True])
def test_a_step_that_tightens_a_loose_norm_reads_the_host_twice(
    monkeypatch, nonfinite: bool
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-finite example's, once
        _, private = loose_dp_steps(2, nonfinite=nonfinite)
    inputs, weights = loose_batch(nonfinite)
    routes = float64_routes(monkeypatch)
    with HostSyncs(within="pergrad") as syncs:
        taken = private.step(inputs, weights)
    assert taken.nonfinite == int(nonfinite)
    assert True in routes  # a loose example was computed again in float64
    assert syncs.count == STEADY_STATE_SYNCS, syncs.top_sites()
    monkeypatch.setattr(cost, "DEFERRED_READS", False)
    routes.clear()
    with HostSyncs(within="pergrad") as syncs:
        private.step(inputs, weights)
    assert True in routes
    # the layer's own reads (whether any is loose, which), the finiteness's and the tie's
    assert syncs.count >= STEADY_STATE_SYNCS + 2, syncs.top_sites()


@pytest.mark.parametrize("nonfinite", [False, True])
def test_tightening_without_a_read_gives_the_same_update_bit_for_bit(
    monkeypatch, nonfinite: bool
) -> None:
    updates = []
    for deferred in (True, False):
        monkeypatch.setattr(cost, "DEFERRED_READS", deferred)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the non-finite example's, once
            model, _ = loose_dp_steps(3, noise=1.0, nonfinite=nonfinite)
        updates.append([p.detach().clone() for p in model.parameters()])
    for deferred, before in zip(*updates):
        assert torch.equal(deferred, before)


@pytest.mark.parametrize("seed", range(6))
def test_first_rows_are_the_true_entries_in_order(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(3 + 5 * seed, generator=generator) < 0.4
    expected = mask.nonzero().squeeze(1)
    assert torch.equal(torch_norms.first_rows(mask, len(expected)), expected)


def test_tightening_that_could_overflow_leaves_the_finiteness_to_read() -> None:
    huge = torch.finfo(torch.float32).max / 2
    tight = cost.Certified(torch.tensor([1.0, 2.0]), torch.tensor([1e-6, 1e-6]))
    loose = cost.Certified(torch.tensor([1.0, huge / 2]), torch.tensor([1e-6, huge]))
    counts, keeps_finite, order = torch_norms.loose_counts([tight, loose])
    assert [int(counts[k]) for k in range(2)] == [0, 1] and order == [0, 1]
    assert not bool(keeps_finite)
    # loose, but its upper bound far from overflowing; or near it, but not loose
    moderate = cost.Certified(torch.tensor([1.0, huge / 4]), torch.tensor([1.0, 1.0]))
    counts, keeps_finite, _ = torch_norms.loose_counts([tight, moderate])
    assert [int(count) for count in counts] == [0, 1] and bool(keeps_finite)

"""Tied parameters held as their formed per-example gradients in the one-pass ghost DP step.

Where a tied table's per-example gradient (``B V D``) is no more numbers than its LM head's
output gradients (``B T V``: sequences at least as long as the width), the DP step forms each
use's term as its last output gradient arrives, sums them into one per-example gradient, takes
its norms from that sum and drops the records (``capture/torch_held_tied.py``); shorter
sequences keep the cross terms of ``torch_tied.py``. Either way the clipped sum must be that of
per-example gradients formed by ordinary training code run one example at a time, and each
example must stay within the bound, also where its uses nearly cancel.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch ghost strategy")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from pergrad._src.capture import torch_held, torch_quantities  # noqa: E402
from pergrad._src.dp.from_loss import clipped_sum_of  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

VOCAB, WIDTH = 50, 8
HELD_LENGTH, SHORT_LENGTH = 12, 4  # V D = 400 <= T V = 600; 400 > 200


class TinyGPT(nn.Module):
    """GPT-2's shape in miniature: token and position tables, a residual block, a final norm
    and the LM head tied to the token table (its only parameter)."""

    def __init__(self, max_length: int = HELD_LENGTH) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(max_length, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        h = self.wte(ids) + self.wpe(positions)
        h = h + torch.tanh(self.block(h))
        return self.head(self.norm(h))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batch(size: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, length), generator=generator)
    labels = torch.randint(0, VOCAB, (size, length), generator=generator)
    return ids, labels


def reference(model, loss_fn, inputs, targets, max_norm):
    """Per-example norms and the clipped sum from a loop of ordinary backward passes."""
    grads = torch_module_loop_grads(model, loss_fn, inputs, targets)
    norms = torch.sqrt(sum(g.flatten(1).double().pow(2).sum(1) for g in grads.values()))
    factors = (max_norm / norms).clamp(max=1.0)
    return {k: torch.tensordot(factors, g.double(), dims=1) for k, g in grads.items()}, norms


@pytest.fixture
def sessions(monkeypatch):
    """The captured passes the held path was armed on."""
    armed = []
    arm = torch_held.arm

    def spying(session, computed, first_run):
        armed.append(session)
        arm(session, computed, first_run)

    monkeypatch.setattr(torch_held, "arm", spying)
    weighted_sums = torch_quantities.weighted_sums

    def noting(session, *args):  # (the sums let every record go as they read it)
        _AT_SUMS[id(session)] = {
            layer: all(r.inputs == () and r.output_grad is None for r in records)
            for layer, records in session.records.items()
        }
        return weighted_sums(session, *args)

    monkeypatch.setattr(torch_quantities, "weighted_sums", noting)
    _AT_SUMS.clear()
    return armed


# id(session) -> whether each layer's records were dropped when the clipped sum started
_AT_SUMS: dict[int, dict[str, bool]] = {}


def dropped(session, layer: str) -> bool:
    """Whether the backward pass dropped ``layer``'s records (read as the clipped sum starts)."""
    return _AT_SUMS[id(session)][layer]


@pytest.mark.parametrize("length", [HELD_LENGTH, SHORT_LENGTH])
def test_the_tied_table_gives_the_loops_clipped_sum(sessions, length):
    """At 12 tokens the table is held (its records dropped in the backward pass, on the
    layout's first call too); at 4 its uses keep their records and the cross terms. Norms and
    clipped sums are the loop's either way."""
    torch.manual_seed(0)
    model = TinyGPT()
    loss = pergrad.module_loss(model, lm_loss)
    params = loss.params()
    ids, labels = batch(5, length)
    first = clipped_sum_of(loss, params, ids, labels, max_norm=0.5, strategy="ghost")
    held = length == HELD_LENGTH
    assert ("wte.weight" in sessions[0].held) == held  # the first call of the layout
    got = clipped_sum_of(loss, params, ids, labels, max_norm=0.5, strategy="ghost")
    session = sessions[-1]
    assert ("wte.weight" in session.held) == held
    assert dropped(session, "head") == held and dropped(session, "wte") == held
    want, norms = reference(model, lm_loss, [ids], [labels], 0.5)
    assert (norms > 0.5).sum() >= 3  # most examples are clipped
    torch.testing.assert_close(got.norms.double(), norms, rtol=1e-5, atol=1e-7)
    for name, value in want.items():
        torch.testing.assert_close(got.sum[name].double(), value, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(first.sum[name], got.sum[name], rtol=1e-5, atol=1e-7)


class Cancelling(nn.Module):
    """``loss = logits[id] = W[id]^T (R + eps I) W[id]`` with ``R`` antisymmetric: the head's
    term ``(R + eps I) W[id]`` and the lookup's ``(R + eps I)^T W[id]`` cancel but for ``2 eps
    W[id]``, each of them ``|R| / eps`` times larger than their sum."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        skew = torch.randn(WIDTH, WIDTH)
        self.register_buffer("mix", skew - skew.T + eps * torch.eye(WIDTH))

    def forward(self, ids):
        return self.head(self.wte(ids) @ self.mix.T)


def own_logits(logits, ids):
    """Each position's logit of its own token, summed."""
    return logits.gather(-1, ids.unsqueeze(-1)).sum()


def test_a_nearly_cancelling_tied_pair_stays_within_the_bound(sessions):
    """The held sum's norm is that of the numbers the clipped sum adds (its certified upper
    bound covers their exact squared norm): where the two uses cancel to 1e-4 of their size
    each clipped example stays within the bound, and the norms are the float64 loop's within
    the float32 rounding of the terms (``1e-7 / 1e-4``)."""
    torch.manual_seed(3)
    model = Cancelling(eps=1e-4)
    loss = pergrad.module_loss(model, own_logits)
    params = loss.params()
    ids = torch.randint(0, VOCAB, (4, HELD_LENGTH), generator=torch.Generator().manual_seed(4))
    grads = torch_module_loop_grads(model.double(), own_logits, [ids], [ids])["wte.weight"]
    model.float()
    norms = grads.flatten(1).norm(dim=1)
    max_norm = 0.5 * float(norms.min())  # every example clipped
    got = clipped_sum_of(loss, params, ids, ids, max_norm=max_norm, strategy="ghost")
    session = sessions[-1]
    held = session.held["wte.weight"]
    torch.testing.assert_close(got.norms.double(), norms, rtol=2e-2, atol=0)
    # the bound is of the numbers summed: estimate + bound >= their exact squared norm
    k = session.index_of("wte.weight")
    upper = session.squared[k].double() + session.squared.bounds[k].double()
    assert (upper >= held.double().flatten(1).pow(2).sum(1)).all()
    for k in range(4):  # each example alone, at the batch's layout (checked above)
        one = clipped_sum_of(
            loss, params, ids, ids, max_norm=max_norm, strategy="ghost", mask=torch.arange(4) == k
        )
        assert "wte.weight" in sessions[-1].held
        assert float(one.sum["wte.weight"].double().norm()) <= max_norm * (1 + 1e-6)


class ThreeUses(nn.Module):
    """One table looked up by two embedding layers (T5's encoder and decoder, were they two
    modules) and reused as the head; the second lookup also called once off the loss's path,
    so that it never completes in its hook and is added after the pass."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Embedding(VOCAB, WIDTH)
        self.dec = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.dec.weight = self.enc.weight
        self.head.weight = self.enc.weight
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        self.dec(ids.flip(0))  # off the loss's path: its gradient never comes
        h = torch.tanh(self.mix(self.enc(ids))) + self.dec(ids.flip(1))
        return self.head(h)


def test_three_uses_and_a_use_off_the_loss_path(sessions):
    torch.manual_seed(5)
    model = ThreeUses()
    loss = pergrad.module_loss(model, lm_loss)
    params = loss.params()
    ids, labels = batch(4, HELD_LENGTH, seed=6)
    for _ in range(2):
        got = clipped_sum_of(loss, params, ids, labels, max_norm=0.5, strategy="ghost")
        session = sessions[-1]
        assert "enc.weight" in session.held
        assert all(dropped(session, layer) for layer in ("head", "enc", "dec"))
    want, norms = reference(model, lm_loss, [ids], [labels], 0.5)
    torch.testing.assert_close(got.norms.double(), norms, rtol=1e-5, atol=1e-7)
    for name, value in want.items():
        torch.testing.assert_close(got.sum[name].double(), value, rtol=1e-5, atol=1e-7)


def test_a_head_with_a_frozen_bias_keeps_the_cross_terms(sessions):
    """A use holding another parameter (here a frozen bias) is not held: its records stay."""
    torch.manual_seed(6)
    model = TinyGPT()
    model.head.bias = nn.Parameter(torch.randn(VOCAB), requires_grad=False)
    loss = pergrad.module_loss(model, lm_loss)
    params = loss.params()
    ids, labels = batch(4, HELD_LENGTH, seed=7)
    clipped_sum_of(loss, params, ids, labels, max_norm=0.5, strategy="ghost")
    got = clipped_sum_of(loss, params, ids, labels, max_norm=0.5, strategy="ghost")
    assert "wte.weight" not in sessions[-1].held
    want, _ = reference(model, lm_loss, [ids], [labels], 0.5)
    for name in got.sum:
        torch.testing.assert_close(got.sum[name].double(), want[name], rtol=1e-5, atol=1e-7)


def test_an_empty_batch_between_held_steps_and_the_model_left_as_it_was(sessions):
    torch.manual_seed(7)
    model = TinyGPT()
    loss = pergrad.module_loss(model, lm_loss)
    params = loss.params()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for size in (3, 0, 3):
        ids, labels = batch(size, HELD_LENGTH, seed=size)
        got = clipped_sum_of(loss, params, ids, labels, max_norm=0.5, strategy="ghost")
        assert got.norms.shape == (size,)
        if size == 0:
            assert all(float(v.abs().sum()) == 0.0 for v in got.sum.values())
    assert "wte.weight" in sessions[-1].held
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert model.head.weight is model.wte.weight


class TimeFirst(nn.Module):
    """The tied pair run time-first, ``(T, B, D)``: at ``T == B`` axis 0 has the batch size
    but holds the positions, which only the first call's row check can tell."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        steps = self.wte(ids.T)  # (T, B, D)
        steps = torch.tanh(steps + steps.cumsum(0))  # mixes the positions: not row-local
        return self.head(steps).transpose(0, 1)


def test_a_held_tie_on_a_wrong_axis_is_refused_on_its_first_call(sessions):
    """Held from the first call on, the tie's dropped output gradients still go to the row
    check through their summaries: at ``B == T`` the first call is refused, not summed along
    the positions; at another batch size it is the loop's."""
    torch.manual_seed(8)
    model = TimeFirst()
    loss = pergrad.module_loss(model, lm_loss)
    ids, labels = batch(5, HELD_LENGTH, seed=9)
    got = clipped_sum_of(loss, loss.params(), ids, labels, max_norm=0.5, strategy="ghost")
    assert "wte.weight" in sessions[-1].held
    want, _ = reference(model, lm_loss, [ids], [labels], 0.5)
    torch.testing.assert_close(
        got.sum["wte.weight"].double(), want["wte.weight"], rtol=1e-5, atol=1e-7
    )
    ids, labels = batch(HELD_LENGTH, HELD_LENGTH, seed=10)
    with pytest.raises(ValueError, match="strategy='ghost' cannot handle"):
        clipped_sum_of(loss, loss.params(), ids, labels, max_norm=0.5, strategy="ghost")
    assert "wte.weight" in sessions[-1].held  # held, and refused by the row check


@pytest.mark.parametrize("length", [HELD_LENGTH, SHORT_LENGTH])
def test_the_route_choice_counts_the_held_tie_once(length):
    """The cost model's works (``torch_probe.layer_works``): the tied table's two uses are one
    ``"held"`` work (its ``V D`` numbers, materialising's work on them plus its lookups') where
    the step holds them, and their own calls' works where it does not."""
    from pergrad._src.capture import cost, torch_probe
    from pergrad._src.capture.torch_plan import ownership, plan

    model = TinyGPT()
    loss = pergrad.module_loss(model, lm_loss)
    params = loss.params()
    layers = plan(loss, params).layers
    holdable = frozenset(torch_held.candidate_layers(ownership(model, params, layers)))
    assert {"wte", "head"} <= holdable
    args = (params, *batch(3, length))
    works = torch_probe.layer_works(loss, layers, 0, args, holdable)
    held = [w for w in works if w.kind == "held" and w.numbers == VOCAB * WIDTH]
    head = [w for w in works if w.kind == "dense" and w.widths == (WIDTH, VOCAB)]
    if length == SHORT_LENGTH:
        assert held == [] and len(head) == 1
        return
    assert head == [] and len(held) == 1
    lookups = length * WIDTH  # the token table's one call, a light work
    assert held[0].norm_work == cost.MATERIALIZED_NUMBER_COST * VOCAB * WIDTH + lookups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_term_added_in_place_is_the_rules_per_example_gradient(dtype):
    """``add_term``: a lookup table's rows scattered into a float32 sum in place, or, into a
    narrower one, the rule's per-example gradients added; either way what the rule forms (the
    padding row left out, a row looked up twice summed)."""
    from pergrad._src.capture.rules import rule_for
    from pergrad._src.capture.torch_held_tied import add_term
    from pergrad._src.capture.torch_layers import LayerCall

    table = nn.Embedding(VOCAB, WIDTH, padding_idx=0).to(dtype)
    ids = torch.tensor([[0, 3, 3, 7], [5, 5, 5, 1]])
    grads = torch.randn(2, 4, WIDTH).to(dtype)
    calls = [LayerCall((ids,), grads)]
    start = torch.randn(2, VOCAB, WIDTH).to(dtype)
    total = start.clone()
    add_term(total, table, "weight", calls)
    want = start.float() + rule_for(table).per_example(table, calls)["weight"].float()
    torch.testing.assert_close(total.float(), want.to(dtype).float())
    assert float(total[0, 0].sub(start[0, 0]).abs().sum()) == 0.0  # the padding row


def test_held_norms_under_cpu_autocast_are_float32_and_tight(sessions, monkeypatch):
    """A CPU's backward pass runs the hooks under the caller's ``torch.autocast``: the held
    sums' norms (the tie's and a held layer's) are still taken in float32, their bounds tight
    (in bfloat16 they were 5-11% of the norms, and the examples clipped by that much more),
    and the clipped sum is the cross terms' (``cost.HOLD_TIED`` off) to float32 rounding."""
    from pergrad._src.capture import cost

    torch.manual_seed(9)
    model = TinyGPT()
    loss = pergrad.module_loss(model, lm_loss)
    params = loss.params()
    ids, labels = batch(4, HELD_LENGTH, seed=11)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return clipped_sum_of(loss, params, ids, labels, max_norm=0.5, strategy="ghost")

    step()
    got = step()
    session = sessions[-1]
    assert {"wte.weight", "block.weight"} <= set(session.held)
    for name in session.held:
        k = session.index_of(name)
        assert session.squared[k].dtype == torch.float32
        assert (session.squared.bounds[k] <= 1e-4 * session.squared[k]).all()
    monkeypatch.setattr(cost, "HOLD_TIED", False)
    want = step()
    assert "wte.weight" not in sessions[-1].held
    torch.testing.assert_close(got.norms, want.norms, rtol=1e-5, atol=0)
    for name, value in want.sum.items():
        torch.testing.assert_close(got.sum[name], value, rtol=1e-5, atol=1e-7)

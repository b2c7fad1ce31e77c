"""Tied parameters on the PyTorch ghost path (``capture/torch_tied.py``, issue 19).

An embedding table shared with the output projection (GPT-2, Llama, T5) has the per-example
gradient ``g_emb + g_head``; its norm needs their cross term, which the ghost strategy takes
from the two layers' captured calls. Every result is checked against ordinary training code
run one example at a time (``_reference.torch_module_loop_grads``), which shares no code with
pergrad.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch ghost strategy")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402

# Each strategy must run as chosen: a ghost run that fell back would hide what is tested.
pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

VOCAB, WIDTH, BATCH, LENGTH = 50, 16, 5, 7
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TiedLM(nn.Module):
    """The issue's model: the head's weight is the embedding table."""

    def __init__(self, padding_idx=None, head_bias=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx)
        self.head = nn.Linear(WIDTH, VOCAB, bias=head_bias)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)))


class MixedLM(TiedLM):
    """A layer of its own between the tied ends, as in a real language model."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


class TwiceLM(TiedLM):
    """The embedding looked up twice and the head applied twice in one forward pass."""

    def forward(self, tokens):
        hidden = torch.tanh(self.emb(tokens) + 0.5 * self.emb(tokens.flip(1)))
        half = tokens.shape[1] // 2
        return torch.cat([self.head(hidden[:, :half]), self.head(hidden[:, half:])], dim=1)


class HeadFirstLM(nn.Module):
    """The head registered first: the parameter is ``head.weight``, the uses come (linear,
    embedding), the cross rule's other order."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.emb.weight = self.head.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)))


MODELS = {
    "tied": TiedLM,
    "head-first": HeadFirstLM,
    "tied-head-bias": lambda: TiedLM(head_bias=True),
    "mixed": MixedLM,
    "called-twice": TwiceLM,
    "padding-idx": lambda: TiedLM(padding_idx=0),
}


def tokens_with_repeats(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids with a repeated id and the padding id 0 in every sequence, and targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)
    tokens[:, 1] = tokens[:, 0]
    tokens[:, 3] = 0
    tokens[:, -1] = 0
    return tokens, torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)


def reference_norms(grads: dict) -> np.ndarray:
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], 1).double()
    return flat.norm(dim=1).cpu().numpy()


def reference_clipped_sum(grads: dict, max_norm: float) -> dict:
    factors = np.minimum(1.0, max_norm / np.maximum(reference_norms(grads), 1e-30))
    return {k: np.tensordot(factors, g.double().cpu().numpy(), axes=1) for k, g in grads.items()}


def assert_close(actual, expected, rtol):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(MODELS))
def test_tied_norms_and_clipped_sums_match_the_loop(name, dtype):
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    tokens, targets = tokens_with_repeats(1)
    loss = pergrad.module_loss(model, lm_loss)
    params = loss.params()
    want = torch_module_loop_grads(model, lm_loss, [tokens], [targets])
    assert set(want) == set(params)

    choice = pergrad.norms.choose_strategy(loss, params, tokens, targets)
    assert choice.strategy == "ghost", choice.reason
    assert choice.layers["emb"] == "embedding" and choice.layers["head"] == "linear"
    assert "tied" in choice.reason and f"{list(params)[0]!r}" in choice.reason

    norms = pergrad.norms.per_example_norms_of(loss, params, tokens, targets)
    assert norms.dtype == dtype
    assert_close(norms, reference_norms(want), RTOL[dtype])

    max_norm = float(np.median(reference_norms(want)))
    clipped = pergrad.dp.clipped_sum_of(loss, params, tokens, targets, max_norm=max_norm)
    expected = reference_clipped_sum(want, max_norm)
    assert set(clipped.sum) == set(expected)
    for key in expected:
        assert_close(clipped.sum[key].detach(), expected[key], RTOL[dtype])


def test_the_padding_row_gets_no_gradient_from_the_lookups():
    """With padding tokens only, the lookups add nothing: the norm is the head's alone."""
    torch.manual_seed(1)
    model = TiedLM(padding_idx=0)
    tokens = torch.zeros(BATCH, LENGTH, dtype=torch.long)
    targets = torch.randint(0, VOCAB, (BATCH, LENGTH))
    loss = pergrad.module_loss(model, lm_loss)
    want = torch_module_loop_grads(model, lm_loss, [tokens], [targets])
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), tokens, targets)
    assert_close(norms, reference_norms(want), RTOL[torch.float32])


def test_dp_optimizer_takes_the_ghost_step_of_the_loop():
    torch.manual_seed(2)
    model = MixedLM()
    tokens, targets = tokens_with_repeats(2)
    want = torch_module_loop_grads(model, lm_loss, [tokens], [targets])
    max_norm = float(np.median(reference_norms(want)))
    expected = reference_clipped_sum(want, max_norm)
    before = {k: p.detach().double().clone() for k, p in model.named_parameters()}
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model,
        lm_loss,
        max_norm=max_norm,
        noise_multiplier=0.0,
        expected_batch_size=BATCH,
    )
    stats = optimizer.step(tokens, targets)
    assert stats.strategy == "ghost"
    assert model.head.weight is model.emb.weight  # still tied
    for key, param in model.named_parameters():
        step = before[key].cpu().numpy() - 0.5 * expected[key] / BATCH
        np.testing.assert_allclose(param.detach().cpu().numpy(), step, rtol=1e-5, atol=1e-6)


class Skew(nn.Module):
    """``logits_t = W (M^T W[id_t])`` with ``M`` skew-symmetric plus ``cancel`` times the identity.

    With the loss ``sum_t w_t logits_t[id_t] = sum_t w_t W[id_t] M^T W[id_t]^T`` the skew part
    contributes nothing to the loss, so the embedding's and the head's gradients cancel but for
    the ``cancel`` part: ``|g_emb + g_head|`` is about ``cancel`` times ``|g_emb|``.
    """

    def __init__(self, cancel: float, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        scale = 10.0 ** torch.empty(VOCAB, 1).uniform_(-1, 1, generator=g)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(VOCAB, WIDTH, generator=g) * scale)
        skew = torch.randn(WIDTH, WIDTH, generator=g)
        self.register_buffer("mix", skew - skew.T + cancel * torch.eye(WIDTH))

    def forward(self, tokens):
        return self.head(self.emb(tokens) @ self.mix)


def own_logits(logits, tokens, weights):
    # The offset keeps the loss well above its rounding noise (it is nearly zero otherwise),
    # which the first run's check of each example's loss alone against its batched loss needs.
    return (logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * weights).sum() + 1e3


@pytest.mark.parametrize("cancel", [1e-2, 1e-3, 1e-4])
def test_cancelling_uses_never_let_a_clipped_example_exceed_the_bound(cancel):
    """float32 model, gradients ``cancel`` times the size of their two parts. Summing
    ``|g_emb|^2 + |g_head|^2 + 2 <g_emb, g_head>`` in float32 errs by ``eps |g_emb|^2``, far
    more than ``|g|^2`` here; in float64 only the float32 gradient's own rounding remains."""
    model = Skew(cancel, seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    weights = torch.randn(BATCH, LENGTH, generator=g)
    loss = pergrad.module_loss(model, own_logits)
    params = loss.params()
    args = (tokens, tokens, weights)
    # the references in float64 from the same float32 numbers: the tied model, and an untied
    # copy for the two parts' sizes
    wide = copy.deepcopy(model).double()
    exact = reference_norms(torch_module_loop_grads(wide, own_logits, [tokens], [tokens, weights]))
    untied = copy.deepcopy(wide)
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    parts = torch_module_loop_grads(untied, own_logits, [tokens], [tokens, weights])
    terms = parts["emb.weight"].flatten(1).norm(dim=1) + parts["head.weight"].flatten(1).norm(dim=1)
    terms = terms.cpu().numpy()
    assert np.all(exact < 30 * cancel * terms)  # the parts really cancel

    assert pergrad.norms.choose_strategy(loss, params, *args).strategy == "ghost"
    norms = pergrad.norms.per_example_norms_of(loss, params, *args).cpu().numpy()
    eps = np.finfo(np.float32).eps
    assert np.all(np.abs(norms - exact) <= 1e-5 * exact + 8 * eps * terms), (norms, exact)

    bound = float(np.median(exact))
    for i in range(BATCH):
        mask = torch.zeros(BATCH)
        mask[i] = 1
        result = pergrad.dp.clipped_sum_of(loss, params, *args, max_norm=bound, mask=mask)
        size = float(result.sum["emb.weight"].double().norm())
        slack = 1e-6 + 8 * eps * terms[i] / exact[i]
        assert size <= bound * (1 + slack), (i, size, bound, slack)
        if exact[i] > bound * (1 + 2 * slack):
            assert size >= bound * (1 - slack), (i, size, bound, slack)


def count_widenings(monkeypatch) -> list:
    """Record each call of the float64 recomputation of the tied layers' own norms."""
    from pergrad._src.capture import torch_tied

    seen, widened = [], torch_tied.widened
    monkeypatch.setattr(torch_tied, "widened", lambda calls: seen.append(1) or widened(calls))
    return seen


def test_only_cancelling_uses_pay_for_float64_copies_of_the_records(monkeypatch):
    """Copying an LM head's output gradients (B x T x V) to float64 costs more than the rest of
    the norm: it is done only where some example's uses cancel, as in the Skew model."""
    widenings = count_widenings(monkeypatch)
    tokens, targets = tokens_with_repeats(seed=5)
    loss = pergrad.module_loss(MixedLM(), lm_loss)
    pergrad.norms.per_example_norms_of(loss, loss.params(), tokens, targets)
    assert widenings == []
    model = Skew(1e-3, seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    weights = torch.randn(BATCH, LENGTH, generator=g)
    loss = pergrad.module_loss(model, own_logits)
    pergrad.norms.per_example_norms_of(loss, loss.params(), tokens, tokens, weights)
    assert widenings  # the norms themselves are checked by the test above


class TwoLinears(nn.Module):
    """Two linear layers sharing one weight: no cross rule for that pair."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 6)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def test_a_tie_without_a_cross_rule_goes_chunked_and_says_why():
    torch.manual_seed(5)
    model = TwoLinears()
    x, y = torch.randn(BATCH, 6), torch.randn(BATCH, 6)

    def squared_error(out, target):
        return ((out - target) ** 2).sum()

    loss = pergrad.module_loss(model, squared_error)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, y)
    assert choice.strategy == "chunked"
    why = choice.unsupported["first"]
    assert "'first.weight' is shared with ['second.weight'] (tied weights)" in why
    assert "no cross rule for ('linear', 'linear')" in why
    want = torch_module_loop_grads(model, squared_error, [x], [y])
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), x, y)
    assert_close(norms, reference_norms(want), RTOL[torch.float32])

"""Token-level losses under DP (issue 19): with padding labelled ``ignore_index``, each
example's loss is the mean over its own valid tokens and padding contributes nothing; checked
on the ghost path (a tied embedding / head language model) against a loop of per-example
autograd gradients, clipped and averaged."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="DPOptimizer is PyTorch's")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")
VOCAB, WIDTH, BATCH, LENGTH, MAX_NORM, LR, PAD = 30, 12, 6, 9, 0.3, 0.2, 0


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, padding_idx=PAD)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2

    def forward(self, ids):
        return self.head(self.norm(torch.tanh(self.mix(self.emb(ids)))))


def token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)
    lengths = torch.tensor([9, 7, 4, 9, 2, 5])
    valid = torch.arange(LENGTH)[None] < lengths[:, None]
    ids = ids.masked_fill(~valid, PAD)
    labels = torch.roll(ids, -1, 1).masked_fill(~torch.roll(valid, -1, 1), -100)
    labels[:, -1] = -100
    return ids, labels


def test_each_example_is_the_mean_over_its_own_tokens_and_padding_adds_nothing():
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    ids, labels = batch()
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        token_loss,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
    )
    stats = optimizer.step(ids, labels)
    assert stats.strategy == "ghost"
    params = list(reference.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(BATCH):
        mine = labels[i] != -100
        # the example's own loss, the mean over its valid tokens, written out by hand
        logits = reference(ids[i : i + 1])[0]
        loss = -torch.log_softmax(logits[mine], -1).gather(1, labels[i][mine][:, None]).mean()
        grads = torch.autograd.grad(loss, params)
        scale = min(1.0, MAX_NORM / torch.sqrt(sum((g**2).sum() for g in grads)).item())
        total = [t + scale * g for t, g in zip(total, grads)]
    with torch.no_grad():
        for p, t in zip(params, total):
            p -= LR * t / BATCH
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_more_padding_changes_nothing():
    """The same sequences padded to a longer length: the same step."""
    torch.manual_seed(0)
    short_model, long_model = TinyLM(), None
    long_model = copy.deepcopy(short_model)
    ids, labels = batch()
    longer_ids = torch.cat([ids, torch.full((BATCH, 5), PAD)], 1)
    longer_labels = torch.cat([labels, torch.full((BATCH, 5), -100)], 1)
    for model, (x, y) in ((short_model, (ids, labels)), (long_model, (longer_ids, longer_labels))):
        optimizer = pergrad.dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR),
            model,
            token_loss,
            max_norm=MAX_NORM,
            noise_multiplier=0.0,
        )
        optimizer.step(x, y)
    for a, b in zip(short_model.parameters(), long_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

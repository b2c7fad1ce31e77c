"""The ghost rule of ``nn.MultiheadAttention`` (``capture/torch_attention.py``, issue 19).

Its parameters are used through ``F.multi_head_attention_forward``; the rule recomputes the
attention from the recorded call and reduces the in- and out-projections as linear layers. Each
test compares with ordinary training code run one example at a time
(``_reference.torch_module_loop_grads``): per-example norms, clipped sums and a zero-noise
``DPOptimizer`` step, in the layouts and with the masks the rule covers, and the configurations
it does not cover take the paths they took before (run alone, or a fallback), still exact.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import (  # noqa: E402
    assert_updates_close,
    torch_clipped_sum,
    torch_flat_norms,
    torch_module_loop_grads,
)

B, T, WIDTH, CLASSES = 4, 6, 16, 3
RTOL = 1e-5  # float32 models, float64 references


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (2 layers) on ``(B, T, D)`` inputs, time-first inside when
    ``batch_first=False``, with a padding mask and a causal mask."""

    def __init__(self, batch_first: bool):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=batch_first
        )
        self.batch_first = batch_first
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, padding):
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = x if self.batch_first else x.transpose(0, 1)
        padding = padding if bool(padding.any()) else None  # causal only: is_causal replaces it
        h = self.encoder(h, mask=causal, src_key_padding_mask=padding, is_causal=True)
        h = h if self.batch_first else h.transpose(0, 1)
        return self.head(h.mean(1))


def encoder_batch(seed: int, padded: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, WIDTH, generator=g)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, 4:] = padded
    padding[3, 2:] = padded
    labels = torch.randint(0, CLASSES, (B,), generator=g)
    return x, padding, labels


def dp_step(model, inputs, labels, max_norm):
    """One zero-noise DPOptimizer step (lr 0); each parameter's update (``.grad`` x B)."""
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        F.cross_entropy,
        max_norm=max_norm,
        noise_multiplier=0.0,
        expected_batch_size=B,
        num_inputs=len(inputs),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        stats = optimizer.step(*inputs, labels)
    updates = {n: B * p.grad.double().numpy() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return updates, stats


@pytest.mark.parametrize(
    "batch_first, padded",
    [(True, True), (False, True), (True, False)],
    ids=["batch-first", "time-first", "causal-only"],
)
def test_encoder_with_padding_and_causal_masks_is_ghost_and_the_loops(batch_first, padded):
    torch.manual_seed(0)
    model = Encoder(batch_first).eval()
    x, padding, labels = encoder_batch(1, padded)
    loss = pergrad.module_loss(model, F.cross_entropy, num_inputs=2)
    params = loss.params()
    choice = pergrad.norms.choose_strategy(loss, params, x, padding, labels)
    assert choice.strategy == "ghost", choice.reason
    for i in range(2):
        assert choice.layers[f"encoder.layers.{i}.self_attn"] == "multihead_attention"
    assert "generic" not in choice.layers.values()

    want = torch_module_loop_grads(model, F.cross_entropy, [x, padding], [labels])
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        norms = pergrad.norms.per_example_norms_of(loss, params, x, padding, labels, per_layer=True)
    for name, g in want.items():
        np.testing.assert_allclose(
            norms[name].double().numpy(),
            g.double().reshape(B, -1).norm(dim=1).numpy(),
            rtol=1e-4,
            atol=1e-7,
            err_msg=name,
        )

    max_norm = float(np.median(torch_flat_norms(want)))
    updates, stats = dp_step(model, [x, padding], labels, max_norm)
    assert stats.strategy == "ghost"
    assert_updates_close(updates, torch_clipped_sum(want, max_norm), rtol=RTOL)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-first"])
def test_hooks_per_example_grads_of_an_encoder_are_the_loops(batch_first):
    """The hooks strategy plans ownership as the ghost strategy does, so the attention's
    out_proj (a submodule never called as a module) belongs to the attention's rule; the
    hooks refused it before ("no layer rule for NonDynamicallyQuantizableLinear")."""
    torch.manual_seed(0)
    model = Encoder(batch_first).eval()
    x, padding, labels = encoder_batch(2)
    loss = pergrad.module_loss(model, F.cross_entropy, num_inputs=2)
    grads = pergrad.per_example_grads(loss, strategy="hooks")(loss.params(), x, padding, labels)
    want = torch_module_loop_grads(model, F.cross_entropy, [x, padding], [labels])
    assert set(grads) == set(want)
    for name, g in want.items():
        np.testing.assert_allclose(
            grads[name].double().numpy(), g.double().numpy(), rtol=1e-4, atol=1e-6, err_msg=name
        )


class CrossAttention(nn.Module):
    """A decoder-style block: queries from ``x``, keys and values from ``memory`` (one tensor,
    or two), of other widths (separate projection weights) or not, with a float per-head mask,
    attention weights asked for (and not used by the loss)."""

    def __init__(self, kdim, vdim, bias: bool, batch_first: bool, shared: bool):
        super().__init__()
        self.attention = nn.MultiheadAttention(
            WIDTH, 2, kdim=kdim, vdim=vdim, bias=bias, batch_first=batch_first
        )
        self.batch_first, self.shared = batch_first, shared
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, keys, values):
        # one (L, S) mask per head, a key blocked for head 0: a (B * heads, L, S) mask
        length, source = x.shape[1], keys.shape[1]
        per_head = torch.linspace(-1.0, 1.0, 2 * length * source).reshape(2, length, source)
        per_head[0, :, 1] = float("-inf")
        heads_mask = per_head.expand(x.shape[0], 2, length, source).reshape(-1, length, source)
        if not self.batch_first:
            x, keys, values = (t.transpose(0, 1) for t in (x, keys, values))
        values = keys if self.shared else values  # one tensor: an encoder's memory
        out, weights = self.attention(x, keys, values, attn_mask=heads_mask, need_weights=True)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(torch.tanh(out).mean(1))


@pytest.mark.parametrize(
    "kdim, vdim, bias, batch_first, shared",
    [
        (None, None, True, True, True),  # packed weight, key is value
        (None, None, False, False, False),  # packed weight, three inputs, no bias, time-first
        (10, 12, True, True, False),  # q_proj_weight, k_proj_weight, v_proj_weight
    ],
    ids=["key-is-value", "three-inputs-no-bias", "separate-weights"],
)
def test_cross_attention_clipped_sum_is_the_loops(kdim, vdim, bias, batch_first, shared):
    torch.manual_seed(2)
    model = CrossAttention(kdim, vdim, bias, batch_first, shared).eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, WIDTH, generator=g)
    keys = torch.randn(B, T + 2, kdim or WIDTH, generator=g)
    values = torch.randn(B, T + 2, vdim or WIDTH, generator=g)
    labels = torch.randint(0, CLASSES, (B,), generator=g)
    loss = pergrad.module_loss(model, F.cross_entropy, num_inputs=3)
    params = loss.params()
    choice = pergrad.norms.choose_strategy(loss, params, x, keys, values, labels)
    assert choice.strategy == "ghost", choice.reason
    assert choice.layers["attention"] == "multihead_attention"

    want = torch_module_loop_grads(model, F.cross_entropy, [x, keys, values], [labels])
    max_norm = float(np.median(torch_flat_norms(want)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        norms = pergrad.norms.per_example_norms_of(loss, params, x, keys, values, labels)
        clipped = pergrad.dp.clipped_sum_of(
            loss, params, x, keys, values, labels, max_norm=max_norm
        )
    np.testing.assert_allclose(norms.double().numpy(), torch_flat_norms(want), rtol=RTOL)
    assert_updates_close(
        {k: v.detach().double().numpy() for k, v in clipped.sum.items()},
        torch_clipped_sum(want, max_norm),
        rtol=RTOL,
    )


class SelfAttention(nn.Module):
    """One attention and a head; with ``uses_weights`` the loss reads the attention weights
    too, which the rule (reading the output only) must refuse."""

    def __init__(self, uses_weights: bool = False, **options):
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True, **options)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.uses_weights = uses_weights

    def forward(self, x):
        out, weights = self.attention(x, x, x, need_weights=self.uses_weights)
        logits = self.head(out.mean(1))
        return logits + weights.mean((1, 2))[:, None] if self.uses_weights else logits


def test_attention_weights_that_reach_the_loss_refuse_the_rule():
    torch.manual_seed(4)
    model = SelfAttention(uses_weights=True).eval()
    x, _, labels = encoder_batch(5)
    loss = pergrad.module_loss(model, F.cross_entropy)
    params = loss.params()
    want = torch_module_loop_grads(model, F.cross_entropy, [x], [labels])
    with pytest.warns(pergrad.FallbackWarning, match="attention weights"):
        norms = pergrad.norms.per_example_norms_of(loss, params, x, labels)
    np.testing.assert_allclose(norms.double().numpy(), torch_flat_norms(want), rtol=RTOL)
    with pytest.raises(ValueError, match="attention weights"):
        pergrad.norms.per_example_norms_of(loss, params, x, labels, strategy="ghost")


@pytest.mark.parametrize(
    "options", [{"add_bias_kv": True}, {"add_zero_attn": True}], ids=["bias-kv", "zero-attn"]
)
def test_configurations_the_rule_does_not_cover_run_alone(options):
    """Without a rule, as before it existed: the attention runs alone as a generic unit while
    the other layers stay ghost, and the norms are still the loop's."""
    torch.manual_seed(6)
    model = SelfAttention(**options).eval()
    x, _, labels = encoder_batch(7)
    loss = pergrad.module_loss(model, F.cross_entropy)
    params = loss.params()
    choice = pergrad.norms.choose_strategy(loss, params, x, labels)
    assert choice.strategy == "ghost", choice.reason
    assert choice.layers == {"attention": "generic", "head": "linear"}
    want = torch_module_loop_grads(model, F.cross_entropy, [x], [labels])
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        norms = pergrad.norms.per_example_norms_of(loss, params, x, labels)
    np.testing.assert_allclose(norms.double().numpy(), torch_flat_norms(want), rtol=RTOL)


def test_attention_dropout_is_covered_in_eval_mode_only():
    """In training mode its mask is drawn inside the attention, where the rule cannot see it."""
    model = SelfAttention(dropout=0.1)
    x, _, labels = encoder_batch(8)
    loss = pergrad.module_loss(model, F.cross_entropy)
    for training, path in [(True, "generic"), (False, "multihead_attention")]:
        model.train(training)
        choice = pergrad.norms.choose_strategy(loss, loss.params(), x, labels)  # runs nothing
        assert choice.layers["attention"] == path


class ZeroWeightedAttention(SelfAttention):
    """The loss reads the attention weights times zero: a gradient reaches them, all zeros,
    and changes no parameter's gradient."""

    def forward(self, x):
        out, weights = self.attention(x, x, x)
        return self.head(out.mean(1)) + 0.0 * weights.sum((1, 2))[:, None]


def test_an_all_zero_gradient_at_the_attention_weights_keeps_the_rule():
    """Only a gradient at the weights that is not all zeros refuses the rule (a compiled graph's
    backward pass gives every output a gradient, zeros where unused); the norms are the
    loop's."""
    torch.manual_seed(4)
    model = ZeroWeightedAttention().eval()
    x, _, labels = encoder_batch(5)
    loss = pergrad.module_loss(model, F.cross_entropy)
    want = torch_module_loop_grads(model, F.cross_entropy, [x], [labels])
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), x, labels, strategy="ghost")
    np.testing.assert_allclose(norms.double().numpy(), torch_flat_norms(want), rtol=RTOL)

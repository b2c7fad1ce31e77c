"""DP-SGD through real transformers: Llama, T5, ViT and ``nn.TransformerEncoder`` (issue 19).

Each model is built from a tiny config (nothing downloaded, dropout 0) and takes one zero-noise
``pergrad.dp.DPOptimizer`` step with a bound that clips about half the examples. The update must
equal ordinary training code run one example at a time (``_reference.torch_module_loop_grads``:
``loss.backward()`` on a copy of the model), each example's gradient clipped in float64 and the
results summed. Every parameter is checked, none may be left out, and the path each takes
(a layer rule, or its module run alone: ``"generic"``) is asserted from
``pergrad.norms.choose_strategy``, as is the strategy the step reports.

What each model exercises:

- Llama: RMSNorm (Hugging Face's own class, matched by its attributes: the ``hf_rms_norm``
  rule, checked against the layer's output), rotary position embeddings (no parameters),
  SwiGLU, no biases, grouped key-value heads, with the input embedding untied and tied to the
  lm head (embedding x linear cross term).
- T5: one table used by the encoder's and the decoder's embedding layers and by the lm head
  ((embedding, embedding) and (embedding, linear) cross terms), relative attention bias (an
  ``nn.Embedding`` looked up with a grid of bucket ids shared by the batch, its bias reused by
  every block: the ``"position-bias"`` path, ``capture/torch_position_bias.py``), T5's layer
  norm (an RMS norm: ``hf_rms_norm``).
- ViT: the patch convolution, and the class token and position embeddings as bare parameters.
- ``nn.TransformerEncoder``: ``nn.MultiheadAttention`` uses its weights through
  ``F.multi_head_attention_forward``, never through an ``nn.Linear``; its rule recomputes the
  attention from its recorded call (``capture/torch_attention.py``, tested in depth in
  ``test_attention_rule.py``).
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="Hugging Face models are checked when transformers is installed"
)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import (  # noqa: E402
    assert_updates_close,
    torch_clipped_sum,
    torch_flat_norms,
    torch_module_loop_grads,
)

transformers.logging.set_verbosity_error()

B, T, VOCAB, WIDTH, CLASSES = 4, 8, 40, 16, 3
RTOL = 1e-5  # float32 models, float64 references


# --- the models -------------------------------------------------------------------------------


def token_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(B, T)`` with repeats (a row looked up twice adds up) and right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 12, (B, T), generator=g)  # a small id range: rows repeat
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0
    mask[3, 3:] = 0
    return ids * mask, mask


def lm_loss(output, labels):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def classification_loss(output, labels):
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits, labels)


def llama(tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids, mask = token_batch(1)
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)

    def next_token_loss(output, labels):
        return lm_loss(type(output)(logits=output.logits[:, :-1]), labels)

    return model, next_token_loss, [{"input_ids": ids, "attention_mask": mask}], [labels]


def t5(head: str):
    """``head``: "tied" (T5's own lm head, the shared table, decoder outputs rescaled),
    "untied" (``tie_word_embeddings=False``: no rescaling, and the head given its own copy)."""
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=WIDTH,
        d_kv=8,
        d_ff=2 * WIDTH,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        tie_word_embeddings=head == "tied",
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    # transformers 5 always ties the head (tie_word_embeddings=False only drops the rescaling)
    if head == "untied":
        model.lm_head.weight = nn.Parameter(model.shared.weight.detach().clone())
    assert (model.lm_head.weight is model.shared.weight) == (head == "tied")
    assert model.encoder.embed_tokens.weight is model.decoder.embed_tokens.weight
    ids, mask = token_batch(2)
    targets, _ = token_batch(3)
    decoder_ids = torch.cat([torch.zeros(B, 1, dtype=torch.long), targets[:, :-1]], 1)
    inputs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids}
    return model, lm_loss, [inputs], [targets]


def vit():
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * WIDTH,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=CLASSES,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config).eval()
    g = torch.Generator().manual_seed(4)
    images = torch.randn(B, 3, 8, 8, generator=g)
    labels = torch.randint(0, CLASSES, (B,), generator=g)
    return model, classification_loss, [images], [labels]


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def encoder():
    torch.manual_seed(0)
    model = EncoderClassifier().eval()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, 6, WIDTH, generator=g)
    labels = torch.randint(0, CLASSES, (B,), generator=g)
    return model, classification_loss, [x], [labels]


def llama_paths(name: str) -> str:
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return "hf_rms_norm"  # LlamaRMSNorm: Hugging Face's class, not nn.RMSNorm
    return "embedding" if "embed_tokens" in name else "linear"


def t5_paths(name: str) -> str:
    if "layer_norm" in name:
        return "hf_rms_norm"  # T5LayerNorm: an RMS norm of Hugging Face's own
    if "relative_attention_bias" in name:
        return "position-bias"  # its bias expanded to the batch while the step runs
    if name == "shared.weight":
        return "embedding"
    return "linear"


def vit_paths(name: str) -> str:
    if name in ("vit.embeddings.cls_token", "vit.embeddings.position_embeddings"):
        return "generic"
    if "projection" in name:
        return "conv"
    return "layer_norm" if "layernorm" in name else "linear"


def encoder_paths(name: str) -> str:
    if ".self_attn." in name:
        return "multihead_attention"  # used through F.multi_head_attention_forward
    return "layer_norm" if ".norm" in name else "linear"


# name -> (build, the rule each parameter's path takes, the strategy of the step)
MODELS = {
    "llama": (lambda: llama(tied=False), llama_paths, "ghost"),
    "llama-tied": (lambda: llama(tied=True), llama_paths, "ghost"),
    "t5-tied": (lambda: t5("tied"), t5_paths, "ghost"),
    "t5-untied-head": (lambda: t5("untied"), t5_paths, "ghost"),
    "vit": (vit, vit_paths, "ghost"),
    "transformer-encoder": (encoder, encoder_paths, "ghost"),
}


# --- helpers ----------------------------------------------------------------------------------


def paths_taken(choice, params: dict) -> dict[str, str]:
    """Parameter name -> the rule of the layer that reduces it (``choice.layers``): the module
    owning it, or, for ``"generic"``, the nearest ancestor run alone. Missing: taken by none."""
    paths = {}
    for name in params:
        owner = name.rpartition(".")[0]
        candidates = [owner] + [
            owner.rsplit(".", depth)[0] for depth in range(1, owner.count(".") + 1)
        ]
        for module in candidates + [""]:
            if module in choice.layers:
                paths[name] = choice.layers[module]
                break
    return paths


def dp_step(
    model, loss_fn, inputs, targets, max_norm, noise_multiplier=0.0, seed=0, strategy="auto"
):
    """One DPOptimizer step (SGD, lr 0: the model is left as it was); the update each
    parameter got (its ``.grad``, times B), the step's stats and the FallbackWarnings."""
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        loss_fn,
        max_norm=max_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=B,
        generator=torch.Generator().manual_seed(seed),
        strategy=strategy,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = optimizer.step(*inputs, *targets)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, pergrad.FallbackWarning)]
    updates = {
        name: None if p.grad is None else B * p.grad.double().numpy()
        for name, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return updates, stats, fallbacks


# --- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_every_parameter_takes_the_path_reported(name):
    build, paths, strategy = MODELS[name]
    model, loss_fn, inputs, targets = build()
    loss = pergrad.module_loss(model, loss_fn)
    params = loss.params()
    assert set(params) == {k for k, p in model.named_parameters() if p.requires_grad}
    choice = pergrad.norms.choose_strategy(loss, params, *inputs, *targets)
    assert choice.strategy == strategy, choice.reason
    assert not choice.unsupported
    assert paths_taken(choice, params) == {k: paths(k) for k in params}


@pytest.mark.parametrize("low_memory", [False, True], ids=["auto", "ghost-lowmem"])
@pytest.mark.parametrize("name", list(MODELS))
def test_zero_noise_dp_step_is_the_loops_clipped_sum(name, low_memory):
    """Also with ``strategy="ghost-lowmem"``: norms in the backward pass, records released,
    the clipped sum from a second backward pass through the retained graph."""
    build, _, strategy = MODELS[name]
    model, loss_fn, inputs, targets = build()
    per_example = torch_module_loop_grads(model, loss_fn, inputs, targets)
    norms = torch_flat_norms(per_example)
    max_norm = float(np.median(norms))
    assert 0 < (norms > max_norm).sum() < B  # some examples clip, some do not
    want = torch_clipped_sum(per_example, max_norm)

    if low_memory:
        strategy = "ghost-lowmem"
    updates, stats, fallbacks = dp_step(
        model, loss_fn, inputs, targets, max_norm, strategy=strategy if low_memory else "auto"
    )
    assert not fallbacks, fallbacks
    assert stats.strategy == strategy
    assert stats.clip_fraction == pytest.approx((norms > max_norm).mean())
    left_out = [k for k, u in updates.items() if u is None]
    assert not left_out, f"no update for {left_out}"
    assert_updates_close(updates, want, rtol=RTOL)


@pytest.mark.parametrize("name", ["llama-tied", "vit", "transformer-encoder"])
def test_every_parameter_gets_noise(name):
    """With noise, each parameter's update minus the zero-noise one is Gaussian of std
    ``noise_multiplier x max_norm``: none is skipped, none gets noise twice (a tied table)."""
    build, _, _ = MODELS[name]
    model, loss_fn, inputs, targets = build()
    max_norm, noise_multiplier = 0.5, 2.0
    clean, _, _ = dp_step(model, loss_fn, inputs, targets, max_norm)
    noisy, _, _ = dp_step(model, loss_fn, inputs, targets, max_norm, noise_multiplier, seed=7)
    std = noise_multiplier * max_norm
    noise = {k: noisy[k] - clean[k] for k in clean}
    # a parameter left out gets exactly the zero-noise update (the two runs are the same)
    quiet = [k for k, n in noise.items() if not np.all(n != 0)]
    assert not quiet, f"parameters without noise: {quiet}"
    everything = np.concatenate([n.ravel() for n in noise.values()]) / std
    # thousands of N(0, 1) draws: the sample std within a few percent of 1
    assert abs(everything.std() - 1.0) < 0.1, everything.std()
    for k, n in noise.items():
        if n.size >= 500:  # each large parameter's own draws too (twice the noise: std 1.41)
            assert abs(n.std() / std - 1.0) < 0.2, (k, n.std() / std)


def relative_bias_attentions(model):
    return [m for m in model.modules() if getattr(m, "has_relative_attention_bias", False)]


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_t5_relative_attention_bias_norms_are_the_loops(head):
    """Each example's gradient norm of each relative-bias table (encoder and decoder), on the
    ghost path, against ``loss.backward()`` one example at a time; the model's attention
    modules are left as they were (no ``compute_bias`` left shadowing the class's)."""
    model, loss_fn, inputs, targets = t5(head)
    per_example = torch_module_loop_grads(model, loss_fn, inputs, targets)
    loss = pergrad.module_loss(model, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        norms = pergrad.norms.per_example_norms_of(
            loss, loss.params(), *inputs, *targets, per_layer=True, strategy="ghost"
        )
    tables = [k for k in per_example if "relative_attention_bias" in k]
    assert len(tables) == 2  # the encoder's and the decoder's
    for name in tables:
        want = np.linalg.norm(per_example[name].reshape(B, -1), axis=1)
        assert want.min() > 0, name  # every example's bias gradient is there to be read
        np.testing.assert_allclose(norms[name].double().numpy(), want, rtol=1e-4)
    for attention in relative_bias_attentions(model):
        assert "compute_bias" not in vars(attention)


def test_t5_relative_bias_of_another_shape_is_refused_and_the_step_stays_exact():
    """A ``compute_bias`` that does not return its lookup as a ``(1, heads, q, k)`` bias (here
    scaled by 2) is not read as one: the ghost run refuses, with a FallbackWarning, and the step
    is still the loop's clipped sum; the instance's own ``compute_bias`` is put back."""
    model, loss_fn, inputs, targets = t5("tied")

    def doubled(self, *args, **kwargs):
        return 2 * type(self).compute_bias(self, *args, **kwargs)

    for attention in relative_bias_attentions(model):  # a bound method: a deepcopy rebinds it
        attention.compute_bias = types.MethodType(doubled, attention)
    per_example = torch_module_loop_grads(model, loss_fn, inputs, targets)
    norms = torch_flat_norms(per_example)
    max_norm = float(np.median(norms))
    want = torch_clipped_sum(per_example, max_norm)
    updates, stats, fallbacks = dp_step(model, loss_fn, inputs, targets, max_norm)
    assert any("compute_bias does not return its (q, k) lookup" in f for f in fallbacks), fallbacks
    assert stats.strategy == "chunked"
    assert_updates_close(updates, want, rtol=RTOL)
    for attention in relative_bias_attentions(model):
        assert "compute_bias" in vars(attention)  # the user's own, still there


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_t5_with_the_relative_bias_frozen_is_ghost_and_the_loops_clipped_sum(head):
    """The shared table on the ghost path: the encoder's and the decoder's lookups of it (an
    (embedding, embedding) cross term) and, tied, the lm head (embedding x linear)."""
    model, loss_fn, inputs, targets = t5(head)
    for module in model.modules():
        if getattr(module, "has_relative_attention_bias", False):
            module.relative_attention_bias.weight.requires_grad_(False)
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    per_example = {
        k: g
        for k, g in torch_module_loop_grads(model, loss_fn, inputs, targets).items()
        if k in trainable
    }
    norms = torch_flat_norms(per_example)
    max_norm = float(np.median(norms))
    want = torch_clipped_sum(per_example, max_norm)

    loss = pergrad.module_loss(model, loss_fn)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), *inputs, *targets)
    assert choice.strategy == "ghost", choice.reason
    assert choice.layers["encoder.embed_tokens"] == choice.layers["decoder.embed_tokens"]
    updates, stats, fallbacks = dp_step(model, loss_fn, inputs, targets, max_norm)
    assert not fallbacks, fallbacks
    assert stats.strategy == "ghost"
    frozen = {k for k, u in updates.items() if u is not None} - trainable
    assert not frozen, f"a frozen parameter got an update: {frozen}"
    assert_updates_close({k: updates[k] for k in trainable}, want, rtol=RTOL)


class SharedTable(nn.Module):
    """An encoder-decoder in miniature: two embedding layers over one table (with a padding
    row), the decoder's output projected back onto the table."""

    def __init__(self, tied_head: bool):
        super().__init__()
        self.encoder_embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.decoder_embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.decoder_embed.weight = self.encoder_embed.weight
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied_head:
            self.head.weight = self.encoder_embed.weight

    def forward(self, source, target):
        memory = self.encoder_embed(source).mean(1, keepdim=True)
        return self.head(torch.tanh(self.mix(self.decoder_embed(target) + memory)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("tied_head", [False, True], ids=["two-lookups", "two-lookups-and-head"])
def test_one_table_looked_up_by_two_layers_gets_its_cross_term(tied_head, dtype):
    torch.manual_seed(6)
    model = SharedTable(tied_head).to(dtype)
    source, _ = token_batch(7)  # padded with the padding row, ids repeated
    target, _ = token_batch(8)
    labels = torch.randint(0, VOCAB, (B, T))
    loss = pergrad.module_loss(model, lm_loss_of_logits, num_inputs=2)
    params = loss.params()
    choice = pergrad.norms.choose_strategy(loss, params, source, target, labels)
    assert choice.strategy == "ghost", choice.reason
    assert "tied weights" in choice.reason
    want = torch_module_loop_grads(model, lm_loss_of_logits, [source, target], [labels])
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        norms = pergrad.norms.per_example_norms_of(loss, params, source, target, labels)
        max_norm = float(np.median(torch_flat_norms(want)))
        clipped = pergrad.dp.clipped_sum_of(loss, params, source, target, labels, max_norm=max_norm)
    np.testing.assert_allclose(norms.double().numpy(), torch_flat_norms(want), rtol=RTOL)
    assert_updates_close(
        {k: v.detach().double().numpy() for k, v in clipped.sum.items()},
        torch_clipped_sum(want, max_norm),
        rtol=RTOL,
    )


def lm_loss_of_logits(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def test_multihead_attention_keeps_a_realistic_encoder_ghost():
    width, batch = 256, 32
    layer = nn.TransformerEncoderLayer(
        width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).eval()
    x = torch.randn(batch, 8, width)
    loss = pergrad.module_loss(model, lambda output, target: ((output - target) ** 2).sum())
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, x)  # runs nothing
    assert choice.strategy == "ghost", choice.reason


class RMSNormLike(nn.Module):
    """The attributes of a Hugging Face RMS norm (``weight``, ``variance_epsilon``), computing
    Gemma's ``(1 + weight) * x_hat`` (``offset``: the same weight gradient) or, ``centred``, a
    layer norm without bias (not an RMS norm: the rule must refuse it)."""

    def __init__(self, offset: bool, centred: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.variance_epsilon = 1e-6
        self.offset, self.centred = offset, centred

    def forward(self, x):
        x32 = x.float()
        if self.centred:
            x32 = x32 - x32.mean(-1, keepdim=True)
        x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight if self.offset else self.weight) * x_hat.to(x.dtype)


class NormBetweenLinears(nn.Module):
    def __init__(self, offset: bool, centred: bool):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.norm = RMSNormLike(offset, centred)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.norm(self.embed(x)).mean(1))


@pytest.mark.parametrize(
    "offset, centred", [(True, False), (False, True)], ids=["gemma", "centred"]
)
def test_rms_norm_rule_checks_the_formula(offset, centred):
    """Matched by its attributes, the layer is checked on each call: an RMS norm keeps the rule,
    anything else is refused at run time (auto: the chunked strategy), never reduced wrongly."""
    torch.manual_seed(9)
    model = NormBetweenLinears(offset, centred).eval()
    x = torch.randn(B, T, WIDTH, generator=torch.Generator().manual_seed(10))
    labels = torch.randint(0, CLASSES, (B,))
    loss = pergrad.module_loss(model, classification_loss)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, labels)  # runs nothing
    assert choice.layers["norm"] == "hf_rms_norm"
    want = torch_module_loop_grads(model, classification_loss, [x], [labels])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), x, labels)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, pergrad.FallbackWarning)]
    if centred:
        assert any("does not compute weight * x" in message for message in fallbacks), fallbacks
    else:
        assert not fallbacks, fallbacks
    np.testing.assert_allclose(norms.double().numpy(), torch_flat_norms(want), rtol=RTOL)


@pytest.mark.parametrize("reentrant", [False, True], ids=["checkpointing", "reentrant"])
def test_zero_noise_dp_step_under_activation_checkpointing(reentrant):
    """``gradient_checkpointing_enable()``: non-reentrant checkpointing keeps the ghost path;
    reentrant (torch's autograd.grad refuses it) takes the chunked strategy over layer hooks,
    with a warning that says how to keep the ghost path. Both are the loop's clipped sum."""
    model, loss_fn, inputs, targets = llama(tied=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()  # Hugging Face checkpoints in training mode only (no dropout in this config)
    per_example = torch_module_loop_grads(model, loss_fn, inputs, targets)
    norms = torch_flat_norms(per_example)
    max_norm = float(np.median(norms))
    want = torch_clipped_sum(per_example, max_norm)
    updates, stats, fallbacks = dp_step(model, loss_fn, inputs, targets, max_norm)
    if reentrant:
        assert stats.strategy == "chunked"
        assert any("'use_reentrant': False" in f for f in fallbacks), fallbacks
        assert any("layer hooks" in f for f in fallbacks), fallbacks
    else:
        assert stats.strategy == "ghost" and not fallbacks, fallbacks
    assert_updates_close(updates, want, rtol=RTOL)


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_compiled_models_norms_run_in_whole_graphs_and_are_the_loops(name):
    """``torch.compile`` d Llama and ViT (aot_eager): Llama's RMS norms' rule checks their formula
    on the eager run of the layout, outside the graph, and ViT's class token and position
    embeddings (a generic unit) are recorded in the graph with a probe on the unit's output, so
    from the second call the norm pass is one graph without a break (Llama: it was 18 graphs /
    21 breaks, cut at each hooked layer), and every example's gradient norm is the loop's."""
    from torch._dynamo.utils import counters

    model, loss_fn, inputs, targets = llama(tied=True) if name == "llama" else vit()
    want = torch_flat_norms(torch_module_loop_grads(model, loss_fn, inputs, targets))
    torch._dynamo.reset()
    try:
        loss = pergrad.module_loss(torch.compile(model, backend="aot_eager"), loss_fn)
        counted = []
        for _ in range(2):  # the first call checks the layout eagerly
            counters.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("error", pergrad.FallbackWarning)
                norms = pergrad.norms.per_example_norms_of(
                    loss, loss.params(), *inputs, *targets, strategy="ghost"
                )
            np.testing.assert_allclose(norms.double().numpy(), want, rtol=RTOL)
            counted.append(
                (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
            )
        assert counted == [(0, 0), (1, 0)]
    finally:
        torch._dynamo.reset()

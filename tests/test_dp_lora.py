"""DP fine-tuning of LoRA adapters (``peft``) with ``pergrad.dp.DPOptimizer`` (issue 19): only
the trainable adapter parameters are clipped and noised, the frozen base weights stay exactly as
they were, and the zero-noise update equals a loop of per-example autograd gradients of the
adapters, clipped and averaged (Opacus users report silent corruption here, opacus#820)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the model is Hugging Face's GPT-2")
peft = pytest.importorskip("peft", reason="LoRA adapters come from peft")

import torch.nn.functional as F  # noqa: E402

import pergrad  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")
transformers.logging.set_verbosity_error()
B, T, VOCAB, MAX_NORM, LR = 4, 8, 40, 0.05, 0.5


def lora_gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config).eval()
    lora = peft.LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["c_attn"],
        fan_in_fan_out=True,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    return peft.get_peft_model(base, lora)


def causal_lm_loss(output, labels):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def data():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    return {"input_ids": ids}, ids


def test_lora_adapters_are_clipped_and_the_base_is_untouched():
    model = lora_gpt2()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    start = {n: p.detach().clone() for n, p in trainable.items()}
    inputs, labels = data()

    # the reference: per-example gradients of the adapters, one example at a time
    total = {n: torch.zeros_like(p) for n, p in trainable.items()}
    norms = []
    for i in range(B):
        loss = causal_lm_loss(model(input_ids=inputs["input_ids"][i : i + 1]), labels[i : i + 1])
        grads = dict(zip(trainable, torch.autograd.grad(loss, list(trainable.values()))))
        norm = torch.sqrt(sum((g**2).sum() for g in grads.values())).item()
        norms.append(norm)
        for n, g in grads.items():
            total[n] += min(1.0, MAX_NORM / norm) * g
    assert max(norms) > MAX_NORM  # clipping is active

    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(trainable.values(), lr=LR),
        model,
        causal_lm_loss,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
    )
    stats = optimizer.step(inputs, labels)
    assert stats.strategy == "ghost"
    for n, p in trainable.items():
        torch.testing.assert_close(p.detach(), start[n] - LR * total[n] / B, rtol=1e-5, atol=1e-7)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), frozen[n]), n
            assert p.grad is None, n


def test_every_adapter_receives_noise():
    model = lora_gpt2()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in trainable.items()}
    inputs, labels = data()
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(trainable.values(), lr=LR),
        model,
        causal_lm_loss,
        max_norm=MAX_NORM,
        noise_multiplier=1e6,
        generator=torch.Generator().manual_seed(0),
        expected_batch_size=B,
    )
    optimizer.step(inputs, labels)
    expected = LR * 1e6 * MAX_NORM / B  # the noise's std in the update; it swamps the gradient
    for n, p in trainable.items():
        moved = p.detach() - start[n]
        assert moved.std().item() == pytest.approx(expected, rel=0.4), n

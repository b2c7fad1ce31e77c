"""Hugging Face ``transformers`` models built from small configs (nothing downloaded).

GPT-2 with a causal LM loss and BERT with sequence classification, both with attention masks and
padding, with and without activation checkpointing, against ordinary training code run one
example at a time. The strategy each one takes is asserted.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="Hugging Face models are checked when transformers is installed"
)
import torch.nn.functional as F  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from test_models_in_the_wild import assert_matches, assert_same_state, run, state_of  # noqa: E402

transformers.logging.set_verbosity_error()
B, T, VOCAB = 4, 9, 40


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 6:] = 0  # right padding on two examples
    mask[2, 4:] = 0
    ids = ids * mask  # pad token 0
    return ids, mask


def gpt2(checkpointing: dict | None):
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
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        model.train()  # Hugging Face checkpoints in training mode only (dropout is 0 here)
    else:
        model.eval()
    return model


def causal_lm_loss(output, labels):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


CHECKPOINTING = {
    "no checkpointing": None,
    "checkpointing": {"use_reentrant": False},
    "checkpointing-reentrant": {"use_reentrant": True},
}


@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING), ids=list(CHECKPOINTING))
def test_gpt2_causal_lm(checkpointing):
    model = gpt2(CHECKPOINTING[checkpointing])
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    ids, mask = batch(1)
    labels = ids.masked_fill(mask == 0, -100)  # no loss on padding
    inputs = {"input_ids": ids, "attention_mask": mask}
    before = state_of(model)
    loss = pergrad.module_loss(model, causal_lm_loss)
    grads, strategy, fallbacks = run(loss, inputs, labels)
    # the layer hooks, ahead of vmap (which GPT-2's sdpa attention with a padding mask fails)
    assert strategy == "hooks" and not fallbacks
    assert_matches(grads, torch_module_loop_grads(model, causal_lm_loss, [inputs], [labels]))
    assert_same_state(before, state_of(model))


@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING), ids=list(CHECKPOINTING))
def test_bert_sequence_classification(checkpointing):
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    if CHECKPOINTING[checkpointing] is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=CHECKPOINTING[checkpointing]
        )
        model.train()
    else:
        model.eval()
    ids, mask = batch(2)
    y = torch.tensor([0, 2, 1, 2])

    def classification_loss(output, y):
        return F.cross_entropy(output.logits, y)

    inputs = {"input_ids": ids, "attention_mask": mask}
    before = state_of(model)
    loss = pergrad.module_loss(model, classification_loss)
    grads, strategy, _ = run(loss, inputs, y)
    assert strategy == "hooks"
    assert_matches(grads, torch_module_loop_grads(model, classification_loss, [inputs], [y]))
    assert_same_state(before, state_of(model))


def test_gpt2_every_strategy_agrees():
    model = gpt2({"use_reentrant": False})
    ids, mask = batch(3)
    labels = ids.masked_fill(mask == 0, -100)
    inputs = {"input_ids": ids, "attention_mask": mask}
    loss = pergrad.module_loss(model, causal_lm_loss)
    want = torch_module_loop_grads(model, causal_lm_loss, [inputs], [labels])
    for strategy in ("hooks", "loop"):
        grads, taken, fallbacks = run(loss, inputs, labels, strategy=strategy)
        assert taken == strategy and not fallbacks
        assert_matches(grads, want)
    with pytest.raises(ValueError, match="strategy='vmap'"):
        run(loss, inputs, labels, strategy="vmap")

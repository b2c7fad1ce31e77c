"""``pergrad.dp.DPTrainer`` (issue 19): DP-SGD inside Hugging Face's ``Trainer``.

At zero noise the trained weights equal an independent computation: the same Poisson batches
(same sampling seed), each example's gradient from a loop of ordinary autograd calls, clipped,
summed, divided by the expected batch size, plain SGD. Gradient accumulation equals one batch;
noise reaches every trainable parameter; epsilon is logged; bad arguments are named.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="DPTrainer is PyTorch's")
transformers = pytest.importorskip(
    "transformers", reason="DPTrainer subclasses transformers.Trainer"
)
pytest.importorskip("dp_accounting", reason="DPTrainer's accountant uses dp-accounting")

import torch.nn.functional as F  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402

transformers.logging.set_verbosity_error()
N, T, VOCAB, RATE, MAX_NORM, LR, DELTA = 24, 8, 30, 0.25, 0.3, 0.5, 1e-3


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=T,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def lm_loss(output, labels):
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def dataset():
    ids = torch.randint(0, VOCAB, (N, T), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def trainer(tmp_path, model, steps=2, accumulation=1, sampling_seed=3, **dp):
    args = transformers.TrainingArguments(
        str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        learning_rate=LR,
        optim="sgd",
        weight_decay=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    dp.setdefault("noise_multiplier", 0.0)
    dp.setdefault("sample_rate", RATE)
    return pergrad.dp.DPTrainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        loss_fn=lm_loss,
        max_norm=MAX_NORM,
        delta=DELTA,
        sampling_generator=torch.Generator().manual_seed(sampling_seed),
        **dp,
    )


def reference_weights(model, steps, sampling_seed=3):
    """SGD on the clipped sums of a loop of per-example autograd gradients, by hand."""
    model = copy.deepcopy(model)
    data = dataset()
    sampler = pergrad.dp.PoissonBatchSampler(
        N, RATE, steps, torch.Generator().manual_seed(sampling_seed)
    )
    for indices in sampler:
        total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        if indices:
            ids = torch.stack([data[i]["input_ids"] for i in indices])
            grads = torch_module_loop_grads(model, lm_loss, [{"input_ids": ids}], [ids])
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
            scale = (MAX_NORM / norms).clamp(max=1.0)
            for name, g in grads.items():
                total[name] = (scale.view(-1, *[1] * (g.dim() - 1)) * g).sum(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * total[name] / (RATE * N)
    return dict(model.named_parameters())


def assert_weights_equal(got, want, rtol=1e-5, atol=1e-6):
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=name)


def test_zero_noise_training_equals_a_per_example_loop(tmp_path):
    model = gpt2()
    want = reference_weights(model, steps=2)
    run = trainer(tmp_path, model)
    run.train()
    assert run.dp_optimizer.model is model  # the model is not wrapped
    assert_weights_equal(dict(model.named_parameters()), want)


def test_accumulation_equals_one_batch(tmp_path):
    whole, parts = gpt2(), gpt2()
    trainer(tmp_path / "whole", whole).train()
    run = trainer(tmp_path / "parts", parts, accumulation=3)
    run.train()
    assert run.accountant.steps == 2  # optimizer steps, not micro-batches
    assert_weights_equal(dict(parts.named_parameters()), dict(whole.named_parameters()))


def test_noise_reaches_every_trainable_parameter_and_epsilon_is_logged(tmp_path):
    quiet, noisy = gpt2(), gpt2()
    trainer(tmp_path / "quiet", quiet, steps=1).train()
    run = trainer(
        tmp_path / "noisy",
        noisy,
        steps=1,
        noise_multiplier=1.0,
        noise_generator=torch.Generator().manual_seed(0),
    )
    run.train()
    for (name, a), b in zip(quiet.named_parameters(), noisy.parameters()):
        assert not torch.allclose(a, b), f"{name} received no noise"
    logged = [entry["epsilon"] for entry in run.state.log_history if "epsilon" in entry]
    want = pergrad.dp.epsilon(noise_multiplier=1.0, sample_rate=RATE, steps=1, delta=DELTA)
    assert logged and logged[-1] == pytest.approx(want)
    assert not any("grad_norm" in entry for entry in run.state.log_history)


def test_target_epsilon_is_calibrated_for_max_steps(tmp_path):
    run = trainer(tmp_path, gpt2(), steps=3, noise_multiplier=None, target_epsilon=4.0)
    spent = pergrad.dp.epsilon(
        noise_multiplier=run.noise_multiplier, sample_rate=RATE, steps=3, delta=DELTA
    )
    assert spent <= 4.0 and spent == pytest.approx(4.0, abs=0.05)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        trainer(tmp_path, gpt2(), noise_multiplier=1.0, target_epsilon=3.0)
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        trainer(tmp_path, gpt2(), noise_multiplier=None)
    with pytest.raises(TypeError, match="args must be a transformers.TrainingArguments"):
        pergrad.dp.DPTrainer(
            model=gpt2(),
            args={},
            train_dataset=dataset(),
            loss_fn=lm_loss,
            max_norm=1.0,
            noise_multiplier=1.0,
            delta=DELTA,
        )
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
        trainer(tmp_path, gpt2(), sample_rate=1.5)
    run = trainer(tmp_path, gpt2())
    run.label_name = "targets"
    with pytest.raises(ValueError, match="label_name='targets'"):
        run.train()


# --- clipping policies -------------------------------------------------------------------


def dp_optimizer_weights(model, steps, clipping, sampling_seed=3):
    """The same Poisson batches through ``pergrad.dp.DPOptimizer`` around ``torch.optim.SGD``
    (noise off): the weights and the final bound."""
    model = copy.deepcopy(model)
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        lm_loss,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        expected_batch_size=RATE * N,
        clipping=clipping,
    )
    data = dataset()
    sampler = pergrad.dp.PoissonBatchSampler(
        N, RATE, steps, torch.Generator().manual_seed(sampling_seed)
    )
    for indices in sampler:
        ids = torch.stack([data[i]["input_ids"] for i in indices]).reshape(-1, T)
        optimizer.step({"input_ids": ids}, ids)
    return dict(model.named_parameters()), optimizer.max_norm


@pytest.mark.parametrize(
    "clipping",
    [
        pergrad.dp.automatic(gamma=0.01),
        pergrad.dp.adaptive(count_noise_std=0.0, target_quantile=0.3, learning_rate=0.5),
    ],
    ids=["automatic", "adaptive"],
)
def test_clipping_policy_steps_as_dp_optimizer_does(tmp_path, clipping):
    """Two steps without noise: the trainer's weights (and, adaptive, its bound after each
    step, which the second step clips at) are DPOptimizer's on the same batches."""
    model = gpt2()
    want, want_bound = dp_optimizer_weights(model, 2, clipping)
    run = trainer(tmp_path, model, steps=2, clipping=clipping)
    run.train()
    assert run.dp_optimizer.clipping is clipping
    assert_weights_equal(dict(model.named_parameters()), want)
    unclipped, _ = dp_optimizer_weights(model, 2, None)  # the policy makes a difference
    assert not torch.allclose(want["transformer.wte.weight"], unclipped["transformer.wte.weight"])
    if isinstance(clipping, pergrad.dp.AdaptiveClipping):
        assert run.dp_optimizer.max_norm == pytest.approx(want_bound, rel=1e-6)
        assert want_bound != pytest.approx(MAX_NORM)  # the bound moved
        logged = [entry["max_norm"] for entry in run.state.log_history if "max_norm" in entry]
        assert logged[-1] == pytest.approx(want_bound, rel=1e-6)


def test_adaptive_clipping_is_accounted_at_the_noise_multiplier_given(tmp_path):
    """The accountant takes the noise multiplier given (or calibrated); the gradient's is
    raised to leave room for the noisy counts, by Andrew et al.'s split."""
    policy = pergrad.dp.adaptive(count_noise_std=2.0)
    run = trainer(
        tmp_path,
        gpt2(),
        steps=1,
        noise_multiplier=1.0,
        clipping=policy,
        noise_generator=torch.Generator().manual_seed(0),
    )
    assert run.noise_multiplier == 1.0
    split = (1.0**-2 - (2 * 2.0) ** -2) ** -0.5
    assert run.dp_optimizer.gradient_noise_multiplier == pytest.approx(split)
    run.train()
    logged = [entry["epsilon"] for entry in run.state.log_history if "epsilon" in entry]
    want = pergrad.dp.epsilon(noise_multiplier=1.0, sample_rate=RATE, steps=1, delta=DELTA)
    assert logged[-1] == pytest.approx(want)
    calibrated = trainer(
        tmp_path, gpt2(), steps=3, noise_multiplier=None, target_epsilon=4.0, clipping=policy
    )
    sigma = pergrad.dp.noise_multiplier_for(
        target_epsilon=4.0, delta=DELTA, sample_rate=RATE, steps=3
    )
    assert calibrated.noise_multiplier == pytest.approx(sigma)
    assert calibrated.dp_optimizer.gradient_noise_multiplier > sigma


def test_bad_clipping_is_named(tmp_path):
    with pytest.raises(TypeError, match="DPTrainer: clipping must be None"):
        trainer(tmp_path, gpt2(), clipping="auto")
    with pytest.raises(ValueError, match="count_noise_std must exceed"):
        trainer(
            tmp_path,
            gpt2(),
            noise_multiplier=1.0,
            clipping=pergrad.dp.adaptive(count_noise_std=0.1),
        )
    banded = pergrad.dp.toeplitz([1.0, 0.5], steps=2, min_separation=2, sample_rate=0.5)
    with pytest.raises(ValueError, match="DPTrainer: adaptive clipping needs independent"):
        trainer(
            tmp_path,
            gpt2(),
            noise_multiplier=1.0,
            sample_rate=None,
            noise=banded,
            clipping=pergrad.dp.adaptive(count_noise_std=5.0),
        )

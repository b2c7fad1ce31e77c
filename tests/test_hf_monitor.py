"""``pergrad.norms.TrainingMonitorCallback`` in a real ``transformers.Trainer`` (issue 35).

A tiny BERT classifier (built from a config, nothing downloaded, dropout 0) trains a few SGD
steps on a fixed order of examples. A second callback snapshots the parameters at the moment
the monitor measures (just before the optimizer steps); the reference then recomputes, for
each step's batch, every example's gradient alone with ``loss.backward()`` on a float64 copy
of the model, and from those the norms' quantiles, the clipped fraction and the running noise
scale (the moving averages of the unbiased estimates, by hand). The Trainer's own run must be
unchanged by the callback.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip(
    "transformers", reason="the Trainer callback is checked when transformers is installed"
)
import torch.nn.functional as F  # noqa: E402

import pergrad  # noqa: E402

transformers.logging.set_verbosity_error()

N, T, VOCAB, CLASSES, BATCH, STEPS = 24, 6, 30, 3, 4, 3
MAX_NORM, SMOOTHING = 1.0, 0.5


def loss_fn(output, labels):
    return F.cross_entropy(output.logits, labels)


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=T,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


def dataset():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N, T), generator=generator)
    mask = torch.ones(N, T, dtype=torch.long)
    mask[::3, T - 2 :] = 0  # some examples padded
    labels = torch.randint(0, CLASSES, (N,), generator=generator)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(N)]


class Snapshots(transformers.TrainerCallback):
    """The parameters at each optimizer step, before it moves them."""

    def __init__(self):
        self.states = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.states.append(copy.deepcopy(model.state_dict()))


def train(tmp_path, callbacks, accumulation=1, every=1):
    args = transformers.TrainingArguments(
        str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=accumulation,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        train_sampling_strategy="sequential",
        disable_tqdm=True,
    )
    model = tiny_bert()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=dataset(), callbacks=callbacks
    )
    trainer.train()
    return trainer, model


def reference_grads(state, examples):
    """Each example's gradient alone, flattened, in float64: ``(B, P)``."""
    model = tiny_bert().double().eval()
    model.load_state_dict(state)
    rows = []
    for example in examples:
        model.zero_grad()
        output = model(
            input_ids=example["input_ids"][None], attention_mask=example["attention_mask"][None]
        )
        loss_fn(output, example["labels"][None]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows).numpy()


def estimates(flat):
    batch = len(flat)
    trace = ((flat - flat.mean(0)) ** 2).sum() / (batch - 1)
    return trace, (flat.mean(0) ** 2).sum() - trace / batch


@pytest.mark.parametrize(
    "accumulation",
    [
        1,
        pytest.param(
            2,
            marks=pytest.mark.slow(
                reason="gradient accumulation: three more Trainer runs, about 10 s on 2 cores"
            ),
        ),
    ],
)
def test_logged_numbers_equal_single_example_gradients(tmp_path, accumulation):
    monitor = pergrad.norms.TrainingMonitor(smoothing=SMOOTHING, quantiles=(0.1, 0.5, 0.9))
    callback = pergrad.norms.TrainingMonitorCallback(loss_fn, monitor=monitor, max_norm=MAX_NORM)
    snapshots = Snapshots()
    trainer, model = train(tmp_path, [callback, snapshots], accumulation)
    history = monitor.history
    assert history["step"] == list(range(1, STEPS + 1))
    examples, step_batch = dataset(), BATCH * accumulation
    traces, signals, clipped = [], [], []
    for step, state in enumerate(snapshots.states):
        flat = reference_grads(state, examples[step * step_batch : (step + 1) * step_batch])
        norms = np.linalg.norm(flat, axis=1)
        assert np.min(np.abs(norms - MAX_NORM)) > 1e-3  # the clipped fraction is unambiguous
        for q in monitor.quantiles:
            key = pergrad._src.monitor.quantile_key(q)
            assert history[key][step] == pytest.approx(np.quantile(norms, q), rel=1e-4)
        clipped.append(np.mean(norms > MAX_NORM))
        assert history["clip_fraction"][step] == pytest.approx(clipped[-1])
        trace, signal = estimates(flat)
        traces.append(trace)
        signals.append(signal)
        weights = [(1 - SMOOTHING) * SMOOTHING ** (step - k) for k in range(step + 1)]
        signal = np.dot(weights, signals)  # the running estimate is nan while it is <= 0
        running = np.dot(weights, traces) / signal if signal > 0 else math.nan
        assert history["noise_scale"][step] == pytest.approx(running, rel=1e-3, nan_ok=True)
    assert any(math.isfinite(value) for value in history["noise_scale"])
    assert 0 < sum(clipped) < len(clipped)  # some examples clipped, not all
    # the numbers reach the Trainer's logs, step by step
    logged = [e for e in trainer.state.log_history if "per_example_norm_q50" in e and "loss" in e]
    assert [entry["step"] for entry in logged] == list(range(1, STEPS + 1))
    assert [entry["per_example_norm_q50"] for entry in logged] == history["q50"]
    assert [entry["clip_fraction"] for entry in logged] == history["clip_fraction"]
    # the training itself is what it is without the callback
    _, alone = train(tmp_path / "alone", [], accumulation)
    for (name, value), other in zip(model.state_dict().items(), alone.state_dict().values()):
        assert torch.equal(value, other), name


def test_every_and_a_trainer_that_hides_the_labels(tmp_path):
    callback = pergrad.norms.TrainingMonitorCallback(loss_fn, every=2)
    train(tmp_path, [callback])
    assert callback.monitor.history["step"] == [1, 3]
    assert callback.monitor.history["clip_fraction"] == [None, None]
    hidden = pergrad.norms.TrainingMonitorCallback(loss_fn, label_name="targets")
    with pytest.warns(UserWarning, match="recorded no step in 3 steps.*'targets'"):
        train(tmp_path / "hidden", [hidden])
    assert hidden.latest() == {}


def test_bad_arguments_are_refused_by_name():
    make = pergrad.norms.TrainingMonitorCallback
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        make("cross_entropy")
    with pytest.raises(TypeError, match="monitor must be a pergrad.norms.TrainingMonitor"):
        make(loss_fn, monitor={})
    with pytest.raises(ValueError, match="max_norm must be a positive number or None; got 0"):
        make(loss_fn, max_norm=0)
    with pytest.raises(ValueError, match="every must be a positive int; got 0"):
        make(loss_fn, every=0)
    with pytest.raises(TypeError, match="label_name must be a str"):
        make(loss_fn, label_name=3)
    assert math.isnan(pergrad.norms.TrainingMonitor().noise_scale)

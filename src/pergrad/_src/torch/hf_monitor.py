"""Gradient diagnostics inside Hugging Face's ``transformers.Trainer``: a ``TrainerCallback``
that feeds a :class:`pergrad.norms.TrainingMonitor` from the batches the Trainer trains on.

A callback sees neither the batch nor the loss, so it keeps a reference to the keyword
arguments of the model's training forward passes (a forward pre-hook, which copies nothing)
and, just before the optimizer steps, computes each example's gradient norm and the batch's
summed gradient on the ghost path (:func:`pergrad.dp.clipped_sum_of` with a bound no example reaches:
no per-example gradients formed), at the parameters the step's gradient was taken at.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers

from pergrad._src.core.module_loss import ModuleLoss, module_loss
from pergrad._src.dp.from_loss import clipped_sum_of
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.monitor import TrainingMonitor, quantile_key

# A clipping bound no gradient reaches: the clipped sum is then the plain sum (math.inf would
# make the clip factors inf / inf).
_NO_BOUND = 1e30
# Keyword arguments of the Trainer's forward call that are not one example's data: the
# batch's token count, which the Trainer passes for its own loss normalisation.
_NOT_EXAMPLE_DATA = frozenset({"num_items_in_batch"})


class TrainingMonitorCallback(transformers.TrainerCallback):
    """Per-example gradient diagnostics during ``transformers.Trainer`` training.

        callback = pergrad.norms.TrainingMonitorCallback(
            loss_fn=lambda output, labels: F.cross_entropy(output.logits, labels),
            max_norm=1.0, every=10)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train,
                                       callbacks=[callback])
        trainer.train()
        callback.monitor.history["q50"]      # the median per-example norm, per monitored step
        pergrad.plotting.training_curves(callback.monitor, path="training.png", max_norm=1.0)

    Every ``every`` optimizer steps, just before the optimizer steps, it takes the batch the
    step was computed on (all of its micro-batches under gradient accumulation), computes each
    example's gradient norm and the batch's summed gradient in one ghost pass (no per-example
    gradients formed; memory about that of a batch gradient), and calls
    :meth:`TrainingMonitor.update` with them: the norms' quantiles, the clipped fraction
    (the share of norms above ``max_norm``) and the running gradient noise scale. The latest
    values are added to the Trainer's logs (``per_example_norm_q50``, ``clip_fraction``,
    ``noise_scale``) and to ``trainer.state.log_history``.

    What is measured: the gradient of ``loss_fn(model(**inputs), labels)`` for each example
    alone, with the model in eval mode (dropout off, so that each gradient is a function of
    the example; the training mode is restored afterwards), at the parameters the step's
    gradient was taken at. The Trainer's ``.grad`` and the model are left as they were.

    Cost: one more forward and backward pass over each monitored step's batch; ``every=10``
    makes it a tenth of that.

    Logging integrations (TensorBoard, W&B) are called before callbacks passed to the Trainer,
    so they see these keys from the next log on only if the callback comes first:
    ``trainer.callback_handler.callbacks.insert(0, callback)``.

    Not for :class:`pergrad.dp.DPTrainer`: it never gives the model the labels, so nothing is
    recorded (said with a warning at the end of training); a DP step reports its clipped
    fraction itself (``DPStep.clip_fraction``). The numbers here are not private.

    Args:
      loss_fn: ``loss_fn(output, labels) -> scalar``, the loss of a batch as the MEAN of its
        examples' losses (as :class:`pergrad.dp.DPTrainer` takes it); called one example at a
        time.
      monitor: the :class:`pergrad.norms.TrainingMonitor` to feed (None: a new one, with its
        defaults); :attr:`monitor` holds it.
      max_norm: a bound for the clipped fraction (None: no clipped fraction).
      every: monitor every ``every``-th optimizer step (1, 1 + every, ...), a positive int.
      label_name: the key of the targets among the model's keyword arguments.
      strategy: how the norms are computed, as for :func:`pergrad.norms.per_example_norms_of`
        (``"auto"``: ghost where every layer has a rule).
      chunk_size: as for :func:`pergrad.norms.per_example_norms_of`.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        monitor: TrainingMonitor | None = None,
        max_norm: float | None = None,
        every: int = 1,
        label_name: str = "labels",
        strategy: str = "auto",
        chunk_size: int | None = None,
    ) -> None:
        name = "TrainingMonitorCallback"
        if not callable(loss_fn):
            raise PergradTypeError(
                f"{name}: loss_fn must be callable, loss_fn(output, labels) -> scalar; got "
                f"{type(loss_fn).__name__}."
            )
        if monitor is not None and not isinstance(monitor, TrainingMonitor):
            raise PergradTypeError(
                f"{name}: monitor must be a pergrad.norms.TrainingMonitor or None; got "
                f"{type(monitor).__name__}."
            )
        if max_norm is not None and (
            isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm <= 0
        ):
            raise PergradValueError(
                f"{name}: max_norm must be a positive number or None; got {max_norm!r}."
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise PergradValueError(f"{name}: every must be a positive int; got {every!r}.")
        if not isinstance(label_name, str):
            raise PergradTypeError(
                f"{name}: label_name must be a str (the key of the targets); got "
                f"{type(label_name).__name__}."
            )
        self.loss_fn = loss_fn
        #: the monitor the callback feeds
        self.monitor = TrainingMonitor() if monitor is None else monitor
        self.max_norm = None if max_norm is None else float(max_norm)
        self.every = every
        self.label_name = label_name
        self.strategy = strategy
        self.chunk_size = chunk_size
        self._model: torch.nn.Module | None = None
        self._loss: ModuleLoss | None = None
        self._hook: Any = None
        self._batches: list[dict[str, Any]] = []  # this step's micro-batches (references)
        self._recording = False  # whether this step is monitored
        self._busy = False  # inside the callback's own pass: its forward calls are not batches

    # --- the Trainer's events -----------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            raise PergradTypeError(
                f"TrainingMonitorCallback: the Trainer's model must be a torch.nn.Module; got "
                f"{type(model).__name__}."
            )
        self._remove_hook()
        self._model = model
        self._loss = module_loss(model, self.loss_fn)
        self._hook = model.register_forward_pre_hook(self._keep_batch, with_kwargs=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._batches = []
        self._recording = state.global_step % self.every == 0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        batches, self._batches = self._batches, []
        if not self._recording or not batches:
            return
        norms, grad_sum = self._norms_and_sum(batches)
        if grad_sum is None:  # only empty micro-batches
            return
        self.monitor.update(
            norms=norms, grad_sum=grad_sum, max_norm=self.max_norm, step=state.global_step + 1
        )

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        latest = self.latest()
        if logs is None or not latest:
            return
        logs.update(latest)
        # Trainer.log appended {**logs, "step": global_step} to the history before calling us
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(latest)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_hook()
        if state.global_step > 0 and not self.monitor.history["step"]:
            warnings.warn(
                f"TrainingMonitorCallback recorded no step in {state.global_step} steps: the "
                f"model was never called for training with {self.label_name!r} among its "
                f"keyword arguments (the Trainer's default). A Trainer that takes the labels "
                f"out before the forward pass (compute_loss_func, a label smoother, "
                f"pergrad.dp.DPTrainer) hides them: set label_name to where they are, or feed "
                f"the monitor yourself with TrainingMonitor.update.",
                UserWarning,
                stacklevel=2,
            )

    # --- the monitor's numbers --------------------------------------------------------------

    def latest(self) -> dict[str, float]:
        """The last monitored step's numbers under the keys the logs get (empty before the
        first): ``per_example_norm_q{..}`` for each quantile, ``clip_fraction`` (with
        ``max_norm``), ``noise_scale`` (once it is defined)."""
        history = self.monitor.history
        if not history["step"]:
            return {}
        latest = {
            f"per_example_norm_{quantile_key(q)}": history[quantile_key(q)][-1]
            for q in self.monitor.quantiles
        }
        if history["clip_fraction"][-1] is not None:
            latest["clip_fraction"] = history["clip_fraction"][-1]
        if math.isfinite(history["noise_scale"][-1]):
            latest["noise_scale"] = history["noise_scale"][-1]
        return latest

    def _keep_batch(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """The forward pre-hook: keeps (a reference to) the keyword arguments of a training
        forward pass of the model (training mode, gradients on, the labels among them, not
        inside a torch.func transform nor the callback's own pass)."""
        if (
            not self._recording
            or self._busy
            or args
            or not module.training
            or not torch.is_grad_enabled()
            or self.label_name not in kwargs
            or torch._C._functorch.maybe_current_level() is not None
        ):
            return
        self._batches.append(dict(kwargs))

    def _norms_and_sum(self, batches: list[dict[str, Any]]) -> tuple[torch.Tensor, Any]:
        """Each example's gradient norm over the step's micro-batches, and their summed
        (unclipped) gradient, in eval mode."""
        model, loss = self._model, self._loss
        assert model is not None and loss is not None
        training = model.training
        self._busy = True
        norms: list[torch.Tensor] = []
        total: dict[str, torch.Tensor] | None = None
        try:
            model.eval()
            params = loss.params()
            for inputs in batches:
                labels, inputs = _split(inputs, self.label_name)
                if len(labels) == 0:
                    continue
                summed = clipped_sum_of(
                    loss,
                    params,
                    inputs,
                    labels,
                    max_norm=_NO_BOUND,
                    strategy=self.strategy,
                    chunk_size=self.chunk_size,
                )
                norms.append(summed.norms.detach())
                step_sum = {name: value.detach() for name, value in summed.sum.items()}
                total = (
                    step_sum
                    if total is None
                    else {name: total[name] + value for name, value in step_sum.items()}
                )
        finally:
            model.train(training)
            self._busy = False
        return torch.cat(norms) if norms else torch.zeros(0, device="cpu"), total

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _split(inputs: dict[str, Any], label_name: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(labels, model inputs)`` of one micro-batch: the labels taken out (they go to
    ``loss_fn``), the Trainer's per-batch arguments left out, and the tensors that are not
    one row per example left out (a per-example computation cannot split them)."""
    labels = inputs[label_name]
    size = len(labels)
    kept = {}
    for key, value in inputs.items():
        if key == label_name or key in _NOT_EXAMPLE_DATA or value is None:
            continue
        if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] != size):
            continue
        kept[key] = value
    return labels, kept

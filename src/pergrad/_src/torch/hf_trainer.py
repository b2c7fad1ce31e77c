"""DP-SGD inside Hugging Face's ``transformers.Trainer``: Poisson batches, per-example clipping,
noise once per optimizer step, epsilon in the logs."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import transformers
from torch.func import functional_call
from torch.utils.data import DataLoader, Sampler

from pergrad._src.backends.secure import SecureRandom
from pergrad._src.core.module_loss import running_statistics_left_alone
from pergrad._src.dp.accounting import Accountant, noise_multiplier_for
from pergrad._src.dp.clipping import check_positive
from pergrad._src.dp.clipping_policies import (
    AdaptiveClipping,
    ClippingPolicy,
    check_adaptive_noise,
    check_clipping,
)
from pergrad._src.dp.noise import NoiseMechanism, check_mechanism
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.torch.dp_optimizer import DPOptimizer
from pergrad._src.torch.sampling import (
    CyclicPoissonBatchSampler,
    PoissonBatchSampler,
    collate_with_empty_batches,
)


class _NoUpdate(torch.optim.Optimizer):
    """The optimizer DPOptimizer steps: nothing. The Trainer's own optimizer takes the step
    from the noisy gradients DPOptimizer writes to ``.grad``."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        return None


class _MicroBatches(Sampler[list[int]]):
    """One batch per optimizer step (Poisson or cyclic Poisson), cut into ``pieces``
    micro-batches (some may be empty), so the Trainer's gradient accumulation sees ``pieces``
    batches per step."""

    def __init__(self, batches: Sampler[list[int]], pieces: int) -> None:
        self.batches = batches
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.batches) * self.pieces  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            for piece in np.array_split(np.asarray(batch, dtype=np.int64), self.pieces):
                yield piece.tolist()


class _ReleaseNoisyGradient(transformers.TrainerCallback):
    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.dp_optimizer.step()


def _fresh_generator(device: Any) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


class DPTrainer(transformers.Trainer):
    """``transformers.Trainer`` with DP-SGD: a drop-in subclass.

        trainer = pergrad.dp.DPTrainer(
            model=model,
            args=TrainingArguments("out", max_steps=1000, per_device_train_batch_size=64,
                                   learning_rate=1e-3, logging_steps=50),
            train_dataset=train, data_collator=collator,
            loss_fn=causal_lm_loss, max_norm=1.0, target_epsilon=8.0, delta=1e-6,
        )
        trainer.train()          # the logs carry "epsilon" at each logging step
        trainer.accountant.epsilon()

    What changes from ``Trainer``:

    - **Batches** are Poisson-sampled, as the accounting assumes: each step includes every
      training example independently with probability ``sample_rate`` (default
      ``per_device_train_batch_size * gradient_accumulation_steps / len(train_dataset)``, so
      the expected batch is the batch you asked for). With gradient accumulation, each step's
      Poisson batch is cut into ``gradient_accumulation_steps`` micro-batches.
    - **Gradients** come from :class:`pergrad.dp.DPOptimizer`: each example's gradient of
      ``loss_fn(model(**inputs), labels)`` is clipped to ``max_norm`` (on the ghost path for
      standard layers, without forming it), the clipped sums of the step's micro-batches are
      added, Gaussian noise of std ``noise_multiplier * max_norm`` is drawn once, and the sum is
      divided by the expected batch size; then the Trainer's optimizer and scheduler step as
      usual. ``args.max_grad_norm`` is set to 0 (per-example clipping replaces it).
    - **Clipping policy** (``clipping=``, as for :class:`pergrad.dp.DPOptimizer`):
      :func:`pergrad.dp.automatic` scales each gradient by ``max_norm / (norm + gamma)``;
      :func:`pergrad.dp.adaptive` starts the bound at ``max_norm`` and moves it after each
      optimizer step towards a quantile of the norms, from a noisy count of the examples
      within it (its noise drawn from ``noise_generator``). Its privacy cost is accounted: the gradient's noise multiplier is
      raised (``dp_optimizer.gradient_noise_multiplier``) so that each step (noisy sum and
      noisy count) costs one Gaussian release of ``noise_multiplier``, the number the
      accountant takes, calibrated from ``target_epsilon`` as without it. The current bound
      is ``dp_optimizer.max_norm``, logged as ``"max_norm"``; it lives in the DPOptimizer,
      so a run resumed from a checkpoint restarts it from ``max_norm`` (as it restarts the
      accountant's count).
    - **Accounting**: :attr:`accountant` counts the optimizer steps; ``epsilon`` (at ``delta``)
      is added to every log. Give ``noise_multiplier``, or ``target_epsilon`` to have it
      calibrated for ``args.max_steps`` steps (when ``max_steps`` is not set, it becomes
      ``ceil(num_train_epochs / sample_rate)``).
    - **Amplified banded noise** (``noise=pergrad.dp.toeplitz(..., min_separation=,
      sample_rate=)``): the batches are drawn by cyclic Poisson sampling, as its accounting
      assumes (:class:`pergrad.dp.CyclicPoissonBatchSampler`, the groups fixed for the
      trainer's life); ``sample_rate`` and the steps come from the mechanism
      (``args.max_steps`` unset becomes its ``steps``; more is refused), and the sum is divided
      by ``len(train_dataset) * sample_rate / min_separation``. A mechanism accounted without
      sampling (``blt``, ``optimal_blt``, ``toeplitz`` without ``sample_rate``) is refused: its
      guarantee needs a fixed participation pattern, which Poisson batches do not keep.

    The model is not wrapped: evaluate or generate between steps as usual. Runs in one process
    (for data parallelism use ``DPOptimizer(distributed=True)`` in your own loop).

    Cost: a step of DPOptimizer per optimizer step (see its cost), plus, with
    ``report_loss=True``, one forward pass without gradients per micro-batch for the logged
    loss (the clipped gradients do not give the loss); pass ``report_loss=False`` to save it
    (the logged loss is then 0).

    Args:
      model: the ``nn.Module`` to train (its trainable parameters are clipped and noised).
      args: ``transformers.TrainingArguments``.
      loss_fn: ``loss_fn(output, labels) -> scalar``, the loss of a batch as the MEAN of its
        examples' losses (e.g. a token-level cross-entropy, which is then each example's mean
        over its own tokens); pergrad evaluates it one example at a time.
      max_norm: the clipping bound, > 0.
      noise_multiplier: noise std divided by ``max_norm``, >= 0; or None with
        ``target_epsilon``.
      target_epsilon: the epsilon to calibrate the noise for, or None with
        ``noise_multiplier``.
      delta: the delta of the guarantee (and of the logged epsilon), in (0, 1).
      sample_rate: each example's probability of being in a step's batch, in (0, 1]; with a
        mechanism made for one run (``noise.steps`` set), taken from it (given, it must agree).
      accountant: ``"rdp"`` (default) or ``"pld"``, as for :func:`pergrad.dp.epsilon`.
      label_name: the key of the targets in each collated batch (default ``"labels"``); the
        other keys go to the model as keyword arguments.
      noise_generator: the noise's ``torch.Generator`` (on ``args.device``) or a
        :class:`pergrad.dp.SecureRandom` (noise from the operating system's cryptographic
        source; about 0.1 s per million parameters per step). Default None: a generator seeded
        from the operating system's secure source, NOT from ``args.seed`` (a known seed would
        let anyone recompute the noise).
      sampling_generator: the Poisson sampling's ``torch.Generator`` (default None: seeded
        from the operating system's secure source); seed it only in tests.
      report_loss: log the training loss (one extra forward pass; see Cost).
      noise: the noise mechanism, calibrated and accounted (None:
        :func:`pergrad.dp.gaussian`, independent Gaussian noise at every step).
      clipping: the clipping policy (None: ``min(1, max_norm / norm)``;
        :func:`pergrad.dp.automatic` or :func:`pergrad.dp.adaptive`, see above). Adaptive
        clipping needs independent Gaussian noise (``noise`` None) and ``count_noise_std``
        above ``noise_multiplier / 2``.
      **kwargs: the rest of ``transformers.Trainer``'s arguments (``train_dataset``,
        ``eval_dataset``, ``data_collator``, ``callbacks``...).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        args: transformers.TrainingArguments,
        *,
        loss_fn: Callable[..., Any],
        max_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float,
        sample_rate: float | None = None,
        accountant: str = "rdp",
        label_name: str = "labels",
        noise_generator: torch.Generator | SecureRandom | None = None,
        sampling_generator: torch.Generator | None = None,
        report_loss: bool = True,
        noise: NoiseMechanism | None = None,
        clipping: ClippingPolicy | None = None,
        **kwargs: Any,
    ) -> None:
        name = "DPTrainer"
        if not callable(loss_fn):
            raise PergradTypeError(
                f"{name}: loss_fn must be callable, loss_fn(output, labels) -> scalar; got "
                f"{type(loss_fn).__name__}."
            )
        if not isinstance(args, transformers.TrainingArguments):
            raise PergradTypeError(
                f"{name}: args must be a transformers.TrainingArguments; got {type(args).__name__}."
            )
        if (noise_multiplier is None) == (target_epsilon is None):
            raise PergradValueError(
                f"{name}: give exactly one of noise_multiplier and target_epsilon; got "
                f"noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r}."
            )
        if args.world_size > 1:
            raise PergradValueError(
                f"{name}: runs in one process; got world_size={args.world_size}. For data "
                "parallelism, use pergrad.dp.DPOptimizer(distributed=True) in your own loop."
            )
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is None or not hasattr(train_dataset, "__len__"):
            raise PergradTypeError(
                f"{name}: train_dataset must be a dataset with a length (Poisson sampling "
                f"draws a coin per example); got {type(train_dataset).__name__}."
            )
        n = len(train_dataset)
        noise = check_mechanism(name, noise)
        if noise.steps is not None:  # a mechanism made for one run: its sampling and steps
            sample_rate = _sampling_of_run(name, noise, sample_rate, args)
        if sample_rate is None:
            sample_rate = min(
                1.0, args.per_device_train_batch_size * args.gradient_accumulation_steps / n
            )
        check_positive(name, "sample_rate", sample_rate)
        if sample_rate > 1:
            raise PergradValueError(f"{name}: sample_rate must be in (0, 1]; got {sample_rate}.")
        if args.max_steps is None or args.max_steps <= 0:
            args.max_steps = math.ceil(args.num_train_epochs / sample_rate)
        steps = int(args.max_steps) if noise.steps is None else noise.steps
        #: the number of groups of cyclic Poisson sampling (None: Poisson over all the data)
        self.cyclic_groups: int | None = _cyclic_groups(noise)
        if target_epsilon is not None:
            noise_multiplier = noise_multiplier_for(
                target_epsilon, delta, sample_rate, steps, accountant, noise=noise
            )
        clipping = check_clipping(name, clipping)
        if isinstance(clipping, AdaptiveClipping):  # before the Trainer is built: fail early
            check_adaptive_noise(name, clipping, noise, float(noise_multiplier), 1)
        args.max_grad_norm = 0.0
        super().__init__(model=model, args=args, **kwargs)
        self.loss_fn = loss_fn
        self.label_name = label_name
        self.sample_rate = float(sample_rate)
        self.report_loss = bool(report_loss)
        self.sampling_generator = sampling_generator
        self._batch_sampler: Sampler[list[int]] | None = None  # cyclic: made once, kept
        #: what each step's sum is divided by: the mean batch size of the sampling
        self.expected_batch_size = self.sample_rate * n / (self.cyclic_groups or 1)
        self.accountant = Accountant(noise_multiplier, sample_rate, delta, accountant, noise=noise)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.dp_optimizer = DPOptimizer(
            _NoUpdate(trainable),
            model,
            loss_fn,
            max_norm=max_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=self.expected_batch_size,
            generator=_fresh_generator(args.device) if noise_generator is None else noise_generator,
            accountant=self.accountant,
            noise=noise,
            clipping=clipping,
        )
        self.add_callback(_ReleaseNoisyGradient(self))

    @property
    def noise_multiplier(self) -> float:
        return self.accountant.noise_multiplier

    def get_train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset
        collator = self.data_collator
        if type(dataset).__module__.split(".")[0] == "datasets":  # a Hugging Face Dataset
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        return DataLoader(
            dataset,
            batch_sampler=_MicroBatches(
                self._batches(len(dataset)), self.args.gradient_accumulation_steps
            ),
            collate_fn=collate_with_empty_batches(dataset, collator),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def _batches(self, num_examples: int) -> Sampler[list[int]]:
        """The step's batches as the accounting assumes them: Poisson over all the examples,
        or, for an amplified banded mechanism, cyclic Poisson (one sampler for the trainer's
        life, so that its groups stay and a second ``train()`` continues the cycle)."""
        if self.cyclic_groups is None:
            return PoissonBatchSampler(
                num_examples, self.sample_rate, int(self.args.max_steps), self.sampling_generator
            )
        if self._batch_sampler is None:
            self._batch_sampler = CyclicPoissonBatchSampler(
                num_examples, generator=self.sampling_generator, noise=self.accountant.noise
            )
        return self._batch_sampler

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Clips this micro-batch's examples and adds them to the step (no backward of a batch
        loss: the noisy gradient is written just before the optimizer steps)."""
        model.train()
        inputs = dict(self._prepare_inputs(inputs))
        if self.label_name not in inputs:
            raise PergradValueError(
                f"DPTrainer: each batch must hold the targets under label_name="
                f"{self.label_name!r}; got the keys {sorted(inputs)}."
            )
        labels = inputs.pop(self.label_name)
        self.dp_optimizer.accumulate(inputs, labels)
        if not self.report_loss or len(labels) == 0:
            return torch.zeros((), device=self.args.device)
        with torch.no_grad():
            # the forward pass as the private step runs it: no running statistic written
            output = functional_call(model, running_statistics_left_alone(model), (), inputs)
            loss = self.loss_fn(output, labels).detach()
        return loss / self.args.gradient_accumulation_steps  # the Trainer sums micro-batches

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        logs = dict(logs)
        logs.pop("grad_norm", None)  # the Trainer's, taken before the noisy gradient exists
        if self.accountant.steps > 0:
            logs["epsilon"] = self.accountant.epsilon()
        if isinstance(self.dp_optimizer.clipping, AdaptiveClipping):
            logs["max_norm"] = self.dp_optimizer.max_norm  # the bound the next step clips at
        super().log(logs, *args, **kwargs)


UNSAMPLED_MECHANISM = """\
DPTrainer: noise={noise!r} is accounted as one Gaussian release for a fixed participation
pattern (each example in at most {participations} steps, at least {separation} apart), but
DPTrainer draws Poisson batches, which put an example in any number of steps, any distance
apart: the epsilon would not hold. Use noise accounted for sampling: pergrad.dp.gaussian(), or
amplified banded noise with cyclic Poisson sampling, which DPTrainer then draws:

    noise = pergrad.dp.toeplitz(coefs, steps=max_steps, min_separation=b, sample_rate=q)

or run pergrad.dp.DPOptimizer(noise=...) in a loop of your own over batches in a fixed order
(each example once per epoch, min_separation = steps per epoch)."""


def _sampling_of_run(name: str, noise: NoiseMechanism, sample_rate: Any, args: Any) -> float:
    """The sample rate of a mechanism made for one run, checked against the caller's
    ``sample_rate`` and ``args.max_steps`` (unset: it becomes the mechanism's steps)."""
    if noise.sample_rate is None:
        raise PergradValueError(
            UNSAMPLED_MECHANISM.format(
                noise=noise,
                participations=getattr(noise, "participations", "?"),
                separation=getattr(noise, "min_separation", None) or 1,
            )
        )
    if sample_rate is not None and sample_rate != noise.sample_rate:
        raise PergradValueError(
            f"{name}: sample_rate={sample_rate!r} disagrees with noise={noise!r}, whose "
            f"sample_rate is {noise.sample_rate!r} (the rate its accounting assumes); leave "
            "sample_rate out: it is taken from noise."
        )
    if args.max_steps is None or args.max_steps <= 0:
        args.max_steps = noise.steps
    elif args.max_steps > noise.steps:
        raise PergradValueError(
            f"{name}: args.max_steps={args.max_steps} is more than the steps={noise.steps} "
            f"noise={noise!r} is made for (it refuses a step past them). Set max_steps <= "
            f"{noise.steps}, or leave it unset, or make the mechanism for {args.max_steps} steps."
        )
    return noise.sample_rate


def _cyclic_groups(noise: NoiseMechanism) -> int | None:
    """The number of groups of the cyclic Poisson sampling ``noise`` is accounted for, or None
    (Poisson sampling over all the examples)."""
    if noise.steps is None or noise.sample_rate is None:
        return None
    return getattr(noise, "min_separation", None)

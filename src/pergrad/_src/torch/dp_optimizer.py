"""DP-SGD for PyTorch: a wrapper around any ``torch.optim`` optimizer, in one process or many."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from pergrad._src.backends import backend_of
from pergrad._src.backends.secure import SecureRandom
from pergrad._src.core.module_loss import module_loss
from pergrad._src.dp.accounting import check_accountant_noise
from pergrad._src.dp.clipping import ClippedSum, check_noise_multiplier, check_positive
from pergrad._src.dp.clipping_policies import (
    AdaptiveClipping,
    ClippingPolicy,
    check_adaptive_noise,
    check_clipping,
)
from pergrad._src.dp.from_loss import CHEAPER, clipped_sum_run
from pergrad._src.dp.noise import NoiseMechanism, check_mechanism
from pergrad._src.dp.sampling import FixedSizeCheck
from pergrad._src.errors import (
    NonFiniteWarning,
    PergradTypeError,
    PergradValueError,
    warn_from_caller,
)
from pergrad._src.torch import fsdp, fsdp_noise
from pergrad._src.torch.distributed import (
    StepTotals,
    all_reduce_totals,
    check_same_across_ranks,
    is_noise_rank,
    process_group_of,
)
from pergrad._src.torch.dp_step import (
    MAX_NORM_KEY,
    DPStep,
    ScaledLoss,
    check_scaler,
    host_numbers,
    mean_loss,
    warn_realised_batch_size,
)


class DPOptimizer:
    """DP-SGD around any ``torch.optim`` optimizer, in one process or across many.

        optimizer = pergrad.dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, F.cross_entropy,
            max_norm=1.0, noise_multiplier=1.1, expected_batch_size=256,
            generator=torch.Generator().manual_seed(secrets.randbits(63)),
        )
        for x, y in loader:             # Poisson batches: pergrad.dp.PoissonBatchSampler
            stats = optimizer.step(x, y)   # per-example grads, clip, noise, optimizer step

    ``step`` computes per-example gradients of ``loss_fn(model(x), y)`` through
    :func:`pergrad.module_loss`, clips each to ``max_norm``, sums, adds Gaussian noise of std
    ``noise_multiplier * max_norm`` from ``generator``, divides by ``expected_batch_size``
    (None: the batch size), writes the result to each parameter's ``.grad`` and steps the
    wrapped optimizer. ``zero_grad()`` is not needed between steps: each step (and each
    :meth:`accumulate`) first drops the trainable parameters' ``.grad``, which it overwrites,
    so that the last step's are not held through this one. The model keeps its mode, hooks
    and flags; parameters with ``requires_grad=False`` are left out. An empty batch still takes a step (pure noise), as
    the accounting assumes. Pass an :class:`Accountant` to have it count the steps.

    **Across processes** (``distributed=True``, after ``torch.distributed.init_process_group``;
    gloo on CPU, nccl on GPU): every process builds the same model and this optimizer with the
    same arguments, and steps on its own shard of each Poisson batch
    (``PoissonBatchSampler(..., num_replicas=world_size, rank=rank)``, empty shards included).
    Each process clips its own examples; one all-reduce sums the clipped sums over processes,
    and the noise is drawn once per step, from rank 0's ``generator`` (the other ranks'
    generators are not used), so the step equals the single-process step on the union of the
    shards. ``expected_batch_size`` is the GLOBAL one (``sample_rate * dataset size``), and the
    accountant takes the global ``sample_rate``. Do not wrap the model in
    ``DistributedDataParallel`` (it would all-reduce unclipped gradients): start every process
    from the same parameters (seed identically or :func:`pergrad.dp.broadcast_parameters`);
    construction checks that they are the same, as are ``max_norm``, ``noise_multiplier``,
    ``expected_batch_size`` and the accountant's settings.

    **A model sharded with FSDP2** (``torch.distributed.fsdp.fully_shard``, its parameters
    DTensor shards): pass ``distributed=True`` and the sharded model, and build the optimizer
    over ``model.parameters()`` as for any FSDP2 model. Each process's per-example norms come
    from its layers' inputs and output gradients (ghost, no gathered parameter kept); the
    clipped sum is a backward pass of the clip-weighted losses, which FSDP's reduce-scatter
    sums over the processes into each one's shard; the noise, from rank 0's ``generator``, is
    the single-process noise, scattered by shard (:attr:`DPStep.strategy` ``"ghost-fsdp"``;
    ``torch/fsdp.py``, the noise ``torch/fsdp_noise.py``); correlated noise keeps each
    process's share of its state. Tied weights, mixed precision (FSDP's
    ``MixedPrecisionPolicy`` or ``torch.autocast``: the clipped sum from the records in
    float32), ``user_ids`` (each user on one process) and parameters without a ghost rule (a
    class token, a LayerScale: their module run alone per example, ``torch/fsdp_units.py``)
    work too. Not yet: such a parameter on a module that is or holds a ``fully_shard``'ed
    module (the root), HSDP meshes: each is refused with the reason.

    Cost: the clipped sum comes from :func:`pergrad.dp.clipped_sum_of` with ``strategy``
    (default ``"auto"``): for models built from standard layers (Linear, Conv1d/2d, Embedding,
    norm layers) the ghost strategy, about 1.3-1.7 batch gradients of time and no ``B x P`` memory
    (unless a cost model finds forming the ``B x P`` per-example gradients faster and they fit in
    ``2**25`` numbers: a small model with few examples; ``choose_strategy`` says which);
    otherwise per-example gradients ``chunk_size`` examples at a time, which, under ``"auto"``,
    the first step that takes them says once with a :class:`pergrad.FallbackWarning` naming the
    layers and why. Short of memory: ``strategy="ghost-lowmem"`` holds no layer's records past
    its hook (each layer's norms computed in the backward pass, then a second backward pass for
    the clipped sum), for one more backward pass
    (``benchmarks/results/cpu/dp_transformers.md``). Gradient accumulation: :meth:`accumulate`
    each micro-batch, then :meth:`step` (noise once per logical step). Distributed: one
    all-reduce of ``P + 2`` numbers per step, and at construction two all-gathers and one pass
    over the parameters' bytes.

    **Mixed precision**: call ``step`` inside ``torch.autocast`` (the model's forward pass
    runs in bfloat16 / float16, the parameters stay float32); the norms, clip factors and
    clipped sum are computed in float32 from the low-precision activations, so the bound holds
    to float32 rounding. With float16, pass a ``scaler`` (``torch.amp.GradScaler``): each
    example's loss is multiplied by the scale, its gradient is clipped at ``scale * max_norm``
    and the sum divided by the scale (the same as unscaling, then clipping at ``max_norm``),
    and the noise is added to that unscaled sum. If any example's scaled gradient overflows
    (inf or nan), the step is skipped: no noise is drawn, the parameters keep their values,
    ``.grad`` is None, the scaler backs its scale off and :attr:`DPStep.skipped` is True. The
    accountant still counts a skipped step (the batch was drawn). Skipping depends on the data
    (whether some example overflowed) and is visible, a release the noise does not cover: with
    skipped steps the accountant's epsilon holds for the noisy updates but not for the skip
    pattern. Prefer bfloat16 (float32's range, no scaler, never skips) where the hardware has
    it. See the DP-SGD guide.

    **Non-finite gradients** (without a ``scaler``): an example whose gradient has an inf or
    nan (a nan in its input, a ``log(0)`` in its loss) is zeroed rather than poisoning the
    step: it adds nothing to the clipped sum, the rest of the batch updates the model as
    usual, and :attr:`DPStep.nonfinite` counts it. The first step that meets one says so with
    a :class:`pergrad.NonFiniteWarning` (once per optimizer). The example still counts in the
    batch, and the accountant is unaffected: a contribution of 0 is within the clipping bound,
    so the noise covers it as it covers any other example. Cost: an elementwise ``where`` over
    each layer's recorded activations and output gradients (ghost), over the per-example
    gradients (materialize) or over the batch's inputs (chunked), where the ghost and
    materialised paths run it only when some example's norm is not finite (one host sync per
    micro-batch checks; within 2% of a step without it, ``benchmarks/nonfinite_cost.py``), and
    one host sync per micro-batch to read the count.

    Args:
      optimizer: the ``torch.optim.Optimizer`` over the model's parameters.
      model: the ``nn.Module`` (not wrapped in ``DistributedDataParallel``).
      loss_fn: a batch loss ``loss_fn(output, *targets)``, as for :func:`pergrad.module_loss`.
      max_norm: clipping bound ``C``, > 0.
      noise_multiplier: noise std divided by ``C``, >= 0.
      expected_batch_size: divide the noisy sum by this (global) number; None divides by the
        actual number of examples (over all processes when distributed), which releases the
        realised batch size: with an ``Accountant`` of Poisson sampling that is said with a
        :class:`pergrad.PrivacyWarning`. With such an accountant, batches that keep one size
        step after step (fixed-size batches, a ``DataLoader(batch_size=)``, which Poisson
        sampling would give with probability under 1e-9) are said too, once.
      generator: the ``torch.Generator`` of the noise (None: torch's global generator); seed
        it securely for real privacy, or pass :class:`pergrad.dp.SecureRandom` to draw the
        noise from the operating system's cryptographic source. Distributed: rank 0's is used.
      num_inputs: how many batch arguments go to the model (the rest go to ``loss_fn``).
      chunk_size: how the clipped sum is computed (see :func:`clipped_sum_of`).
      strategy: how the clipped sum is computed (see :func:`clipped_sum_of`).
      accountant: an :class:`Accountant` whose ``step()`` is called once per step.
      distributed: False (one process), True (the default ``torch.distributed`` process
        group) or a ``torch.distributed.ProcessGroup``.
      scaler: a ``torch.amp.GradScaler`` for float16 autocast (None: no loss scaling). Not
        with ``distributed``. ``step`` calls its ``step`` and ``update``; do not call them.
      noise: the noise mechanism (None: :func:`pergrad.dp.gaussian`, independent Gaussian
        noise at every step); the optimizer keeps its state from step to step. An
        ``accountant`` must account for the same mechanism.
      clipping: the clipping policy (None: ``min(1, max_norm / norm)``).
        :func:`pergrad.dp.automatic` scales each gradient by ``max_norm / (norm + gamma)``.
        :func:`pergrad.dp.adaptive` starts at ``max_norm`` and moves :attr:`max_norm` after
        each step (kept in :meth:`state_dict`), releasing a noisy count of the examples within
        the bound from ``generator``; the gradient's noise multiplier is raised to pay for it
        (:attr:`gradient_noise_multiplier`), so the accountant takes ``noise_multiplier``.
        Adaptive clipping needs independent Gaussian noise (``noise`` None).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        loss_fn: Callable[..., Any],
        *,
        max_norm: float,
        noise_multiplier: float,
        expected_batch_size: float | None = None,
        generator: torch.Generator | SecureRandom | None = None,
        num_inputs: int = 1,
        chunk_size: int | None = None,
        strategy: str = "auto",
        accountant: Any = None,
        distributed: bool | torch.distributed.ProcessGroup = False,
        scaler: torch.amp.GradScaler | None = None,
        noise: NoiseMechanism | None = None,
        clipping: ClippingPolicy | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PergradTypeError(
                f"DPOptimizer: optimizer must be a torch.optim.Optimizer; got "
                f"{type(optimizer).__name__}."
            )
        check_positive("DPOptimizer", "max_norm", max_norm)
        check_noise_multiplier("DPOptimizer", noise_multiplier)
        if expected_batch_size is not None:
            check_positive("DPOptimizer", "expected_batch_size", expected_batch_size)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise PergradTypeError(
                "DPOptimizer: model is wrapped in torch.nn.parallel.DistributedDataParallel; "
                "pass the plain module (model.module) and distributed=True instead. DDP "
                "all-reduces the unclipped gradients of backward(), which DP-SGD must not "
                "release and pergrad does not use; DPOptimizer(distributed=True) all-reduces "
                "the clipped sums itself and adds the noise once."
            )
        if generator is not None and not isinstance(generator, (torch.Generator, SecureRandom)):
            raise PergradTypeError(
                f"DPOptimizer: generator must be a torch.Generator, a pergrad.dp.SecureRandom "
                f"or None; got "
                f"{type(generator).__name__}."
            )
        scaler = check_scaler(scaler, distributed)
        self.noise = check_mechanism("DPOptimizer", noise)
        check_accountant_noise("DPOptimizer", accountant, self.noise)
        self.clipping = check_clipping("DPOptimizer", clipping)
        #: the noise multiplier of the gradient: ``noise_multiplier``, raised under adaptive
        #: clipping to leave room for the noisy count (the accountant takes noise_multiplier)
        self.gradient_noise_multiplier = float(noise_multiplier)
        if isinstance(self.clipping, AdaptiveClipping):
            self.gradient_noise_multiplier = check_adaptive_noise(
                "DPOptimizer", self.clipping, self.noise, float(noise_multiplier), 1
            )
        warn_realised_batch_size(accountant, expected_batch_size)
        # fixed-size batches fed to a Poisson accountant: seen from the realised batch sizes
        self._size_check = FixedSizeCheck.of("DPOptimizer", accountant, expected_batch_size)
        self._noise_state: Any = None  # the mechanism's state, made at the first step
        self.scaler = scaler
        self._scaled_loss = None if scaler is None else ScaledLoss(loss_fn)
        self.optimizer = optimizer
        self.model = model
        self.max_norm = float(max_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self.generator = generator
        self.accountant = accountant
        self._loss = module_loss(model, self._scaled_loss or loss_fn, num_inputs=num_inputs)
        self.strategy = strategy
        self.chunk_size = chunk_size
        self._warned_off_ghost = False
        self._warned_nonfinite = False
        self._pending: ClippedSum | None = None  # accumulated micro-batches of this step
        self._pending_unclipped = 0.0  # adaptive clipping: examples within the bound, this step
        self._pending_overflow = False  # some micro-batch's scaled gradients were not finite
        self._pending_strategy = "materialize"
        # (sum, number) of the step's per-example losses so far; None once a micro-batch had none
        self._pending_losses: tuple[float, int] | None = (0.0, 0)
        self._micro_losses: tuple[float, int] | None = None  # the last micro-batch's
        self._user_level: bool | None = None  # whether the steps take user_ids (set by the first)
        self._pending_users: set[int] = set()  # the users of this step's micro-batches so far
        self.process_group = process_group_of("DPOptimizer", distributed)
        # FSDP2 (fully_shard): parameters are DTensor shards (torch/fsdp.py)
        self._sharded = (
            fsdp.check_sharded_model("DPOptimizer", model, self.process_group, self.noise)
            if fsdp.is_sharded(model)
            else None
        )
        if self._sharded is not None and (self.strategy not in ("auto", "ghost") or chunk_size):
            raise PergradValueError(
                f"DPOptimizer: the model is sharded with FSDP2, whose steps take the ghost "
                f"strategy only (each layer's norms from its records, 'ghost-fsdp'); got "
                f"strategy={self.strategy!r}, chunk_size={chunk_size!r}. Pass strategy='auto' "
                f"or 'ghost' and no chunk_size."
            )
        if self.process_group is not None:
            check_same_across_ranks(
                "DPOptimizer",
                self.process_group,
                dict(model.named_parameters()),
                {
                    "max_norm": self.max_norm,
                    "noise_multiplier": self.noise_multiplier,
                    "clipping": repr(self.clipping),
                    "expected_batch_size": expected_batch_size,
                    "accountant.sample_rate": getattr(accountant, "sample_rate", None),
                    "accountant.noise_multiplier": getattr(accountant, "noise_multiplier", None),
                },
                values=self._sharded is None,  # shards differ by design
            )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def accumulate(self, *batch: Any, user_ids: Any = None) -> DPStep:
        """Clip one micro-batch and add it to the current logical step; no noise, no update.

        Gradient accumulation: call ``accumulate`` on every micro-batch of a logical batch but
        the last, then :meth:`step` on the last (or ``step()`` with no arguments). Each example
        is clipped on its own, the noise is drawn once per logical step, the update divides
        by ``expected_batch_size`` (the logical batch's), and the accountant counts one step:
        the same as one :meth:`step` on the micro-batches put together, with the memory of one
        micro-batch. With ``user_ids`` (see :meth:`step`), each user's examples must all be in
        one micro-batch of the step (a user met again is refused: its parts would be clipped
        apart).

        Returns:
          The micro-batch's :class:`DPStep` (its clip fraction and size).
        """
        if not batch:
            raise PergradTypeError(
                "DPOptimizer.accumulate: pass one micro-batch, the model inputs then the loss "
                "function's targets, as for step()."
            )
        clipped, strategy, overflow, unclipped = self._clipped(batch, user_ids)
        self._pending_overflow = self._pending_overflow or overflow
        self._pending_unclipped += unclipped
        pending = self._pending
        if pending is None:
            self._pending = clipped
        else:
            self._pending = ClippedSum(
                sum={name: pending.sum[name] + value for name, value in clipped.sum.items()},
                norms=None,
                clip_fraction=(
                    pending.clip_fraction * pending.count + clipped.clip_fraction * clipped.count
                )
                / max(float(pending.count + clipped.count), 1.0),
                sensitivity=clipped.sensitivity,
                count=pending.count + clipped.count,
                nonfinite=pending.nonfinite + clipped.nonfinite,
            )
        self._pending_strategy = strategy
        micro, pending_losses = self._micro_losses, self._pending_losses
        self._pending_losses = (
            None
            if micro is None or pending_losses is None
            else (pending_losses[0] + micro[0], pending_losses[1] + micro[1])
        )
        return DPStep(
            float(clipped.clip_fraction),
            int(clipped.count),
            strategy,
            overflow,
            int(clipped.nonfinite),
            self.max_norm,
            mean_loss(micro),
        )

    def step(self, *batch: Any, user_ids: Any = None) -> DPStep:
        """One DP-SGD step on ``batch`` (the model inputs, then the loss function's targets);
        after :meth:`accumulate`, on the accumulated micro-batches and this one (or on those
        alone, with no arguments).

        ``user_ids``: None (example-level privacy), or a ``(B,)`` integer tensor or numpy
        array, one non-negative user id per example, for user-level privacy: each user's
        summed gradient is clipped to ``max_norm`` (as :func:`pergrad.dp.clipped_sum_of` with
        ``user_ids``), ``expected_batch_size`` is then the expected number of USERS per batch,
        the accountant's ``sample_rate`` the users' (:class:`pergrad.dp.UserPoissonBatchSampler`
        draws such batches) and :attr:`DPStep.batch_size` the number of users. An optimizer
        whose steps took ``user_ids`` refuses a step without them, and the reverse. The ghost
        strategy computes each user's norm from its examples' layer records (no per-example
        gradient of a layer with a rule formed); where it cannot take the model, the
        per-example gradients are formed and summed per user, said once with a
        :class:`pergrad.FallbackWarning` under ``strategy="auto"``. With
        :func:`pergrad.dp.adaptive` clipping the bound follows the count of users within it.
        Not with data-parallel ``distributed`` yet; on an FSDP2 model, with each user's
        examples on one process (checked at every step)."""
        if batch:
            self.accumulate(*batch, user_ids=user_ids)
        elif user_ids is not None:
            raise PergradTypeError(
                "DPOptimizer.step: user_ids were passed without a batch; pass them with the "
                "micro-batch they label (step(x, y, user_ids=ids) or accumulate(...))."
            )
        elif self._pending is None:
            raise PergradTypeError(
                "DPOptimizer.step: pass a batch (the model inputs, then the loss function's "
                "targets), or accumulate() micro-batches first and then call step()."
            )
        clipped, strategy = self._pending, self._pending_strategy
        overflow, self._pending, self._pending_overflow = self._pending_overflow, None, False
        self._pending_users = set()
        unclipped, self._pending_unclipped = self._pending_unclipped, 0.0
        losses, self._pending_losses = self._pending_losses, (0.0, 0)
        bound = self.max_norm
        if overflow:
            self._skip()
            totals = StepTotals(clipped.sum, float(clipped.count), float(clipped.clip_fraction))
        else:
            totals = self._noisy_totals(clipped)
            denominator = self.expected_batch_size or max(totals.count, 1.0)
            # in place: the totals are the step's own (a model's worth of numbers per copy);
            # one foreach op for every parameter (on an accelerator a few kernels, not one each)
            if totals.sum:
                torch._foreach_div_(list(totals.sum.values()), denominator)
            self._update(totals.sum)
            if isinstance(self.clipping, AdaptiveClipping):
                self._move_bound(unclipped, totals.count)
        if self._size_check is not None:
            self._size_check.observe(int(totals.count))
        if self.accountant is not None:
            self.accountant.step()  # skipped or not: the batch was drawn (see the docstring)
        return DPStep(
            clip_fraction=totals.clip_fraction,
            batch_size=int(totals.count),
            strategy=strategy,
            skipped=overflow,
            nonfinite=int(clipped.nonfinite),
            max_norm=bound,
            loss=mean_loss(losses),
        )

    def _move_bound(self, unclipped: float, count: float) -> None:
        """Adaptive clipping: release this step's count of examples within the bound, noised
        once (on rank 0 when distributed, then summed over the processes, so every process
        moves to the same bound), and move the bound. ``count`` is already global."""
        assert isinstance(self.clipping, AdaptiveClipping)
        group = self.process_group
        device = next(iter(self._loss.params().values())).device
        local = [torch.tensor(unclipped, dtype=torch.float32, device=device)]
        if group is None or is_noise_rank(group):
            local = self.clipping.noisy_counts(local, self.generator)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(local[0], op=dist.ReduceOp.SUM, group=group)
        (bound,) = self.clipping.bounds_from(
            [self.max_norm], [float(local[0])], count, self.expected_batch_size
        )
        self.max_norm = float(bound)

    def _update(self, gradient: dict[str, torch.Tensor]) -> None:
        """Write the private gradient to ``.grad`` and step: through the scaler, which gets
        it multiplied by its scale (it divides by it again; exact for a power-of-two scale)."""
        scale = self._scale() if self._scaled_loss is not None else 1.0
        for name, param in self.model.named_parameters():
            if name in gradient:
                value = gradient[name].detach()
                param.grad = (value if scale == 1.0 else value.mul_(scale)).to(param.dtype)
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def _skip(self) -> None:
        """A skipped step: the scaler learns of the overflow the only way it can, from a
        non-finite gradient it is asked to unscale, and backs its scale off; the optimizer
        does not step, and ``.grad`` is left None."""
        assert self.scaler is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for param in params:
            param.grad = torch.full_like(param, float("inf"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        for param in params:
            param.grad = None

    def _clipped(self, batch: tuple[Any, ...], user_ids: Any) -> tuple[ClippedSum, str, bool]:
        """The micro-batch's clipped sum (unscaled, non-finite examples zeroed), its strategy,
        and whether its scaled gradients overflowed (with a scaler, any non-finite example)."""
        pending_users = set(self._pending_users)
        refused = None
        try:
            user_ids = self._check_user_ids(user_ids)
        except (PergradTypeError, PergradValueError) as err:
            if self._sharded is None:
                raise
            # on an FSDP2 model every process must learn of it, or they would wait in the
            # step's collectives (raised on all of them, torch/fsdp_checks.agreed_batch)
            user_ids, refused = None, err
        try:
            return self._clipped_checked(batch, user_ids, refused)
        except BaseException:
            self._pending_users = pending_users  # (the micro-batch was not added: retry it)
            raise

    def _clipped_checked(
        self, batch: tuple[Any, ...], user_ids: Any, refused: BaseException | None
    ) -> tuple[ClippedSum, str, bool]:
        """:meth:`_clipped` once the user ids are checked (``refused``: their refusal, on an
        FSDP2 model, raised on every process)."""
        # The step overwrites every trainable parameter's .grad: the last step's go first, or
        # they would be held through this step's backward pass (a model's worth of memory).
        for param in self.model.parameters():
            if param.requires_grad:
                param.grad = None
        scale = 1.0
        if self._scaled_loss is not None:
            scale = self._scaled_loss.scale = self._scale()
        # Each loss times the scale gives each gradient times the scale: clipping those at
        # scale * max_norm and dividing the sum by the scale is unscaling, then clipping.
        if self._sharded is not None:  # (no scaler with distributed: scale is 1)
            clipped, choice, ran, losses = fsdp.clipped_sum_run(
                self._sharded,
                self._loss,
                batch,
                max_norm=self.max_norm,
                clipping=self.clipping,
                user_ids=user_ids,
                step_users=self._pending_users,
                refused=refused,
            )
        else:
            clipped, choice, ran, losses = clipped_sum_run(
                self._loss,
                self._loss.params(),
                *batch,
                max_norm=self.max_norm * scale,
                strategy=self.strategy,
                chunk_size=self.chunk_size,
                clipping=self.clipping.rescaled(scale),
                user_ids=user_ids,
            )
        self._warn_off_ghost(choice)
        unclipped: Any = 0.0
        if isinstance(self.clipping, AdaptiveClipping) and user_ids is not None:
            # a user-level step's norms are in its users' rows, the other rows 0: the users
            # within the bound are the real, finite ones that were not clipped
            unclipped = clipped.count * (1 - clipped.clip_fraction) - clipped.nonfinite
        elif isinstance(self.clipping, AdaptiveClipping):
            bk = backend_of(clipped.norms, "DPOptimizer", "norms")
            (unclipped,) = self.clipping.unclipped_counts(
                bk, [clipped.norms], [self.max_norm * scale], None
            )
        # The step's statistics, read from the device at once (one host sync, not one each).
        loss_sum: Any = 0.0 if losses is None else losses.float().sum()
        clip_fraction, count, nonfinite, unclipped, loss_sum = host_numbers(
            clipped.clip_fraction, clipped.count, clipped.nonfinite, unclipped, loss_sum
        )
        # the ghost strategies' losses (times the scale, under a scaler); none from the others,
        # and an empty micro-batch has nothing to add
        self._micro_losses = (
            (loss_sum / scale, losses.numel())
            if losses is not None
            else ((0.0, 0) if count == 0 else None)
        )
        clipped = clipped._replace(clip_fraction=clip_fraction, count=count, nonfinite=nonfinite)
        if nonfinite and self._scaled_loss is None:
            self._warn_nonfinite(int(nonfinite), int(count))
        if scale != 1.0:
            clipped = clipped._replace(
                sum={name: value / scale for name, value in clipped.sum.items()},
                norms=clipped.norms / scale,
                sensitivity=self.max_norm,
            )
        return clipped, ran, nonfinite > 0 and self._scaled_loss is not None, unclipped

    def _warn_nonfinite(self, nonfinite: int, batch_size: int) -> None:
        """Once per optimizer: a step zeroed examples whose gradient was not finite."""
        if self._warned_nonfinite:
            return
        self._warned_nonfinite = True
        warn_from_caller(
            f"DPOptimizer: {nonfinite} of {batch_size} examples had a gradient that is not "
            f"finite (inf or nan). Each was zeroed: it contributes nothing to the update and "
            f"still counts in the batch (the privacy accounting is unaffected: 0 is within the "
            f"clipping bound). DPStep.nonfinite counts them at every step; said once per "
            f"optimizer. Look for a nan or inf in the data or the loss (log(0)); under float16 "
            f"autocast, whose range ends at 65504, pass scaler=torch.amp.GradScaler(...) or "
            f"autocast to bfloat16.",
            NonFiniteWarning,
        )

    def _scale(self) -> float:
        """The scaler's current scale. Asked through ``scale()``, which creates it on the
        parameters' device the first time (``step`` and ``update`` need it to exist)."""
        assert self.scaler is not None
        device = next(iter(self._loss.params().values())).device
        return float(self.scaler.scale(torch.ones((), device=device)))

    def _check_user_ids(self, user_ids: Any) -> Any:
        """The micro-batch's user ids on the parameters' device (None: example-level), after
        the checks that keep a run at one level and each user in one micro-batch of a step."""
        level = user_ids is not None
        if self._user_level is not None and level != self._user_level:
            said = "without" if level else "with"
            raise PergradValueError(
                f"DPOptimizer: this optimizer's earlier steps were taken {said} user_ids, this "
                f"one {'with' if level else 'without'}; a run is user-level (every step "
                f"passes user_ids=) or example-level (none does), which its accounting assumes."
            )
        self._user_level = level
        if not level:
            return None
        if self.process_group is not None and self._sharded is None:
            raise PergradValueError(
                "DPOptimizer: user_ids (user-level clipping) is not supported with data-parallel "
                "distributed yet (a user's examples would have to be on one process); train in "
                "one process, or shard the model with FSDP2 (fully_shard)."
            )
        if isinstance(user_ids, torch.Tensor):
            device = next(iter(self._loss.params().values())).device
            user_ids = user_ids.to(device)
            ids = set(user_ids.tolist()) if user_ids.ndim == 1 else set()
        else:
            ids = set(np.asarray(user_ids).reshape(-1).tolist())
        repeated = ids & self._pending_users
        if repeated:
            raise PergradValueError(
                f"DPOptimizer.accumulate: user ids {sorted(repeated)[:5]} are in an earlier "
                f"micro-batch of this step too; keep each user's examples in one micro-batch "
                f"(its summed gradient is clipped as a whole)."
            )
        self._pending_users |= ids
        return user_ids

    def _warn_off_ghost(self, choice: Any) -> None:
        """Once per optimizer: "auto" left the ghost strategy for the chunked one (a layer it
        cannot take, or parameters without a rule whose per-example gradients are large), or
        user-level clipping formed the per-example gradients (the ghost strategy refused)."""
        user_formed = (
            self._user_level
            and choice.strategy not in ("ghost", fsdp.STRATEGY)
            and CHEAPER not in choice.reason
        )
        if not self._warned_off_ghost and self.strategy == "auto" and user_formed:
            self._warned_off_ghost = True
            warn_from_caller(
                f"DPOptimizer: {choice.reason}. The steps form each micro-batch's per-example "
                f"gradients (B x P memory: use accumulate() with smaller micro-batches if "
                f"short of it). Said once per optimizer."
            )
            return
        if self._warned_off_ghost or self.strategy != "auto" or choice.strategy != "chunked":
            return
        self._warned_off_ghost = True
        warn_from_caller(
            f"DPOptimizer: the ghost strategy cannot take every parameter of this model "
            f"({choice.reason}), so its steps take the chunked strategy: per-example gradients "
            f"chunk by chunk, the same step with more time and memory. Said once per optimizer."
        )

    def _noisy_totals(self, clipped: ClippedSum) -> StepTotals:
        """The clipped sum plus the step's one noise draw; across processes, summed over them
        with the noise drawn on rank 0 only."""
        group = self.process_group
        std = self.gradient_noise_multiplier * self.max_norm
        if self._sharded is not None:  # each shard already sums every process's examples
            # (each process keeps the mechanism's state of its own shards)
            noisy, self._noise_state = fsdp_noise.add_noise(
                clipped.sum, std, self.generator, self.noise, self._noise_state
            )
            counts = all_reduce_totals(
                {}, torch.as_tensor(clipped.count), torch.as_tensor(clipped.clip_fraction), group
            )
            return counts._replace(sum=noisy)
        if group is None or is_noise_rank(group):
            if self._noise_state is None:
                self._noise_state = self.noise.init(clipped.sum)
            # in place: the sums are the step's own (a model's worth of numbers per copy)
            local, self._noise_state = self.noise.add(
                clipped.sum, std, self.generator, self._noise_state, owned=True
            )
        else:
            local = clipped.sum
        if group is None:
            return StepTotals(local, float(clipped.count), float(clipped.clip_fraction))
        return all_reduce_totals(
            local, torch.as_tensor(clipped.count), torch.as_tensor(clipped.clip_fraction), group
        )

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; under adaptive clipping with the current bound
        under the key ``"pergrad_max_norm"``."""
        state = self.optimizer.state_dict()
        if isinstance(self.clipping, AdaptiveClipping):
            state = {**state, MAX_NORM_KEY: self.max_norm}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if MAX_NORM_KEY in state:
            state = dict(state)
            self.max_norm = check_positive(
                "DPOptimizer.load_state_dict", MAX_NORM_KEY, state.pop(MAX_NORM_KEY)
            )
        self.optimizer.load_state_dict(state)

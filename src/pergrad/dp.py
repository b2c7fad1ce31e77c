"""Differential privacy: per-example clipping, Gaussian noise, DP-SGD optimizers, accounting.

    # JAX / optax
    tx = optax.chain(pergrad.dp.optax_aggregate(max_norm=1.0, noise_multiplier=1.1, key=key,
                                                expected_batch_size=256), optax.adam(1e-3))
    # PyTorch
    opt = pergrad.dp.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                 F.cross_entropy, max_norm=1.0, noise_multiplier=1.1,
                                 expected_batch_size=256)

The noise is a mechanism (``noise=`` on every DP path and on the accounting): ``gaussian()``,
independent Gaussian noise at every step, is the default; ``NoiseMechanism`` is the protocol a
new mechanism implements (its state, its noise, its DP event). Correlated noise
(matrix-factorisation DP-FTRL, jax-privacy's conventions) is made for one run: ``toeplitz``
(banded Toeplitz strategies), ``blt`` (buffered linear Toeplitz) and ``optimal_blt`` (the BLT
that minimises the largest prefix-sum error), accounted as one Gaussian release::

    mech = pergrad.dp.optimal_blt(steps=1000)
    opt = pergrad.dp.DPOptimizer(..., noise_multiplier=4.0, noise=mech)
    pergrad.dp.epsilon(noise_multiplier=4.0, delta=1e-5, noise=mech)

One call sets a run up (the noise multiplier from a target epsilon, the sampler, the expected
batch size and the accountant, derived together; what Opacus's ``make_private`` is)::

    optimizer, loader, accountant = pergrad.dp.make_private(          # PyTorch
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, F.cross_entropy,
        batch_size=64, epochs=10, target_epsilon=3.0, delta=1e-5, max_norm=1.0)
    tx, loader, accountant = pergrad.dp.make_private_optax(           # JAX: (x, y, mask)
        X, Y, batch_size=64, epochs=10, target_epsilon=3.0, delta=1e-5, max_norm=1.0)

``plan`` gives the numbers alone (a ``DPPlan``).

Privacy is accounted through Google's ``dp-accounting`` (the ``dp`` extra): ``epsilon``,
``noise_multiplier_for`` and the ``Accountant`` that counts training steps. The accounting
assumes Poisson sampling: ``poisson_batches`` (numpy indices, with ``pad_batch`` for a fixed
shape under ``jax.jit``) and ``PoissonBatchSampler`` (a torch ``batch_sampler``). A banded
``toeplitz(..., min_separation=, sample_rate=)`` is accounted with amplification by cyclic
Poisson sampling: ``cyclic_poisson_batches`` and ``CyclicPoissonBatchSampler`` draw it.

The framework-free pieces (``clip``, ``clipped_sum``, ``add_noise``, ``private_mean``) take
per-example gradients of either framework. ``optax_aggregate`` / ``dpsgd`` need JAX and optax,
``DPOptimizer`` needs PyTorch; they are imported when first used.

Parameters too big for one JAX device: ``shard_params`` splits them over a mesh axis
(FSDP-style); the jitted ghost step runs unchanged and its gradient comes out sharded alike.

Several JAX devices: ``shard_batch`` splits a batch over a mesh for ``jax.jit`` (clipping then
happens where the examples live; only the summed gradient crosses devices); inside
``jax.shard_map`` pass ``axis_name=`` to ``clipped_sum`` / ``optax_aggregate`` or call
``psum_clipped``. See ``examples/sharded_dp_jax.py``.

User-level privacy (a user contributes many examples; the user is clipped, sampled and
accounted): ``user_ids=`` on ``clipped_sum``, ``private_mean``, ``clipped_sum_of``,
``private_grad_of``, ``DPOptimizer.step`` and the optax ``update``; users are sampled with
``poisson_user_batches`` / ``UserPoissonBatchSampler``, and ``epsilon`` takes their sample rate.

Data-parallel DP-SGD over ``torch.distributed``: ``DPOptimizer(..., distributed=True)`` with
``PoissonBatchSampler(..., num_replicas=world_size, rank=rank)`` in every process (and
``broadcast_parameters`` to start them from the same weights); the noise is added once per step.
"""

from typing import Any

from pergrad._src.backends.secure import SecureRandom
from pergrad._src.dp.accounting import Accountant, epsilon, noise_multiplier_for
from pergrad._src.dp.clipping import ClippedSum, add_noise, clip, clipped_sum, private_mean
from pergrad._src.dp.clipping_policies import (
    AdaptiveClipping,
    AutomaticClipping,
    ClippingPolicy,
    adaptive,
    automatic,
)
from pergrad._src.dp.correlated import BLTNoise, CorrelatedNoise, ToeplitzNoise, blt, toeplitz
from pergrad._src.dp.cyclic import cyclic_poisson_batches
from pergrad._src.dp.from_loss import clipped_sum_of, private_grad_of
from pergrad._src.dp.noise import GaussianNoise, NoiseMechanism, gaussian
from pergrad._src.dp.sampling import max_batch_size_for, pad_batch, poisson_batches
from pergrad._src.dp.setup import DPPlan, DPSetup, PaddedPoissonLoader, plan
from pergrad._src.dp.strategy_optimization import optimal_blt
from pergrad._src.dp.users import poisson_user_batches

_LAZY = {
    "make_private": "pergrad._src.torch.make_private",
    "make_private_optax": "pergrad._src.jax.make_private",
    "optax_aggregate": "pergrad._src.jax.optax",
    "dpsgd": "pergrad._src.jax.optax",
    "PrivateAggregateState": "pergrad._src.jax.optax",
    "psum_clipped": "pergrad._src.dp.psum",
    "shard_batch": "pergrad._src.jax.sharding",
    "shard_params": "pergrad._src.jax.sharding",
    "DPOptimizer": "pergrad._src.torch.dp_optimizer",
    "DPStep": "pergrad._src.torch.dp_step",
    "DPTrainer": "pergrad._src.torch.hf_trainer",
    "broadcast_parameters": "pergrad._src.torch.distributed",
    "PoissonBatchSampler": "pergrad._src.torch.sampling",
    "CyclicPoissonBatchSampler": "pergrad._src.torch.sampling",
    "UserPoissonBatchSampler": "pergrad._src.torch.sampling",
    "collate_with_empty_batches": "pergrad._src.torch.sampling",
    "epsilon_lower_bound": "pergrad._src.dp.audit",
    "epsilon_lower_bound_ceiling": "pergrad._src.dp.audit",
    "epsilon_lower_bound_clopper_pearson": "pergrad._src.dp.audit_many_runs",
    "guess_grid": "pergrad._src.dp.audit",
    "one_run_p_value": "pergrad._src.dp.audit",
    "tpr_at_fpr": "pergrad._src.dp.audit_many_runs",
    "auroc": "pergrad._src.dp.audit_many_runs",
    "GradientCanaries": "pergrad._src.dp.canaries",
    "InputCanaries": "pergrad._src.dp.canaries",
    "AuditReport": "pergrad._src.dp.canaries",
    "audit": "pergrad._src.dp.canaries",
}

__all__ = [
    "SecureRandom",
    "Accountant",
    "ClippedSum",
    "GaussianNoise",
    "NoiseMechanism",
    "CorrelatedNoise",
    "ToeplitzNoise",
    "BLTNoise",
    "epsilon",
    "gaussian",
    "toeplitz",
    "blt",
    "optimal_blt",
    "max_batch_size_for",
    "noise_multiplier_for",
    "pad_batch",
    "poisson_batches",
    "plan",
    "DPPlan",
    "DPSetup",
    "PaddedPoissonLoader",
    "cyclic_poisson_batches",
    "poisson_user_batches",
    "add_noise",
    "clip",
    "clipped_sum",
    "ClippingPolicy",
    "AutomaticClipping",
    "AdaptiveClipping",
    "automatic",
    "adaptive",
    "clipped_sum_of",
    "private_mean",
    "private_grad_of",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pergrad.dp' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazy names too (DPOptimizer, optax_aggregate, ...), without importing their framework
    return sorted({*globals(), *_LAZY})

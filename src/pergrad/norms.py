"""Per-example gradient norms, their summary statistics, alignment and the noise scale.

    norms = pergrad.norms.per_example_norms(grads)           # (B,)
    print(pergrad.norms.summarize(norms, threshold=1.0))     # NormSummary(n=64, mean=..., ...)
    pergrad.norms.noise_scale(grads).b_simple                # McCandlish et al. (2018)

Over training, ``TrainingMonitor`` keeps a running noise scale (never ``inf``) and per-step
norm quantiles and clipped fractions; ``pergrad.plotting.training_curves`` plots them. In a JAX or PyTorch loop of your own, one
``monitor.update(grads=...)`` per step; in ``transformers.Trainer``,
``TrainingMonitorCallback`` (imports transformers when first used).

``per_example_norms_of(loss, params, X, Y)`` gets the norms straight from a single-example loss
without materialising per-example gradients (``strategy="auto" | "ghost" | "ghost-lowmem" |
"chunked" | "materialize"``; ``choose_strategy`` says which one a call gets and why).

Each function takes per-example gradients from either framework and returns the framework's
arrays (or plain Python numbers for summaries).
"""

from typing import Any

from pergrad._src.api.reductions import StrategyChoice, choose_strategy, per_example_norms_of
from pergrad._src.monitor import TrainingMonitor
from pergrad._src.norms import (
    NoiseScale,
    NormSummary,
    cosine_to_mean,
    noise_scale,
    per_example_norms,
    summarize,
)

# needs torch and transformers: imported when first asked for
_LAZY = {"TrainingMonitorCallback": "pergrad._src.torch.hf_monitor"}

__all__ = [
    "NoiseScale",
    "NormSummary",
    "StrategyChoice",
    "TrainingMonitor",
    "choose_strategy",
    "per_example_norms_of",
    "cosine_to_mean",
    "noise_scale",
    "per_example_norms",
    "summarize",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pergrad.norms' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazy names too, without importing their framework
    return sorted({*globals(), *_LAZY})

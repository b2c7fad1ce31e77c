"""pergrad: per-example gradients with one API over JAX and PyTorch.

    import pergrad
    grads = pergrad.per_example_grads(loss_of_one_example)(params, X, Y)

Public names only; the implementation lives in ``pergrad._src``. Frameworks are imported when
a call needs them, so ``import pergrad`` imports neither JAX nor PyTorch.
"""

from typing import Any

from pergrad import dp, influence, norms, outliers, testing
from pergrad._src.api.grads import per_example_grads, value_and_per_example_grads
from pergrad._src.errors import FallbackWarning, NonFiniteWarning, PrivacyWarning

__version__ = "0.1.0"

__all__ = [
    "FallbackWarning",
    "NonFiniteWarning",
    "PrivacyWarning",
    "dp",
    "influence",
    "module_loss",
    "norms",
    "outliers",
    "testing",
    "per_example_grads",
    "value_and_per_example_grads",
]


def __getattr__(name: str) -> Any:
    # module_loss needs torch; import it only when it is asked for.
    if name in ("module_loss", "ModuleLoss"):
        from pergrad._src.core import module_loss as torch_module

        return getattr(torch_module, name)
    raise AttributeError(f"module 'pergrad' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazy names too, so that dir(pergrad) and tab completion show them
    return sorted({*globals(), "module_loss", "ModuleLoss"})

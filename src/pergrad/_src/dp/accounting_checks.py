"""The accounting's plumbing: dp-accounting imported on first use (with its absl
"failed to converge" records filtered, and only those), and the checks of its arguments."""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
from collections.abc import Iterator
from typing import Any

from pergrad._src.errors import PergradTypeError, PergradValueError

# dp_accounting's RDP accountant logs this through absl when the series for one fractional
# order does not converge; it then leaves that order out of the minimum over orders, so the
# epsilon is still a valid (at most slightly looser) bound. Nothing is wrong, yet every
# epsilon / noise_multiplier_for call printed several such lines.
NOT_CONVERGED = "_compute_log_a_frac failed to converge"


class NotConvergedFilter(logging.Filter):
    """Drops the RDP accountant's "failed to converge" records, and only those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(NOT_CONVERGED)


@contextlib.contextmanager
def quiet_convergence_warnings() -> Iterator[None]:
    """Silences dp_accounting's "failed to converge" warnings while the block runs; every other
    record of absl's logger (a negative Rényi divergence, PLD's notes) still gets through."""
    logger = logging.getLogger("absl")
    dropped = NotConvergedFilter()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def import_dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError as err:
        raise ImportError(
            "pergrad's privacy accounting needs Google's dp-accounting library, which is not "
            "installed. Install it with: pip install 'pergrad[dp]'"
        ) from err
    return dp_accounting


# --- validation -------------------------------------------------------------------------


def check_real(fn: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PergradTypeError(
            f"{fn}: {name} must be a real number, got {type(value).__name__} {value!r}."
        )
    value = float(value)
    if math.isnan(value):
        raise PergradValueError(f"{fn}: {name} must be a number, got nan.")
    return value


def check_noise_multiplier_value(fn: str, noise_multiplier: Any) -> float:
    value = check_real(fn, "noise_multiplier", noise_multiplier)
    if not 0.0 <= value < math.inf:
        raise PergradValueError(
            f"{fn}: noise_multiplier must be finite and >= 0 (the noise standard deviation "
            f"divided by the clipping norm), got {noise_multiplier!r}."
        )
    return value


def check_sample_rate(fn: str, sample_rate: Any) -> float:
    value = check_real(fn, "sample_rate", sample_rate)
    if not 0.0 < value <= 1.0:
        raise PergradValueError(
            f"{fn}: sample_rate must be in (0, 1] (the probability that an example is in a "
            f"batch, e.g. batch_size / num_examples), got {sample_rate!r}."
        )
    return value


def check_delta(fn: str, delta: Any) -> float:
    value = check_real(fn, "delta", delta)
    if not 0.0 < value < 1.0:
        raise PergradValueError(
            f"{fn}: delta must be in (0, 1), typically well below 1 / num_examples, got {delta!r}."
        )
    return value


def check_count(fn: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = f" (e.g. math.ceil({value!r}))" if isinstance(value, float) else ""
        raise PergradTypeError(
            f"{fn}: {name} must be an int, got {type(value).__name__} {value!r}{hint}."
        )
    if value < minimum:
        raise PergradValueError(f"{fn}: {name} must be >= {minimum}, got {value!r}.")
    return int(value)


def check_choice(fn: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        options = " or ".join(repr(choice) for choice in choices)
        raise PergradValueError(f"{fn}: {name} must be {options}, got {value!r}.")
    return value

"""pergrad's own exceptions and warnings.

Errors pergrad raises about the user's input are ordinary ``ValueError`` / ``TypeError``
subclasses, so ``except ValueError`` works; the subclasses let the core tell its own errors
apart from a framework's while it decides whether to fall back to another strategy.
"""

from __future__ import annotations

import sys
import warnings


class PergradValueError(ValueError):
    """Bad input: the message names the argument, what was expected and what came."""


class PergradTypeError(TypeError):
    """An argument of the wrong type: the message names it, what was expected and what came."""


class FallbackWarning(UserWarning):
    """The framework could not vectorise ``fn`` and pergrad took a slower, correct strategy."""


class NonFiniteWarning(UserWarning):
    """Some example's gradient was not finite (inf or nan): it was zeroed, so it contributed
    nothing to the step, and counted (``DPStep.nonfinite``, ``ClippedSum.nonfinite``)."""


def is_pergrad_error(err: BaseException) -> bool:
    return isinstance(err, (PergradValueError, PergradTypeError))


class GhostUnsupported(Exception):
    """Internal: this call cannot take the ghost strategy (of either framework), or a capture
    check failed; the message says why. ``"auto"`` falls back on it; it never reaches users
    except as the cause of a :class:`PergradValueError` under a forced strategy."""


def warn_from_caller(message: str, category: type[Warning] = FallbackWarning) -> None:
    """Warn, attributed to the first frame outside pergrad (the user's call)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the caller of this function
    while frame is not None and frame.f_globals.get("__name__", "").startswith("pergrad."):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)

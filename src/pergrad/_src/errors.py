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


class PrivacyWarning(UserWarning):
    """A DP setting that the privacy accounting does not cover as given (the fix is named)."""


class NonFiniteWarning(UserWarning):
    """Some example's gradient was not finite (inf or nan): it was zeroed, so it contributed
    nothing to the step, and counted (``DPStep.nonfinite``, ``ClippedSum.nonfinite``)."""


def is_pergrad_error(err: BaseException) -> bool:
    return isinstance(err, (PergradValueError, PergradTypeError))


class Unsupported(Exception):
    """Internal, the one way of saying "cannot": a strategy, a capture engine, a layer rule or
    a first-call check finds that it cannot take this call; the message says why. ``"auto"``
    moves on to the next strategy (``strategies/registry.py``); a named strategy turns it into a
    :class:`PergradValueError` that names the strategy, so it never reaches users itself."""


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, or, when that is longer than ``limit`` characters
    (a dict of tensors passed where a number was expected), its type and the start of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"a {type(value).__name__} ({' '.join(text[:limit].split())} ...)"


def warn_from_caller(message: str, category: type[Warning] = FallbackWarning) -> None:
    """Warn, attributed to the first frame outside pergrad (the user's call)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the caller of this function
    while frame is not None and frame.f_globals.get("__name__", "").startswith("pergrad."):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)

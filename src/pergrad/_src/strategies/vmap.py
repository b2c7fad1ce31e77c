"""The ``"vmap"`` strategy: the framework's ``vmap(value_and_grad(loss of one example))``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pergrad._src.backends import (
    Backend,
)
from pergrad._src.core.call import Call, Spec, single_example
from pergrad._src.errors import (
    Unsupported,
    is_pergrad_error,
)
from pergrad._src.strategies.protocol import Assessment, GradsRequest


def _without_losses(value_and_grad: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``value_and_grad`` returning the gradients only, or ``(aux, grads)``: losses nobody reads
    stay inside the vectorised function instead of being batched as an output (a few percent
    of the time on small models)."""
    if has_aux:

        def aux_and_grads(*args: Any) -> Any:
            (_, aux), grads = value_and_grad(*args)
            return aux, grads

        return aux_and_grads

    def grads_only(*args: Any) -> Any:
        return value_and_grad(*args)[1]

    return grads_only


# torch.func's words when fn needs a Python number from a batched tensor: most often the
# backward pass of indexing by the example's label, logits[y].
_DATA_DEPENDENT = "data-dependent control flow"

DATA_DEPENDENT_HINT = (
    "fn needs a Python number from a batched tensor, which vmap cannot give: most often it "
    "indexes a tensor computed from the parameters by the example's label or index "
    "(logits[y], h[i]), or calls .item() or branches (if) on a tensor. Write the selection "
    "as logits.gather(-1, y.unsqueeze(-1)).squeeze(-1), which stays vectorised; for a "
    "margin, pergrad.influence.classification_margin(logits, y); for a loss, "
    "F.cross_entropy(logits, y)"
)


def vmap_failure(bk: Backend, err: Exception) -> str:
    """Why ``bk.vmap`` failed, in whole sentences; re-raises what a fallback would not fix
    (pergrad's own errors, and failures the backend explains, such as dropout without
    ``randomness``)."""
    if is_pergrad_error(err):
        raise err
    explained = bk.explain_failure(err)
    if explained is not None:
        raise explained from err
    message = str(err)
    if _DATA_DEPENDENT in message:
        return DATA_DEPENDENT_HINT
    return f"{type(err).__name__}: {first_sentences(message)}"


def first_sentences(message: str, limit: int = 300) -> str:
    """The first line of ``message``, cut after its last whole sentence within ``limit``
    characters (never mid-word: a cut without a sentence end says so with "...")."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    if len(line) <= limit:
        return line
    end = line.rfind(". ", 0, limit)
    if end > 0:
        return line[: end + 1]
    return line[: line.rfind(" ", 0, limit)].rstrip(",;:") + " ..."


class CallContext:
    """A call and its keyword arguments, handed to :func:`vectorised`'s function as one
    unbatched argument: an object that no framework's pytree looks into."""

    __slots__ = ("call", "kwargs")

    def __init__(self, call: Call, kwargs: dict[str, Any]) -> None:
        self.call = call
        self.kwargs = kwargs


def vectorised(spec: Spec, bk: Backend) -> Callable[..., Any]:
    """``vmap(value_and_grad(one example's loss))`` as ``f(diff_values, batched_values,
    context)``, made once per wrapped function and backend: building the transforms on every
    call costs as much as a small model's gradients."""
    vectorised = spec.vectorised.get(bk.name)
    if vectorised is None:

        def single(diff_values: Any, batched_values: Any, context: CallContext) -> Any:
            return single_example(spec, context.call, context.kwargs, diff_values, batched_values)

        value_and_grad = bk.value_and_grad(single, spec.has_aux)
        if not spec.returns_losses:
            value_and_grad = _without_losses(value_and_grad, spec.has_aux)
        vectorised = bk.vmap(value_and_grad, (None, 0, None), spec.chunk_size, spec.randomness)
        spec.vectorised[bk.name] = vectorised
    return vectorised


def assess(request: GradsRequest, forced: bool, refused: dict[str, Assessment]) -> Assessment:
    """Always worth trying: whether the framework can batch fn shows only by running it."""
    return Assessment(
        "vmap", True, "requested" if forced else "auto's first choice: the framework's vmap of fn"
    )


def run(request: GradsRequest, _: Assessment) -> Any:
    spec, bk = request.spec, request.call.backend
    try:
        out = vectorised(spec, bk)(
            request.diff_values, request.batched_values, CallContext(request.call, request.kwargs)
        )
    except Exception as err:  # vmap_failure re-raises pergrad's own errors
        raise Unsupported(f"{bk.name} could not vectorise fn ({vmap_failure(bk, err)})") from err
    spec.last_strategy = "vmap"
    if spec.returns_losses:
        return out
    return ((None, out[0]), out[1]) if spec.has_aux else (None, out)

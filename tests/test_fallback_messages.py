"""The ``FallbackWarning`` for indexing by a batched label, ``logits[y]`` (issue 35): whole (no
sentence cut off, as "...For (1): we)" was), true (it does not ask for a ``module_loss`` the
loss already is) and naming the vectorised rewrite, which then runs without a warning. JAX
vectorises ``logits[y]`` itself: no warning there. Results against a loop of single-example
gradients."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pergrad
from pergrad._src.strategies.vmap import first_sentences

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call  # noqa: E402

REWRITE = "logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)"


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    params = {name: p.detach() for name, p in model.named_parameters()}
    return model, params, torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0, 2])


def loop_grads(model, fn, params, X, Y):
    """Each example's gradient, one ``torch.autograd.grad`` at a time."""
    leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
    rows = [torch.autograd.grad(fn(leaves, x, y), list(leaves.values())) for x, y in zip(X, Y)]
    return {name: torch.stack([row[k] for row in rows]) for k, name in enumerate(leaves)}


def the_warning(record):
    messages = [str(w.message) for w in record if issubclass(w.category, pergrad.FallbackWarning)]
    assert len(messages) == 1, messages
    return messages[0]


def assert_whole_and_naming_the_fix(message):
    assert REWRITE in message
    assert "pergrad.influence.classification_margin(logits, y)" in message
    assert "logits[y]" in message
    assert "For (1): we" not in message  # torch's text cut mid-sentence, as the issue saw
    assert message.count("(") == message.count(")")
    assert message.rstrip().endswith(".")


def test_logits_indexed_by_the_label_warns_whole_and_names_the_rewrite():
    model, params, X, Y = model_and_batch()

    def margin(p, x, y):  # the natural way
        return functional_call(model, p, (x,))[y]

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        grads = pergrad.per_example_grads(margin)(params, X, Y)
    message = the_warning(record)
    assert_whole_and_naming_the_fix(message)
    assert message.startswith("per_example_grads: torch could not vectorise fn (")
    assert message.endswith("Later calls of this function use the loop directly.")
    expected = loop_grads(model, margin, params, X, Y)
    for name in params:
        torch.testing.assert_close(grads[name], expected[name])

    def gathered(p, x, y):  # the rewrite the warning names
        logits = functional_call(model, p, (x,))
        return logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)

    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        rewritten = pergrad.per_example_grads(gathered)(params, X, Y)
    for name in params:
        torch.testing.assert_close(rewritten[name], expected[name])


def test_a_module_loss_inside_another_function_is_not_told_to_be_a_module_loss():
    """pergrad.influence calls the user's module_loss from a function of its own (flattened
    parameters): the message must not claim the loss was not made with module_loss."""
    model, params, X, Y = model_and_batch()
    loss = pergrad.module_loss(model, lambda out, y: out[0, y[0]])

    def wrapped(p, x, y):
        return loss(p, x, y)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        grads = pergrad.per_example_grads(wrapped)(params, X, Y)
    message = the_warning(record)
    assert_whole_and_naming_the_fix(message)
    assert "a module_loss called from inside another function" in message
    assert "need a PyTorch loss made with" not in message
    expected = loop_grads(model, wrapped, params, X, Y)
    for name in params:
        torch.testing.assert_close(grads[name], expected[name])
    with warnings.catch_warnings(record=True) as record:  # the norms' path says it whole too
        warnings.simplefilter("always")
        norms = pergrad.norms.per_example_norms_of(wrapped, params, X, Y)
    assert_whole_and_naming_the_fix(the_warning(record))
    flat = torch.cat([g.reshape(len(X), -1) for g in expected.values()], 1)
    torch.testing.assert_close(norms, flat.norm(dim=1))


def test_jax_vectorises_logits_indexed_by_the_label():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    W = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
    X = jnp.asarray(np.random.default_rng(1).normal(size=(6, 5)), jnp.float32)
    Y = jnp.asarray([0, 2, 1, 1, 0, 2])

    def margin(w, x, y):
        return jnp.tanh(x @ w)[y]

    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)
        grads = pergrad.per_example_grads(margin)(W, X, Y)
    expected = np.stack([np.asarray(jax.grad(margin)(W, x, y)) for x, y in zip(X, Y)])
    np.testing.assert_allclose(np.asarray(grads), expected, rtol=1e-5, atol=1e-7)


def test_long_framework_messages_are_cut_at_a_sentence_or_marked():
    sentences = "First part of the reason. " * 20
    assert first_sentences(sentences).endswith("reason.")
    assert len(first_sentences(sentences)) <= 300
    words = "word " * 100
    assert first_sentences(words).endswith(" ...")
    assert first_sentences("short one\nsecond line") == "short one"

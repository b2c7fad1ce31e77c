"""The public contract of per_example_grads on both backends: shapes, inference, bad input.

Numbers are checked against closed forms (a linear model's per-example gradient is
``2 (x.w - y) x``) computed here in numpy, independently of pergrad.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pergrad

RNG = np.random.default_rng(0)


def linear_loss(w, x, y):
    """Squared error of one example: x (D,), y (), w (D,)."""
    return ((x * w).sum() - y) ** 2


def closed_form(w, x, y):
    """Per-example gradient of ``linear_loss`` for a batch: (B, D)."""
    return 2 * (x @ w - y)[:, None] * x


def data(batch_size=6, dim=3):
    w = RNG.normal(size=dim)
    x = RNG.normal(size=(batch_size, dim))
    y = RNG.normal(size=batch_size)
    return w, x, y


def test_import_pulls_in_no_framework():
    code = "import sys, pergrad; print('jax' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_dir_shows_the_lazy_names_without_importing_a_framework():
    code = (
        "import sys, pergrad; names = dir(pergrad); "
        "print('module_loss' in names, 'per_example_grads' in names, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "False"]


def test_dir_of_dp_shows_its_lazy_names_without_importing_a_framework():
    code = (
        "import sys, pergrad; names = dir(pergrad.dp); "
        "print(all(n in names for n in ('DPOptimizer', 'optax_aggregate', 'PoissonBatchSampler', "
        "'clip', 'toeplitz')), 'torch' in sys.modules, 'jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False"]


def test_linear_regression_matches_closed_form(fw):
    w, x, y = data()
    grads = pergrad.per_example_grads(linear_loss)(fw.array(w), fw.array(x), fw.array(y))
    np.testing.assert_allclose(fw.to_numpy(grads), closed_form(w, x, y), rtol=1e-5, atol=1e-5)


def test_value_and_grads_returns_losses(fw):
    w, x, y = data()
    losses, grads = pergrad.value_and_per_example_grads(linear_loss)(
        fw.array(w), fw.array(x), fw.array(y)
    )
    np.testing.assert_allclose(fw.to_numpy(losses), (x @ w - y) ** 2, rtol=1e-5)
    assert fw.to_numpy(grads).shape == x.shape


def test_result_mirrors_nested_params_and_tuple_argnums(fw):
    w, x, y = data()
    half = len(w) // 2

    def loss(params, bias, x, y):
        wa, wb = params["layer"][0], params["layer"][1]["w"]
        return ((x[:half] * wa).sum() + (x[half:] * wb).sum() + bias - y) ** 2

    params = {"layer": [fw.array(w[:half]), {"w": fw.array(w[half:])}]}
    bias = fw.array(np.float32(0.0))
    grads, bias_grads = pergrad.per_example_grads(loss, argnums=(0, 1))(
        params, bias, fw.array(x), fw.array(y)
    )
    expected = closed_form(w, x, y)
    np.testing.assert_allclose(fw.to_numpy(grads["layer"][0]), expected[:, :half], atol=1e-5)
    np.testing.assert_allclose(fw.to_numpy(grads["layer"][1]["w"]), expected[:, half:], atol=1e-5)
    np.testing.assert_allclose(fw.to_numpy(bias_grads), 2 * (x @ w - y), atol=1e-5)


def test_has_aux_returns_batched_aux(fw):
    w, x, y = data()

    def loss(w, x, y):
        residual = (x * w).sum() - y
        return residual**2, {"residual": residual}

    grads, aux = pergrad.per_example_grads(loss, has_aux=True)(
        fw.array(w), fw.array(x), fw.array(y)
    )
    np.testing.assert_allclose(fw.to_numpy(aux["residual"]), x @ w - y, rtol=1e-5)
    np.testing.assert_allclose(fw.to_numpy(grads), closed_form(w, x, y), atol=1e-5)


def test_chunking_gives_the_same_result(fw):
    w, x, y = data(batch_size=7)
    args = fw.array(w), fw.array(x), fw.array(y)
    chunked = pergrad.per_example_grads(linear_loss, chunk_size=3)(*args)
    np.testing.assert_allclose(fw.to_numpy(chunked), closed_form(w, x, y), atol=1e-5)


def test_empty_batch_gives_empty_result(fw):
    w, x, y = data(batch_size=0)
    losses, grads = pergrad.value_and_per_example_grads(linear_loss)(
        fw.array(w), fw.array(x), fw.array(y)
    )
    assert fw.to_numpy(grads).shape == (0, 3)
    assert fw.to_numpy(losses).shape == (0,)


def test_keyword_arguments_are_shared(fw):
    w, x, y = data()

    def loss(w, x, y, scale=1.0):
        return scale * linear_loss(w, x, y)

    grads = pergrad.per_example_grads(loss)(fw.array(w), fw.array(x), fw.array(y), scale=3.0)
    np.testing.assert_allclose(fw.to_numpy(grads), 3 * closed_form(w, x, y), atol=1e-4)


def test_explicit_in_axes_nonzero_axis(fw):
    w, x, y = data()

    def loss(w, x_t, y):  # x_t is batched along axis 1
        return linear_loss(w, x_t, y)

    grads = pergrad.per_example_grads(loss, in_axes=(None, 1, 0))(
        fw.array(w), fw.array(x.T.copy()), fw.array(y)
    )
    np.testing.assert_allclose(fw.to_numpy(grads), closed_form(w, x, y), atol=1e-5)


def test_explicit_in_axes_dict_prefix(fw):
    w, x, y = data()

    def loss(w, batch):
        return linear_loss(w, batch["x"], batch["y"]) * batch["scale"]

    batch = {"x": fw.array(x), "y": fw.array(y), "scale": fw.array(np.float32(2.0))}
    in_axes = (None, {"x": 0, "y": 0, "scale": None})
    grads = pergrad.per_example_grads(loss, in_axes=in_axes)(fw.array(w), batch)
    np.testing.assert_allclose(fw.to_numpy(grads), 2 * closed_form(w, x, y), atol=1e-4)


# ---- in_axes="auto": model state is shared, data is batched --------------------------------


def state_loss(w, state, x, y):
    """A loss that reads model state: (x - mean) / scale, the shape of BatchNorm in eval mode."""
    normed = (x - state["mean"]) / state["scale"]
    return linear_loss(w, normed, y)


def state_reference(w, state, x, y):
    return closed_form(w, (x - state["mean"]) / state["scale"], y)


def test_auto_shares_state_whose_length_equals_the_batch(fw):
    batch = dim = 4  # the state's leading size equals B
    w, x, y = data(batch_size=batch, dim=dim)
    state = {"mean": RNG.normal(size=dim), "scale": 1 + RNG.random(dim), "count": np.int64(7)}
    state_fw = {k: fw.array(v) for k, v in state.items()}
    grads = pergrad.per_example_grads(state_loss)(fw.array(w), state_fw, fw.array(x), fw.array(y))
    np.testing.assert_allclose(
        fw.to_numpy(grads), state_reference(w, state, x, y), rtol=1e-4, atol=1e-5
    )


def test_auto_shares_state_of_another_size(fw):
    w, x, y = data(batch_size=5, dim=3)
    state = {"mean": RNG.normal(size=3), "scale": 1 + RNG.random(3)}
    state_fw = {k: fw.array(v) for k, v in state.items()}
    grads = pergrad.per_example_grads(state_loss)(fw.array(w), state_fw, fw.array(x), fw.array(y))
    np.testing.assert_allclose(
        fw.to_numpy(grads), state_reference(w, state, x, y), rtol=1e-4, atol=1e-5
    )


def test_auto_batches_a_dict_of_data(fw):
    w, x, y = data()

    def loss(w, batch):
        return linear_loss(w, batch["x"], batch["y"])

    batch = {"x": fw.array(x), "y": fw.array(y)}
    grads = pergrad.per_example_grads(loss)(fw.array(w), batch)
    np.testing.assert_allclose(fw.to_numpy(grads), closed_form(w, x, y), atol=1e-5)


# ---- bad input: a clear error that names the argument ---------------------------------------


def test_batch_sizes_that_disagree(fw):
    w, x, y = data(batch_size=6)
    with pytest.raises(ValueError, match=r"disagree.*'x'.* 6.*'y'.* 4"):
        pergrad.per_example_grads(linear_loss)(fw.array(w), fw.array(x), fw.array(y[:4]))


def test_explicit_batch_sizes_that_disagree(fw):
    w, x, y = data(batch_size=6)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        pergrad.per_example_grads(linear_loss, in_axes=(None, 0, 0))(
            fw.array(w), fw.array(x), fw.array(y[:4])
        )


def test_non_scalar_loss(fw):
    w, x, y = data()

    def vector_loss(w, x, y):
        return (x * w - y) ** 2

    with pytest.raises(ValueError, match=r"scalar loss.*shape \(3,\)"):
        pergrad.per_example_grads(vector_loss)(fw.array(w), fw.array(x), fw.array(y))


@pytest.mark.parametrize("argnums", [3, (0, 5)])
def test_argnums_out_of_range(fw, argnums):
    w, x, y = data()
    with pytest.raises(ValueError, match="argnums.*points past the 3 positional"):
        pergrad.per_example_grads(linear_loss, argnums=argnums)(
            fw.array(w), fw.array(x), fw.array(y)
        )


def test_argnums_pointing_at_an_integer_array(fw):
    w, x, _ = data()
    labels = np.arange(len(x))
    with pytest.raises(TypeError, match=r"argument 2 \('y'\).*dtype int"):
        pergrad.per_example_grads(linear_loss, argnums=2)(
            fw.array(w), fw.array(x), fw.array(labels)
        )


@pytest.mark.parametrize("argnums", ["0", 1.0, (), [0, "a"], True])
def test_argnums_of_the_wrong_type(argnums):
    with pytest.raises(TypeError, match="argnums must be an int"):
        pergrad.per_example_grads(linear_loss, argnums=argnums)


def test_parameters_passed_where_argnums_goes_are_named_not_dumped():
    # per_example_grads(fn, params) (a transform called like a function) put a dict of
    # arrays in argnums: the message names its type, not pages of numbers.
    params = {f"w{i}": np.arange(1000.0) for i in range(5)}
    with pytest.raises(TypeError, match=r"argnums must be an int.*got a dict \(\{'w0'") as info:
        pergrad.per_example_grads(linear_loss, params)
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("argnums", [-1, (0, 0)])
def test_argnums_negative_or_repeated(argnums):
    with pytest.raises(ValueError, match="argnums"):
        pergrad.per_example_grads(linear_loss, argnums=argnums)


def test_in_axes_wrong_length(fw):
    w, x, y = data()
    with pytest.raises(ValueError, match="in_axes has 2 entries but fn was called with 3"):
        pergrad.per_example_grads(linear_loss, in_axes=(None, 0))(
            fw.array(w), fw.array(x), fw.array(y)
        )


def test_in_axes_wrong_structure(fw):
    w, x, y = data()

    def loss(w, batch):
        return linear_loss(w, batch["x"], batch["y"])

    batch = {"x": fw.array(x), "y": fw.array(y)}
    with pytest.raises(ValueError, match=r"not a prefix of its structure"):
        pergrad.per_example_grads(loss, in_axes=(None, {"x": 0, "z": 0}))(fw.array(w), batch)


def test_in_axes_axis_out_of_range(fw):
    w, x, y = data()
    with pytest.raises(ValueError, match=r"axis 2 is out of range.*argument 1 \('x'\)"):
        pergrad.per_example_grads(linear_loss, in_axes=(None, 2, 0))(
            fw.array(w), fw.array(x), fw.array(y)
        )


def test_in_axes_batching_the_differentiated_argument(fw):
    w, x, y = data()
    with pytest.raises(ValueError, match=r"argument 0 \('w'\) is differentiated"):
        pergrad.per_example_grads(linear_loss, in_axes=0)(fw.array(w), fw.array(x), fw.array(y))


@pytest.mark.parametrize("in_axes", ["batch", {"x": 0}, 1.5])
def test_in_axes_of_the_wrong_type(in_axes):
    with pytest.raises((TypeError, ValueError), match="in_axes"):
        w, x, y = data()
        import jax.numpy as jnp

        pergrad.per_example_grads(linear_loss, in_axes=in_axes)(
            jnp.asarray(w), jnp.asarray(x), jnp.asarray(y)
        )


def test_in_axes_all_none(fw):
    w, x, y = data()
    with pytest.raises(ValueError, match="batches no argument"):
        pergrad.per_example_grads(linear_loss, in_axes=(None, None, None))(
            fw.array(w), fw.array(x), fw.array(y)
        )


def test_arrays_from_two_frameworks():
    import jax.numpy as jnp
    import torch

    w, x, y = data()
    with pytest.raises(TypeError, match=r"mix.*argument 0 \('w'\).*argument 1 \('x'\)"):
        pergrad.per_example_grads(linear_loss)(
            jnp.asarray(w), torch.as_tensor(x), torch.as_tensor(y)
        )


def test_forced_backend_that_does_not_match():
    import jax.numpy as jnp

    w, x, y = data()
    with pytest.raises(TypeError, match="backend='torch'.*jax"):
        pergrad.per_example_grads(linear_loss, backend="torch")(
            jnp.asarray(w), jnp.asarray(x), jnp.asarray(y)
        )


def test_numpy_only_needs_a_backend():
    w, x, y = data()
    with pytest.raises(TypeError, match="cannot tell the framework"):
        pergrad.per_example_grads(linear_loss)(w, x, y)
    grads = pergrad.per_example_grads(linear_loss, backend="jax")(
        w.astype(np.float32), x.astype(np.float32), y.astype(np.float32)
    )
    np.testing.assert_allclose(np.asarray(grads), closed_form(w, x, y), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [0, -2, 1.5, True, "4"])
def test_chunk_size_not_a_positive_int(chunk_size):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        pergrad.per_example_grads(linear_loss, chunk_size=chunk_size)


def test_has_aux_without_aux(fw):
    w, x, y = data()
    with pytest.raises(ValueError, match=r"has_aux=True needs fn to return a pair"):
        pergrad.per_example_grads(linear_loss, has_aux=True)(fw.array(w), fw.array(x), fw.array(y))


def test_aux_returned_without_has_aux(fw):
    w, x, y = data()

    def loss(w, x, y):
        return linear_loss(w, x, y), x

    with pytest.raises(ValueError, match="pass has_aux=True"):
        pergrad.per_example_grads(loss)(fw.array(w), fw.array(x), fw.array(y))


def test_has_aux_not_a_bool():
    with pytest.raises(TypeError, match="has_aux must be True or False"):
        pergrad.per_example_grads(linear_loss, has_aux="yes")


def test_fn_not_callable():
    with pytest.raises(TypeError, match="fn must be a callable.*got dict"):
        pergrad.per_example_grads({"w": 1})


def test_no_batched_argument(fw):
    w, _, _ = data()

    def loss(w, scale):
        return (w**2).sum() * scale

    with pytest.raises(ValueError, match=r"no argument looks batched.*argument 1 \('scale'\)"):
        pergrad.per_example_grads(loss)(fw.array(w), 2.0)


def test_no_positional_arguments():
    with pytest.raises(ValueError, match="no positional arguments"):
        pergrad.per_example_grads(linear_loss)()


def test_unknown_backend_and_randomness():
    with pytest.raises(ValueError, match="backend must be one of"):
        pergrad.per_example_grads(linear_loss, backend="tensorflow")
    with pytest.raises(ValueError, match="randomness must be one of"):
        pergrad.per_example_grads(linear_loss, randomness="sometimes")


def test_randomness_is_refused_for_jax():
    import jax.numpy as jnp

    w, x, y = data()
    with pytest.raises(ValueError, match="randomness='different' is a PyTorch option"):
        pergrad.per_example_grads(linear_loss, randomness="different")(
            jnp.asarray(w), jnp.asarray(x), jnp.asarray(y)
        )


# ---- repeated calls: the analysis of a call is reused for arguments of the same structure ----


def test_repeated_calls_with_other_shapes_and_structures(fw):
    def loss(params, x, y):
        return (params.get("scale", 1.0) * (x * params["w"]).sum() - y) ** 2

    per_example = pergrad.per_example_grads(loss)
    for batch_size, dim in [(6, 3), (4, 3), (5, 2), (6, 3)]:  # the last one hits the first's
        w, x, y = data(batch_size, dim)
        grads = per_example({"w": fw.array(w)}, fw.array(x), fw.array(y))
        np.testing.assert_allclose(fw.to_numpy(grads["w"]), closed_form(w, x, y), atol=1e-5)
    w, x, y = data(3, 3)  # a new key in the parameters: a new structure
    grads = per_example(
        {"w": fw.array(w), "scale": fw.array(np.float32(1.0))}, *map(fw.array, (x, y))
    )
    np.testing.assert_allclose(fw.to_numpy(grads["w"]), closed_form(w, x, y), atol=1e-5)
    np.testing.assert_allclose(fw.to_numpy(grads["scale"]), 2 * (x @ w - y) * (x @ w), atol=1e-5)


def test_repeated_calls_with_explicit_in_axes(fw):
    per_example = pergrad.per_example_grads(linear_loss, in_axes=(None, 1, 0))
    for batch_size in (6, 3):
        w, x, y = data(batch_size)
        grads = per_example(fw.array(w), fw.array(x.T.copy()), fw.array(y))
        np.testing.assert_allclose(fw.to_numpy(grads), closed_form(w, x, y), atol=1e-5)


def test_repeated_calls_read_new_python_float_values(fw):
    def loss(scale, x, y):
        return (scale * x.sum() - y) ** 2

    per_example = pergrad.per_example_grads(loss)
    _, x, y = data()
    for scale in (0.5, 2.0):
        grads = per_example(scale, fw.array(x), fw.array(y))
        expected = 2 * (scale * x.sum(1) - y) * x.sum(1)
        np.testing.assert_allclose(fw.to_numpy(grads), expected, rtol=1e-5, atol=1e-5)


def test_bad_input_on_a_repeated_call_still_raises(fw):
    per_example = pergrad.per_example_grads(linear_loss)
    w, x, y = data(batch_size=6)
    per_example(fw.array(w), fw.array(x), fw.array(y))
    with pytest.raises(ValueError, match=r"disagree.*'x'.* 6.*'y'.* 4"):
        per_example(fw.array(w), fw.array(x), fw.array(y[:4]))
    with pytest.raises(TypeError, match=r"argument 0 \('w'\).*dtype int"):
        per_example(fw.array(np.arange(3)), fw.array(x), fw.array(y))
    with pytest.raises(ValueError, match="no argument looks batched"):
        per_example(fw.array(w), 1.0, 2.0)
    with pytest.raises(ValueError, match="no positional arguments"):
        per_example()
    grads = per_example(fw.array(w), fw.array(x), fw.array(y))  # and good input still works
    np.testing.assert_allclose(fw.to_numpy(grads), closed_form(w, x, y), atol=1e-5)


def test_repeated_calls_switching_frameworks():
    import jax.numpy as jnp
    import torch

    per_example = pergrad.per_example_grads(linear_loss)
    w, x, y = data()
    for to_array in (torch.as_tensor, jnp.asarray, torch.as_tensor):
        grads = per_example(to_array(w), to_array(x), to_array(y))
        np.testing.assert_allclose(np.asarray(grads), closed_form(w, x, y), atol=1e-5)
    with pytest.raises(TypeError, match=r"mix.*argument 0 \('w'\).*argument 1 \('x'\)"):
        per_example(jnp.asarray(w), torch.as_tensor(x), torch.as_tensor(y))


def test_repeated_calls_with_an_opaque_leaf(fw):
    """An object the pytree does not look into may hold anything: it is analysed every call."""

    class Holder:
        def __init__(self, value):
            self.value = value

    def loss(w, x, y, holder):
        return linear_loss(w, x, y) * holder.value

    per_example = pergrad.per_example_grads(loss)
    w, x, y = data()
    for value in (1.0, 3.0):
        grads = per_example(fw.array(w), fw.array(x), fw.array(y), Holder(value))
        np.testing.assert_allclose(fw.to_numpy(grads), value * closed_form(w, x, y), atol=1e-4)


def test_torch_shortcuts_match_torch_pytrees():
    from collections import OrderedDict

    torch = pytest.importorskip("torch")
    import torch.utils._pytree as pytree

    from pergrad._src.backends.torch_backend import BACKEND

    t = torch.ones(2)
    trees = [t, {"a": t, "b": t}, {}, {"a": {"b": t}}, {"a": {}}, {"a": None, "b": t}]
    trees += [{"a": 1, "b": t}, [t], {"a": (t, t)}, OrderedDict(a=t)]
    for tree in trees:
        leaves, treedef = BACKEND.flatten_leaves(tree)
        expected_leaves, expected_treedef = pytree.tree_flatten(tree)
        assert treedef == expected_treedef and hash(treedef) == hash(expected_treedef), tree
        assert len(leaves) == len(expected_leaves), tree
        assert all(a is b for a, b in zip(leaves, expected_leaves)), tree
        rebuilt = BACKEND.unflatten(treedef, leaves)
        assert type(rebuilt) is type(tree) and pytree.tree_structure(rebuilt) == treedef, tree

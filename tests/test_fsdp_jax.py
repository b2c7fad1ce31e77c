"""JAX parameters too big for one device: the ghost DP step with the parameters split over a
mesh axis (FSDP-style, ``pergrad.dp.shard_params``) and the batch over another gives the
one-device results, keeps ``1/N`` of every parameter per device, and returns the clipped sum
and the noisy gradient sharded like the parameters.

As in ``test_sharding_jax.py``, the forced host devices live in ONE subprocess whose checks
print JSON; references are computed in the same subprocess on one device, unsharded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax", reason="sharding is a JAX feature")
pytest.importorskip("optax", reason="the DP step uses optax")

_CHECKS = r"""
import json
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import pergrad

assert jax.device_count() == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "model"))
B, T, D, H, V, C = 16, 3, 16, 32, 12, 8
rng = np.random.default_rng(0)  # numpy's: jax.random would compile once per array shape
params = {"table": jnp.asarray(rng.normal(size=(V, D)) / 2, jnp.float32),
          "w1": jnp.asarray(rng.normal(size=(D, H)) / 4, jnp.float32),
          "b1": jnp.asarray(rng.normal(size=(H,)) / 4, jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(H, C)) / 4, jnp.float32),
          "b2": jnp.zeros(C - 1)}  # no axis of a size divisible by 4: replicated
X = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
Y = jnp.asarray(rng.integers(0, C, B), jnp.int32)

def loss(p, ids, y):
    h = jnp.tanh(p["table"][ids] @ p["w1"] + p["b1"]).mean(0)
    logits = h @ p["w2"] + jnp.concatenate([p["b2"], jnp.zeros(1)])
    return -jax.nn.log_softmax(logits)[y]

def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

def specs(tree):  # each leaf's spec, one entry per axis (JAX drops trailing Nones)
    padded = lambda v: list(v.sharding.spec) + [None] * (v.ndim - len(v.sharding.spec))
    return {k: [None if s is None else str(s) for s in padded(v)] for k, v in tree.items()}

sharded = pergrad.dp.shard_params(params, mesh)
Xs, Ys = pergrad.dp.shard_batch((X, Y), mesh)
out = {"param_specs": specs(sharded),
       "shard_shapes": {k: list(v.addressable_shards[0].data.shape) for k, v in sharded.items()},
       "shapes": {k: list(v.shape) for k, v in params.items()}}
key = jax.random.key(3)
for strategy in ("ghost",):
    for noise in (0.0, 1.0):
        def step(p, ids, y, rng):
            return pergrad.dp.private_grad_of(loss, p, ids, y, max_norm=0.2,
                                              noise_multiplier=noise, rng=rng,
                                              expected_batch_size=B, strategy=strategy)
        one, one_stats = jax.jit(step)(params, X, Y, key)
        many, many_stats = jax.jit(step)(sharded, Xs, Ys, key)
        name = f"{strategy}_noise{noise:g}"
        out[f"{name}_diff"] = diff(many, one)
        out[f"{name}_size"] = max(float(np.max(np.abs(np.asarray(x)))) for x in one.values())
        out[f"{name}_specs"] = specs(many)
        out[f"{name}_clip_fraction"] = [float(many_stats.clip_fraction),
                                        float(one_stats.clip_fraction)]

clipped = lambda p, ids, y: pergrad.dp.clipped_sum_of(loss, p, ids, y, max_norm=0.2,
                                                      strategy="ghost")
one_sum = jax.jit(clipped)(params, X, Y)
many_sum = jax.jit(clipped)(sharded, Xs, Ys)
out["clipped_sum_diff"] = diff(many_sum.sum, one_sum.sum)
out["clipped_sum_specs"] = specs(many_sum.sum)
# the reference of the clipped sum: each example's own gradient, clipped, in numpy float64
grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, X, Y)
flat = np.concatenate([np.asarray(grads[k], np.float64).reshape(B, -1) for k in sorted(grads)], 1)
factors = np.minimum(1.0, 0.2 / np.linalg.norm(flat, axis=1))
reference = {k: np.tensordot(factors, np.asarray(grads[k], np.float64), 1) for k in grads}
out["clipped_sum_vs_loop"] = diff({k: many_sum.sum[k] for k in sorted(reference)},
                                  {k: reference[k] for k in sorted(reference)})

# an optax training step with the parameters and optimizer state sharded
tx = optax.sgd(0.1)
def train(p, state, ids, y, rng):
    g, _ = pergrad.dp.private_grad_of(loss, p, ids, y, max_norm=0.2, noise_multiplier=0.5,
                                      rng=rng, expected_batch_size=B)
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state
one_p, _ = jax.jit(train)(params, tx.init(params), X, Y, key)
# the new parameters placed as the old ones (out_shardings): the table's too
like = jax.tree.map(lambda v: v.sharding, sharded)
many_p, _ = jax.jit(train, out_shardings=(like, None))(sharded, tx.init(sharded), Xs, Ys, key)
out["train_diff"] = diff(many_p, one_p)
out["train_moved"] = diff(one_p, params)
out["train_specs"] = specs(many_p)
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("fsdp") / "fsdp_checks.py"
    path.write_text(_CHECKS)
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = [row for row in result.stdout.splitlines() if row.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS ") :])


def test_each_parameter_is_split_over_the_model_axis_or_replicated(results):
    for name, shape in results["shapes"].items():
        spec = results["param_specs"][name]
        shard = results["shard_shapes"][name]
        if any(size % 4 == 0 for size in shape):
            axis = max((a for a in range(len(shape)) if shape[a] % 4 == 0), key=lambda a: shape[a])
            assert spec[axis] == "model" and spec.count("model") == 1, (name, spec)
            assert np.prod(shard) * 4 == np.prod(shape), (name, shard)  # 1/N per device
        else:
            assert spec == [None] * len(shape) and shard == shape, (name, spec)  # b2: (7,)


def assert_sharded_like_params(found, params):
    """Every dense leaf's gradient keeps its parameter's sharding. A table read by a gather gets
    its gradient from XLA's scatter-add, which the partitioner leaves replicated (or sharded):
    ``out_shardings`` pins it (``test_an_optax_step_on_sharded_parameters_...``)."""
    for name, spec in params.items():
        if name == "table":
            assert found[name] in (spec, [None] * len(spec)), found[name]
        else:
            assert found[name] == spec, (name, found[name], spec)


@pytest.mark.parametrize("strategy", ["ghost"])
@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_the_ghost_step_equals_one_device_and_stays_sharded(results, strategy, noise):
    name = f"{strategy}_noise{noise:g}"
    assert results[f"{name}_diff"] <= 1e-6 * max(1.0, results[f"{name}_size"])
    clipped, reference = results[f"{name}_clip_fraction"]
    assert clipped == reference and reference > 0.0  # the bound is active
    assert_sharded_like_params(results[f"{name}_specs"], results["param_specs"])


def test_the_clipped_sum_equals_one_device_and_a_loop_of_single_examples(results):
    assert results["clipped_sum_diff"] < 1e-6
    assert results["clipped_sum_vs_loop"] < 1e-5
    assert_sharded_like_params(results["clipped_sum_specs"], results["param_specs"])


def test_an_optax_step_on_sharded_parameters_equals_one_device(results):
    assert results["train_moved"] > 1e-3  # the step did something
    assert results["train_diff"] < 1e-6
    assert results["train_specs"] == results["param_specs"]


def test_shard_params_refuses_a_bad_mesh_or_axis():
    import jax
    from jax.sharding import AxisType, Mesh

    import pergrad

    params = {"w": np.zeros((4, 2), np.float32)}
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh.*got dict"):
        pergrad.dp.shard_params(params, {"model": 1})
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="axis_name 'model' is not an axis of the mesh"):
        pergrad.dp.shard_params(params, mesh)
    explicit = Mesh(np.array(jax.devices()[:1]), ("model",), axis_types=(AxisType.Explicit,))
    with pytest.raises(ValueError, match="'model' has AxisType.Explicit"):
        pergrad.dp.shard_params(params, explicit)
    auto = Mesh(np.array(jax.devices()[:1]), ("model",), axis_types=(AxisType.Auto,))
    placed = pergrad.dp.shard_params(params, auto)  # one device: trivially split
    np.testing.assert_array_equal(np.asarray(placed["w"]), params["w"])

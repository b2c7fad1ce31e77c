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

# user-level DP on the sharded path: users' ids traced, the batch sharded with them (issue 37)
U = jnp.asarray(rng.integers(0, 5, B), jnp.int32)
Us = pergrad.dp.shard_batch(U, mesh)
for noise in (0.0, 1.0):
    def user_step(p, ids, y, users, rng):
        return pergrad.dp.private_grad_of(loss, p, ids, y, max_norm=0.2, noise_multiplier=noise,
                                          rng=rng, expected_batch_size=5, user_ids=users,
                                          strategy="ghost")
    one, one_stats = jax.jit(user_step)(params, X, Y, U, key)
    many, many_stats = jax.jit(user_step)(sharded, Xs, Ys, Us, key)
    out[f"user_noise{noise:g}_diff"] = diff(many, one)
    out[f"user_noise{noise:g}_size"] = max(float(np.max(np.abs(np.asarray(x))))
                                           for x in one.values())
    out[f"user_noise{noise:g}_specs"] = specs(many)
    out[f"user_noise{noise:g}_clip_fraction"] = float(many_stats.clip_fraction)
# each user's summed gradient, clipped, in numpy float64: the reference of the user-level sum
users = np.asarray(U)
per_user = {k: np.stack([np.asarray(grads[k], np.float64)[users == u].sum(0)
                         for u in np.unique(users)]) for k in grads}
flat_u = np.concatenate([per_user[k].reshape(len(np.unique(users)), -1) for k in sorted(grads)], 1)
user_factors = np.minimum(1.0, 0.2 / np.linalg.norm(flat_u, axis=1))
user_clipped = jax.jit(lambda p, ids, y, u: pergrad.dp.clipped_sum_of(
    loss, p, ids, y, max_norm=0.2, strategy="ghost", user_ids=u))(sharded, Xs, Ys, Us)
out["user_clipped_sum_vs_loop"] = diff(
    {k: user_clipped.sum[k] for k in sorted(grads)},
    {k: np.tensordot(user_factors, per_user[k], 1) for k in sorted(grads)})

# correlated noise (a banded Toeplitz mechanism) on the sharded path: three steps, the state
# threaded through, sharded like the parameters
mech = pergrad.dp.toeplitz([1.0, -0.4, 0.1], steps=3)
def noisy_step(p, ids, y, rng, state):
    return pergrad.dp.private_grad_of(loss, p, ids, y, max_norm=0.2, noise_multiplier=1.0,
                                      rng=rng, expected_batch_size=B, noise=mech,
                                      noise_state=state)
states = {"one": mech.init(params), "many": mech.init(sharded)}
diffs = []
for step_key in jax.random.split(key, 3):
    one, _, states["one"] = jax.jit(noisy_step)(params, X, Y, step_key, states["one"])
    many, _, states["many"] = jax.jit(noisy_step)(sharded, Xs, Ys, step_key, states["many"])
    diffs.append(diff(many, one))
out["correlated_diffs"] = diffs
out["correlated_size"] = max(float(np.max(np.abs(np.asarray(x)))) for x in one.values())
out["correlated_specs"] = specs(many)
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


@pytest.mark.parametrize("noise", ["0", "1"])
def test_user_level_dp_on_sharded_parameters_equals_one_device(results, noise):
    assert results[f"user_noise{noise}_diff"] < 1e-5 * max(1.0, results[f"user_noise{noise}_size"])
    assert results[f"user_noise{noise}_clip_fraction"] > 0.0  # the bound is active
    assert_sharded_like_params(results[f"user_noise{noise}_specs"], results["param_specs"])


def test_the_user_level_sum_on_sharded_parameters_is_each_users_clipped_gradient(results):
    assert results["user_clipped_sum_vs_loop"] < 1e-5


def test_correlated_noise_on_sharded_parameters_equals_one_device_step_by_step(results):
    assert len(results["correlated_diffs"]) == 3
    assert max(results["correlated_diffs"]) < 1e-5 * max(1.0, results["correlated_size"])
    assert_sharded_like_params(results["correlated_specs"], results["param_specs"])

"""jaxside.checkpoint: save on the (4, 2) FSDP x TP mesh, restore bitwise on (2, 1) and (1, 1) meshes.

The state mixes what a training run saves: fp32 and bf16 parameters, FusedAdam's state after a step
(fp32 moments, an fp32 master, None where there is no master, the int32 step), and FP8 scaling
state (an fp32 amax history and scale) plus float8_e4m3fn bytes covering all 256 codes. An
interrupted save is the state Orbax is in just before its commit: every file written into the
temporary directory, no commit file, not renamed.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxside import checkpoint, sharding
from jaxside.optim import fused_adam

KERNEL = (("embed", "mlp"), "column", "kernel")
NORM = (("embed",), "column", "norm")


def _state_on(mesh) -> dict:
    """A training state whose every array carries its own coordinates, placed on `mesh`."""

    def place(values, logical):
        return jax.device_put(values, sharding.named_sharding(mesh, *logical, shape=values.shape))

    kernel = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7
    params = {
        "kernel": place(jnp.asarray(kernel, jnp.bfloat16), KERNEL),
        "norm": place(jnp.linspace(-1, 1, 16, dtype=jnp.float32), NORM),
    }
    tx = fused_adam(1e-2, master_weights=True)
    optimizer = tx.init(params)
    _, optimizer = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), optimizer, params)
    fp8_codes = jnp.arange(256, dtype=jnp.uint8).reshape(32, 8).view(jnp.float8_e4m3fn)  # NaN codes too
    return {
        "params": params,
        "optimizer": optimizer,
        "fp8": {
            "weight_fp8": place(fp8_codes, KERNEL),
            "amax_history": jnp.linspace(0, 3, 1024 * 3, dtype=jnp.float32).reshape(1024, 3),
            "scale": jnp.array([448.0, 0.5, 2.0**-10], jnp.float32),
        },
    }


def _target_on(saved, mesh):
    """The saved shapes and dtypes with the same logical layouts on another mesh (small leaves replicated)."""

    def sharding_for(leaf):
        if leaf.ndim == 2 and leaf.shape[1] == 8:  # the kernels
            return sharding.named_sharding(mesh, *KERNEL)
        if leaf.shape == (16,):
            return sharding.named_sharding(mesh, *NORM)
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    return checkpoint.abstract_target(saved, jax.tree.map(sharding_for, saved))


def _bytes(array) -> np.ndarray:
    values = np.asarray(array)
    return values.view(np.uint8) if values.ndim else values.reshape(1).view(np.uint8)


@pytest.mark.parametrize("dp_shard", [2, 1])
def test_save_on_4x2_restores_bitwise_on_a_smaller_mesh(tmp_path, dp_shard):
    saved = _state_on(sharding.make_mesh(dp_shard=4, tp=2))
    checkpoint.save(tmp_path, 3, saved)
    mesh = sharding.make_mesh(dp_shard=dp_shard)
    target = _target_on(saved, mesh)
    restored = checkpoint.restore(tmp_path, 3, target)

    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    assert restored["optimizer"].master_param["norm"] is None
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(restored)}
    assert {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn)} <= dtypes
    for (key, got), want, wanted_layout in zip(
        jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(saved), jax.tree.leaves(target)
    ):
        assert got.dtype == want.dtype and got.shape == want.shape, jax.tree_util.keystr(key)
        assert np.array_equal(_bytes(got), _bytes(want)), jax.tree_util.keystr(key)
        assert got.sharding == wanted_layout.sharding, jax.tree_util.keystr(key)


def test_an_interrupted_save_is_never_listed_and_the_last_committed_step_survives(tmp_path):
    state = _state_on(sharding.make_mesh(dp_shard=4, tp=2))
    assert checkpoint.latest_step(tmp_path) is None
    checkpoint.save(tmp_path, 1, state)
    interrupted = checkpoint.save(tmp_path, 2, state)
    (interrupted / "commit_success.txt").unlink()
    shutil.move(interrupted, interrupted.with_name("step-2.orbax-checkpoint-tmp"))  # as before Orbax's commit

    assert checkpoint.committed_steps(tmp_path) == [1]
    assert checkpoint.latest_step(tmp_path) == 1
    target = _target_on(state, sharding.make_mesh())
    with pytest.raises(ValueError, match=r"step 2 has no committed save.*committed: \[1\]"):
        checkpoint.restore(tmp_path, 2, target)
    restored = checkpoint.restore(tmp_path, 1, target)
    assert np.array_equal(_bytes(restored["fp8"]["weight_fp8"]), _bytes(state["fp8"]["weight_fp8"]))

    checkpoint.save(tmp_path, 2, state)  # the retry replaces the leftover
    assert checkpoint.committed_steps(tmp_path) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]


def test_mistakes_raise_errors_that_say_what_to_do(tmp_path):
    state = {"w": jnp.arange(8, dtype=jnp.float32), "fp8": jnp.zeros(4, jnp.float8_e4m3fn)}
    checkpoint.save(tmp_path, 0, state)
    with pytest.raises(ValueError, match="step 0 is already committed"):
        checkpoint.save(tmp_path, 0, state)
    with pytest.raises(ValueError, match="step=-1"):
        checkpoint.save(tmp_path, -1, state)
    one_device = jax.sharding.NamedSharding(sharding.make_mesh(), jax.sharding.PartitionSpec())
    with pytest.raises(TypeError, match=r"target \['w'\] is of type ArrayImpl, not jax.ShapeDtypeStruct"):
        checkpoint.restore(tmp_path, 0, {**checkpoint.abstract_target(state, one_device), "w": state["w"]})
    unsharded = {**checkpoint.abstract_target(state, one_device), "w": jax.ShapeDtypeStruct((8,), jnp.float32)}
    with pytest.raises(TypeError, match="without a sharding"):
        checkpoint.restore(tmp_path, 0, unsharded)
    as_bf16 = checkpoint.abstract_target({**state, "fp8": jnp.zeros(4, jnp.bfloat16)}, one_device)
    with pytest.raises(ValueError, match=r"\['fp8'\] was saved as float8_e4m3fn\[4\] but the target asks for bfloat16"):
        checkpoint.restore(tmp_path, 0, as_bf16)

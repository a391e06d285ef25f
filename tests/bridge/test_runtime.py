"""The co-located runtime on 4 CPU processes (torchrun's launcher, gloo for torch and for JAX), in one launch.

One launch answers every question of this file (starting 4 processes that import torch and JAX
costs ~25 s here):

- the JAX mesh of a torch DeviceMesh holds rank r where torch does, and a permuted one is refused;
- a DTensor that FSDP2 shards on top of column-parallel TP crosses to JAX and back without a copy
  (equal data pointers) and holds the values torch's full_tensor() does (JAX's own all-gather);
  an uneven one is refused;
- parameters and FusedAdam moments map to JAX (a kernel is the transposed weight, checked on the
  gathered values) and back into another torch model;
- `verify` passes for a 2-layer LayerNormMLP stack on FSDP x TP (2x2) and HSDP (2x2) with FP8 off
  (each FP8 recipe compiles its own JAX step, 25-75 s here: the whole recipe grid is
  test_verify_cli's slow test), and a mapping that swaps two rows of a column-parallel weight is
  caught and named.

On CUDA (`pytest -m gpu`) a second launch, on 2 GPUs where there are (else 1), checks the same
verdicts through XLA's GPU client, cuBLASLt and NCCL: verify of the MLP stack passes on dp=N (FP8
off and DelayedScaling), the swapped mapping is caught on tp=N.
"""

from __future__ import annotations

import numpy as np
import pytest

from bridge import crosscheck, params, runtime
from twinspec.mesh import MeshShape

pytestmark = pytest.mark.multiprocess

SWAPPED_NAME = "layers.0.mlp.fc1_weight"  # column-parallel: its rows are output features


def _swap_rows_then_transpose(w_OI):
    return w_OI[np.array([1, 0, *range(2, w_OI.shape[0])])].T


def _transpose_then_swap_rows(kernel_IO):
    w_OI = kernel_IO.T
    return w_OI[np.array([1, 0, *range(2, w_OI.shape[0])])]


# A wrong rule: two rows of one weight swap places on the way to JAX (and back, so it is self-consistent).
SWAPPED = params.Layout("swapped rows", _swap_rows_then_transpose, _transpose_then_swap_rows, transposes=True)
BROKEN_RULES = (params.Rule(SWAPPED_NAME.replace(".", r"\."), 2, "layers.0.mlp.fc1_kernel", SWAPPED), *params.RULES)


def _mesh_and_transfer(rt) -> dict:
    import torch
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    from torch.distributed.device_mesh import init_device_mesh

    from bridge import layout, transfer
    from torchside.modules import Linear, ModuleConfig
    from torchside.parallel import parallelize

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    mesh = runtime.jax_mesh(world)
    permuted = Mesh(np.array(mesh.devices).T, mesh.axis_names)  # ranks 0 2 / 1 3 instead of 0 1 / 2 3
    try:
        runtime.check_mesh(world, permuted)
        permuted_refused = ""
    except ValueError as error:
        permuted_refused = str(error)
    results = {"permuted refused": permuted_refused}
    for out_features in (8, 6):
        layer = Linear(16, out_features, bias=False, config=ModuleConfig(tp_size=2, parallel_mode="column"),
                       tp_mesh=world["tp"])  # fmt: skip
        parallelize(layer, world["dp_shard"])
        arange = torch.arange(out_features * 16, dtype=torch.float32).reshape(out_features, 16)
        local = layer.weight.to_local()
        with torch.no_grad():
            local.copy_(arange[layout.from_dtensor(layer.weight).selectors(tuple(world.get_coordinate()))])
        try:
            array = transfer.to_jax(layer.weight, mesh)
        except ValueError as error:
            results[out_features] = {"refused": str(error)}
            continue
        back = transfer.to_torch(array, layer.weight.device_mesh, layer.weight.placements)
        shard = array.addressable_shards[0].data
        results[out_features] = {
            "spec": tuple(array.sharding.spec),
            "zero-copy to JAX": shard.unsafe_buffer_pointer() == local.data_ptr(),
            "zero-copy back": back.to_local().data_ptr() == local.data_ptr(),
            "JAX's full array": np.asarray(multihost_utils.process_allgather(array, tiled=True)),
            "torch's full tensor": layer.weight.full_tensor().detach().numpy(),
        }
    return results


def _round_trip(rt) -> dict:
    """Parameters and FusedAdam moments of a FSDP x TP model to JAX (by the rules) and back into another model."""
    import torch
    from flax import nnx
    from jax.experimental import multihost_utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import jaxside.modules as JM
    from bridge import twins
    from torchside.optim import FusedAdam
    from torchside.parallel import MESH_AXES, parallelize

    world = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=MESH_AXES)  # jaxside's axes
    mesh = runtime.jax_mesh(world)
    spec = twins.TwinSpec("mlp", 1, 32, tp_size=2, amax_history_len=1)
    source, target = twins.build_torch(spec), twins.build_torch(spec)
    for model, seed in ((source, 0), (target, 1)):
        torch.manual_seed(seed)  # every rank fills its shards alike: the two models differ
        parallelize(model, world["dp_shard"], tp_mesh=world["tp"], blocks=list(model.layers))
    jax_model = twins.build_jax(spec)
    JM.place(jax_model, mesh)
    shardings = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(JM.shardings(jax_model, mesh))}
    pairs = params.pair_models(source, jax_model)
    source_params = dict(source.named_parameters())
    params.load_into_jax(jax_model, params.torch_values_to_jax(source_params, pairs, mesh, shardings))
    loaded = {n: p.full_tensor().detach().clone() for n, p in source_params.items()}  # JAX holds copies of these
    optimizer = FusedAdam(source.parameters(), lr=0.1)
    for p in source.parameters():
        ones = torch.ones_like(p.to_local())
        p.grad = DTensor.from_local(ones, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    optimizer.step()  # makes the moments (and moves the torch parameters, not JAX's copies)
    moments = params.optimizer_states_to_jax(optimizer, source, pairs, mesh, shardings)
    values = params.jax_parameters(jax_model)
    params.load_into_torch(target, params.jax_values_to_torch(values, pairs, dict(target.named_parameters())))
    full = lambda array: np.asarray(multihost_utils.process_allgather(array, tiled=True))  # noqa: E731
    fc1 = ("layers", 0, "mlp", "fc1_kernel")
    return {
        "states": sorted(moments),
        "fc1 kernel is the weight's transpose": np.array_equal(
            full(values[fc1]), loaded["layers.0.mlp.fc1_weight"].numpy().T
        ),
        "fc1 exp_avg is the transpose": np.array_equal(
            full(moments["exp_avg"][fc1]),
            optimizer.state[source_params["layers.0.mlp.fc1_weight"]]["exp_avg"].full_tensor().numpy().T,
        ),
        "target equals the loaded source": {n: torch.equal(p.full_tensor(), loaded[n]) for n, p in target.named_parameters()},
    }


def _scenario(rt) -> dict:
    import os

    os.environ["TRITON_INTERPRET"] = "0"  # torchside's kernels through the pure-torch reference
    fsdp_tp, hsdp = MeshShape(dp_shard=2, tp=2), MeshShape(dp_replicate=2, dp_shard=2)
    return {
        "layouts": _mesh_and_transfer(rt),
        "round trip": _round_trip(rt),
        "verify": crosscheck.verify(rt, [
            crosscheck.VerifyCase("mlp", 2, 64, fsdp_tp, ("off",), 2),
            crosscheck.VerifyCase("mlp", 2, 64, hsdp, ("off",), 2),
        ]),  # fmt: skip
        "broken": crosscheck.verify(rt, [crosscheck.VerifyCase("mlp", 2, 64, fsdp_tp, ("off",), 1)], BROKEN_RULES),
    }


@pytest.fixture(scope="module")
def results():
    return runtime.launch(_scenario, 4, device_type="cpu")


def test_the_jax_mesh_is_in_torch_rank_order(results):
    for rank_results in results:
        assert "does not match the torch DeviceMesh" in rank_results["layouts"]["permuted refused"]


def test_fsdp_over_tp_shards_cross_without_a_copy(results):
    for rank_results in results:
        moved = rank_results["layouts"][8]
        assert moved["spec"] == (("tp", "dp_shard"), None)
        assert moved["zero-copy to JAX"] and moved["zero-copy back"]
        np.testing.assert_array_equal(moved["JAX's full array"], moved["torch's full tensor"])
        np.testing.assert_array_equal(moved["JAX's full array"], np.arange(8 * 16).reshape(8, 16))


def test_parameters_and_moments_map_both_ways(results):
    for rank_results in results:
        moved = rank_results["round trip"]
        assert moved["states"] == ["exp_avg", "exp_avg_sq"]  # fp32 parameters keep no master copy
        assert moved["fc1 kernel is the weight's transpose"] and moved["fc1 exp_avg is the transpose"]
        assert all(moved["target equals the loaded source"].values()), moved["target equals the loaded source"]


def test_an_uneven_shard_is_refused(results):
    for rank_results in results:
        assert "pad dim 0 to 8" in rank_results["layouts"][6]["refused"]


def test_verify_passes_on_fsdp_tp_and_hsdp(results):
    reports = results[0]["verify"]
    assert [(r["mesh"], r["recipe"]) for r in reports] == [
        ("dp_shard=2,tp=2", "off"), ("dp_replicate=2,dp_shard=2", "off"),
    ]
    for report in reports:
        assert report["passed"], report["first_divergence"]
        stages = {check["stage"] for check in report["checks"]}
        assert stages == {"layout", "forward", "input_grad", "weight_grad", "param", "exp_avg", "exp_avg_sq"}
    assert all(rank_results["verify"] == reports for rank_results in results)  # one verdict everywhere


def _assert_caught_and_named(report: dict) -> None:
    assert not report["passed"]
    first = report["first_divergence"]
    assert (first["step"], first["stage"], first["layer"]) == (0, "forward", "layers.0")
    assert first["relative"] > 1e-3  # far beyond the 1e-5 of FP8 off
    failed_grads = {c["name"] for c in report["checks"] if c["stage"] == "weight_grad" and not c["passed"]}
    assert SWAPPED_NAME in failed_grads


def test_a_broken_mapping_is_caught_and_named(results):
    (report,) = results[0]["broken"]
    _assert_caught_and_named(report)


def _gpu_scenario(rt) -> dict:
    dp, tp = MeshShape(dp_shard=rt.world_size), MeshShape(tp=rt.world_size)
    return {
        "verify": crosscheck.verify(rt, [crosscheck.VerifyCase("mlp", 2, 64, dp, ("off", "delayed"), 2)]),
        "broken": crosscheck.verify(rt, [crosscheck.VerifyCase("mlp", 2, 64, tp, ("off",), 1)], BROKEN_RULES),
    }


@pytest.fixture(scope="module")
def gpu_results():
    import torch

    return runtime.launch(_gpu_scenario, min(2, torch.cuda.device_count()), device_type="cuda")  # a process a GPU


@pytest.mark.gpu
def test_verify_on_gpus_passes_and_catches_a_broken_mapping(gpu_results):
    """verify on CUDA (XLA GPU, cuBLASLt; NCCL on 2 GPUs): a correct mapping passes, a broken one is named."""
    for report in gpu_results[0]["verify"]:
        assert report["passed"] and report["device_type"] == "cuda", report["first_divergence"]
    (broken,) = gpu_results[0]["broken"]
    _assert_caught_and_named(broken)

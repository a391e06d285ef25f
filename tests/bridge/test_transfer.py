"""bridge.transfer: which NamedSharding holds a DTensor's shards, what is refused, and that nothing is copied.

Layout questions need no processes: a torch mesh described as a MeshSpec against a JAX mesh of this
process's 8 host devices (device i stands for rank i), checked against the closed forms of docs/design.md.
Zero-copy is checked on a one-rank gloo world (its DTensor's local shard is the whole tensor): the
jax.Array's buffer must be the torch storage, and back. Several processes: test_runtime.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torch.distributed as dist
from jax.sharding import Mesh, PartitionSpec
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from bridge import layout, params, transfer
from torchside.parallel._torch_compat import make_strided_shard
from jaxside.sharding import make_mesh
from torchside.quantization import Quantizer
from torchside.recipe import Float8CurrentScaling

FSDP_TP = layout.MeshSpec((4, 2), ("dp_shard", "tp"))  # ranks 0..7 in row-major order, as JAX's mesh


def test_fsdp_over_column_tp_is_tp_major_in_jax():
    """FSDP2 over a column-parallel weight: rank (dp=i, tp=j) holds row 4j + i of 8 (docs/design.md)."""
    placements = (make_strided_shard(0, 2), Shard(0))
    sharding = transfer.sharding_for(FSDP_TP, placements, (8, 16), make_mesh(dp_shard=4, tp=2))
    assert sharding.spec == PartitionSpec(("tp", "dp_shard"), None)
    held = layout.from_named_sharding(sharding, (8, 16))
    for coordinate in held.mesh.coordinates():
        _, i, j = coordinate  # (dp_replicate, dp_shard, tp)
        assert held.indices[coordinate][0].tolist() == [4 * j + i]


def test_row_parallel_weight_and_replicated_bias():
    mesh = make_mesh(dp_shard=4, tp=2)
    weight = transfer.sharding_for(FSDP_TP, (Shard(0), Shard(1)), (8, 16), mesh)
    bias = transfer.sharding_for(FSDP_TP, (Shard(0), Replicate()), (8,), mesh)
    assert (weight.spec, bias.spec) == (PartitionSpec("dp_shard", "tp"), PartitionSpec("dp_shard"))


@pytest.mark.parametrize(
    "torch_mesh, placements, shape, message",
    [
        (FSDP_TP, (Shard(0), Partial()), (8, 16), "Partial"),
        (FSDP_TP, (Shard(0), Shard(1)), (6, 16), r"pad dim 0 to 8"),
        (layout.MeshSpec((2,), ("dp_shard",), (0, 1)), (Shard(0),), (8, 16), r"spans ranks \[0, 1\]"),
        (layout.MeshSpec((4, 2), ("dp", "tp")), (Shard(0), Shard(1)), (8, 16), r"\['dp'\] are not axes"),
    ],
    ids=["partial", "uneven", "part-of-the-devices", "unknown-axis"],
)
def test_layouts_without_an_equivalent_are_refused(torch_mesh, placements, shape, message):
    with pytest.raises(ValueError, match=message):
        transfer.sharding_for(torch_mesh, placements, shape, make_mesh(dp_shard=4, tp=2))


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo world, its torch mesh and the JAX mesh of this process's first device."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",)), Mesh(np.array(jax.devices()[:1]), ("dp_shard",))
    dist.destroy_process_group()


def _pointer(array: jax.Array) -> int:
    return array.addressable_shards[0].data.unsafe_buffer_pointer()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_torch_to_jax_and_back_shares_the_buffer(one_rank, dtype):
    device_mesh, mesh = one_rank
    values = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    tensor = DTensor.from_local(values, device_mesh, [Shard(0)], run_check=False)
    array = transfer.to_jax(tensor, mesh)
    assert _pointer(array) == values.data_ptr()
    assert str(array.dtype) == str(dtype).removeprefix("torch.")
    np.testing.assert_array_equal(np.asarray(array).view(np.uint8), values.view(torch.uint8).numpy())
    back = transfer.to_torch(array, device_mesh, [Shard(0)])
    assert back.to_local().data_ptr() == _pointer(array)
    assert torch.equal(back.to_local().view(torch.uint8), values.view(torch.uint8))


def test_fp8_bytes_as_uint8(one_rank):
    device_mesh, mesh = one_rank
    values = torch.randn(4, 32).to(torch.float8_e5m2)
    array = transfer.to_jax(DTensor.from_local(values, device_mesh, [Shard(0)], run_check=False), mesh, as_bytes=True)
    assert array.dtype == np.uint8 and _pointer(array) == values.data_ptr()
    np.testing.assert_array_equal(np.asarray(array), values.view(torch.uint8).numpy())


def test_quantized_weight_crosses_as_bytes_and_scale(one_rank):
    device_mesh, mesh = one_rank
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    quantized = Quantizer(Float8CurrentScaling(), "weight", rowwise=True, columnwise=False).quantize(weight)
    tensor = DTensor.from_local(quantized, device_mesh, [Shard(0)], run_check=False)
    with pytest.raises(TypeError, match="quantized_to_jax"):
        transfer.to_jax(tensor, mesh)
    arrays = transfer.quantized_to_jax(tensor, mesh, as_bytes=True)
    storage = quantized.quantized_storage
    assert _pointer(arrays.data) == storage.rowwise_data.data_ptr()
    np.testing.assert_array_equal(np.asarray(arrays.data), storage.rowwise_data.view(torch.uint8).numpy())
    np.testing.assert_array_equal(np.asarray(arrays.scale_inv), storage.rowwise_scale_inv.numpy())
    assert (arrays.scheme, arrays.fmt) == ("tensorwise", "e4m3")


def test_a_non_contiguous_shard_is_refused(one_rank):
    device_mesh, mesh = one_rank
    transposed = torch.randn(16, 8).T
    tensor = DTensor.from_local(transposed, device_mesh, [Replicate()], run_check=False)
    with pytest.raises(ValueError, match="not contiguous"):
        transfer.to_jax(tensor, mesh)


def test_an_fp8_weight_maps_to_its_dequantized_kernel(one_rank):
    """bridge.params: FP8 bytes and scale_inv cross as they are and become torch's dequantized values, transposed."""
    device_mesh, mesh = one_rank
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    quantized = Quantizer(Float8CurrentScaling(), "weight", rowwise=True, columnwise=False).quantize(weight)
    tensor = DTensor.from_local(quantized, device_mesh, [Shard(0)], run_check=False)
    pair = params.ParamPair("weight", ("kernel",), params.TRANSPOSE)
    replicated = jax.sharding.NamedSharding(mesh, PartitionSpec())
    (kernel,) = params.torch_values_to_jax({"weight": tensor}, [pair], mesh, {("kernel",): replicated}).values()
    np.testing.assert_array_equal(np.asarray(kernel), quantized.dequantize().numpy().T)

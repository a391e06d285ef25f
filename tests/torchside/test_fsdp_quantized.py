"""FSDP2 shards a QuantizedTensor parameter and all-gathers its bytes, never its values.

Every rank quantizes the same full tensor (the expected result), makes it a parameter,
and `fully_shard`s it over 2 ranks. The local shard must hold the expected rows, and
`unshard()` must rebuild exactly the expected bytes (twice: the second gather refills the
first one's buffers in place), while the dequantize fallback is never reached.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fp8kernels._backend import Backend
from tests.distributed import run_processes, run_threads
from torchside.quantization import FALLBACK_CALLS, QuantizedTensor, Quantizer
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

BUFFERS = (
    "rowwise_data",
    "rowwise_scale_inv",
    "columnwise_data",
    "columnwise_scale_inv",
    "tensor_amax",
    "columnwise_amax",
)

# name: (recipe, role, full shape, usages): shards of 2 ranks land on scale-block boundaries
CASES = {
    "current-uneven": (Float8CurrentScaling(), "weight", (5, 32), (True, True)),
    "current-empty-rank": (Float8CurrentScaling(), "weight", (1, 32), (True, False)),
    "block128x128": (Float8BlockScaling(), "weight", (256, 128), (True, True)),
    "block1x128": (Float8BlockScaling(), "input", (256, 160), (True, True)),
    "mxfp8-3d": (MXFP8BlockScaling(), "input", (4, 16, 64), (True, True)),
    "nvfp4-rht": (NVFP4BlockScaling(), "input", (64, 32), (True, True)),
    "nvfp4-16x16": (NVFP4BlockScaling(), "weight", (64, 32), (True, True)),
}


def same_bytes(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(flat(a), flat(b))


def mismatched(got: QuantizedTensor, want: QuantizedTensor) -> list[str]:
    wrong = [b for b in BUFFERS if not same_bytes(getattr(got, b), getattr(want, b))]
    return wrong + (["shape"] if got.shape != want.shape else [])


def _shard_and_gather(rank, world_size, name):
    recipe, role, shape, (rowwise, columnwise) = CASES[name]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    expected = Quantizer(recipe, role, rowwise=rowwise, columnwise=columnwise).quantize(full, backend=Backend.REFERENCE)
    model = nn.Module()
    model.weight = nn.Parameter(expected.clone(), requires_grad=False)
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh)

    local = model.weight.to_local()
    chunk = -(-shape[0] // world_size)  # torch.chunk's shard size
    start = min(rank * chunk, shape[0])
    report = {"local": type(local).__name__, "local wrong": mismatched(local, expected[start : start + chunk])}
    inputs, _ = local.fsdp_pre_all_gather(mesh, torch.Size(shape), None, model, MixedPrecisionPolicy())
    report["input dtypes"] = sorted({str(t.dtype) for t in inputs})
    for attempt in ("first", "second"):
        model.unshard()
        report[f"{attempt} wrong"] = mismatched(model.weight, expected)
        report[f"{attempt} type"] = type(model.weight).__name__
        model.reshard()
    report["fallback calls"] = sum(FALLBACK_CALLS.values())  # read by the process test (a fresh process)
    return report


@pytest.mark.parametrize("name", list(CASES))
def test_unshard_gathers_the_bytes_of_the_full_quantization(name):
    before = sum(FALLBACK_CALLS.values())
    for report in run_threads(_shard_and_gather, 2, name):
        report.pop("fallback calls")  # threads share the counter: checked once below
        assert report == {
            "local": "QuantizedTensor",
            "local wrong": [],
            "input dtypes": ["torch.uint8"],
            "first wrong": [],
            "first type": "QuantizedTensor",
            "second wrong": [],
            "second type": "QuantizedTensor",
        }
    assert sum(FALLBACK_CALLS.values()) == before


def _shard_unevenly(rank, world_size, recipe, role, shape, columnwise):
    quantizer = Quantizer(recipe, role, columnwise=columnwise)
    quantized = quantizer.quantize(torch.randn(shape), backend=Backend.REFERENCE)
    model = nn.Module()
    model.weight = nn.Parameter(quantized, requires_grad=False)
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        model.unshard()
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "recipe, role, shape, columnwise, message",
    [
        (Float8BlockScaling(), "weight", (384, 128), True, "multiples of 128"),  # 192-row shards cut a block
        (Float8BlockScaling(), "input", (3, 128), False, "shards this block1x128"),  # scales cannot be padded
    ],
)
def test_shards_that_break_the_scale_layout_are_refused_on_every_rank(recipe, role, shape, columnwise, message):
    for error in run_threads(_shard_unevenly, 2, recipe, role, shape, columnwise):
        assert message in error


def _quantize_halves(rank, world_size, recipe):
    full = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    full[5, 7] = 40.0  # the amax lives on rank 1 only
    mine = full.chunk(world_size)[rank]
    quantizer = Quantizer(recipe, "input", columnwise=False, amax_reduction_group=dist.group.WORLD)
    local = quantizer.quantize(mine, backend=Backend.REFERENCE)
    quantizer.update()  # DelayedScaling: all-reduce this step's amax, then the next scale
    return local, quantizer.scale


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(power_2_scale=True), DelayedScaling()])
def test_amax_reduction_gives_every_shard_the_full_tensors_scale(recipe):
    full = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    full[5, 7] = 40.0
    results = run_threads(_quantize_halves, 2, recipe)
    if isinstance(recipe, Float8CurrentScaling):
        expected = Quantizer(recipe, "input", columnwise=False).quantize(full, backend=Backend.REFERENCE)
        for rank, (local, _) in enumerate(results):
            assert same_bytes(local.rowwise_data, expected.rowwise_data[4 * rank : 4 * rank + 4])
            assert same_bytes(local.rowwise_scale_inv, expected.rowwise_scale_inv)
    else:
        assert [scale.item() for _, scale in results] == [pytest.approx(448.0 / 40.0)] * 2


def _gloo_shard_and_gather(rank, world_size):
    return {name: _shard_and_gather(rank, world_size, name) for name in ("current-uneven", "mxfp8-3d", "nvfp4-rht")}


# In CI: the same cases on threads (test_unshard_gathers_the_bytes_of_the_full_quantization); FSDP all-gathers of FP8 bytes on gloo processes, with no
# dequantize fallback: checkpoint/test_resharding's launch (test_no_fp8_parameter_ran_on_dequantized_values).
@pytest.mark.grid
@pytest.mark.multiprocess
def test_gloo_processes_gather_the_bytes():
    for report in run_processes(_gloo_shard_and_gather, 2):
        for name, checks in report.items():
            wrong = {k: v for k, v in checks.items() if k.endswith("wrong") and v}
            assert not wrong and checks["input dtypes"] == ["torch.uint8"], (name, checks)
            assert checks["fallback calls"] == 0, (name, checks)

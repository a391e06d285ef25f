"""fp8kernels.ops: the custom ops (quantize, scaled GEMM, norm) pass torch.library.opcheck (schema, fake
implementation against the real one, AOT dispatch) and return the bytes of the kernel function each wraps, on
the interpreter and the reference, on CPU (CI) and CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from fp8kernels import gemm, grouped_gemm, norm, ops
from fp8kernels._backend import backend_for
from tests.fp8kernels.devices import DEVICES

SEED, GLOBAL_AMAX = torch.tensor([2**40 + 7]), torch.tensor([3.5])  # a seed past 2^32: the kernels take it mod 2^32
# case -> (kernel function keyword arguments, the op's arguments after x and before the usage flags)
QUANTIZE_OPS = {
    "quantize_tensorwise": ({"fmt": "e5m2"}, ("e5m2", None, None, False, 0.0)),
    "quantize_blockwise": ({"block": (1, 128)}, ("e4m3", [1, 128], True)),
    "quantize_blockwise_square": ({"block": (128, 128)}, ("e4m3", [128, 128], True)),
    "quantize_mxfp8": ({}, ("e4m3", "up")),
    "quantize_nvfp4": (  # an input's or a grad's: the Hadamard transform, stochastic rounding
        {"hadamard": True, "stochastic_seed": SEED}, ([1, 16], True, SEED, None)
    ),
    "quantize_nvfp4_square": ({"block": (16, 16)}, ([16, 16], False, None, None)),  # a weight's
    "quantize_nvfp4_given_amax": ({"global_amax": GLOBAL_AMAX}, ([1, 16], False, None, GLOBAL_AMAX)),  # a shard's
}
USAGES = [(True, False), (False, True), (True, True)]


CPU, CUDA = DEVICES  # (their marks: the CPU cases where CUDA is absent, the CUDA ones under `pytest -m gpu`)


@pytest.fixture(
    params=[
        pytest.param(("cpu", "1"), id="cpu-interpreter", marks=CPU.marks),
        pytest.param(("cpu", "0"), id="cpu-reference", marks=CPU.marks),
        pytest.param(("cuda", "0"), id="cuda-triton", marks=CUDA.marks),
    ]
)
def device(request, monkeypatch) -> str:
    """Where the ops run, with TRITON_INTERPRET set for it (the interpreter runs on CPU tensors only)."""
    device, interpret = request.param
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    return device


def _x(device: str) -> torch.Tensor:
    """[2, 48, 288]: 96 rows, three 128-blocks along K (the last partial), multiples of 32 (MXFP8)."""
    return torch.randn(2, 48, 288, generator=torch.Generator().manual_seed(0)).to(device)


def _function(case: str) -> str:
    """The op's (and kernel function's) name of a QUANTIZE_OPS case."""
    return case.removesuffix("_square").removesuffix("_given_amax")


def _op(case: str):
    return getattr(torch.ops.shardbridge, _function(case)).default


def _quantize_cases() -> list:
    """Every case x usage; NVFP4 (slow under the interpreter) with both copies only, its other usages in the grid."""
    return [
        pytest.param(name, *usage, id=f"{name}-{usage[0]}-{usage[1]}", marks=pytest.mark.grid)
        if name.startswith("quantize_nvfp4") and usage != (True, True)
        else pytest.param(name, *usage, id=f"{name}-{usage[0]}-{usage[1]}")
        for name in QUANTIZE_OPS
        for usage in USAGES
    ]


@pytest.mark.parametrize("name, rowwise, columnwise", _quantize_cases())
def test_quantize_op_passes_opcheck_and_returns_the_kernel_bytes(name, rowwise, columnwise, device):
    x = _x(device)
    kwargs, op_arguments = QUANTIZE_OPS[name]
    kwargs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    op_arguments = tuple(value.to(device) if isinstance(value, torch.Tensor) else value for value in op_arguments)
    arguments = (x, *op_arguments, rowwise, columnwise, "")
    torch.library.opcheck(_op(name), arguments)
    outputs = _op(name)(*arguments)
    kernel = getattr(ops.implementation(backend_for(x.device)), _function(name))
    expected = kernel(x, **kwargs, rowwise=rowwise, columnwise=columnwise)
    buffers = ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv", "amax", "columnwise_amax")
    assert len(outputs) == (6 if name.startswith("quantize_nvfp4") else 5)
    for buffer, output in zip(buffers, outputs):
        wanted = getattr(expected, buffer)
        if wanted is None:
            assert output.numel() == 0, f"{buffer}: a placeholder where the kernel returns none"
        else:
            assert torch.equal(output, wanted), f"{buffer} differs"


# The three GEMMs of a linear layer (x [T, I], w [O, I], dy [T, O]; T, I, O multiples of 32 for MXFP8):
# (A, B, A columnwise, B columnwise)
LAYOUTS = {"fprop": ("x", "w", False, False), "dgrad": ("dy", "w", False, True), "wgrad": ("dy", "x", True, True)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["quantize_tensorwise", "quantize_blockwise", "quantize_mxfp8"])
def test_scaled_mm_op_passes_opcheck_and_returns_the_gemm_result(name, layout, device):
    generator = torch.Generator().manual_seed(1)
    tensors = {"x": (64, 96), "w": (32, 96), "dy": (64, 32)}
    quantize = getattr(ops.implementation(backend_for(device)), name)
    quantized = {
        key: quantize(torch.randn(shape, generator=generator).to(device), rowwise=True, columnwise=True)
        for key, shape in tensors.items()
    }
    a_name, b_name, a_columnwise, b_columnwise = LAYOUTS[layout]
    a, b = quantized[a_name], quantized[b_name]
    bias = torch.randn(tensors[b_name][1 if b_columnwise else 0], generator=generator).to(device)
    arguments = (
        *ops._operand_arguments(a, a_columnwise), *ops._operand_arguments(b, b_columnwise), torch.float32, bias
    )  # fmt: skip
    torch.library.opcheck(torch.ops.shardbridge.scaled_mm.default, arguments)
    expected = gemm.scaled_mm(
        a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=torch.float32, bias=bias
    )
    assert torch.equal(torch.ops.shardbridge.scaled_mm.default(*arguments), expected)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_ops_pass_opcheck_and_return_the_kernel_results(rms, device):
    generator = torch.Generator().manual_seed(2)
    x, dy = (torch.randn(2, 24, 96, generator=generator).to(device) for _ in range(2))
    weight, bias = (torch.randn(96, generator=generator).to(device) for _ in range(2))
    arguments = (x, weight, None if rms else bias, rms, 1e-5, True)
    torch.library.opcheck(torch.ops.shardbridge.norm_forward.default, arguments)
    out, mean, rstd = torch.ops.shardbridge.norm_forward.default(*arguments)
    forward = (norm.rms_norm_forward(x, weight, zero_centered_gamma=True) if rms else
               norm.layer_norm_forward(x, weight, bias, zero_centered_gamma=True))  # fmt: skip
    assert torch.equal(out, forward.out) and torch.equal(rstd, forward.rstd)
    assert mean.numel() == 0 if rms else torch.equal(mean, forward.mean)
    backward_arguments = (dy, x, weight, None if rms else mean, rstd, True)
    torch.library.opcheck(torch.ops.shardbridge.norm_backward.default, backward_arguments)
    dx, dweight, dbias = torch.ops.shardbridge.norm_backward.default(*backward_arguments)
    grads = (norm.rms_norm_backward(dy, x, weight, rstd, zero_centered_gamma=True) if rms else
             norm.layer_norm_backward(dy, x, weight, mean, rstd, zero_centered_gamma=True))  # fmt: skip
    assert torch.equal(dx, grads.dx) and torch.equal(dweight, grads.dweight)
    assert dbias.numel() == 0 if rms else torch.equal(dbias, grads.dbias)


def test_split_quantize_and_grouped_gemm_ops_pass_opcheck_and_return_the_kernel_results(device):
    """GroupedLinear's ops: the split cast of x's row groups (one empty), then the fprop of the live groups."""
    generator = torch.Generator().manual_seed(3)
    x, splits = torch.randn(96, 64, generator=generator).to(device), [32, 0, 64]
    kernels = ops.implementation(backend_for(device))
    arguments = (x, splits, "e4m3", None, None, False, 0.0, True, True, "")
    torch.library.opcheck(torch.ops.shardbridge.quantize_tensorwise_split.default, arguments)
    outputs = torch.ops.shardbridge.quantize_tensorwise_split.default(*arguments)
    groups = kernels.quantize_tensorwise_split(x, splits, rowwise=True, columnwise=True)
    buffers = ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv", "amax")
    assert len(outputs) == len(buffers) * len(splits)
    for output, (g, buffer) in zip(outputs, [(g, b) for g in range(len(splits)) for b in buffers], strict=True):
        assert torch.equal(output, getattr(groups[g], buffer)), f"group {g} {buffer} differs"
    a = [groups[0], groups[2]]
    b = [kernels.quantize_tensorwise(torch.randn(48, 64, generator=generator).to(device)) for _ in a]
    bias = [torch.randn(48, generator=generator).to(device) for _ in a]
    gemm_arguments = (*ops._group_arguments(a, False), *ops._group_arguments(b, False), torch.float32, bias)
    torch.library.opcheck(torch.ops.shardbridge.grouped_scaled_mm.default, gemm_arguments)
    expected = grouped_gemm.grouped_scaled_mm(a, b, out_dtype=torch.float32, bias=bias)
    for result, wanted in zip(torch.ops.shardbridge.grouped_scaled_mm.default(*gemm_arguments), expected, strict=True):
        assert torch.equal(result, wanted)

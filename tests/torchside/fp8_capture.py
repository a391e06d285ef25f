"""Record what one FP8 step of a module really computed: every cast and every GEMM, by submodule.

`record_fp8_step(module)` wraps `Quantizer.quantize_storage` and the `scaled_mm` the modules call (the name
torchside.modules.functions imports) for the duration of a `with` block. It records, on the
module's device (the tensors are kept alive, so no buffer address is reused while recording):

- `Cast`: which FP8 submodule, role ("input", "weight", "grad") and GEMM slot it belongs to, the
  high-precision tensor the quantizer received, the kernel function and arguments it called, and the
  codes it produced;
- `Gemm`: the submodule and slot (found from the cast that produced its A operand), fprop / dgrad /
  wgrad, the provider fp8kernels.gemm dispatched it to (cuBLASLt, Triton, the interpreter or the
  reference), both operands as the GEMM read them and its output.

Used by the CUDA TransformerLayer check and benchmarks/diagnose_cuda_layer.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

import fp8kernels.gemm
import fp8kernels.reference
import torchside.modules.functions as functions
from fp8kernels._backend import Backend, backend_for
from fp8kernels.gemm_reference import gemm_operand, operand_values
from fp8kernels.reference import Quantized
from torchside.modules import FP8Module
from torchside.quantization.quantizer import Quantizer

CastKey = tuple[str, str, int]  # (submodule name, role, GEMM slot)


@dataclass
class Cast:
    key: CastKey
    x: Tensor  # what the quantizer received
    kernel: str  # the fp8kernels.reference / fp8kernels.quantize function it called
    kwargs: dict  # that call's arguments (tensors cloned when called: delayed scales change later)
    q: Quantized

    def reference(self) -> Quantized:
        """fp8kernels.reference's cast of the same input with the same arguments, on the same device."""
        return getattr(fp8kernels.reference, self.kernel)(self.x, **self.kwargs)


@dataclass
class Gemm:
    key: CastKey  # the cast of its A operand: (submodule, "input" for fprop else "grad", slot)
    role: str  # "fprop" | "dgrad" | "wgrad"
    provider: str  # "cublaslt" | "dequantize" | "triton" (fp8kernels.gemm.cuda_path) | "interpreter" | "reference"
    a: Quantized
    b: Quantized
    a_columnwise: bool
    b_columnwise: bool
    bias: Tensor | None
    out: Tensor

    def float64(self) -> tuple[Tensor, Tensor]:
        """(A @ B^T + bias, |A| @ |B|^T) in float64 from the operands the GEMM read, on the CPU."""
        a = operand_values(self.a, self.a_columnwise).double().cpu()
        b = operand_values(self.b, self.b_columnwise).double().cpu()
        exact = a @ b.T
        if self.bias is not None:
            exact = exact + self.bias.double().cpu()
        return exact, a.abs() @ b.abs().T


@dataclass
class Recording:
    casts: dict[CastKey, Cast] = field(default_factory=dict)
    gemms: list[Gemm] = field(default_factory=list)


def _cast_keys(module: nn.Module) -> dict[int, CastKey]:
    """id(quantizer) -> key for the quantizers the FP8 submodules hold now (built by their forward)."""
    keys = {}
    for name, child in module.named_modules():
        cached = getattr(child, "_quantizer_cache", None) if isinstance(child, FP8Module) else None
        if cached is None:
            continue
        forward_q, backward_q = cached[2]
        for slot, q in enumerate(forward_q):
            keys[id(q)] = (name, ("input", "weight")[slot % 2], slot // 2)
        for slot, q in enumerate(backward_q):
            keys[id(q)] = (name, "grad", slot)
    return keys


def _provider(a: Quantized, b: Quantized, a_columnwise: bool, b_columnwise: bool, out_dtype, bias) -> str:
    """Where fp8kernels.gemm.scaled_mm sent this GEMM (asked after the call: a refused cuBLASLt case is remembered)."""
    a_op, b_op = gemm_operand(a, a_columnwise, "a"), gemm_operand(b, b_columnwise, "b")
    backend = backend_for(a_op.data.device)
    if backend is not Backend.TRITON:
        return backend.name.lower()
    return fp8kernels.gemm.cuda_path(a_op, b_op, out_dtype, bias)


def _cloned(kwargs: dict) -> dict:
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in kwargs.items()}


@contextlib.contextmanager
def record_fp8_step(module: nn.Module) -> Iterator[Recording]:
    """Record every cast and GEMM of `module`'s FP8 submodules inside the block (module docstring)."""
    recording = Recording()
    original_quantize, original_kernel_call, original_scaled_mm = (
        Quantizer.quantize_storage, Quantizer.kernel_call, functions.scaled_mm
    )  # fmt: skip
    calls: list[tuple[str, dict]] = []
    buffer_owner: dict[int, CastKey] = {}  # data_ptr of a rowwise or columnwise copy -> its cast

    def kernel_call(self, *args, **kw):
        name, kwargs = original_kernel_call(self, *args, **kw)
        calls.append((name, _cloned(kwargs)))
        return name, kwargs

    def quantize(self, x, *args, **kw):
        result = original_quantize(self, x, *args, **kw)
        key = _cast_keys(module).get(id(self))
        if key is not None:
            q = result.to_quantized()
            kernel, kwargs = calls[-1]
            recording.casts[key] = Cast(key, x.detach().clone(), kernel, kwargs, q)
            for copy in (q.data, q.columnwise_data):
                if copy is not None:
                    buffer_owner[copy.data_ptr()] = key
        return result

    def scaled_mm(a, b, *, a_columnwise=False, b_columnwise=False, out_dtype=torch.bfloat16, bias=None):
        out = original_scaled_mm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype,
                                 bias=bias)  # fmt: skip
        a_copy = a.columnwise_data if a_columnwise else a.data
        role = "wgrad" if a_columnwise else "dgrad" if b_columnwise else "fprop"
        provider = _provider(a, b, a_columnwise, b_columnwise, out_dtype, bias)
        recording.gemms.append(
            Gemm(buffer_owner.get(a_copy.data_ptr(), ("?", "?", -1)), role, provider, a, b, a_columnwise,
                 b_columnwise, None if bias is None else bias.detach().clone(), out.detach().clone())
        )  # fmt: skip
        return out

    Quantizer.kernel_call, Quantizer.quantize_storage, functions.scaled_mm = kernel_call, quantize, scaled_mm
    try:
        yield recording
    finally:
        Quantizer.kernel_call, Quantizer.quantize_storage = original_kernel_call, original_quantize
        functions.scaled_mm = original_scaled_mm


def on_cpu(q: Quantized) -> Quantized:
    """A copy of q with every tensor on the CPU (the float64 model's device)."""
    return dataclasses.replace(
        q, **{f.name: getattr(q, f.name).cpu() for f in dataclasses.fields(q) if isinstance(getattr(q, f.name), Tensor)}
    )


__all__ = ["Cast", "CastKey", "Gemm", "Recording", "on_cpu", "record_fp8_step"]

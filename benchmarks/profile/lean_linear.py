"""The host floor of an eager FP8 Linear written in Python (issue 32: can eager current scaling reach 0.8x bf16?).

A current-scaling Linear's forward + backward, stripped to what any Python design must issue: per
operand (x, w, dy) one zeroed amax word, the two FP8 copies and a scale (three allocations), the amax
launch and the cast launch (fp8kernels._quantize_kernels, the same bytes as fp8kernels.quantize), then three
torch._scaled_mm. No validation, no result objects, one autograd.Function. The launches go through
Triton's JIT front end ("lean, JIT") or straight to the cached CompiledKernel ("lean, cached").

Measured against torch's own bf16 F.linear and torchside.Linear (off, current), per fwd + bwd, host
microseconds (calls back to back, benchmarks.harness.host_us). The last lines project a 125M Llama
step (48 Linears, 12 layers x qkv, proj, fc1, fc2): FP8 current >= 0.8x bf16 eager needs the FP8 step's
host time <= bf16's / 0.8, i.e. the FP8 additions <= a quarter of bf16's step host time.

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/profile/lean_linear.py [--bf16-step-ms 58.9]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from benchmarks.harness import environment_line, host_us
from benchmarks.profile.launch_cost import linear_host_us
from bridge.numerics import relative_error
from fp8kernels import quantize as kq
from fp8kernels._casts import format_constants
from fp8kernels.formats import TORCH_DTYPES
from twinspec.formats import FORMATS
from torchside.modules import Linear


class LeanCast:
    """Current scaling of one [M, K] shape into rowwise + columnwise FP8: two launches, three allocations."""

    def __init__(self, M: int, K: int, fmt: str, cached: bool):
        self.M, self.K, self.fmt, self.cached = M, K, fmt, cached
        (self.amax_kernel, (amax_config, *_), _), (self.cast_kernel, (cast_config, *_), _) = (
            kq._KERNELS["amax"],
            kq._KERNELS["tensorwise"],
        )
        self.amax_meta = dict(HADAMARD=False, **amax_config)
        self.cast_meta = dict(
            **format_constants(fmt), FMAX=FORMATS[fmt].max, POWER_2=False, EPSILON=0.0, GIVEN="", SPLIT=False,
            ROW_UNIT=1, SCALE_STRIDE=1, ROWWISE=True, COLUMNWISE=True, PACK4=M % 4 == 0, HARDWARE_CAST=True,
            **cast_config,
        )  # fmt: skip
        grid = lambda config: (triton.cdiv(M, config["BLOCK_M"]), triton.cdiv(K, config["BLOCK_K"]))  # noqa: E731
        self.amax_grid, self.cast_grid = grid(amax_config), grid(cast_config)
        self.amax_runner = self.cast_runner = None
        # the cached launcher takes every kernel argument in signature order, constexprs included
        self.amax_constants = self._ordered(self.amax_kernel, self.amax_meta)
        self.cast_constants = self._ordered(self.cast_kernel, self.cast_meta)

    def _arguments(self, x, data, columnwise, scale_inv, amax_bits):
        amax = (x, amax_bits, self.M, self.K, x.stride(0), x.stride(1))
        cast = (x, data, columnwise, scale_inv, amax_bits, scale_inv, scale_inv, amax_bits, 1, *amax[2:])
        return amax, cast

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        amax_bits = torch.zeros(1, dtype=torch.int32, device=x.device)
        data = torch.empty((self.M, self.K), dtype=torch.uint8, device=x.device)
        columnwise = torch.empty((self.K, self.M), dtype=torch.uint8, device=x.device)
        scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
        amax_args, cast_args = self._arguments(x, data, columnwise, scale_inv, amax_bits)
        if self.amax_runner is None or not self.cached:  # the JIT front end (compiles on the first call)
            amax_compiled = self.amax_kernel[self.amax_grid](*amax_args, **self.amax_meta)
            cast_compiled = self.cast_kernel[self.cast_grid](*cast_args, **self.cast_meta)
            self.amax_runner = amax_compiled[(*self.amax_grid, 1)]
            self.cast_runner = cast_compiled[(*self.cast_grid, 1)]
        else:
            self.amax_runner(*amax_args, *self.amax_constants)
            self.cast_runner(*cast_args, *self.cast_constants)
        dtype = TORCH_DTYPES[self.fmt]
        return data.view(dtype), columnwise.view(dtype), scale_inv

    @staticmethod
    def _ordered(kernel, meta: dict) -> tuple:
        """The constexpr arguments in signature order (launch options such as num_warps are not arguments)."""
        return tuple(meta[name] for name in kernel.arg_names if name in meta)


class _LeanFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, casts):
        x_cast, w_cast, dy_cast = casts
        x_fp8, x_t, x_scale = x_cast(x)
        w_fp8, w_t, w_scale = w_cast(weight)
        y = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
        ctx.saved = (x_t, x_scale, w_t, w_scale, dy_cast)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_t, x_scale, w_t, w_scale, dy_cast = ctx.saved
        dy_fp8, dy_t, dy_scale = dy_cast(dy)
        dx = torch._scaled_mm(dy_fp8, w_t.t(), scale_a=dy_scale, scale_b=w_scale, out_dtype=dy.dtype)
        dw = torch._scaled_mm(dy_t, x_t.t(), scale_a=dy_scale, scale_b=x_scale, out_dtype=dy.dtype)
        return dx, dw, None


class _PassThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument(
        "--bf16-step-ms", type=float, default=58.9,
        help="host ms of the bf16 125M step (profile_step.py, RESULTS 2026-12-03 04:40)",
    )  # fmt: skip
    parser.add_argument("--linears", type=int, default=48, help="FP8 Linears a step (12 layers x 4 GEMMs)")
    args = parser.parse_args()
    print(f"# lean_linear, {environment_line()}")
    T, H = args.tokens, args.hidden
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(H, H, device="cuda", dtype=torch.bfloat16) * H**-0.5)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # cuBLAS handles and workspaces: not part of any row
        F.linear(x, w).backward(dy)
    rows = [("torch F.linear bf16", host_us(lambda: F.linear(x, w).backward(dy), calls=200))]
    pieces = []
    for cached in (False, True):
        casts = (LeanCast(T, H, "e4m3", cached), LeanCast(H, H, "e4m3", cached), LeanCast(T, H, "e5m2", cached))
        y = _LeanFP8Linear.apply(x, w, casts)
        ref = F.linear(x.float(), w.float())
        error = relative_error(y, ref)  # the lean path computes the same product
        how = "cached CompiledKernel" if cached else "JIT front end"
        rows.append((f"lean FP8 current, {how} (rel err {error:.3f})",
                     host_us(lambda: _LeanFP8Linear.apply(x, w, casts).backward(dy), calls=200)))  # fmt: skip
        pieces.append((f"lean cast (zeros, 3 x empty, 2 launches), {how}", host_us(lambda: casts[0](x), calls=200)))
    fp8_x, fp8_wt, one = (
        x.detach().to(torch.float8_e4m3fn),
        w.detach().to(torch.float8_e4m3fn).t(),
        dy.new_ones((), dtype=torch.float32),
    )
    pieces += [
        ("torch.zeros(1)", host_us(lambda: torch.zeros(1, device="cuda"), calls=200)),
        ("torch.empty(T, H) uint8", host_us(lambda: torch.empty(T, H, dtype=torch.uint8, device="cuda"), calls=200)),
        ("torch._scaled_mm", host_us(lambda: torch._scaled_mm(fp8_x, fp8_wt, one, one, out_dtype=x.dtype), calls=200)),
        ("autograd.Function pass-through fwd + bwd", host_us(lambda: _PassThrough.apply(x).backward(dy), calls=200)),
    ]
    linear = Linear(H, H, params_dtype=torch.bfloat16, device="cuda")
    for recipe_name in ("off", "current"):
        rows.append((f"torchside.Linear {recipe_name}", linear_host_us(linear, x, dy, recipe_name, calls=100)))
    width = max(len(name) for name, _ in rows + pieces)
    print(f"{'piece':<{width}}  host us")
    for name, us in pieces:
        print(f"{name:<{width}}  {us:8.1f}")
    print(f"\nLinear {H} -> {H}, {T} tokens, fwd + bwd")
    print(f"{'call':<{width}}  host us")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.1f}")
    budget = args.bf16_step_ms * (1 / 0.8 - 1)
    bf16 = rows[0][1]
    print(f"\n125M step projection: FP8 may add {budget:.1f} ms of host to the bf16 step ({args.bf16_step_ms} ms)")
    for name, us in rows[1:]:
        extra = (us - bf16) * args.linears / 1000
        share = extra / budget
        print(f"  {name:<{width}}  adds {extra:6.1f} ms over {args.linears} bf16 F.linear ({share:.2f}x budget)")


if __name__ == "__main__":
    main()

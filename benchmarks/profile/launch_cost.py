"""Host microseconds per call of the pieces an eager FP8 step is made of (issue 32: where the host time goes).

Each row is benchmarks.harness.host_us: calls issued back to back, no synchronization inside, so the
figure is what the host pays to issue the call (the GPU runs far behind on these small tensors). The
shapes are the ~125M Llama's (4096 tokens x hidden 768). Rows: a torch allocation and an eager op (the
unit everything else is counted in); a trivial Triton kernel and one with our cast's dozen constexprs,
each through Triton's JIT front end and through the CompiledKernel it returns (what a launch costs
without the binder and cache lookup); our amax launch; fp8kernels.quantize's current-scaling cast; the
Quantizer call the modules make per recipe; torch._scaled_mm; a Linear's forward + backward per recipe.

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/profile/launch_cost.py
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.harness import environment_line, host_us
from fp8kernels import quantize as kq
from torchside.autocast import fp8_autocast
from torchside.modules import Linear
from torchside.quantization.quantizer import Quantizer, local_amax
from torchside.recipe import recipe_from_name


@triton.jit
def _scale_kernel(x, y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offsets, tl.load(x + offsets, mask=offsets < n) * 2, mask=offsets < n)


@triton.jit
def _scale_kernel_many_constexprs(
    x, y, n, BLOCK: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
    E: tl.constexpr, F: tl.constexpr, G: tl.constexpr, H: tl.constexpr, P: tl.constexpr, J: tl.constexpr,
    K: tl.constexpr, L: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale = 2 if A else 1
    tl.store(y + offsets, tl.load(x + offsets, mask=offsets < n) * scale, mask=offsets < n)


def _launch_rows(x: torch.Tensor, y: torch.Tensor) -> list[tuple[str, float]]:
    n = x.numel()
    grid = (triton.cdiv(n, 1024),)
    many = dict(A=True, B=False, C=1.0, D="x", E=4, F=True, G=False, H=448.0, P=0, J=True, K=False, L=16)
    rows = []
    kernels = (("1 constexpr", _scale_kernel, {}), ("12 constexprs", _scale_kernel_many_constexprs, many))
    for name, kernel, constexprs in kernels:
        compiled = kernel[grid](x, y, n, BLOCK=1024, **constexprs)  # compiles; returns the CompiledKernel
        jit_us = host_us(lambda: kernel[grid](x, y, n, BLOCK=1024, **constexprs))
        rows.append((f"Triton launch, {name}, JIT front end", jit_us))
        runner = compiled[(grid[0], 1, 1)]
        values = (x, y, n, 1024, *constexprs.values())  # the launcher takes every argument, constexprs too
        try:
            runner(*values)
            torch.cuda.synchronize()
            equal = torch.equal(y, x * 2)  # both kernels double x (A=True)
            cached_us = host_us(lambda: runner(*values))
            rows.append((f"Triton launch, {name}, cached CompiledKernel (same output: {equal})", cached_us))
        except Exception as error:  # this Triton's launcher wants other arguments: report, go on
            failed = f"{type(error).__name__}: {error}"
            rows.append((f"Triton launch, {name}, cached CompiledKernel: {failed}", float("nan")))
    return rows


def linear_host_us(linear: Linear, x: torch.Tensor, dy: torch.Tensor, recipe_name: str, calls: int = 50) -> float:
    """Host us of a torchside module's forward + backward under recipe `recipe_name` ("off": FP8 disabled)."""
    recipe = None if recipe_name == "off" else recipe_from_name(recipe_name)

    def step():
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            out = linear(x)
        out.backward(dy)

    return host_us(step, calls=calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()
    print(f"# launch_cost, {environment_line()}")
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    w = torch.randn(args.hidden, args.hidden, device="cuda", dtype=torch.bfloat16)
    fp8_x, fp8_wt = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    rows = [
        ("torch.empty (4096 x 768 uint8)", host_us(lambda: torch.empty(x.shape, dtype=torch.uint8, device="cuda"))),
        ("torch eager op (torch.mul out=)", host_us(lambda: torch.mul(x, 2, out=y))),
        ("local_amax (torch inf-norm)", host_us(lambda: local_amax(x))),
        *_launch_rows(x, y),
        ("fp8kernels.quantize._launch('amax')", host_us(lambda: kq._global_amax(x, hadamard=False))),
        ("fp8kernels.quantize.quantize_tensorwise (amax + cast)", host_us(lambda: kq.quantize_tensorwise(x))),
        ("  the same, amax by torch (local_amax)", host_us(lambda: kq.quantize_tensorwise(x, amax=local_amax(x)))),
        ("torch._scaled_mm tensorwise", host_us(lambda: torch._scaled_mm(fp8_x, fp8_wt, one, one, out_dtype=x.dtype))),
    ]
    for recipe_name in ("current", "delayed", "block"):
        quantizer = Quantizer(recipe_from_name(recipe_name), "input", device="cuda")
        us = host_us(lambda: quantizer.quantize_storage(x))
        rows.append((f"Quantizer({recipe_name}).quantize_storage, rowwise + columnwise", us))
    linear = Linear(args.hidden, args.hidden, params_dtype=torch.bfloat16, device="cuda")
    xg = x.detach().requires_grad_()
    for recipe_name in ("off", "current", "delayed", "block"):
        rows.append((f"Linear {args.hidden} fwd + bwd, {recipe_name}", linear_host_us(linear, xg, x, recipe_name)))
    width = max(len(name) for name, _ in rows)
    print(f"{'call':<{width}}  host us")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.1f}")


if __name__ == "__main__":
    main()

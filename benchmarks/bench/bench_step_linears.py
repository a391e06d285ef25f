"""Benchmark: the device time of each Linear of a Llama block (forward + backward), bf16 against FP8 recipes.

The per-GEMM floor of issue 32: with the host out of the step (CUDA graphs), FP8 can only win what its
three GEMMs save over bf16's, minus its casts (amax, scale, rowwise and columnwise copies of the input,
weight and grad). Each row times one torchside.modules.Linear [T, K] -> [T, N] step, forward and backward
(fprop, dgrad, wgrad), captured in a CUDA graph (benchmarks.harness.device_ms: no host time), for the GEMM
shapes of the config's block: qkv, attention output, fc1 (SwiGLU: 2 x ffn), fc2. T = batch x sequence.
Floor: the three GEMMs' 6 * T * K * N flop at the bf16 or FP8 peak. Peer: bf16's Linear of the same shape.
The "layer" rows sum the four shapes.

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/bench/bench_step_linears.py [--configs 125m,1b]
"""

from __future__ import annotations

import torch

from benchmarks.harness import PEAK_FLOPS, Result, argument_parser, device_ms, report
from torchside.autocast import fp8_autocast
from torchside.models.llama import LLAMA_CONFIGS
from torchside.modules import Linear
from torchside.recipe import recipe_from_name, recipe_names


def block_shapes(config: str) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of each Linear GEMM of one block of the Llama config."""
    c = LLAMA_CONFIGS[config]
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return {
        "qkv": (c.hidden_size, qkv),
        "proj": (c.num_heads * c.head_dim, c.hidden_size),
        "fc1": (c.hidden_size, 2 * c.ffn_hidden_size),
        "fc2": (c.ffn_hidden_size, c.hidden_size),
    }


def linear_step_ms(k: int, n: int, tokens: int, recipe_name: str) -> float:
    """Median device ms of Linear(k, n) forward + backward on [tokens, k] bf16 under the recipe (off: bf16)."""
    torch.manual_seed(0)
    linear = Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    grad = torch.randn(tokens, n, dtype=torch.bfloat16, device="cuda")
    recipe = recipe_from_name(recipe_name)

    def step() -> None:
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = linear(x)
        y.backward(grad)

    step()  # compile and autotune outside the capture
    return device_ms(step)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--configs", default="125m")
    parser.add_argument("--recipes", default="off,current,block")
    parser.add_argument("--tokens", type=int, default=8 * 512, help="batch x sequence")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    if set(recipes) - set(recipe_names()) or set(args.configs.split(",")) - set(LLAMA_CONFIGS):
        parser.error(f"--recipes from {', '.join(recipe_names())}; --configs from {', '.join(LLAMA_CONFIGS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_linears needs a CUDA device")
    rows = []
    for config in args.configs.split(","):
        totals = dict.fromkeys(recipes, 0.0)
        layer_flop = 0
        for name, (k, n) in block_shapes(config).items():
            flop = 6 * args.tokens * k * n
            layer_flop += flop
            times = {recipe: linear_step_ms(k, n, args.tokens, recipe) for recipe in recipes}
            for recipe, ms in times.items():
                totals[recipe] += ms
                peak = PEAK_FLOPS["bf16" if recipe == "off" else "fp8"]
                rows.append(Result(f"{config} {name} {k}->{n} T={args.tokens}", ms, flop / peak * 1e3,
                                   provider="bf16" if recipe == "off" else recipe,
                                   peer=times.get("off") if recipe != "off" else None,
                                   peer_name="bf16" if recipe != "off" else ""))  # fmt: skip
        for recipe, ms in totals.items():
            peak = PEAK_FLOPS["bf16" if recipe == "off" else "fp8"]
            rows.append(Result(f"{config} layer (4 Linears)", ms, layer_flop / peak * 1e3,
                               provider="bf16" if recipe == "off" else recipe,
                               peer=totals.get("off") if recipe != "off" else None,
                               peer_name="bf16" if recipe != "off" else ""))  # fmt: skip
    report("bench_step_linears", rows, args.json)


if __name__ == "__main__":
    main()

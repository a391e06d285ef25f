"""bridge.compare at depth: a random Llama in torch and its JAX twin, faithful and with one planted difference.

Issue 44's question: does the verdict stay quiet on a correct model at real depth (false alarms over
seeds) and name the one block whose implementation differs (misses)? Each seed builds both twins
with random weights (compare copies torch's into JAX), feeds `--batch` x `--seq` random tokens and
runs `bridge.compare` under each recipe; then the JAX twin's block `--plant` gets one test-only change of
that instance (`--plant-kind`: its MLP's RMSNorm epsilon x10, or its activation swiglu -> geglu) and the
same check must fail naming that block.

Usage (repository root): PYTHONPATH=. python3 benchmarks/diagnose/compare_llama_depth.py
    [--config 1b] [--vocab 128256] [--layers 16] [--recipes off,current] [--seeds 3] [--plant 9] [--plant-kind eps,activation] [--device cuda]
"""

from __future__ import annotations

import dataclasses
import time

from benchmarks.harness import argument_parser

DTYPES = ("bf16", "fp32")
PLANT_KINDS = ("eps", "activation")


def build(args, seed: int):
    """(torch Llama, JAX Llama, tokens) of one seed, both in --dtype."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from jaxside.models.llama import Llama as JaxLlama
    from torchside.models.llama import Llama as TorchLlama
    from twinspec.llama import LLAMA_CONFIGS

    config = dataclasses.replace(LLAMA_CONFIGS[args.config], vocab_size=args.vocab, num_layers=args.layers)
    torch.manual_seed(seed)
    torch_dtype, jax_dtype = (torch.bfloat16, jnp.bfloat16) if args.dtype == "bf16" else (torch.float32, jnp.float32)
    torch_model = TorchLlama(config, params_dtype=torch_dtype, device=args.device)
    jax_model = JaxLlama(config, params_dtype=jax_dtype, rngs=nnx.Rngs(seed))
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    return torch_model, jax_model, tokens


def plant(jax_model, block: int, kind: str) -> str:
    """One change of block `block`'s MLP in the JAX twin only; what was changed."""
    mlp = jax_model.layers[block].layernorm_mlp
    if kind == "eps":
        mlp.norm = dataclasses.replace(mlp.norm, eps=mlp.norm.eps * 10)
        return f"layers.{block}.layernorm_mlp eps x10"
    mlp.activation = "geglu"
    return f"layers.{block}.layernorm_mlp swiglu->geglu"


def check(torch_model, jax_model, tokens, recipe: str) -> tuple[bool, str, float]:
    """(passed, first divergence or '-', seconds) of one bridge.compare."""
    import bridge

    started = time.perf_counter()
    report = bridge.compare(torch_model, jax_model, tokens, recipe=recipe)
    first = report.first_divergence
    where = "-" if first is None else f"{first.name} ({first.stage})"
    return report.passed, where, time.perf_counter() - started


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--config", default="1b", help="a twinspec.llama.LLAMA_CONFIGS name (default 1b)")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary size (default Llama 3's 128256)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--recipes", default="off,current", help="comma-separated recipe names")
    parser.add_argument("--seeds", type=int, default=3, help="faithful seeds per recipe (the first also plants)")
    parser.add_argument("--plant", type=int, default=9, help="the JAX block whose norm epsilon differs")
    parser.add_argument("--plant-kind", default="eps,activation", help="comma-separated: eps, activation")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if not 0 <= args.plant < args.layers:
        parser.error(f"--plant {args.plant}: pick a block in 0..{args.layers - 1}")
    if unknown := set(args.plant_kind.split(",")) - set(PLANT_KINDS):
        parser.error(f"--plant-kind {','.join(sorted(unknown))}: use {', '.join(PLANT_KINDS)}")
    print("| recipe | seed | model | passed | first divergence | s |\n|---|---|---|---|---|---|", flush=True)
    for recipe in args.recipes.split(","):
        for seed in range(args.seeds):
            passed, where, seconds = check(*build(args, seed), recipe)
            print(f"| {recipe} | {seed} | faithful | {passed} | {where} | {seconds:.1f} |", flush=True)
        for kind in args.plant_kind.split(","):
            torch_model, jax_model, tokens = build(args, 0)
            name = plant(jax_model, args.plant, kind)
            passed, where, seconds = check(torch_model, jax_model, tokens, recipe)
            print(f"| {recipe} | 0 | {name} | {passed} | {where} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()

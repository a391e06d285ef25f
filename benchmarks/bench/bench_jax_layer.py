"""Benchmark: the jaxside TransformerLayer training step under jax.jit: FP8 off, current and block scaling.

Issue 9: the compiled step must really run its projections' GEMMs in FP8 (counted in the optimized
HLO with jaxside.hlo: 4 projections x (fprop, dgrad, wgrad) = 12 FP8 GEMMs; attention's score and
value products stay in high precision) and is timed against the twin with FP8 off and against the
peer: the same layer in plain jnp with bf16 GEMMs at XLA's default precision, attention by JAX's
default (XLA) and by cuDNN's fused kernel (the twin's on a GPU; the peer of the ratios).
Llama-3-8B's layer: hidden 4096, 32 heads, 8 KV groups, ffn 14336, SwiGLU, RMSNorm, no bias, causal;
seq 2048 x batch 4 (8192 tokens: the torch benchmark's count), bf16 parameters and activations.
Floor: the projections' GEMM flops (2 * T * in * out, x3 for forward + backward) at the GEMM peak
(bf16 788 TFLOP/s, FP8 1425, benchmarks/harness.py) plus attention's (4 * B * S^2 * N * D, causal halves it, x3)
at the bf16 peak.

Run on a CUDA machine:  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/bench/bench_jax_layer.py
(the twin's steps compile with jaxside.xla_options, the peer with XLA's defaults: with XLA's Triton GEMMs on,
the H200 spent over 260 s compiling the FP8 step, 6 s with them off)
(add `--compile-cache /tmp/jax-cache` so that a second run in the same machine session skips compiling).
Times: benchmarks.harness.wall_ms of the compiled step up to jax.block_until_ready, after one warm call.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.harness import PEAK_TFLOPS, Result, argument_parser, report, wall_ms
from jaxside import xla_options
from jaxside.hlo import fp8_gemm_count
from jaxside.modules import ModuleConfig, TransformerConfig, TransformerLayer, fp8_autocast
from twinspec.recipe import Float8BlockScaling, Float8CurrentScaling


def build_step(args, recipe):
    """The jitted step (loss and grads of parameters and input) and its arguments."""
    config = TransformerConfig(
        normalization="RMSNorm", activation="swiglu", bias=False, qkv_format="bshd", module_config=ModuleConfig()
    )
    layer = TransformerLayer(
        args.hidden, args.ffn, args.heads, num_gqa_groups=args.groups, params_dtype=jnp.bfloat16, config=config,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    keys = jax.random.split(jax.random.key(1))
    x = jax.random.normal(keys[0], (args.batch, args.seq, args.hidden), jnp.bfloat16)
    dy = jax.random.normal(keys[1], x.shape, jnp.float32)

    def step(params, rest, x, dy):
        def loss(params, x):
            model = nnx.merge(graphdef, params, rest)
            with fp8_autocast(enabled=recipe is not None, recipe=recipe):
                y = model(x)
            return jnp.sum(y.astype(jnp.float32) * dy)

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    return xla_options.jit(step), (params, rest, x, dy)


def build_plain_step(args, attention: str = "cudnn"):
    """The peer: the same layer in plain jnp, bf16 GEMMs at XLA's default precision (the tensor cores),
    attention by jax.nn.dot_product_attention's `attention` implementation ("xla" is JAX's default,
    "cudnn" the fused flash kernel a JAX user asks for, and the twin's on a GPU).

    The twin's FP8-off GEMMs ask precision=HIGHEST (fp32 accumulation, the numerics contract with torch),
    which is not the bf16 step a JAX user would time against.
    """
    heads, groups, head_dim = args.heads, args.groups, args.hidden // args.heads
    keys = jax.random.split(jax.random.key(2), 6)
    shapes = {"qkv": (args.hidden, (heads + 2 * groups) * head_dim), "proj": (heads * head_dim, args.hidden),
              "fc1": (args.hidden, 2 * args.ffn), "fc2": (args.ffn, args.hidden)}  # fmt: skip
    params = {n: (0.02 * jax.random.normal(k, shape)).astype(jnp.bfloat16) for (n, shape), k in zip(shapes.items(), keys)}
    params |= {"norm1": jnp.ones(args.hidden, jnp.bfloat16), "norm2": jnp.ones(args.hidden, jnp.bfloat16)}
    x = jax.random.normal(keys[4], (args.batch, args.seq, args.hidden), jnp.bfloat16)
    dy = jax.random.normal(keys[5], x.shape, jnp.float32)
    half = head_dim // 2
    angles = jnp.arange(args.seq)[:, None] / 10000.0 ** (jnp.arange(half) / half)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]

    def rms_norm(t, weight):
        t32 = t.astype(jnp.float32)
        return (t32 * jax.lax.rsqrt(jnp.mean(t32 * t32, axis=-1, keepdims=True) + 1e-5) * weight).astype(t.dtype)

    def rope(t):
        first, second = t[..., :half], t[..., half:]
        return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1).astype(t.dtype)

    def layer(p, x):
        batch, seq, _ = x.shape
        q, k, v = jnp.split(rms_norm(x, p["norm1"]) @ p["qkv"], [heads * head_dim, (heads + groups) * head_dim], -1)
        q, k = rope(q.reshape(batch, seq, heads, head_dim)), rope(k.reshape(batch, seq, groups, head_dim))
        attended = jax.nn.dot_product_attention(q, k, v.reshape(k.shape), is_causal=True, implementation=attention)
        x = x + attended.reshape(batch, seq, -1) @ p["proj"]
        gate, up = jnp.split(rms_norm(x, p["norm2"]) @ p["fc1"], 2, -1)
        return x + (jax.nn.silu(gate) * up) @ p["fc2"]

    def step(p, x, dy):
        return jax.value_and_grad(lambda p, x: jnp.sum(layer(p, x).astype(jnp.float32) * dy), argnums=(0, 1))(p, x)

    return jax.jit(step), (params, x, dy)  # (XLA's default options: what plain JAX gets)


def compile_step(name: str, step, arguments):
    """The compiled step, its trace and compile times printed as they end (the H200 run once spent 60 s compiling)."""
    start = time.perf_counter()
    lowered = step.lower(*arguments)
    traced = time.perf_counter()
    print(f"{name}: traced in {traced - start:.1f} s ({len(lowered.as_text()) / 1e3:.0f} kB of StableHLO)", flush=True)
    compiled = lowered.compile()
    print(f"{name}: compiled in {time.perf_counter() - traced:.1f} s", flush=True)
    return compiled


def step_ms(compiled, arguments, repeats: int) -> float:
    """Median ms of the compiled step up to its results (one warm call first)."""
    return wall_ms(lambda: jax.block_until_ready(compiled(*arguments)), repeats=repeats)


def floor_ms(args, gemm_peak: float) -> float:
    tokens, head_dim = args.batch * args.seq, args.hidden // args.heads
    qkv_out = (args.heads + 2 * args.groups) * head_dim
    projections = 2 * tokens * args.hidden * (qkv_out + args.hidden + 2 * args.ffn + args.ffn) * 3
    attention = 4 * args.batch * args.seq**2 * args.heads * head_dim / 2 * 3
    return (projections / (gemm_peak * 1e12) + attention / (PEAK_TFLOPS["bf16"] * 1e12)) * 1e3


def main() -> None:
    parser = argument_parser(__doc__)
    for name, default in (("hidden", 4096), ("heads", 32), ("groups", 8), ("ffn", 14336), ("seq", 2048), ("batch", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile-cache", metavar="DIR", help="persistent compile cache (reruns skip compiling)")
    args = parser.parse_args()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    rows = []
    twins = (("twin, FP8 off", None, "bf16"), ("Float8CurrentScaling", Float8CurrentScaling(), "fp8"),
             ("Float8BlockScaling", Float8BlockScaling(), "fp8"))  # fmt: skip
    for name, recipe, peak in twins:
        step, arguments = build_step(args, recipe)
        compiled = compile_step(name, step, arguments)
        fp8, total = fp8_gemm_count(compiled.as_text())
        rows.append((name, step_ms(compiled, arguments, args.repeats), floor_ms(args, PEAK_TFLOPS[peak]), fp8, total))
    attentions = ("xla", "cudnn") if jax.default_backend() == "gpu" else ("xla",)  # (cuDNN: CUDA only)
    for attention in attentions:  # the peer is the last row: plain JAX with the twin's attention kernel
        name = f"plain JAX, bf16, {attention} attention"
        peer_step, peer_arguments = build_plain_step(args, attention)
        compiled = compile_step(name, peer_step, peer_arguments)
        rows.append((name, step_ms(compiled, peer_arguments, args.repeats), floor_ms(args, PEAK_TFLOPS["bf16"]),
                     *fp8_gemm_count(compiled.as_text())))  # fmt: skip
    peer_ms = rows[-1][1]
    results = [
        Result(name, ms, floor, peer=peer_ms, peer_name=rows[-1][0],
               extra={"FP8 GEMMs": fp8, "all GEMMs": total})
        for name, ms, floor, fp8, total in rows
    ]
    fp8_gemms = rows[1][3]
    title = (f"bench_jax_layer, TransformerLayer H={args.hidden} heads={args.heads}/{args.groups} F={args.ffn} swiglu, "
             f"seq {args.seq} x batch {args.batch}, bf16, forward + backward")  # fmt: skip
    report(title, results, args.json,
           [f"FP8 GEMMs in the compiled FP8 step: {fp8_gemms} (expected 12: 4 projections x fprop, dgrad, wgrad)"])  # fmt: skip
    if fp8_gemms != 12:
        raise SystemExit("the FP8 step does not run all 12 projection GEMMs in FP8")


if __name__ == "__main__":
    main()

"""Benchmark: JAX Llama training steps in tokens/s, the jaxside twin per recipe against plain-JAX bf16 (issue 46).

Rows (`--recipes`): `bf16` is the peer, a plain-JAX bf16 Llama written here with jnp ops (embedding,
RMSNorm, GQA attention with rotary embeddings through jax.nn.dot_product_attention, SwiGLU MLP, the
head tied or not as the config says, cross-entropy), its GEMMs bf16 at XLA's default precision and
its attention cuDNN's flash kernel on a GPU (XLA's elsewhere), as the twin's; every other name is the
twin, `jaxside.models.llama.Llama` in bf16 under `fp8_autocast` with that twinspec.recipe recipe
(`off`: FP8 off, its 16-bit GEMMs with fp32 accumulation by the numerics contract). Both start from the same weights: the peer's are the twin's, laid out as plain JAX
lays them out (`plain_params`).

A step is one jitted function: forward, mean next-token cross-entropy, gradients and an
`optax.adamw` update, the train state donated. Both rows use the same optax.adamw (moments in the
parameters' bf16), so the ratio compares the models; jaxside.optim.fused_adam (FusedAdam's
arithmetic, used by `shardbridge verify`) is not used: it fetches its fp32 step scalars from the host
every step. The twin's steps compile with jaxside.xla_options (as training with jaxside does), the
peer's with XLA's defaults (what plain JAX gets).

Times: "compile s" is tracing and compiling the step, "first call s" that and the first step; then `--warmup`
untimed steps and `--steps` timed ones (benchmarks.harness.wall_ms: the median of steps each waited
for with jax.block_until_ready). tokens/s = batch x seq / that median. "temp GiB" is the compiled
step's scratch memory (XLA's memory analysis); "FP8 GEMMs" (both operands FP8), "fp32 GEMMs" (an
fp32 operand: XLA's CPU backend upcasts every bf16 GEMM, so only a GPU's count says something) and
"GEMMs" are counted in its optimized HLO (jaxside.hlo); "loss" is the last timed step's (every row
trains the same model on the same batch, so the losses should be close).
Floor: the GEMM flops of the projections (6 x their parameters per token) at the bf16 or FP8 peak
(FP8 for every FP8 recipe), plus the head's (6 x D x V) and the causal attention's (6 x S x heads x
head dim per layer) per token at the bf16 peak (benchmarks/harness.py's H200 figures).

Run on a CUDA machine (from the repository root):
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/bench/bench_jax_train_step.py
On a CPU, as a check of the script: the same with `--configs tiny --batch 2 --seq 16 --steps 2`.
`--check` runs no timing: it compares the peer with the twin under FP8 off on the same weights and
batch (loss, logits and gradients) and exits 1 if they are further apart than bf16 explains.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import Array

from benchmarks.harness import PEAK_FLOPS, Result, argument_parser, report, wall_ms
from jaxside import xla_options
from jaxside.hlo import FP8_TYPES, gemm_operand_types
from jaxside.models.llama import Llama
from jaxside.modules import GRAD_FILTER, finish_backward, fp8_autocast
from twinspec.llama import LLAMA_CONFIGS, LlamaConfig
from twinspec.recipe import recipe_from_name, recipe_names

PEER = "bf16"  # the --recipes name of the plain-JAX row
DEFAULT_SHAPES = {"tiny": (2, 16), "125m": (8, 512), "1b": (8, 1024)}  # (batch, seq) when --batch / --seq are not given
LEARNING_RATE = 3e-4
# --check: every kernel drawn with std 1 / sqrt(hidden size), so that each nonlinearity works away from its linear
# range (at the configs' std 0.02 the attention is near uniform, whatever the rotation, and silu(gate) * up
# near gate * up / 2, whichever is which), and how far the bf16 peer may then be from the twin under FP8 off
# (fp32 GEMMs and attention) and still compute the same model.
CHECK_BOUNDS = {"loss": 1e-3, "logits": 3e-2, "grads": 5e-2}  # relative errors


# --- the peer: a plain-JAX bf16 Llama -------------------------------------------------------------------------
# Shape legend: B batch, S sequence, D hidden, N query heads, G key/value heads, H head dim, F ffn, V vocabulary.


def plain_params(config: LlamaConfig, twin: dict) -> dict:
    """The peer's parameters from the twin's (or its gradients from the twin's), as nnx.to_pure_dict gives them.

    The twin's fused QKV kernel groups its columns by key/value head (each group's N/G query heads, then
    its key head, then its value head) and fc1 interleaves gate and up columns in runs of glu_interleave;
    the peer's are [all queries | keys | values] and [gate | up]. Embedding [V, D] (the twin's is [D, Vp]).
    """
    if config.bias:
        raise ValueError("the plain peer has no biases: pick a config with bias=False")
    d, h, f, run = config.hidden_size, config.head_dim, config.ffn_hidden_size, config.glu_interleave
    groups, per_group = config.num_kv_heads, config.num_heads // config.num_kv_heads

    def qkv(kernel):
        grouped = kernel.reshape(d, groups, per_group + 2, h)
        parts = (grouped[:, :, :per_group], grouped[:, :, per_group], grouped[:, :, per_group + 1])
        return jnp.concatenate([part.reshape(d, -1) for part in parts], axis=1)

    def gate_up(kernel):
        runs = kernel.reshape(d, f // run, 2, run)
        return jnp.concatenate([runs[:, :, 0].reshape(d, f), runs[:, :, 1].reshape(d, f)], axis=1)

    def layer(twin_layer: dict) -> dict:
        attention, mlp = twin_layer["self_attention"], twin_layer["layernorm_mlp"]
        return {
            "attention_norm": attention["layernorm_qkv"]["layer_norm_weight"],
            "qkv": qkv(attention["layernorm_qkv"]["kernel"]),
            "out": attention["proj"]["kernel"],
            "mlp_norm": mlp["layer_norm_weight"],
            "gate_up": gate_up(mlp["fc1_kernel"]),
            "down": mlp["fc2_kernel"],
        }

    params = {
        "embedding": twin["embedding"]["kernel"][:, : config.vocab_size].T,
        "layers": [layer(twin["layers"][index]) for index in range(config.num_layers)],
        "final_norm": twin["norm"]["weight"],
    }
    if not config.tie_word_embeddings:
        params["head"] = twin["lm_head"]["kernel"][:, : config.vocab_size]
    return params


def _rms_norm(x, weight, eps: float) -> Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * weight).astype(x.dtype)


def _rotary_angles(config: LlamaConfig, seq: int) -> Array:
    """[1, S, 1, H/2] fp32: position p times theta^(-2i/H) (Llama 3's frequency scaling where the config has it)."""
    inv_freq = config.rope_theta ** -(jnp.arange(0, config.head_dim, 2, dtype=jnp.float32) / config.head_dim)
    if config.rope_scaling is not None:
        inv_freq = config.rope_scaling.scale(inv_freq, jnp.where)
    return (jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq)[None, :, None, :]


def _rotate(t_BSXH, angles) -> Array:
    """Channels i and i + H/2 of every head rotated by their angle, in fp32, rounded once."""
    first, second = jnp.split(t_BSXH.astype(jnp.float32), 2, axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(t_BSXH.dtype)


def _attention(config: LlamaConfig, layer: dict, x_BSD, angles) -> Array:
    batch, seq, _ = x_BSD.shape
    n, g, h = config.num_heads, config.num_kv_heads, config.head_dim
    q, k, v = jnp.split(x_BSD @ layer["qkv"], [n * h, (n + g) * h], axis=-1)
    q_BSNH, k_BSGH = _rotate(q.reshape(batch, seq, n, h), angles), _rotate(k.reshape(batch, seq, g, h), angles)
    out_BSNH = jax.nn.dot_product_attention(
        q_BSNH, k_BSGH, v.reshape(batch, seq, g, h), is_causal=True,
        implementation="cudnn" if jax.default_backend() == "gpu" else "xla",  # the twin's kernel
    )
    return out_BSNH.reshape(batch, seq, n * h) @ layer["out"]


def _mlp(layer: dict, x_BSD) -> Array:
    gate, up = jnp.split(x_BSD @ layer["gate_up"], 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ layer["down"]


def plain_logits(config: LlamaConfig, params: dict, tokens_BS) -> Array:
    """Logits [B, S, V] of the next token at every position."""
    x_BSD = params["embedding"][tokens_BS]
    angles = _rotary_angles(config, tokens_BS.shape[1])
    for layer in params["layers"]:
        x_BSD = x_BSD + _attention(config, layer, _rms_norm(x_BSD, layer["attention_norm"], config.norm_eps), angles)
        x_BSD = x_BSD + _mlp(layer, _rms_norm(x_BSD, layer["mlp_norm"], config.norm_eps))
    h_BSD = _rms_norm(x_BSD, params["final_norm"], config.norm_eps)
    return h_BSD @ (params["embedding"].T if config.tie_word_embeddings else params["head"])


def cross_entropy(logits, labels) -> Array:
    """Mean next-token cross-entropy in fp32 (logits [..., V], labels shaped like logits' leading dims)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


# --- the train steps: step(state, tokens [B, S + 1]) -> (state, loss) ----------------------------------------


def twin_model(config: LlamaConfig, kernel_init=None) -> Llama:
    """The twin in bf16, from the one seed every row starts from (kernel_init None: the config's init)."""
    return Llama(config, params_dtype=jnp.bfloat16, kernel_init=kernel_init, rngs=nnx.Rngs(0))


def twin_loss(model: Llama, tokens, recipe) -> tuple[Array, Array]:
    """(loss, logits [S, B, V]) of the twin under `recipe` (None: FP8 off)."""
    with fp8_autocast(enabled=recipe is not None, recipe=recipe):
        logits_SBV = model(tokens[:, :-1])
    return cross_entropy(logits_SBV, tokens[:, 1:].T), logits_SBV


def twin_step(config: LlamaConfig, recipe):
    """The twin's jitted step under `recipe` and its first state (model and optimizer)."""
    model = twin_model(config)
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)))

    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        grad_fn = nnx.value_and_grad(twin_loss, argnums=nnx.DiffState(0, GRAD_FILTER), has_aux=True)
        (loss, _), grads = grad_fn(model, tokens, recipe)
        optimizer.update(model, finish_backward(model, grads, recipe))  # (DelayedScaling's backward bookkeeping)
        return nnx.state((model, optimizer)), loss

    return xla_options.jit(step, donate_argnums=0), state


def plain_loss(params: dict, config: LlamaConfig, tokens) -> tuple[Array, Array]:
    """(loss, logits [B, S, V]) of the peer."""
    logits_BSV = plain_logits(config, params, tokens[:, :-1])
    return cross_entropy(logits_BSV, tokens[:, 1:]), logits_BSV


def plain_step(config: LlamaConfig):
    """The peer's jitted step and its first state (parameters, optimizer state), the twin's weights."""
    params = plain_params(config, nnx.to_pure_dict(nnx.state(twin_model(config), nnx.Param)))
    optimizer = optax.adamw(LEARNING_RATE)

    def step(state, tokens):
        params, optimizer_state = state
        (loss, _), grads = jax.value_and_grad(plain_loss, has_aux=True)(params, config, tokens)
        updates, optimizer_state = optimizer.update(grads, optimizer_state, params)
        return (optax.apply_updates(params, updates), optimizer_state), loss

    return jax.jit(step, donate_argnums=0), (params, optimizer.init(params))


# --- measuring ------------------------------------------------------------------------------------------------


def measure(name: str, step, state, tokens, args) -> dict:
    """First call (trace, compile, run), then the median of --steps timed steps after --warmup untimed ones."""
    start = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - start
    state, loss = jax.block_until_ready(compiled(state, tokens))
    first_call_s = time.perf_counter() - start
    print(f"{name}: compiled in {compile_s:.1f} s, first call {first_call_s:.1f} s, loss {float(loss):.4f}", flush=True)
    carried = {"state": state, "loss": loss}

    def one_step() -> None:
        carried["state"], carried["loss"] = jax.block_until_ready(compiled(carried["state"], tokens))

    ms = wall_ms(one_step, repeats=args.steps, warmup=args.warmup)
    memory = compiled.memory_analysis()
    gemms = gemm_operand_types(compiled.as_text())
    return {"ms/step": ms, "compile s": compile_s, "first call s": first_call_s,
            "temp GiB": memory and memory.temp_size_in_bytes / 2**30,
            "FP8 GEMMs": sum(all(t in FP8_TYPES for t in pair) for pair in gemms),
            "fp32 GEMMs": sum("f32" in pair for pair in gemms), "GEMMs": len(gemms),
            "loss": float(carried["loss"])}  # fmt: skip


def floor_tokens_per_s(config: LlamaConfig, seq: int, fp8: bool) -> float:
    """Tokens/s at the GEMM peaks (module docstring)."""
    d, h, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    n, g = config.num_heads, config.num_kv_heads
    projections = d * (n + 2 * g) * h + n * h * d + d * 2 * f + f * d
    projection_flop = 6 * config.num_layers * projections
    bf16_flop = 6 * d * config.vocab_size + 6 * config.num_layers * seq * n * h
    seconds = projection_flop / PEAK_FLOPS["fp8" if fp8 else "bf16"] + bf16_flop / PEAK_FLOPS["bf16"]
    return 1 / seconds


def label(recipe_name: str) -> str:
    return "plain JAX bf16" if recipe_name == PEER else f"twin, {'FP8 off' if recipe_name == 'off' else recipe_name}"


def random_tokens(config_name: str, args) -> Array:
    """The batch every step trains on: random ids [batch, seq + 1] (inputs and next-token labels)."""
    batch, seq = args.batch or DEFAULT_SHAPES[config_name][0], args.seq or DEFAULT_SHAPES[config_name][1]
    vocab = LLAMA_CONFIGS[config_name].vocab_size
    return jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, vocab, jnp.int32)


def benchmark_config(config_name: str, recipes: list[str], args) -> list[Result]:
    config = LLAMA_CONFIGS[config_name]
    tokens = random_tokens(config_name, args)
    batch, seq = tokens.shape[0], tokens.shape[1] - 1
    measured = {}
    for name in recipes:
        recipe = None if name == PEER else recipe_from_name(name)
        step, state = plain_step(config) if name == PEER else twin_step(config, recipe)
        measured[name] = measure(f"{config_name} {label(name)}", step, state, tokens, args)
        del step, state
    rate = {name: batch * seq / (m["ms/step"] / 1e3) for name, m in measured.items()}
    peer = rate.get(PEER)
    return [
        Result(
            f"{config_name} {batch}x{seq}", rate[name], floor_tokens_per_s(config, seq, name not in (PEER, "off")),
            unit="tokens/s", provider=label(name), peer=None if name == PEER else peer,
            peer_name="plain JAX bf16" if peer and name != PEER else "", extra=measured[name],
        )
        for name in recipes
    ]  # fmt: skip


# --- --check --------------------------------------------------------------------------------------------------


def relative_error(ours, theirs) -> float:
    """||ours - theirs|| / ||theirs|| over every leaf of two pytrees of one structure, in fp32."""
    pairs = zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True)
    squares = [(jnp.sum((a.astype(jnp.float32) - b.astype(jnp.float32)) ** 2), jnp.sum(b.astype(jnp.float32) ** 2))
               for a, b in pairs]  # fmt: skip
    return float(jnp.sqrt(sum(d for d, _ in squares) / sum(n for _, n in squares)))


def check_config(config_name: str, args) -> bool:
    """Print how far the peer is from the twin under FP8 off on the same weights and batch; True within bounds."""
    config = LLAMA_CONFIGS[config_name]
    tokens = random_tokens(config_name, args)
    model = twin_model(config, nnx.initializers.normal(config.hidden_size**-0.5))
    twin_grad = nnx.value_and_grad(twin_loss, has_aux=True)  # (FP8 off: only the parameters matter)
    (twin_value, twin_logits_SBV), twin_grads = nnx.jit(twin_grad, static_argnums=2)(model, tokens, None)
    params = plain_params(config, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    plain_grad = jax.value_and_grad(plain_loss, has_aux=True)
    (plain_value, plain_logits_BSV), plain_grads = jax.jit(plain_grad, static_argnums=1)(params, config, tokens)
    errors = {
        "loss": abs(float(plain_value) - float(twin_value)) / abs(float(twin_value)),
        "logits": relative_error(plain_logits_BSV, twin_logits_SBV.transpose(1, 0, 2)),
        "grads": relative_error(plain_grads, plain_params(config, nnx.to_pure_dict(twin_grads))),
    }
    passed = all(errors[name] <= bound for name, bound in CHECK_BOUNDS.items())
    shape = f"{tokens.shape[0]}x{tokens.shape[1] - 1}"
    print(f"{config_name} {shape}: loss plain bf16 {float(plain_value):.6f}, twin FP8 off {float(twin_value):.6f}; "
          + ", ".join(f"{name} rel. error {errors[name]:.2e} (bound {CHECK_BOUNDS[name]:g})" for name in errors)
          + ("" if passed else " -- FAILED"))  # fmt: skip
    return passed


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--configs", default="125m,1b", help="comma-separated twinspec.llama.LLAMA_CONFIGS names")
    recipe_help = f"comma-separated: {PEER} (the plain-JAX peer) or a twinspec recipe ({', '.join(recipe_names())})"
    parser.add_argument("--recipes", default="bf16,off,current,block", help=recipe_help)
    defaults = ", ".join(f"{name} {b}x{s}" for name, (b, s) in DEFAULT_SHAPES.items())
    parser.add_argument("--batch", type=int, help=f"sequences per step (default per config: {defaults})")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default per config, as --batch)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call")
    parser.add_argument("--check", action="store_true", help="compare the peer with the twin (FP8 off), no timing")
    args = parser.parse_args()
    configs, recipes = args.configs.split(","), args.recipes.split(",")
    for option, chosen, allowed in (("configs", configs, tuple(LLAMA_CONFIGS)),
                                    ("recipes", recipes, (PEER, *recipe_names()))):  # fmt: skip
        if unknown := sorted(set(chosen) - set(allowed)):
            parser.error(f"--{option}: unknown {', '.join(unknown)}; pick from {', '.join(allowed)}")
    for option, minimum in (("batch", 1), ("seq", 1), ("steps", 1), ("warmup", 0)):
        if (value := getattr(args, option)) is not None and value < minimum:
            parser.error(f"--{option} {value}: pass an integer >= {minimum}")
    if not (args.batch and args.seq) and (missing := [c for c in configs if c not in DEFAULT_SHAPES]):
        parser.error(f"--configs {', '.join(missing)}: no default batch x seq; pass --batch and --seq")
    if args.check:
        if not all([check_config(name, args) for name in configs]):
            raise SystemExit(1)
        return
    rows = [row for name in configs for row in benchmark_config(name, recipes, args)]
    notes = [f"{args.steps} timed steps after {args.warmup} untimed, optax.adamw (lr {LEARNING_RATE}) in every row; "
             "twin steps compiled with jaxside.xla_options, the peer with XLA's defaults; floor: projection GEMMs at "
             "the bf16 / FP8 peak, head and causal attention at the bf16 peak"]  # fmt: skip
    report("bench_jax_train_step, Llama training step, bf16 parameters", rows, args.json, notes)


if __name__ == "__main__":
    main()

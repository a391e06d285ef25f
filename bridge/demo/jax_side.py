"""The demo's JAX side, in the training processes: the trained shards in JAX, their layouts and a forward pass.

- layouts: for every TransformerLayer parameter, where torch keeps each element (its DTensor placements,
  as bridge.transfer translates them) against where the jaxside twin keeps it (jaxside.sharding's rules
  on the JAX mesh of the same devices; a torch weight [out, in] is a Flax kernel [in, out]). A mismatch
  counts; the tolerance is none.
- transfer: the TransformerLayer parameters cross zero-copy into JAX and are relaid as the twin's
  kernels on the JAX mesh (bridge.params); each process's JAX shard must equal the trained tensor's
  elements there, bit for bit.
- numerics: one unseen batch through the torch Llama (hooks keep the input of the first layer and every
  layer's output, gathered over the DP ranks), and from the same hidden states through the jaxside twin
  of the layers with the trained weights and the FP8 scaling state that forward started from; relative
  error per layer against bridge.numerics' forward tolerance for the recipe. The twin runs on rank 0's
  JAX device on the whole batch: the sharded forward on the multi-process JAX CPU mesh crashed here (a
  segfault when its output is read; JAX 0.10, gloo collectives), so the comparison does not depend on it.

The embedding and the tied head have no JAX twin here: the comparison covers the TransformerLayers.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from bridge import layout, params
from bridge.numerics import tolerance

EVAL_STEP = 1_000_000  # a corpus batch no training step used
LAYOUT_PNG = "layouts.png"


def _jax_twin(config):
    """A stack of jaxside TransformerLayers with the Llama block's settings (kernels start as zeros)."""
    import jax.numpy as jnp
    from flax import nnx

    import jaxside.modules as JM

    zeros = lambda key, shape, dtype: jnp.zeros(shape, dtype)  # noqa: E731  (torch's values replace them)
    block = JM.TransformerConfig(
        normalization="RMSNorm", layernorm_epsilon=config.norm_eps, activation="swiglu", bias=False,
        qkv_format="sbhd", attn_mask_type="causal",
    )  # fmt: skip
    rngs = nnx.Rngs(0)

    class Layers(nnx.Module):
        def __init__(self) -> None:
            self.layers = nnx.List(
                [
                    JM.TransformerLayer(
                        config.hidden_size, config.ffn_hidden_size, config.num_heads,
                        num_gqa_groups=config.num_kv_heads, config=block, kernel_init=zeros,
                        output_kernel_init=zeros, rngs=rngs,
                    )  # fmt: skip
                    for _ in range(config.num_layers)
                ]
            )
            self.rotary = JM.RotaryPositionEmbedding(config.head_dim, rotary_base=config.rope_theta)

    return Layers()


def cross_check(runtime, model, meshes, options, corpus, out: str, reference: dict) -> dict[str, Any]:
    """The layout and forward checks (module docstring); every rank calls it, all get the same checks."""
    import torch
    import torch.distributed as dist
    from flax import nnx

    import jaxside.modules as JM
    from bridge.runtime import jax_mesh

    mesh = jax_mesh(meshes.world)
    twin = _jax_twin(model.config)
    JM.place(twin, mesh)
    shardings = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(JM.shardings(twin, mesh))}
    torch_params = {n: p for n, p in model.named_parameters() if n.startswith("layers.")}
    jax_shapes = {path: tuple(v.shape) for path, v in params.jax_parameters(twin).items()}
    pairs = params.pair_parameters({n: tuple(p.shape) for n, p in torch_params.items()}, jax_shapes)

    same = {p.torch_name: params.same_layout(torch_params[p.torch_name], p, shardings[p.jax_path], mesh) for p in pairs}
    mismatched = [name for name, equal in same.items() if not equal]
    if runtime.rank == 0:
        _draw(Path(out, LAYOUT_PNG), torch_params, pairs, shardings, mesh)
    moved = params.torch_values_to_jax(torch_params, pairs, mesh, shardings)
    differ_here = [p.torch_name for p in pairs if not _same_values(moved[p.jax_path], reference[p.torch_name], p)]
    differ_per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(differ_per_rank, differ_here)  # each process checked its own shards
    moved_differ = sorted({name for names in differ_per_rank for name in names})

    scaling = _scaling_state(model)  # before the forward: DelayedScaling's update at its region's exit moves them on
    with torch.no_grad():
        hidden, torch_outputs = _torch_forward(model, meshes, options, corpus)
    # The whole batch's activations on rank 0 (DP ranks' columns; every TP rank holds a copy).
    hidden, *torch_outputs = (_gather_batch(t, meshes) for t in (hidden, *torch_outputs))
    limit = tolerance(options.recipe, "forward", device_type=runtime.torch_device.type)
    result = {
        "layouts": {"parameters": len(pairs), "mismatched": mismatched},
        "transfer": {"parameters": len(pairs), "differ": moved_differ},
        "forward_tolerance": limit.relative,
    }
    if runtime.rank == 0:
        result["forward"] = _forward_checks(options.recipe, limit, model.config, pairs, reference, scaling, hidden,
                                            torch_outputs)  # fmt: skip
    return result


def _same_values(array, full, pair: params.ParamPair) -> bool:
    """This process's shard of a moved JAX parameter equals the torch tensor's elements there, bit for bit."""
    import numpy as np

    expected = pair.layout.to_jax(full).contiguous().numpy()  # a torch tensor: .T is its transpose too
    shard = array.addressable_shards[0]
    return np.array_equal(np.asarray(shard.data).view(np.uint32), expected[shard.index].view(np.uint32))


def _gather_batch(local, meshes):
    """[S, B, D] from every DP rank's [S, b, D] (rank 0 gets it; the TP ranks' copies are skipped)."""
    import torch
    import torch.distributed as dist

    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, local.contiguous())
    tp = meshes.world.size(2)
    return torch.cat(pieces[::tp], dim=1)


def _scaling_state(model) -> dict:
    """A CPU copy of the layers' buffers (FP8 scales and amax histories among them) by name; every rank calls it.

    A copy, not `.cpu()`, which is the live buffer itself on a CPU run: it would show the state after the
    next forward's DelayedScaling update, not the scales that forward casts with (0.03 error vs 1e-7).
    """
    from torch.distributed.tensor import DTensor

    return {
        name: (buffer.full_tensor() if isinstance(buffer, DTensor) else buffer).detach().to("cpu", copy=True)
        for name, buffer in model.layers.named_buffers(prefix="layers")
    }


def _load_scaling_state(twin, state: dict, device) -> None:
    """The torch layers' scaling state into the twin's FP8State variables of the same names and shapes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxside.modules as JM

    flat = dict(nnx.to_flat_state(nnx.state(twin, JM.FP8State)))
    for path, variable in flat.items():
        name = params.dotted(path)
        if name in state:
            variable.set_value(jax.device_put(jnp.asarray(state[name].numpy()), device))
    nnx.update(twin, nnx.from_flat_state(flat))


def _forward_checks(
    recipe_name: str, limit, config, pairs, reference: dict, scaling: dict, hidden, torch_outputs
) -> list:
    """The twin on this process's device with the trained weights, on the whole batch, against torch's outputs."""
    import math

    import jax
    import jax.numpy as jnp

    from bridge.numerics import local_stats

    device = jax.local_devices()[0]
    twin = _jax_twin(config)
    values = {}
    for pair in pairs:
        full = reference[pair.torch_name]
        values[pair.jax_path] = jax.device_put(jnp.asarray(pair.layout.to_jax(full).numpy()), device)
    params.load_into_jax(twin, values)
    _load_scaling_state(twin, scaling, device)  # DelayedScaling: the scales torch's forward uses
    checks = []
    jax_outputs = _jax_forward(recipe_name, twin, jax.device_put(jnp.asarray(hidden.numpy()), device))
    for i, (theirs, ours) in enumerate(zip(jax_outputs, torch_outputs)):
        sq_diff, sq_ref, nans, max_abs = local_stats(_to_torch(theirs), ours, 1).tolist()
        relative = math.sqrt(sq_diff / sq_ref) if sq_ref > 0 else math.inf
        passed = limit.passes(relative, max_abs, nans > 0)
        checks.append({"name": f"layers.{i}", "relative": relative, "max_abs": max_abs, "passed": passed})
    return checks


def _to_torch(array):
    import numpy as np
    import torch

    return torch.from_numpy(np.array(array))


def _draw(path: Path, torch_params: dict, pairs, shardings: dict, mesh) -> None:
    """torch's live layout and the JAX twin's of one column- and one row-parallel weight of layer 0."""
    from bridge.layout.draw import save_png

    panels = []
    for name in ("layers.0.self_attention.layernorm_qkv.weight", "layers.0.layernorm_mlp.fc2_weight"):
        pair = next(p for p in pairs if p.torch_name == name)
        param = torch_params[name]
        kernel_shape = tuple(param.shape)[::-1]
        short = name.removeprefix("layers.0.")
        torch_title = f"torch layers.0\n{short}\n{list(param.shape)} {_placements(param)}"
        panels.append((torch_title, layout.from_dtensor(param)))
        jax_spec = shardings[pair.jax_path].spec
        panels.append((f"JAX layers.0\n{pair.jax_name.removeprefix('layers.0.')}\n{list(kernel_shape)} {jax_spec}",
                       layout.from_named_sharding(shardings[pair.jax_path], kernel_shape)))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(path, panels)


def _placements(param) -> str:
    return "(" + ", ".join(map(str, param.placements)) + ")"


def _torch_forward(model, meshes, options, corpus):
    """(first layer's input, every layer's output), this rank's [S, b, D] shards, for the unseen batch."""
    from torch.distributed import group

    from torchside.autocast import fp8_autocast
    from torchside.recipe import recipe_from_name

    tokens = corpus.batch(EVAL_STEP, options.batch_size, options.seq_len)[:, :-1]
    tokens = tokens.chunk(meshes.data_parallel_size)[meshes.data_parallel_rank()].to(next(model.parameters()).device)
    captured: dict[str, Any] = {"outputs": []}
    hooks = [model.layers[0].register_forward_pre_hook(lambda module, args: captured.setdefault("input", args[0]))]
    keep_output = lambda module, args, output: captured["outputs"].append(output)  # noqa: E731
    hooks += [layer.register_forward_hook(keep_output) for layer in model.layers]
    recipe = recipe_from_name(options.recipe)
    try:
        with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=group.WORLD):
            model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return captured["input"].contiguous(), captured["outputs"]


def _jax_forward(recipe_name: str, twin, x):
    """Every layer's output of the twin, rotary angles from its own RotaryPositionEmbedding."""
    return _jax_forward_program(recipe_name)(twin, x)


@functools.cache
def _jax_forward_program(recipe_name: str):
    from flax import nnx

    import jaxside.modules as JM
    from jaxside.recipe import recipe_from_name

    recipe = recipe_from_name(recipe_name)

    @nnx.jit
    def forward(twin, x):
        freqs = twin.rotary(x.shape[0])
        outputs = []
        with JM.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            for layer in twin.layers:
                x = layer(x, rotary_pos_emb=freqs)
                outputs.append(x)
        return outputs

    return forward


__all__ = ["LAYOUT_PNG", "cross_check"]

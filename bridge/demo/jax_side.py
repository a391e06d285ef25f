"""The demo's JAX side, in the training processes: the trained model in JAX, its layouts and its logits.

The JAX model is jaxside.models.llama's `Llama`, the full twin of the torch Llama (embedding, the
TransformerLayers, final RMSNorm, tied or untied head), every parameter paired with torch's by
bridge.params' rules.

- layouts: for every parameter, where torch keeps each element (its DTensor placements, as
  bridge.transfer translates them) against where the twin keeps it (jaxside.sharding's rules on the
  JAX mesh of the same devices; a torch weight [out, in] is a Flax kernel [in, out]). A mismatch
  counts; the tolerance is none.
- transfer: the parameters cross zero-copy into JAX and are relaid as the twin's kernels on the JAX
  mesh (bridge.params); each process's JAX shard must equal the trained tensor's elements there, bit
  for bit.
- numerics: the twin, holding those moved shards and the FP8 scaling state torch's forward starts
  from, runs one unseen batch sharded on the JAX mesh (batch over the data-parallel axes, as torch's
  ranks split it); its logits against the torch Llama's, each process comparing its own shard and one
  all-reduce adding them up (bridge.numerics), against bridge.numerics' forward tolerance for the recipe.
  The twin's kernels start as zeros: a parameter the pairing left out would show in the logits.

On the multi-process CPU mesh (gloo) this runs too: an earlier layer-only version ran its twin on
rank 0's device because a sharded forward had segfaulted there; on JAX 0.10.2 it did not (2026-12-02).
The price is one compile of the sharded program per process instead of one on rank 0.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from bridge import layout, logits, params
from bridge.numerics import tolerance

EVAL_STEP = 1_000_000  # a corpus batch no training step used
LAYOUT_PNG = "layouts.png"


def jax_twin(model, plan=None):
    """The jaxside Llama of this torch Llama's config, holding as many vocabulary rows (kernels start as zeros).

    plan: the placement plan the torch model was built under (None: the default plan)."""
    from flax import nnx

    from jaxside.models.llama import Llama
    from twinspec.plan import DEFAULT_PLAN

    # torch pads the vocabulary for its TP size; the twin pads to the same rows, so the two pair up.
    config = dataclasses.replace(model.config, vocab_multiple=model.padded_vocab_size)
    plan = DEFAULT_PLAN if plan is None else plan
    return Llama(config, kernel_init=nnx.initializers.zeros, plan=plan, rngs=nnx.Rngs(0))


def cross_check(runtime, model, meshes, options, recipe, corpus, out: str, reference: dict) -> dict[str, Any]:
    """The layout, transfer and logits checks (module docstring); every rank calls it, all get the same result."""
    import torch.distributed as dist
    from flax import nnx

    import jaxside.modules as JM
    from bridge.runtime import jax_mesh

    mesh = jax_mesh(meshes.world)
    twin = jax_twin(model)
    JM.place(twin, mesh)
    shardings = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(JM.shardings(twin, mesh))}
    torch_params = dict(model.named_parameters())
    pairs = params.pair_models(model, twin)

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
    params.load_into_jax(twin, moved)
    _load_scaling_state(twin, scaling)
    tokens = corpus.batch(EVAL_STEP, options.batch_size, options.seq_len)[:, :-1]
    limit = tolerance(options.recipe, "forward", device_type=runtime.torch_device.type)
    relative, max_abs, nan = logits.check_logits(model, twin, meshes, mesh, recipe, tokens)
    return {
        "layouts": {"parameters": len(pairs), "mismatched": mismatched},
        "transfer": {"parameters": len(pairs), "differ": moved_differ},
        "forward": {"relative": math.inf if nan else relative, "max_abs": max_abs},  # a NaN fails the check
        "forward_tolerance": limit.relative,
    }


def _same_values(array, full, pair: params.ParamPair) -> bool:
    """This process's shard of a moved JAX parameter equals the torch tensor's elements there, bit for bit."""
    import numpy as np

    expected = pair.layout.to_jax(full).contiguous().numpy()  # a torch tensor: .T is its transpose too
    shard = array.addressable_shards[0]
    return np.array_equal(np.asarray(shard.data).view(np.uint32), expected[shard.index].view(np.uint32))


def _scaling_state(model) -> dict:
    """A CPU copy of the model's buffers (FP8 scales and amax histories among them) by name; every rank calls it.

    A copy, not `.cpu()`, which is the live buffer itself on a CPU run: it would show the state after the
    next forward's DelayedScaling update, not the scales that forward casts with (0.03 error vs 1e-7).
    """
    from torch.distributed.tensor import DTensor

    return {
        name: (buffer.full_tensor() if isinstance(buffer, DTensor) else buffer).detach().to("cpu", copy=True)
        for name, buffer in model.named_buffers()
    }


def _load_scaling_state(twin, state: dict) -> None:
    """torch's scaling state into the twin's FP8State variables of the same names, where the twin keeps them."""
    import jax
    from flax import nnx

    import jaxside.modules as JM

    flat = dict(nnx.to_flat_state(nnx.state(twin, JM.FP8State)))
    for path, variable in flat.items():
        name = params.dotted(path)
        if name in state:
            value = state[name].numpy()  # the whole tensor on every process: each takes its shard of it
            sharding = variable.get_value().sharding
            variable.set_value(jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index]))
    nnx.update(twin, nnx.from_flat_state(flat))


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


__all__ = ["LAYOUT_PNG", "cross_check", "jax_twin"]

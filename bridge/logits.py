"""Torch's logits and the JAX twin's of one token batch on the co-located mesh, compared shard by shard.

Used by `shardbridge demo` (the trained model against its twin) and `shardbridge verify --model llama
--hf` (both frameworks' load_hf of one checkpoint). Both frameworks run the one recipe object the caller
made from its recipe name (twinspec.recipe). Each process compares its own shard of the
logits [S, B, V] (batch over the data-parallel axes, as torch's ranks split it; the vocabulary as
torch keeps it) and one all-reduce adds them up (bridge.numerics).
"""

from __future__ import annotations

from twinspec.recipe import Recipe


def check_logits(model, twin, meshes, mesh, recipe: Recipe | None, tokens) -> tuple[float, float, bool]:
    """(relative error, max abs, NaN seen) of the twin's logits of `tokens` [B, S] against the torch model's.

    Every process calls it: torch runs its data-parallel rows (no autograd), the twin the whole batch
    sharded on `mesh`, the JAX mesh of `meshes.world` (torchside's LlamaMeshes).
    """
    import torch

    with torch.no_grad():
        reference = torch_logits(model, meshes, recipe, tokens)
    return compare_logits(recipe, twin, tokens, reference, meshes.world, mesh)


def torch_logits(model, meshes, recipe: Recipe | None, tokens):
    """torch's logits [S, b, V] of this rank's data-parallel rows of `tokens` [B, S]."""
    from torch.distributed import group

    from torchside.autocast import fp8_autocast

    local = tokens.chunk(meshes.data_parallel_size)[meshes.data_parallel_rank()]
    with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=group.WORLD):
        return model(local.to(next(model.parameters()).device))


def compare_logits(recipe: Recipe | None, twin, tokens, torch_logits, world, mesh) -> tuple[float, float, bool]:
    """(relative error, max abs, NaN seen) of the twin's logits on the mesh against torch's, over every shard."""
    import jax
    import numpy as np
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from bridge import transfer
    from bridge.numerics import local_stats, reduce_stats

    data_parallel = [Shard(0), Shard(0), Replicate()]  # [B, S]: torch's ranks' rows, whole on every TP rank
    ids = tokens.numpy().astype(np.int32)
    sharding = transfer.equivalent_sharding(world, data_parallel, ids.shape, mesh)
    jax_logits = _jax_logits(recipe, twin, jax.make_array_from_callback(ids.shape, sharding, lambda i: ids[i]))
    # torch's [S, b, V]: the vocabulary split over TP (a DTensor), or whole on every TP rank (a padded one, sliced),
    # or partial sums over TP (a head by hidden columns: a placement plan's embedding mode "hidden"), summed here
    if isinstance(torch_logits, DTensor) and torch_logits.placements[0].is_partial():
        torch_logits = torch_logits.redistribute(placements=[Replicate()])
    vocab = torch_logits.placements[0] if isinstance(torch_logits, DTensor) else Replicate()
    local = torch_logits.to_local() if isinstance(torch_logits, DTensor) else torch_logits
    sharding = transfer.equivalent_sharding(world, [Shard(1), Shard(1), vocab], tuple(jax_logits.shape), mesh)
    ours = transfer.local_from_jax(jax.device_put(jax_logits, sharding))  # this process's shard, as torch's
    replicas = world.size(2) if isinstance(vocab, Replicate) else 1
    ((relative, max_abs, nan),) = reduce_stats(local_stats(ours, local, replicas)[None])
    return relative, max_abs, nan


def _jax_logits(recipe: Recipe | None, twin, tokens):
    """The twin's logits [S, B, V] of `tokens` [B, S], one program on the mesh the twin and the tokens are on."""
    import jax
    import torch.distributed as dist
    from flax import nnx

    import jaxside.modules as JM
    from jaxside import xla_options

    graphdef, state = nnx.split(twin)

    def forward(state, tokens):
        with JM.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            return nnx.merge(graphdef, state)(tokens)

    compiled = xla_options.jit(forward).lower(state, tokens).compile()
    dist.barrier()  # XLA's gloo collectives give up on a peer still compiling (as bridge.crosscheck's step)
    return compiled(state, tokens)


__all__ = ["check_logits", "compare_logits", "torch_logits"]

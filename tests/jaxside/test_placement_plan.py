"""The default placement plan (twinspec.plan) in JAX: the specs jaxside.sharding's logical-axis rules give."""

from __future__ import annotations

import dataclasses


def test_the_default_plan_gives_the_logical_rules_specs_for_every_llama_parameter():
    """The JAX twin placed by DEFAULT_PLAN gets what jaxside.sharding's logical-axis rules gave it before plans."""
    from flax import nnx

    from jaxside.models.llama import LLAMA_CONFIGS, Llama
    from jaxside.modules.placement import shardings
    from jaxside.sharding import make_mesh, named_sharding

    config = dataclasses.replace(LLAMA_CONFIGS["tiny"], tie_word_embeddings=False, bias=True)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    logical = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    for sizes in [(1, 4, 2), (2, 2, 2), (1, 8, 1), (1, 1, 8)]:
        mesh = make_mesh(*sizes)
        placed = dict(nnx.to_flat_state(shardings(model, mesh)))
        for path, variable in nnx.to_flat_state(state):
            metadata = variable.get_metadata()
            axes = tuple(logical[path].get_value())
            legacy = named_sharding(mesh, axes, metadata.get("parallel_mode"), metadata["parallel_role"])
            assert placed[path].get_value().spec == legacy.spec, (sizes, path)

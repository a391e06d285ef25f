"""The names of a run's world mesh axes, outermost first: replicas (HSDP), FSDP shards, tensor parallelism.

Defined once in the framework-free jaxside.plan (placement plans name these axes), which
jaxside.sharding uses too, so that bridge code maps a torch mesh onto the JAX mesh of the same
devices axis by axis, by name.
"""

from jaxside.plan import DP_REPLICATE, DP_SHARD, MESH_AXES, TP

__all__ = ["DP_REPLICATE", "DP_SHARD", "MESH_AXES", "TP"]

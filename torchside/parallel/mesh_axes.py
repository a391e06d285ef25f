"""The names of a run's world mesh axes, outermost first: replicas (HSDP), FSDP shards, tensor parallelism.

The same names as jaxside.sharding's mesh (tests/bridge/test_sharding_cross.py keeps them equal), so
that bridge code maps a torch mesh onto the JAX mesh of the same devices axis by axis, by name.
"""

DP_REPLICATE, DP_SHARD, TP = "dp_replicate", "dp_shard", "tp"
MESH_AXES = (DP_REPLICATE, DP_SHARD, TP)

__all__ = ["DP_REPLICATE", "DP_SHARD", "MESH_AXES", "TP"]

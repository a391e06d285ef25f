"""`shardbridge plan`: what a placement costs, read off a model as it is built.

- `build`: the torch model (and the specs of its JAX twin) on a fake process group of the mesh's size,
  placed by `place`, the one function a placement plan plugs into;
- `cost`: per parameter its placements, JAX spec, verdict and bytes on every rank; totals of
  parameters, gradients and optimizer states; the collectives of one training step per mesh axis.

Nothing here needs a GPU or more than one process: the model is built as rank 0 of the mesh, and
every other rank's shard follows from the placements (bridge.layout's shard maps).
"""

"""torch and JAX in the same processes, on the same devices: one sharded tensor crosses both ways.

    shardbridge run -n 2 examples/run_colocated.py

Each process is one torch rank and one JAX process on one device (a GPU each where torch sees GPUs,
else the CPU; `bridge.runtime.initialize`). A [4N, 3] float32 tensor, arange(12N) row by row, is
sharded by rows over the N ranks (DTensor `Shard(0)`). It crosses into JAX without a copy
(`bridge.transfer.to_jax`: the NamedSharding that keeps the same rows on the same device, the JAX
buffer being torch's storage), JAX doubles it, and it crosses back into a DTensor with the same
placements. Each rank prints its rows and whether JAX's shard lies on torch's memory; rank 0 prints the
sum, which must be 2 x (0 + 1 + ... + 12N - 1) = 12N (12N - 1): 552 for N = 2.
"""

import os

import jax
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from bridge import runtime, transfer


def main() -> None:
    rt = runtime.initialize()
    try:
        n = rt.world_size
        mesh = init_device_mesh(rt.device_type, (n,), mesh_dim_names=("rows",))
        full = torch.arange(12 * n, dtype=torch.float32, device=rt.torch_device).reshape(4 * n, 3)
        tensor = distribute_tensor(full, mesh, [Shard(0)])

        array = transfer.to_jax(tensor, runtime.jax_mesh(mesh))  # this rank's shard is the JAX buffer
        shard = array.addressable_shards[0]
        rows = shard.index[0]
        shared = shard.data.unsafe_buffer_pointer() == tensor.to_local().data_ptr()
        line = f"rank {rt.rank}: rows {rows.start}-{rows.stop - 1} on {shard.device}, JAX on torch's memory: {shared}"
        os.write(1, f"{line}\n".encode())  # one write: the processes share the pipe

        doubled = transfer.to_torch(jax.jit(lambda a: 2 * a)(array), mesh, [Shard(0)])
        total = doubled.full_tensor().sum().item()  # a collective: every rank takes part
        if rt.rank == 0:
            expected = 12 * n * (12 * n - 1)
            os.write(1, f"sum after the round trip: {total:g} (expected {expected})\n".encode())
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()

"""Benchmark: move a ~1B-parameter model's FSDP shards torch -> JAX -> torch on the same GPUs, zero-copy.

Every process (one per GPU, started by torchrun) holds its FSDP2 shard of an 8-layer LayerNormMLP
stack (hidden 4096, ffn 16384: 8 x 134M = 1.07B fp32 parameters, 4.3 GB) and moves every shard:

- torch -> JAX: bridge.transfer.to_jax (DLPack, then the global jax.Array of the equivalent
  NamedSharding); zero-copy: every JAX buffer is the torch storage (data pointers compared) and
  the device memory both frameworks report does not grow;
- JAX -> torch: bridge.transfer.to_torch on those arrays, the same check;
- peers measured in the same run: a copying exchange (DLPack, then a JAX copy of each shard: the
  floor is its bytes read and written at benchmarks/harness.py's 4.24 TB/s), and the gathering one many
  scripts use (`full_tensor()`, then `jax.device_put` of the whole tensor on every GPU).

Printed on rank 0: the slowest rank's median ms per direction, the bytes a copy would move, the
device memory growth, and whether every pointer matched.

Times: benchmarks.harness.wall_ms (every rank lined up by a barrier before each call), slowest rank.

Run:   PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/bench/bench_transfer.py     (or 1)
CPU smoke test:  PYTHONPATH=. python3 -m bridge run -n 2 benchmarks/bench/bench_transfer.py --device cpu --hidden 64 --layers 2
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.harness import COPY_BYTES_PER_S, Result, argument_parser, report, slowest_rank, wall_ms
from bridge import runtime, transfer, twins
from torchside.parallel import parallelize

REPEATS = 5


def _median_ms(fn) -> float:
    """The slowest rank's median wall time of fn() in ms (every rank starts each repeat together)."""
    return slowest_rank(wall_ms(fn, repeats=REPEATS, warmup=0, before=dist.barrier))


def _memory(rt) -> tuple[int, int]:
    """(torch bytes allocated, JAX bytes in use) on this process's device (0, 0 on the CPU)."""
    if rt.device_type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(), rt.jax_device.memory_stats()["bytes_in_use"]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    rt = runtime.initialize(args.device)
    world = init_device_mesh(rt.device_type, (rt.world_size,), mesh_dim_names=("dp_shard",))
    mesh = runtime.jax_mesh(world)
    model = twins.build_torch(twins.TwinSpec("mlp", args.layers, args.hidden, tp_size=1, amax_history_len=1))
    parallelize(model, world, blocks=list(model.layers), device=rt.torch_device)
    shards = dict(model.named_parameters())
    count = sum(p.numel() for p in shards.values())
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in shards.values())

    before = _memory(rt)
    arrays = {name: transfer.to_jax(p, mesh) for name, p in shards.items()}
    jax.block_until_ready(arrays)
    to_jax_growth = [a - b for a, b in zip(_memory(rt), before)]
    same_to_jax = all(
        arrays[n].addressable_shards[0].data.unsafe_buffer_pointer() == p.to_local().data_ptr() for n, p in shards.items()
    )
    back = {n: transfer.to_torch(arrays[n], p.device_mesh, p.placements) for n, p in shards.items()}
    same_back = all(back[n].to_local().data_ptr() == p.to_local().data_ptr() for n, p in shards.items())

    def torch_to_jax():
        jax.block_until_ready([transfer.to_jax(p, mesh) for p in shards.values()])

    def jax_to_torch():
        [transfer.to_torch(arrays[n], p.device_mesh, p.placements) for n, p in shards.items()]

    def copying_peer():
        jax.block_until_ready([jnp.copy(jax.dlpack.from_dlpack(p.to_local().detach())) for p in shards.values()])

    def gathering_peer():
        for p in shards.values():
            jax.device_put(jax.dlpack.from_dlpack(p.full_tensor().detach())).block_until_ready()

    copy_floor_ms = 1e3 * 2 * local_bytes / COPY_BYTES_PER_S
    to_jax_ms, to_torch_ms = _median_ms(torch_to_jax), _median_ms(jax_to_torch)
    copying_ms, gathering_ms = _median_ms(copying_peer), _median_ms(gathering_peer)
    peer = {"peer": copying_ms, "peer_name": "DLPack + JAX copy of each shard"}
    rows = [  # zero-copy moves no bytes: no floor; the peer is the copying exchange
        Result("torch -> JAX, zero-copy (bridge.transfer)", to_jax_ms, None, **peer),
        Result("JAX -> torch, zero-copy (bridge.transfer)", to_torch_ms, None, **peer),
        Result("peer: DLPack + JAX copy of each shard", copying_ms, copy_floor_ms, note="floor: a copy at 4.24 TB/s"),
        Result("peer: full_tensor() + device_put (gathers)", gathering_ms, None),
    ]
    if rt.rank == 0:
        notes = [
            f"model: {count / 1e9:.2f}B parameters, {local_bytes / 1e9:.2f} GB of shards per device, {rt.world_size} ranks",
            f"zero-copy: every JAX buffer is the torch storage: {same_to_jax}; and back: {same_back}",
            f"device memory growth after torch -> JAX (torch, JAX bytes): {to_jax_growth}",
        ]
        report("bench_transfer, FSDP shards torch <-> JAX", rows, args.json, notes)
    runtime.shutdown()


if __name__ == "__main__":
    main()

"""What a run starts from: the process group, the model on its mesh, the optimizer."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor
from torch.utils._pytree import tree_map_only

from torchside.models.llama import LLAMA_CONFIGS, Llama
from torchside.models.llama_parallel import LlamaMeshes, build_meshes, load_full_state, parallelize_llama
from torchside.modules import ModuleConfig
from torchside.optim import FusedAdam
from torchside.train.options import DTYPES, TrainOptions


def init_distributed(options: TrainOptions) -> None:
    """A process group when the mesh has more than one rank (torchrun's environment gives the rendezvous)."""
    if options.world_size == 1 or dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != options.world_size:
        raise ValueError(
            f"--replicate {options.replicate} x --dp {options.dp} x --tp {options.tp} = {options.world_size} "
            f"ranks, but the launcher started {world}: run torchrun --nproc-per-node {options.world_size}"
        )
    if options.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if options.device == "cuda" else "gloo")


def build_model(options: TrainOptions) -> tuple[Llama, LlamaMeshes | None]:
    """The model on its mesh, starting from the seeded single-device initialization (built on rank 0)."""
    config = LLAMA_CONFIGS[options.config]
    dtype, device = DTYPES[options.dtype], torch.device(options.device)
    full_model = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.manual_seed(options.seed)
        full_model = Llama(config, params_dtype=dtype)  # on the CPU: the same values on any machine
    if options.world_size == 1:
        model = full_model.to(device)
        if options.compile:
            compile_blocks(model, options.compile_mode, options.compile_backend)
        return model, None
    meshes = build_meshes(device.type, dp=options.dp, tp=options.tp, replicate=options.replicate)
    module_config = ModuleConfig(tp_size=options.tp, sequence_parallel=options.sequence_parallel)
    model = Llama(config, params_dtype=dtype, device="meta", module_config=module_config)
    if options.compile:  # torchtitan's order: compile each block, then fully_shard it
        compile_blocks(model, options.compile_mode, options.compile_backend)
    with warnings.catch_warnings():  # materializing on a CPU mesh warns that DTensor RNG support is partial
        warnings.filterwarnings("ignore", message="DTensor random operators")
        parallelize_llama(model, meshes, device=device)
    load_full_state(model, None if full_model is None else full_model.state_dict(), from_rank0=True)
    return model, meshes


def compile_blocks(model: Llama, mode: str = "default", backend: str = "inductor") -> None:
    """torch.compile each TransformerLayer's forward (fullgraph=True), in place, as torchtitan compiles per block.

    torchtitan replaces each block by its torch.compile wrapper; compiling the block's forward instead keeps the
    module, its parameter names (placement plans, checkpoints) and its hooks: the FSDP2 hooks fully_shard adds
    (all-gather, reshard) run outside the graph, as around torchtitan's wrapper, whether fully_shard comes before
    or after. Every block runs the same code, so one graph serves all (a block that differed would recompile).
    """
    for block in model.layers:
        compiled = torch.compile(block.forward, fullgraph=True, mode=mode, backend=backend)
        block.forward = _waiting_for_collectives(compiled)


def _waiting_for_collectives(compiled: Callable) -> Callable:
    """`compiled`, its AsyncCollectiveTensor arguments first waited for by the differentiable `wait_tensor`.

    Under TP, torch's styles hand the first block the embedding's all-reduced (or reduce-scattered) output as an
    AsyncCollectiveTensor. AOTAutograd drops such an input's requires_grad (torch 2.13: the wrapper requires grad,
    the inner tensor it traces does not), so the block's backward gave it no gradient and the eager
    Redistribute behind it failed ("'Tensor' object has no attribute '_local_tensor'").
    """

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        args, kwargs = tree_map_only(AsyncCollectiveTensor, wait_tensor, (args, kwargs))
        return compiled(*args, **kwargs)

    return forward


def build_optimizer(model: Llama, options: TrainOptions, *, capturable: bool | None = None) -> FusedAdam:
    """AdamW with decay on matrices only; fp32 masters for bf16 parameters; capturable (default: under --cuda-graphs)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": options.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    capturable = options.cuda_graphs if capturable is None else capturable
    master_weights = options.dtype == "bf16"
    return FusedAdam(groups, lr=options.lr, betas=(0.9, 0.95), master_weights=master_weights, capturable=capturable)

"""`load_hf`: a Hugging Face LlamaForCausalLM directory into our torch `Llama`, each rank reading its own rows.

The directory is checked first (twinspec.hf_llama.Checkpoint: architecture, config, index,
every file's header, every tensor's name and shape), before any weight is read. Then the model is
built on "meta", parallelized (`parallelize_llama`: TP, FSDP2, materialization), and each
parameter's local shard is filled from the checkpoint: the shard's box (global row and column
offsets, from the DTensor's own chunk metadata, as Distributed Checkpoint reads it) goes through the
name-and-layout table, which names the few row ranges of the HF tensors it is made of (for the
fused QKV: slices of q, k and v; for fc1: of gate and up), and only those rows and this shard's
columns are read (`safe_open(...).get_slice`). A rank never reads another rank's bytes.

An FP8 block-scaled checkpoint (twinspec.hf_llama's docstring) builds the model under
`quantized_model_init(recipe=Float8BlockScaling())` with glu_interleave = 128: every projection
weight is a Float8BlockScaling parameter whose `rowwise_data` and `rowwise_scale_inv` receive the
HF bytes and scales of its shard as they are (no dequantization, no requantization); its
columnwise copy is their transpose, rebuilt as a checkpoint load rebuilds it. The embedding, an
untied head and the norms stay high precision (`dtype`, default the embedding's). A bf16/fp32
checkpoint loaded under the caller's `quantized_model_init(recipe=...)` gets FP8 projection weights
of that recipe: each rank casts the high-precision values of its own shard as it reads them
(`quantize_weight_`, the weight's scale over all its shards, as after an optimizer step).

The materialization initializes the weights randomly before they are overwritten (time, not memory:
each rank allocates only its shards). The vocabulary is padded to a multiple of the mesh's
tp x dp_shard size, the same multiple `jaxside.models.llama.load_hf` uses on the same devices, so
the two models pair up in the bridge; the padding rows are zeros.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from twinspec.hf_llama import BLOCK, Checkpoint, Piece
from torchside.autocast import quantized_model_init
from torchside.checkpoint import quantized_params
from torchside.models.llama import Llama
from torchside.models.llama_parallel import LlamaMeshes, parallelize_llama
from torchside.modules import ModuleConfig
from torchside.recipe import Float8BlockScaling

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _mesh_size(mesh: DeviceMesh | None, dim: int = -1) -> int:
    return 1 if mesh is None else mesh.size(dim % mesh.ndim)


def _box(param: Tensor) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's local tensor, its global offsets, its sizes): DCP's own chunk metadata of a DTensor."""
    if not isinstance(param, DTensor):
        return param.data, (0,) * param.dim(), tuple(param.shape)
    (chunk,) = param.__create_chunk_list__()
    return param._local_tensor, tuple(chunk.offsets), tuple(chunk.sizes)


def _read_into(checkpoint: Checkpoint, name: str, local: Tensor, rows, cols, buffer: str | None = None) -> None:
    def put(piece: Piece, values) -> None:
        target = local[piece.dest : piece.dest + (piece.stop - piece.start) * piece.step : piece.step]
        target.zero_() if values is None else target.copy_(torch.as_tensor(values))

    checkpoint.read_box(name, rows, cols, "pt", put, *([buffer] if buffer else []))  # (a float read: as before)


@torch.no_grad()
def _fill(checkpoint: Checkpoint, model: Llama, name: str, param: Tensor) -> None:
    local, offsets, sizes = _box(param)
    if local.numel() == 0:
        return
    rows = (offsets[0], offsets[0] + sizes[0])
    cols = (offsets[1], offsets[1] + sizes[1]) if local.dim() == 2 else None
    if not quantized_params.is_quantized(param):
        _read_into(checkpoint, name, local, rows, cols)
        return
    if not checkpoint.fp8:  # an FP8 weight of the caller's recipe: cast this shard of the high-precision values
        values = torch.empty(local.shape, dtype=local.dtype, device=local.device)
        _read_into(checkpoint, name, values, rows, cols)
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner).quantize_weight_(attr, values)
        return
    # An FP8 weight: the HF bytes and scales as they are; the shard starts on a block (FSDP2 and TP check it).
    storage = quantized_params.local_of(param).quantized_storage
    _read_into(checkpoint, name, storage.rowwise_data, rows, cols, "rowwise_data")
    blocks = [(lo // BLOCK, -(-hi // BLOCK)) for lo, hi in (rows, cols)]
    _read_into(checkpoint, name, storage.rowwise_scale_inv, *blocks, "rowwise_scale_inv")
    quantized_params.complete(storage)  # the columnwise copy: the rowwise one transposed


def load_hf(
    path: str | Path,
    *,
    mesh: DeviceMesh | None = None,
    tp_mesh: DeviceMesh | None = None,
    weight_mesh: DeviceMesh | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Llama:
    """Our Llama with an HF checkpoint's weights (module docstring); ValueError naming the file for bad input.

    mesh: the data-parallel mesh (1-D FSDP, 2-D HSDP) or None; tp_mesh: the 1-D TP mesh or None.
    weight_mesh: every rank holding a piece of a weight (build_meshes' `weight`); needed when FP8 weights
    of a per-tensor-scale recipe (quantized_model_init) are split over FSDP2 and TP: one scale for all shards.
    dtype: the parameters' dtype; None keeps the checkpoint's.
    """
    checkpoint = Checkpoint(path)
    tp = _mesh_size(tp_mesh)
    vocab_multiple = tp * _mesh_size(mesh)
    config = dataclasses.replace(checkpoint.config, vocab_multiple=vocab_multiple)
    dtype = DTYPES[checkpoint.dtype()] if dtype is None else dtype
    # An FP8 checkpoint's projection weights become Float8BlockScaling parameters (128x128 E4M3 blocks);
    # a high-precision one's follow the caller's quantized_model_init, if any (cast as they are read).
    fp8_init = quantized_model_init(recipe=Float8BlockScaling()) if checkpoint.fp8 else contextlib.nullcontext()
    with fp8_init:
        model = Llama(config, params_dtype=dtype, device="meta", module_config=ModuleConfig(tp_size=tp))
    meshes = LlamaMeshes(world=None, data=mesh, tp=tp_mesh, weight=weight_mesh)
    with warnings.catch_warnings():  # materializing on a CPU mesh warns of DTensor RNG: the file's values replace all
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        parallelize_llama(model, meshes, device=device)
    params = dict(model.named_parameters())
    unmapped = sorted(set(params) ^ set(checkpoint.sources))
    assert not unmapped, f"the HF table and the model disagree on {unmapped}"
    for name, param in params.items():
        _fill(checkpoint, model, name, param)
    return model


__all__ = ["load_hf"]

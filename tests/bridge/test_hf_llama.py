"""Hugging Face Llama checkpoints into our torch model and the JAX twin, against transformers' own LlamaForCausalLM.

The reference is independent: transformers builds a tiny random Llama (fp32, eager attention),
`save_pretrained`s it (one file, or sharded with a small max_shard_size), and its logits on random
tokens are what our `load_hf` models must give, <= 1e-5 relative. That checks the name table, the
grouped QKV rows, the interleaved gate/up rows, HF's rotary layout against ours, llama3 rope
scaling, head_dim != hidden / heads, tied and untied heads, biases and the vocabulary padding, all
at once. Every HF parameter is redrawn N(0, 1.6 / sqrt(hidden)) (norm weights 1 + that) so that
biases and norms are not their trivial init while the model stays well conditioned: with weights
twice that size the 256-wide grid model amplifies fp32 reordering to 1.1e-5 relative.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM

from bridge.numerics import relative_error
from jaxside.models import llama as jax_llama
from jaxside.sharding import make_mesh
from twinspec import hf_llama
from twinspec.llama import LlamaConfig
from tests.bridge.hf_cases import (
    CASES,
    FP8_DEFECTS,
    TOLERANCE,
    break_fp8,
    dequantize_blocks,
    fp8_hf_checkpoint,
    hf_model,
    our_rows,
    random_tokens,
    reference_logits,
    save,
    torch_logits,
)
from tests.bridge.hf_reads import counting, load_on_fsdp_tp_rank
from tests.distributed import run_processes, run_threads
from torchside.models import llama as torch_llama
from torchside.models.llama_hf import DTYPES
from torchside.modules.multihead_attention import fused_from_qkv


@nnx.jit
def _jax_forward(model, tokens):
    return model(tokens)


def jax_logits(model, tokens: torch.Tensor) -> np.ndarray:
    """[B, S, V]; one jitted program (op-by-op dispatch compiles every op: 3x slower here)."""
    return np.asarray(_jax_forward(model, jnp.asarray(tokens.numpy()))).transpose(1, 0, 2)


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """torch's pure-torch kernels: the Triton interpreter adds nothing here, is slow, and fails in threaded ranks."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray, torch.Tensor]]:
    """Per case: (directory, transformers' logits, tokens); the first case sharded over files, the others one file."""
    out = {}
    for i, case in enumerate(CASES):
        model = hf_model(case)
        directory = save(model, tmp_path_factory.mktemp(case), sharded=i == 0)
        tokens = random_tokens(model.config.vocab_size)
        out[case] = (directory, reference_logits(model, tokens), tokens)
    return out


@pytest.mark.parametrize("case", CASES)
def test_torch_load_hf_gives_transformers_logits(checkpoints, case):
    directory, reference, tokens = checkpoints[case]
    model = torch_llama.load_hf(directory)
    assert relative_error(torch_logits(model, tokens), reference) <= TOLERANCE


# The tied odd-vocabulary case runs sharded below; one device adds only a compilation (~5 s here).
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.grid) if c == "gqa_tied_odd_vocab" else c for c in CASES]
)
def test_jax_load_hf_gives_transformers_logits(checkpoints, case):
    directory, reference, tokens = checkpoints[case]
    model = jax_llama.load_hf(directory)
    assert relative_error(jax_logits(model, tokens), reference) <= TOLERANCE


def test_the_llama3_case_depends_on_its_rope_scaling(checkpoints):
    """Without the scaling transformers' own logits move far past the tolerance: the case tests it."""
    _, reference, tokens = checkpoints["llama3_rope_head_dim"]
    scaled = hf_model("llama3_rope_head_dim")
    config = scaled.config.to_dict() | {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    unscaled = LlamaForCausalLM(HFConfig(**config)).eval()
    unscaled.load_state_dict(scaled.state_dict())
    assert relative_error(reference_logits(unscaled, tokens), reference) > 1e-3


def test_jax_twin_on_an_8_device_mesh_pads_the_vocab_and_shards_by_the_rules(checkpoints):
    directory, reference, tokens = checkpoints["gqa_tied_odd_vocab"]
    mesh = make_mesh(dp_shard=4, tp=2)
    model = jax_llama.load_hf(directory, mesh=mesh)
    assert relative_error(jax_logits(model, tokens), reference) <= TOLERANCE
    kernel = model.embedding.kernel.get_value()
    assert kernel.shape == (64, 136)  # 129 rounded up to a multiple of tp x dp_shard = 8
    assert tuple(kernel.sharding.spec) == (None, ("tp", "dp_shard"))
    assert np.all(np.asarray(kernel)[:, 129:] == 0)


def test_jax_load_reads_each_devices_shard_on_its_own(checkpoints, monkeypatch):
    """dp_shard 4 x tp 2: the elements read are exactly the devices' shards (each replica read by its device)."""
    directory, reference, tokens = checkpoints["mha_untied_bias"]
    read = [0]  # elements handed out by read_box (zeros of the padding counted as read)
    read_box = hf_llama.Checkpoint.read_box

    def counting_read_box(self, ours, rows, cols, framework, put):
        def counting_put(piece, values):
            read[0] += (piece.stop - piece.start) * (1 if cols is None else cols[1] - cols[0])
            put(piece, values)

        read_box(self, ours, rows, cols, framework, counting_put)

    monkeypatch.setattr(hf_llama.Checkpoint, "read_box", counting_read_box)
    model = jax_llama.load_hf(directory, mesh=make_mesh(dp_shard=4, tp=2))
    params = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert read[0] == sum(shard.data.size for p in params for shard in p.addressable_shards)
    assert relative_error(jax_logits(model, tokens), reference) <= TOLERANCE


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_each_jax_shard_is_the_files_values_at_its_index(tmp_path, dtype):
    """dp_shard 4 x tp 2, a bf16 checkpoint: every device's shard of every parameter is the file's values there."""
    hf = hf_model("mha_untied_bias").to(torch.bfloat16)
    directory = save(hf, tmp_path, sharded=True)
    files = {name: tensor.float().numpy() for name, tensor in hf.state_dict().items()}
    model = jax_llama.load_hf(directory, mesh=make_mesh(dp_shard=4, tp=2), dtype=dtype)
    checkpoint = hf_llama.Checkpoint(directory)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        loaded = variable.get_value()
        ours = jax_llama.torch_name(".".join(map(str, path)), loaded.ndim)
        expected = np.zeros(loaded.shape[::-1], np.float32)  # torch's layout; the padded vocabulary's rows stay 0
        for hf_name, rows in our_rows(checkpoint.sources[ours], checkpoint.config, expected.shape[0]).items():
            expected[rows] = files[hf_name]
        expected = expected.T
        assert loaded.dtype == dtype
        for shard in loaded.addressable_shards:
            assert np.array_equal(np.asarray(shard.data).astype(np.float32), expected[shard.index]), ours


def test_a_second_jax_load_compiles_nothing(checkpoints, caplog):
    """No program is built from the model's construction: loading again finds every program it needs compiled."""
    directory, _, _ = checkpoints["mha_untied_bias"]
    mesh = make_mesh(dp_shard=4, tp=2)
    jax_llama.load_hf(directory, mesh=mesh)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        jax_llama.load_hf(directory, mesh=mesh)
    assert not [record.getMessage() for record in caplog.records if "ompil" in record.getMessage()]


@pytest.mark.grid
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("axes", [(1, 8, 1), (2, 2, 2), (1, 2, 4), (8, 1, 1)])
def test_jax_twin_on_every_mesh(checkpoints, case, axes):
    directory, reference, tokens = checkpoints[case]
    model = jax_llama.load_hf(directory, mesh=make_mesh(*axes))
    assert relative_error(jax_logits(model, tokens), reference) <= TOLERANCE


def _load_on_fsdp_tp(rank: int, world_size: int, directory: Path, tokens: torch.Tensor, read: dict):
    """hf_reads' rank on a thread, and the elements its read_box calls put (counted by thread name)."""
    return (*load_on_fsdp_tp_rank(rank, world_size, str(directory), tokens), read[f"rank{rank}"])


def _checkpoint_bytes(directory: Path) -> int:
    return sum(
        math.prod(info.shape) * torch.finfo(DTYPES[info.dtype]).bits // 8
        for info in hf_llama.Checkpoint(directory).tensors.values()
    )


# Exact: safetensors hands out exactly the requested rows and columns, so a rank's tensor bytes are at
# most its local shards' bytes (the vocabulary padding's zero rows are not read). What is not counted:
# the headers, which every rank parses (the index check) and which are a few KiB per file.
READ_SLACK_BYTES = 0


def _assert_reads_its_own_bytes(read_bytes: int, local_bytes: int, checkpoint_bytes: int) -> None:
    """Bytes read are what safetensors hands the rank (tests/bridge/hf_reads.py): bounded by the rank's local
    parameter bytes (its FSDP x TP shards, plus its copies of the TP-replicated norms) plus READ_SLACK_BYTES,
    and far below the checkpoint's, which a rank reading whole tensors would reach."""
    assert 0 < read_bytes <= local_bytes + READ_SLACK_BYTES
    assert read_bytes < 0.3 * checkpoint_bytes  # a quarter each, plus the replicated norms


# (llama3_rope_head_dim is MQA: one key/value head, which TP 2 cannot split: DotProductAttention refuses it)
@pytest.mark.parametrize("case", [case for case in CASES if CASES[case]["num_key_value_heads"] % 2 == 0])
def test_torch_fsdp2_x_tp_load_gives_transformers_logits(checkpoints, monkeypatch, case):
    """FSDP2 x TP (2 x 2, threaded process group): each rank reads exactly the elements of its own shards, and
    safetensors hands it no more bytes than those (the gloo-process run of the same: the grid test below)."""
    import safetensors

    directory, reference, tokens = checkpoints[case]
    config = hf_llama.Checkpoint(directory).config
    read: dict[str, int] = {}  # by thread name: elements read (zeros of the padding counted as read)
    read_box = hf_llama.Checkpoint.read_box

    def counting_read_box(self, ours, rows, cols, framework, put):
        def counting_put(piece, values):
            columns = 1 if cols is None else cols[1] - cols[0]
            rank = threading.current_thread().name
            read[rank] = read.get(rank, 0) + (piece.stop - piece.start) * columns
            put(piece, values)

        read_box(self, ours, rows, cols, framework, counting_put)

    monkeypatch.setattr(hf_llama.Checkpoint, "read_box", counting_read_box)
    monkeypatch.setattr(safetensors, "safe_open", counting(safetensors.safe_open))  # undone after the test
    results = run_threads(_load_on_fsdp_tp, 4, directory, tokens, read, timeout=120)
    for logits, shape, placements, local_elements, local_bytes, read_bytes, read_elements in results:
        assert relative_error(logits, reference) <= TOLERANCE
        assert shape == (-(-config.vocab_size // 4) * 4, config.hidden_size)  # a multiple of dp x tp = 4
        assert placements == ("_StridedShard", "Shard")
        assert read_elements == local_elements
        _assert_reads_its_own_bytes(read_bytes, local_bytes, _checkpoint_bytes(directory))


@pytest.mark.multiprocess
@pytest.mark.slow  # ~13 s of CPU over the 4 ranks, most of it importing torch
@pytest.mark.grid  # CI time (20-37 s): the threaded test above makes the same checks on the same loader
def test_fsdp2_x_tp_ranks_on_gloo_processes_read_only_their_own_bytes(checkpoints):
    """4 gloo processes (2 x 2): transformers' logits, and each rank reads about a quarter of the checkpoint."""
    directory, reference, tokens = checkpoints["gqa_tied_odd_vocab"]  # sharded over a dozen files, vocab padded
    results = run_processes(load_on_fsdp_tp_rank, 4, str(directory), tokens, timeout=120)
    for logits, shape, placements, _, local_bytes, read_bytes in results:
        assert relative_error(logits, reference) <= TOLERANCE
        assert shape == (132, 64) and placements == ("_StridedShard", "Shard")
        _assert_reads_its_own_bytes(read_bytes, local_bytes, _checkpoint_bytes(directory))


@pytest.mark.grid
@pytest.mark.parametrize("case", CASES)
def test_wider_models_match(tmp_path, case):
    model = hf_model(case, vocab=1000, hidden=256, layers=4)
    directory = save(model, tmp_path, sharded=True)
    tokens = random_tokens(1000, batch=2, seq=64)
    reference = reference_logits(model, tokens)
    assert relative_error(torch_logits(torch_llama.load_hf(directory), tokens), reference) <= TOLERANCE
    assert relative_error(jax_logits(jax_llama.load_hf(directory, mesh=make_mesh(2, 2, 2)), tokens), reference) <= TOLERANCE


# ---- the table


SMALL = LlamaConfig(vocab_size=11, hidden_size=8, num_layers=1, num_heads=6, num_kv_heads=2, ffn_hidden_size=5,
                    head_dim=3, tie_word_embeddings=False, bias=True, vocab_multiple=4)  # fmt: skip


def _assemble(source, start, stop, hf_tensors):
    out = torch.full((stop - start,), float("nan"))
    for piece in hf_llama.row_pieces(source, SMALL, start, stop):
        values = torch.zeros(piece.stop - piece.start) if piece.hf_name is None else hf_tensors[piece.hf_name]
        values = values if piece.hf_name is None else values[piece.start : piece.stop]
        out[piece.dest : piece.dest + (piece.stop - piece.start) * piece.step : piece.step] = values
    return out


def test_row_pieces_of_any_row_range_rebuild_the_fused_rows():
    """Every sub-range of our rows, read piece by piece, equals torchside's own fused layouts (independent code)."""
    table = hf_llama.sources(SMALL)
    hf = {name: torch.arange(shape[0], dtype=torch.float32) + 100 * i
          for i, (name, shape) in enumerate(hf_llama.hf_shapes(SMALL).items())}  # fmt: skip
    layer = "model.layers.0."
    q, k, v = (hf[f"{layer}self_attn.{p}_proj.bias"] for p in "qkv")
    gate, up = hf[f"{layer}mlp.gate_proj.bias"], hf[f"{layer}mlp.up_proj.bias"]
    embedding = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(1)])
    expected = {
        "layers.0.self_attention.layernorm_qkv.bias": fused_from_qkv(q, k, v, groups=2, head_dim=3),
        "layers.0.layernorm_mlp.fc1_bias": torch.stack([gate, up], dim=1).flatten(),
        "embedding.weight": embedding,
    }
    for name, full in expected.items():
        for start in range(len(full)):
            for stop in range(start + 1, len(full) + 1):
                assert torch.equal(_assemble(table[name], start, stop, hf), full[start:stop]), (name, start, stop)
        rows = our_rows(table[name], SMALL, len(full))
        for hf_name, ours in rows.items():
            assert torch.equal(full[ours], hf[hf_name])  # the writer's direction


def test_row_pieces_of_runs_of_w_rebuild_fc1():
    """glu_interleave w = 3: every sub-range of fc1's rows, read piece by piece, is gate run j then up run j."""
    config = dataclasses.replace(SMALL, ffn_hidden_size=6, glu_interleave=3)
    source = hf_llama.sources(config)["layers.0.layernorm_mlp.fc1_bias"]
    gate, up = torch.arange(6.0), torch.arange(6.0) + 100
    full = torch.tensor([0.0, 1, 2, 100, 101, 102, 3, 4, 5, 103, 104, 105])  # written out by hand
    hf = {source.hf_names[0]: gate, source.hf_names[1]: up}
    for start in range(len(full)):
        for stop in range(start + 1, len(full) + 1):
            out = torch.full((stop - start,), float("nan"))
            for piece in hf_llama.row_pieces(source, config, start, stop):
                values = hf[piece.hf_name][piece.start : piece.stop]
                out[piece.dest : piece.dest + (piece.stop - piece.start) * piece.step : piece.step] = values
            assert torch.equal(out, full[start:stop]), (start, stop)
    rows = our_rows(source, config, len(full))
    assert torch.equal(full[rows[source.hf_names[0]]], gate) and torch.equal(full[rows[source.hf_names[1]]], up)


def test_the_names_pair_with_the_bridge_and_both_directions_agree():
    from bridge.params import pair_models

    config = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                         tie_word_embeddings=False, bias=True)  # fmt: skip
    twin = nnx.eval_shape(lambda: jax_llama.Llama(config, rngs=nnx.Rngs(0)))  # shapes only: no init to compile
    pairs = pair_models(torch_llama.Llama(config, device="meta"), twin)
    assert {p.torch_name for p in pairs} == set(hf_llama.sources(config))
    assert all(jax_llama.torch_name(p.jax_name, 2 if p.layout.transposes else 1) == p.torch_name for p in pairs)
    ours_of = hf_llama.ours_of(config)
    assert set(ours_of) == set(hf_llama.hf_shapes(config)) and set(ours_of.values()) == set(hf_llama.sources(config))


def test_bf16_checkpoints_load_bit_for_bit_in_both_frameworks(tmp_path):
    """Every HF tensor, rebuilt from our parameters by the table's writer direction, is the checkpoint's bytes."""
    hf = hf_model("mha_untied_bias").to(torch.bfloat16)
    directory = save(hf, tmp_path, sharded=True)
    expected = hf.state_dict()
    ours_torch = dict(torch_llama.load_hf(directory).named_parameters())
    twin = jax_llama.load_hf(directory)
    ours_jax = {
        jax_llama.torch_name(".".join(map(str, path)), v.get_value().ndim): v.get_value()
        for path, v in nnx.to_flat_state(nnx.state(twin, nnx.Param))
    }
    config = hf_llama.Checkpoint(directory).config
    for ours, source in hf_llama.sources(config).items():
        from_jax = torch.from_numpy(np.asarray(ours_jax[ours]).astype(np.float32)).to(torch.bfloat16)
        from_jax = from_jax.T if from_jax.dim() == 2 else from_jax
        for tensor in (ours_torch[ours].detach(), from_jax):
            assert tensor.dtype == torch.bfloat16
            for hf_name, rows in our_rows(source, config, tensor.shape[0]).items():
                assert torch.equal(tensor[rows].view(torch.int16), expected[hf_name].view(torch.int16)), hf_name


def _load_under_current_scaling(rank: int, world_size: int, directory: Path) -> dict[str, torch.Tensor]:
    """A bf16 checkpoint loaded under the caller's quantized_model_init: every FP8 weight's values, gathered."""
    from torch.distributed.tensor import DTensor

    from torchside.autocast import quantized_model_init
    from torchside.models.llama_parallel import build_meshes
    from torchside.quantization import QuantizedTensor
    from torchside.recipe import Float8CurrentScaling

    meshes = build_meshes("cpu", dp=2, tp=2) if world_size > 1 else None
    with quantized_model_init(recipe=Float8CurrentScaling()):
        meshes = {"mesh": meshes.data, "tp_mesh": meshes.tp, "weight_mesh": meshes.weight} if meshes else {}
        model = torch_llama.load_hf(directory, **meshes)
    values = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if not isinstance(local, QuantizedTensor):
            continue
        values[name] = local.dequantize(torch.float32)
        if isinstance(param, DTensor):
            layout = {"shape": param.shape, "stride": param.stride()}
            values[name] = DTensor.from_local(values[name], param.device_mesh, param.placements, **layout).full_tensor()
    return values


def test_a_bf16_checkpoint_under_quantized_model_init_loads_as_fp8_weights_of_that_recipe(tmp_path):
    """Each FP8 weight (one device, and FSDP2 x TP 2 x 2 threaded) is the reference current-scaling cast of the
    whole HF weight fused by the table: one scale over all its shards."""
    from fp8kernels import reference

    hf = hf_model("mha_untied_bias").to(torch.bfloat16)
    directory = save(hf, tmp_path, sharded=False)
    config = hf_llama.Checkpoint(directory).config
    expected = {}
    kv, h = config.num_kv_heads, config.head_dim
    for ours, source in hf_llama.fp8_sources(config).items():
        parts = [hf.state_dict()[name].float() for name in source.hf_names]
        if len(parts) == 3:  # q, k, v -> rows grouped by kv head: its q heads, its k head, its v head
            q, k, v = (t.reshape(kv, -1, t.shape[-1]) for t in parts)
            fused = torch.cat([q, k, v], dim=1).flatten(0, 1)
        elif len(parts) == 2:  # gate, up -> interleaved rows
            fused = torch.stack(parts, dim=1).flatten(0, 1)
        else:
            (fused,) = parts
        expected[ours] = reference.dequantize(reference.quantize_tensorwise(fused))
    for values in (_load_under_current_scaling(0, 1, directory), *run_threads(_load_under_current_scaling, 4, directory)):
        assert sorted(values) == sorted(expected)
        for name, tensor in values.items():
            assert torch.equal(tensor, expected[name]), name


# ---- FP8 block-scaled checkpoints: bytes and scales kept (torch), dequantized exactly (JAX)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(directory, transformers' fp32 model with the dequantized weights, the tensors written, tokens)."""
    directory, model, tensors = fp8_hf_checkpoint(tmp_path_factory.mktemp("fp8") / "hf")
    return directory, model, tensors, random_tokens(model.config.vocab_size)


def _hf_rows_of(tensor: torch.Tensor, source, config) -> dict[str, torch.Tensor]:
    """Each HF tensor's rows of our full `tensor` (the table's writer direction)."""
    return {name: tensor[rows] for name, rows in our_rows(source, config, tensor.shape[0]).items()}


def test_fp8_checkpoint_loads_as_float8_block_scaling_parameters_with_the_files_bytes(fp8_checkpoint):
    from torchside.checkpoint import quantized_params

    directory, _, tensors, _ = fp8_checkpoint
    model = torch_llama.load_hf(directory, dtype=torch.float32)
    config = model.config
    assert config.glu_interleave == 128
    fp8 = {name: p for name, p in model.named_parameters() if quantized_params.is_quantized(p)}
    assert set(fp8) == set(hf_llama.fp8_sources(config))  # every projection weight; norms, embedding, head not
    for name, param in fp8.items():
        source = hf_llama.sources(config)[name]
        storage = quantized_params.local_of(param).quantized_storage
        assert (storage.scheme, storage.fmt) == ("block128x128", "e4m3")
        # Our scale block-rows, expanded to rows, pair with the HF scale rows exactly as the data rows do.
        scale_rows = storage.rowwise_scale_inv.repeat_interleave(128, 0)
        data, scales = _hf_rows_of(storage.rowwise_data, source, config), _hf_rows_of(scale_rows, source, config)
        values = _hf_rows_of(storage.dequantize(torch.float32), source, config)
        for hf_name in source.hf_names:
            assert torch.equal(data[hf_name], tensors[hf_name].view(torch.uint8)), hf_name
            assert torch.equal(scales[hf_name][::128], tensors[hf_name + "_scale_inv"]), hf_name
            reference = dequantize_blocks(tensors[hf_name], tensors[hf_name + "_scale_inv"])
            assert torch.equal(values[hf_name], reference.float()), hf_name  # the float64 formula, rounded once
        assert torch.equal(storage.columnwise_data, storage.rowwise_data.t())
        assert torch.equal(storage.columnwise_scale_inv, storage.rowwise_scale_inv.t())
    assert model.embedding.weight.dtype == model.lm_head.weight.dtype == model.norm.weight.dtype == torch.float32


def test_fp8_checkpoint_gives_the_logits_of_its_dequantized_weights(fp8_checkpoint):
    """FP8 off: our FP8 parameters dequantize in the GEMMs; transformers holds the float64-dequantized weights."""
    directory, reference_model, tensors, tokens = fp8_checkpoint
    reference = reference_logits(reference_model, tokens)
    assert relative_error(torch_logits(torch_llama.load_hf(directory, dtype=torch.float32), tokens), reference) <= TOLERANCE
    twin = jax_llama.load_hf(directory, dtype=jnp.float32)  # (on 8 devices: 1e-6, 10 s more here)
    assert relative_error(jax_logits(twin, tokens), reference) <= TOLERANCE
    config = hf_llama.Checkpoint(directory).config
    fc1 = torch.tensor(np.asarray(twin.layers[0].layernorm_mlp.fc1_kernel.get_value()).T)  # glu_interleave 128
    for hf_name, rows in _hf_rows_of(fc1, hf_llama.sources(config)["layers.0.layernorm_mlp.fc1_weight"], config).items():
        assert torch.equal(rows, dequantize_blocks(tensors[hf_name], tensors[hf_name + "_scale_inv"]).float())  # exact


@pytest.mark.parametrize("defect", FP8_DEFECTS)
def test_bad_fp8_checkpoints_are_refused_naming_the_file_and_tensor(fp8_checkpoint, tmp_path, defect):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_checkpoint[0], bad)
    words = break_fp8(bad, defect)
    with pytest.raises(ValueError) as error:
        torch_llama.load_hf(bad)
    assert all(word in str(error.value) for word in words), (words, str(error.value))


def _load_fp8_on_fsdp_tp(rank: int, world_size: int, directory: Path, tokens: torch.Tensor, full: dict):
    from torchside.checkpoint import quantized_params
    from torchside.models.llama_parallel import build_meshes

    meshes = build_meshes("cpu", dp=2, tp=2)
    model = torch_llama.load_hf(directory, mesh=meshes.data, tp_mesh=meshes.tp, dtype=torch.float32)
    differ = []
    for name, param in model.named_parameters():
        if quantized_params.is_quantized(param):
            (chunk,) = param.__create_chunk_list__()  # this rank's box, as DCP describes it
            (r0, c0), (rows, cols) = chunk.offsets, chunk.sizes
            storage = quantized_params.local_of(param).quantized_storage
            data, scales = full[name]
            blocks = slice(r0 // 128, -(-(r0 + rows) // 128)), slice(c0 // 128, -(-(c0 + cols) // 128))
            if not torch.equal(storage.rowwise_data, data[r0 : r0 + rows, c0 : c0 + cols]):
                differ.append(f"{name} data")
            if not torch.equal(storage.rowwise_scale_inv, scales[blocks]):
                differ.append(f"{name} scales")
    return torch_logits(model, tokens), differ, len(quantized_params.local_of(model.layers[0].layernorm_mlp.fc1_weight))


def test_torch_fsdp2_x_tp_fp8_load_keeps_every_shards_bytes_and_scales(tmp_path):
    """FSDP2 x TP (2 x 2, threaded): each rank's FP8 shard holds the single-device load's bytes and scales of its box."""
    from torchside.checkpoint import quantized_params

    directory, reference_model, _ = fp8_hf_checkpoint(tmp_path / "hf", num_attention_heads=4, num_key_value_heads=2)
    tokens = random_tokens(reference_model.config.vocab_size)
    single = torch_llama.load_hf(directory, dtype=torch.float32)
    full = {}
    for name, param in single.named_parameters():
        if quantized_params.is_quantized(param):
            storage = quantized_params.local_of(param).quantized_storage
            full[name] = (storage.rowwise_data, storage.rowwise_scale_inv)
    reference = reference_logits(reference_model, tokens)
    for logits, differ, fc1_rows in run_threads(_load_fp8_on_fsdp_tp, 4, directory, tokens, full, timeout=120):
        assert relative_error(logits, reference) <= TOLERANCE
        assert differ == []
        assert fc1_rows == 128  # 512 rows over tp 2 x dp 2: one 128-row block, one HF block-row, per rank


def test_fp8_with_head_dim_64_is_refused_not_requantized(tmp_path):
    directory, _, _ = fp8_hf_checkpoint(tmp_path / "hf", head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"config\.json: head_dim=64 is not a multiple of 128.*requantizing them is lossy"):
        jax_llama.load_hf(directory)


def test_the_bridge_moves_a_torch_llama_into_the_twin_with_the_same_logits():
    """As the demo (bridge/demo/jax_side.py) uses the twin: pair the models, move the values by each pair's layout, run."""
    from bridge.params import load_into_jax, pair_models

    config = LlamaConfig(vocab_size=96, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = torch_llama.Llama(config)
    twin = jax_llama.Llama(config, kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
    values = {}
    for pair in pair_models(model, twin):
        tensor = model.get_parameter(pair.torch_name).detach()
        values[pair.jax_path] = jnp.asarray((tensor.T if pair.layout.transposes else tensor).numpy())
    load_into_jax(twin, values)
    tokens = random_tokens(config.vocab_size)
    assert relative_error(jax_logits(twin, tokens), torch_logits(model, tokens)) <= TOLERANCE


# ---- bad input: ValueError naming the file and the tensor, before anything is built


def _edit_index(directory: Path, edit) -> None:
    path = directory / hf_llama.INDEX_FILE
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


@pytest.fixture
def sharded(tmp_path) -> Path:
    return save(hf_model("gqa_tied_odd_vocab"), tmp_path / "hf", sharded=True)


def test_unknown_architecture(sharded):
    config = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config\.json: architectures=\['MistralForCausalLM'\]"):
        torch_llama.load_hf(sharded)


def test_shape_mismatch_with_the_config(sharded):
    config = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ValueError, match=r"model-\d+-of-\d+\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj"):
        jax_llama.load_hf(sharded)


def test_missing_tensor(sharded):
    name = "model.layers.1.self_attn.k_proj.weight"
    file = sharded / json.loads((sharded / hf_llama.INDEX_FILE).read_text())["weight_map"][name]
    file.unlink()
    _edit_index(sharded, lambda weights: [weights.pop(n) for n in [n for n, f in weights.items() if f == file.name]])
    with pytest.raises(ValueError, match=rf"{sharded}: tensor '{name}' is missing"):
        hf_llama.Checkpoint(sharded)


def test_index_naming_a_missing_file(sharded):
    _edit_index(sharded, lambda weights: weights.update({"model.norm.weight": "model-00099-of-00099.safetensors"}))
    with pytest.raises(ValueError, match=r"index\.json: tensor 'model\.norm\.weight' is in 'model-00099"):
        torch_llama.load_hf(sharded)


def test_truncated_shard(sharded):
    file = sorted(sharded.glob("model-*.safetensors"))[1]
    file.write_bytes(file.read_bytes()[:-7])
    with pytest.raises(ValueError, match=rf"{file}: not a readable safetensors file"):
        jax_llama.load_hf(sharded)


def test_corrupt_config_json(sharded):
    (sharded / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not readable JSON"):
        hf_llama.Checkpoint(sharded)

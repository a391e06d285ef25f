"""`shardbridge convert --from hf` / `--to hf`: Hugging Face Llama directories in and out of DCP and Orbax.

References are independent of the converter: transformers' `save_pretrained` writes the source
(its files, names, sharding and index), and its `LlamaForCausalLM` gives the logits. A round trip
must give back the very bytes of every tensor and the same index; a DCP made from HF must load
into our torch Llama and give transformers' logits.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from bridge import cli
from bridge.convert import convert, facts, hf, open_reader
from bridge.convert.plan import make_plan
from bridge.numerics import relative_error
from twinspec import hf_llama
from tests.bridge.hf_cases import (
    FP8_DEFECTS,
    TOLERANCE,
    break_fp8,
    fp8_hf_checkpoint,
    hf_model,
    random_tokens,
    reference_logits,
    save,
    torch_logits,
)
from tests.distributed import run_threads
from torchside.models import llama as torch_llama

SHARD = "20KB"  # the size tests/bridge/hf_cases.save shards with: a dozen files for the tiny model


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """bf16, untied with biases, sharded over files with an index; fp32, tied, odd vocabulary, one file;
    FP8 block-scaled (F8_E4M3 weights + fp32 weight_scale_inv, bf16 embedding, head and norms), sharded."""
    out = {}
    for name, case, dtype, sharded in (
        ("bf16_sharded", "mha_untied_bias", torch.bfloat16, True),
        ("fp32_single", "gqa_tied_odd_vocab", torch.float32, False),
    ):
        model = hf_model(case)
        out[name] = (save(model.to(dtype), tmp_path_factory.mktemp(name), sharded), model)
    directory, model, _ = fp8_hf_checkpoint(tmp_path_factory.mktemp("fp8") / "hf", sharded=True)
    out["fp8_sharded"] = (directory, model)
    return out


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    return {name: t for file in files for name, t in load_file(file).items()}


def assert_same_checkpoint(got: Path, expected: Path) -> None:
    """Every tensor byte-identical (same names, dtypes, shapes), the same files and index, the same config."""
    want, have = tensors_of(expected), tensors_of(got)
    assert have.keys() == want.keys()
    for name, tensor in want.items():
        assert have[name].dtype == tensor.dtype and have[name].shape == tensor.shape, name
        assert torch.equal(have[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert sorted(p.name for p in got.glob("*.safetensors")) == sorted(p.name for p in expected.glob("*.safetensors"))
    index = expected / hf_llama.INDEX_FILE
    assert (got / hf_llama.INDEX_FILE).exists() == index.exists()
    if index.exists():
        assert json.loads((got / hf_llama.INDEX_FILE).read_text()) == json.loads(index.read_text())
    assert (got / "config.json").read_bytes() == (expected / "config.json").read_bytes()


@pytest.mark.parametrize("via", ["dcp", "orbax", "safetensors"])
@pytest.mark.parametrize("source", ["bf16_sharded", "fp32_single", "fp8_sharded"])
def test_hf_roundtrip_is_byte_identical(sources, source, via, tmp_path):
    """FP8: the bytes and scales travel as torchside's FP8 buffers (uint8 data, fp32 scale_inv), never dequantized."""
    directory, _ = sources[source]
    shard_size = SHARD if (directory / hf_llama.INDEX_FILE).exists() else "1GB"
    assert cli.main(["convert", str(directory), str(tmp_path / via), "--from", "hf", "--to", via]) == 0
    held = open_reader(via, tmp_path / via).tensors
    fp8 = {key: info.dtype for key, info in held.items() if key.endswith(("rowwise_data", "rowwise_scale_inv"))}
    assert len(fp8) == (16 if source == "fp8_sharded" else 0)  # (qkv, proj, fc1, fc2) x 2 layers x (data, scales)
    assert set(fp8.values()) <= {"uint8", "float32"}
    back = ["convert", str(tmp_path / via), str(tmp_path / "back"), "--from", via, "--to", "hf"]
    assert cli.main([*back, "--config", str(directory), "--max-shard-size", shard_size]) == 0
    assert_same_checkpoint(tmp_path / "back", directory)


def test_hf_to_dcp_loads_into_our_llama_with_transformers_logits(sources, tmp_path):
    directory, reference_model = sources["fp32_single"]
    assert convert(directory, "hf", tmp_path / "dcp", "dcp").ok
    config, _ = hf_llama.read_config(directory)
    model = torch_llama.Llama(config, params_dtype=torch.float32)
    state = {f"model.{name}": param.data for name, param in model.named_parameters()}
    dcp.load(state, checkpoint_id=tmp_path / "dcp", no_dist=True)  # the keys torchside's AppState saves

    tokens = random_tokens(config.vocab_size)
    logits = torch_logits(model, tokens)
    assert relative_error(logits, reference_logits(reference_model, tokens)) <= TOLERANCE
    assert (logits == torch_logits(torch_llama.load_hf(directory), tokens)).all()  # the same weights as load_hf's


def _convert_on_ranks(rank: int, world: int, directory: Path, target: Path, read: dict):
    result = convert(directory, "hf", target, "dcp")
    mine = sum(math.prod(sizes) for entry in result.plan.entries for _, sizes in entry.boxes[rank])
    return result.ok, mine, read.get(threading.current_thread().name, 0)


def test_hf_to_dcp_on_two_ranks_each_reads_only_its_own_rows(sources, tmp_path, monkeypatch):
    """Two writers (threaded process group): each reads exactly the elements of its own boxes; the result is the same."""
    directory, _ = sources["bf16_sharded"]
    read: dict[str, int] = {}  # by thread name: elements read
    read_box = hf_llama.Checkpoint.read_box

    def counting_read_box(self, ours, rows, cols, framework, put):
        def counting_put(piece, values):
            rank = threading.current_thread().name
            read[rank] = read.get(rank, 0) + values.numel()
            put(piece, values)

        read_box(self, ours, rows, cols, framework, counting_put)

    monkeypatch.setattr(hf_llama.Checkpoint, "read_box", counting_read_box)
    results = run_threads(_convert_on_ranks, 2, directory, tmp_path / "two", read, timeout=120)
    monkeypatch.undo()
    assert all(ok and mine > 0 for ok, mine, _ in results)
    assert [got for _, _, got in results] == [mine for _, mine, _ in results]  # (the read-back reads the DCP target)
    assert convert(directory, "hf", tmp_path / "one", "dcp").ok
    like = {k: torch.empty(info.shape, dtype=getattr(torch, info.dtype)) for k, info in hf.HfReader(directory).tensors.items()}
    one, two = ({k: v.clone() for k, v in like.items()} for _ in range(2))
    dcp.load(one, checkpoint_id=tmp_path / "one", no_dist=True)
    dcp.load(two, checkpoint_id=tmp_path / "two", no_dist=True)
    assert all(torch.equal(one[k].view(torch.uint8), two[k].view(torch.uint8)) for k in one)


@pytest.mark.parametrize("source", ["bf16_sharded", "fp8_sharded"])
def test_a_torchside_save_of_our_llama_exports_to_hf(sources, tmp_path, source):
    """Our keys are the ones torchside.checkpoint.save writes for a Llama: its step exports back to the same HF files.

    FP8: the model holds Float8BlockScaling parameters with glu_interleave 128; shardbridge.json records both.
    """
    from torchside import checkpoint

    directory, _ = sources[source]
    checkpoint.save(tmp_path / "run", torch_llama.load_hf(directory), step=3)
    shard_size = SHARD if (directory / hf_llama.INDEX_FILE).exists() else "1GB"
    argv = ["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--from", "dcp", "--to", "hf"]
    assert cli.main([*argv, "--config", str(directory), "--max-shard-size", shard_size]) == 0  # train.step, rng: left out
    assert_same_checkpoint(tmp_path / "hf", directory)


def test_a_high_precision_fc1_in_runs_of_w_exports_by_its_recorded_layout(sources, tmp_path):
    """A bf16 model with glu_interleave 32 (fc1 rows permuted by hand from load_hf's pairs) exports to the same HF files."""
    import dataclasses

    from torchside import checkpoint

    directory, _ = sources["bf16_sharded"]
    pairs = torch_llama.load_hf(directory)  # w = 1: rows 2i gate i, 2i + 1 up i
    model = torch_llama.Llama(dataclasses.replace(pairs.config, glu_interleave=32), params_dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = pairs.get_parameter(name)
            if "fc1" in name:  # runs of 32: gate rows 32j .. 32j + 31, then the same up rows
                gate, up = (value[parity::2].unflatten(0, (-1, 32)) for parity in (0, 1))
                value = torch.stack([gate, up], dim=1).flatten(0, 2)
            param.copy_(value)
    checkpoint.save(tmp_path / "run", model, step=1)
    argv = ["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--from", "dcp", "--to", "hf"]
    assert cli.main([*argv, "--config", str(directory), "--max-shard-size", SHARD]) == 0
    assert_same_checkpoint(tmp_path / "hf", directory)


def test_an_hf_export_produces_no_more_than_one_hf_tensor_at_a_time_and_verifies_every_tensor(sources, tmp_path):
    """Each of our tensors is produced in row blocks no larger than the largest of its HF tensors (the fused QKV
    and fc1 never whole), and the blocks' checksums still verify every tensor against the files written."""
    directory, _ = sources["bf16_sharded"]  # MHA: q, k, v of 64 rows each, fused into 192
    assert convert(directory, "hf", tmp_path / "dcp", "dcp").ok
    produced: list[tuple[str, int]] = []
    options = {"config": directory, "max_shard_size": SHARD}
    result = convert(tmp_path / "dcp", "dcp", tmp_path / "hf", "hf", target_options=options,
                     on_box=lambda key, nbytes: produced.append((key, nbytes)))  # fmt: skip
    assert result.ok and all(c.produced is not None and c.written is not None for c in result.checksums)
    assert_same_checkpoint(tmp_path / "hf", directory)
    hf_bytes = {name: tensor.nbytes for name, tensor in tensors_of(directory).items()}
    table = hf_llama.sources(hf_llama.read_config(directory)[0])
    for key, nbytes in produced:
        assert nbytes <= max(hf_bytes[name] for name in table[key.removeprefix("model.")].hf_names), key
    for fused in ("self_attention.layernorm_qkv.weight", "layernorm_mlp.fc1_weight"):
        blocks = [nbytes for key, nbytes in produced if key == f"model.layers.0.{fused}"]
        assert len(blocks) > 1 and sum(blocks) == sum(hf_bytes[n] for n in table[f"layers.0.{fused}"].hf_names)


def _fp8_llama_save(directory: Path, root: Path, glu_interleave: int) -> None:
    """A torchside save of a Llama of the FP8 checkpoint's config with Float8BlockScaling weights and the given fc1 layout."""
    import dataclasses

    from torchside import checkpoint
    from torchside.autocast import quantized_model_init
    from torchside.recipe import Float8BlockScaling

    config, _ = hf_llama.read_config(directory)
    with quantized_model_init(recipe=Float8BlockScaling()):
        model = torch_llama.Llama(dataclasses.replace(config, glu_interleave=glu_interleave), params_dtype=torch.bfloat16)
    checkpoint.save(root, model, step=1)


def test_an_fp8_fc1_with_another_gate_up_layout_is_refused_not_split_wrongly(sources, tmp_path, capsys):
    """glu_interleave 1: a 128-row FP8 block of fc1 holds 64 gate and 64 up rows, which no HF block holds."""
    directory, _ = sources["fp8_sharded"]
    _fp8_llama_save(directory, tmp_path / "run", glu_interleave=1)
    argv = ["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--from", "dcp", "--to", "hf", "--config", str(directory)]
    assert cli.main(argv) == 2
    assert "runs of 1 (glu_interleave)" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_loads_only_into_a_model_with_its_fc1_layout(sources, tmp_path):
    from torchside import checkpoint

    directory, _ = sources["fp8_sharded"]
    _fp8_llama_save(directory, tmp_path / "run", glu_interleave=128)
    assert json.loads(next((tmp_path / "run").glob("step-*/shardbridge.json")).read_text())["glu_interleave"] == 128
    config, _ = hf_llama.read_config(directory)
    import dataclasses

    from torchside.autocast import quantized_model_init
    from torchside.recipe import Float8BlockScaling

    with quantized_model_init(recipe=Float8BlockScaling()):
        other = torch_llama.Llama(dataclasses.replace(config, glu_interleave=1), params_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"runs of 128 \(glu_interleave\) in the checkpoint, 1 in the model"):
        checkpoint.load(tmp_path / "run", other)


def test_max_shard_size_spelling():
    assert hf.parse_size("5GB") == 5 * 10**9 and hf.parse_size("2GiB") == 2 * 2**30 and hf.parse_size(123) == 123
    with pytest.raises(ValueError, match="max-shard-size"):
        hf.parse_size("lots")


# ---- bad input: exit 2, one error line naming the file and the tensor, nothing written


def _broken_copy(source: Path, tmp_path: Path, defect: str) -> tuple[Path, tuple[str, ...]]:
    """A copy of `source` with one defect; the words its error line must hold."""
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    config = json.loads((bad / "config.json").read_text())
    files = sorted(bad.glob("model-*.safetensors"))
    if defect == "unknown architecture":
        (bad / "config.json").write_text(json.dumps(config | {"architectures": ["MistralForCausalLM"]}))
        return bad, ("config.json", "MistralForCausalLM")
    if defect == "shape mismatch":
        (bad / "config.json").write_text(json.dumps(config | {"intermediate_size": 80}))
        return bad, ("safetensors", "model.layers.0.mlp.gate_proj.weight", "config.json")
    if defect == "missing tensor":
        name = "model.layers.1.mlp.up_proj.weight"
        file = next(f for f in files if name in load_file(f))
        save_file({k: v for k, v in load_file(file).items() if k != name}, file, metadata={"format": "pt"})
        return bad, (str(bad), name)
    if defect == "index names a missing file":
        files[2].unlink()
        return bad, (hf_llama.INDEX_FILE, files[2].name, "model.layers.0")
    if defect == "truncated shard":
        held = next(iter(load_file(files[3])))
        with open(files[3], "r+b") as file:
            file.truncate(files[3].stat().st_size - 100)
        return bad, (files[3].name, held)
    raise AssertionError(defect)


DEFECTS = ["unknown architecture", "shape mismatch", "missing tensor", "index names a missing file", "truncated shard"]


# The HF checks run before the target format matters: one Orbax case checks that.
@pytest.mark.parametrize(("defect", "to"), [(d, "dcp") for d in DEFECTS] + [("truncated shard", "orbax")])
def test_bad_hf_input_exits_2_and_writes_nothing(sources, tmp_path, capsys, defect, to):
    bad, words = _broken_copy(sources["bf16_sharded"][0], tmp_path, defect)
    assert cli.main(["convert", str(bad), str(tmp_path / "out"), "--from", "hf", "--to", to]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith("error:") and all(word in line for word in words), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no target, no .out.partial


@pytest.mark.parametrize("defect", ["head_dim 64", *FP8_DEFECTS])
def test_bad_fp8_hf_input_exits_2_and_writes_nothing(sources, tmp_path, capsys, defect):
    bad = tmp_path / "bad"
    if defect == "head_dim 64":  # k and v heads share a 128-row block: refused, not requantized
        fp8_hf_checkpoint(bad, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
        capsys.readouterr()  # (transformers' save progress)
        words = ("config.json", "head_dim=64", "requantizing")
    else:
        shutil.copytree(sources["fp8_sharded"][0], bad)
        words = break_fp8(bad, defect)
    assert cli.main(["convert", str(bad), str(tmp_path / "out"), "--from", "hf", "--to", "dcp"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error:") and all(word in line for word in words), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_to_hf_needs_a_config_that_fits(sources, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # the plan printed to a pipe (pytest-xdist's workers set 80)
    directory, _ = sources["fp32_single"]
    assert convert(directory, "hf", tmp_path / "dcp", "dcp").ok
    (tmp_path / "dcp" / facts.FACTS_FILE).unlink()  # a checkpoint that carries no config.json (a torchside save's)
    argv = ["convert", str(tmp_path / "dcp"), str(tmp_path / "out"), "--from", "dcp", "--to", "hf"]
    assert cli.main(argv) == 2
    assert "--config" in capsys.readouterr().err
    other = sources["bf16_sharded"][0] / "config.json"  # untied, biases, MHA: not this checkpoint's model
    assert cli.main([*argv, "--config", str(other)]) == 2
    assert "model.layers.0.self_attention.layernorm_qkv.bias" in capsys.readouterr().err
    assert cli.main([*argv, "--config", str(directory), "--dry-run"]) == 0
    assert "model.layers.0.layernorm_mlp.fc1_weight" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


@pytest.mark.parametrize("via", ["dcp", "orbax"])
def test_the_hf_config_files_travel_with_the_checkpoint(sources, tmp_path, via):
    """HF -> DCP / Orbax -> HF with no --config gives back config.json and generation_config.json byte for byte."""
    directory, _ = sources["bf16_sharded"]
    assert (directory / hf.GENERATION_CONFIG_FILE).is_file()  # (transformers writes one)
    assert cli.main(["convert", str(directory), str(tmp_path / via), "--from", "hf", "--to", via]) == 0
    back = ["convert", str(tmp_path / via), str(tmp_path / "back"), "--from", via, "--to", "hf", "--max-shard-size", SHARD]
    assert cli.main(back) == 0
    assert_same_checkpoint(tmp_path / "back", directory)
    generation = (tmp_path / "back" / hf.GENERATION_CONFIG_FILE).read_bytes()
    assert generation == (directory / hf.GENERATION_CONFIG_FILE).read_bytes()


def test_config_overrides_the_carried_config(sources, tmp_path):
    directory, _ = sources["fp32_single"]
    assert convert(directory, "hf", tmp_path / "dcp", "dcp").ok
    edited = json.loads((directory / "config.json").read_text()) | {"max_position_embeddings": 77}
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    assert convert(tmp_path / "dcp", "dcp", tmp_path / "hf", "hf", target_options={"config": tmp_path / "edited.json"}).ok
    assert (tmp_path / "hf" / "config.json").read_bytes() == (tmp_path / "edited.json").read_bytes()


def test_a_tied_config_for_an_untied_checkpoint_says_what_is_wrong(sources, tmp_path, capsys):
    directory, _ = sources["bf16_sharded"]  # untied: it has its own lm_head
    assert convert(directory, "hf", tmp_path / "dcp", "dcp").ok
    tied = json.loads((directory / "config.json").read_text()) | {"tie_word_embeddings": True}
    (tmp_path / "tied.json").write_text(json.dumps(tied))
    argv = ["convert", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--from", "dcp", "--to", "hf"]
    assert cli.main([*argv, "--config", str(tmp_path / "tied.json")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert all(word in line for word in ("model.lm_head.weight", "tie_word_embeddings", str(tmp_path / "tied.json"))), line
    assert "FP8" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "tied.json"]


def test_an_hf_target_is_refused_for_several_writers(sources):
    reader = hf.HfReader(sources["fp32_single"][0])
    plan = make_plan(reader.tensors, "hf", "hf", owners=2)
    with pytest.raises(ValueError, match="written by one process"):
        hf.check_target(plan, {"config": sources["fp32_single"][0]})


def test_an_hf_target_we_wrote_is_checked_when_converted_again(sources, tmp_path, capsys):
    """Our HF files carry torchside's CRC32 table: a flipped byte is CheckFailed (exit 1), not silently converted."""
    directory, _ = sources["fp32_single"]
    assert convert(directory, "hf", tmp_path / "dcp", "dcp").ok
    assert not convert(directory, "hf", tmp_path / "dry", "dcp", dry_run=True).source_verified  # transformers' files
    written = convert(tmp_path / "dcp", "dcp", tmp_path / "hf", "hf", target_options={"config": directory})
    assert convert(tmp_path / "hf", "hf", tmp_path / "dry", "dcp", dry_run=True).source_verified
    file = tmp_path / "hf" / "model.safetensors"
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size - 1)  # the last byte: of the last tensor in transformers' order
        last = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([last[0] ^ 1]))
    assert written.ok
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "again"), "--from", "hf", "--to", "dcp"]) == 1
    assert "model.norm.weight" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_an_interrupted_hf_export_leaves_nothing(sources, tmp_path, monkeypatch, capsys):
    directory, _ = sources["bf16_sharded"]
    assert convert(directory, "hf", tmp_path / "dcp", "dcp").ok
    calls = []
    write_at = hf.safetensors_file.write_at

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 5:  # a few tensors in, several files created
            raise KeyboardInterrupt
        return write_at(*args)

    monkeypatch.setattr(hf.safetensors_file, "write_at", interrupted)
    argv = ["convert", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--from", "dcp", "--to", "hf"]
    assert cli.main([*argv, "--config", str(directory), "--max-shard-size", SHARD]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]

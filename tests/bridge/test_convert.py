"""`shardbridge convert`: DCP <-> Orbax <-> safetensors, bitwise, across topologies, in bounded memory.

References are independent of the converter: checkpoints are written by DCP, safetensors' own
`save_file` and real FSDP x TP processes, and read back by `dcp.load`, `load_file` and Orbax's
restore; a transposed kernel is compared with the torch weight's `.T`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from bridge import cli
from bridge.convert import plan as convert_plan
from bridge.convert import convert
from tests.distributed import run_threads

REPO = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare any dtype (fp8 and e8m0 have no ==) bitwise."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype, key
        assert got[key].shape == expected[key].shape, key
        assert torch.equal(_bits(got[key]), _bits(expected[key])), key


def app_state() -> dict[str, torch.Tensor]:
    """A torchside AppState, flattened as DCP stores it: plain, FP8 (tensorwise and MXFP8) and optimizer tensors."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "model.norm.weight": rand(32).bfloat16(),
        "model.up.weight": rand(64, 32),
        "model.up.bias": rand(64),
        "model.down.weight.rowwise_data": (rand(32, 64) * 50).to(torch.float8_e4m3fn),
        "model.down.weight.rowwise_scale_inv": torch.tensor([0.02]),
        "model.mx.weight.rowwise_data": rand(16, 64).to(torch.float8_e5m2),
        "model.mx.weight.rowwise_scale_inv": torch.randint(100, 140, (16, 2), generator=g, dtype=torch.uint8).view(
            torch.float8_e8m0fnu
        ),
        "optim.up.weight.exp_avg": rand(64, 32),
        "optim.up.weight.exp_avg_sq": rand(64, 32).abs(),
        "optim.up.weight.step": torch.tensor(3.0),
        "fp8_scaling.down.fp8_forward_amax_history": rand(4, 2).abs(),
        "train.step": torch.tensor(7, dtype=torch.int64),
        "rng.rank0.cpu": torch.get_rng_state(),
    }


def dcp_load(path: Path, like: dict) -> dict:
    out = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def orbax_restore(path: Path) -> dict:
    """Orbax's own restore of every array (on one device), as flat dotted keys (64-bit dtypes kept)."""
    import jax
    import orbax.checkpoint as ocp

    with jax.enable_x64(True), ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(path)
    return {".".join(str(k.key) for k in p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_fp8_buffer_names_match_torchside():
    from torchside.quantization.storage import BUFFER_FIELDS

    assert set(convert_plan.FP8_BUFFERS) == set(BUFFER_FIELDS)


def test_dcp_orbax_dcp_roundtrip_exact(tmp_path):
    import jax

    state = app_state()
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    to_orbax = convert(tmp_path / "dcp", "dcp", tmp_path / "step-1", "orbax", with_optimizer=True)
    assert to_orbax.ok and len(to_orbax.checksums) == len(state) - 1
    assert dict(to_orbax.skipped) == {"rng.rank0.cpu": "per-rank torch generator state"}

    # Orbax holds JAX names and orientation: kernels are the torch weights transposed, FP8 bytes as saved.
    saved = orbax_restore(tmp_path / "step-1")
    assert np.array_equal(saved["model.up.kernel"], state["model.up.weight"].numpy().T)
    assert np.array_equal(saved["optim.exp_avg.up.kernel"], state["optim.up.weight.exp_avg"].numpy().T)
    fp8 = saved["model.down.kernel.rowwise_data"]
    assert fp8.dtype == np.dtype("float8_e4m3fn")
    assert np.array_equal(fp8.view(np.uint8), _bits(state["model.down.weight.rowwise_data"]).numpy().reshape(32, 64))
    assert saved["model.mx.kernel.rowwise_scale_inv"].dtype == np.dtype("float8_e8m0fnu")
    assert saved["train.step"].dtype == np.int64

    # Placed one dim-0 block per JAX device (8 host devices in tests).
    import orbax.checkpoint as ocp

    from bridge.convert.orbax import sharding_for

    target = {"model": {"up": {"kernel": jax.ShapeDtypeStruct((32, 64), np.float32, sharding=sharding_for((32, 64), jax.devices()))}}}
    restored = ocp.PyTreeCheckpointer().restore(
        tmp_path / "step-1", args=ocp.args.PyTreeRestore(item=target, partial_restore=True)
    )["model"]["up"]["kernel"]
    assert len(restored.addressable_shards) == 8 and restored.addressable_shards[3].data.shape == (4, 64)

    back = convert(tmp_path / "step-1", "orbax", tmp_path / "back", "dcp", with_optimizer=True)
    assert back.ok
    expected = {k: v for k, v in state.items() if not k.startswith("rng.")}
    assert_bitwise(dcp_load(tmp_path / "back", expected), expected)


def test_safetensors_dcp_safetensors_roundtrip_exact(tmp_path):
    state = {k: v for k, v in app_state().items() if not k.startswith(("rng.", "model.mx."))}  # e8m0: next test
    save_file(state, tmp_path / "in.safetensors")
    assert convert(tmp_path / "in.safetensors", "safetensors", tmp_path / "dcp", "dcp", with_optimizer=True).ok
    assert convert(tmp_path / "dcp", "dcp", tmp_path / "out.safetensors", "safetensors", with_optimizer=True).ok
    assert_bitwise(load_file(tmp_path / "out.safetensors"), state)


def test_e8m0_scales_survive_safetensors_exact(tmp_path):
    """safetensors has no E8M0 code: stored as U8 bytes, the dtype given back by the header's metadata."""
    state = {k: v for k, v in app_state().items() if k.startswith("model.mx.")}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    convert(tmp_path / "dcp", "dcp", tmp_path / "x.safetensors", "safetensors")
    assert convert(tmp_path / "x.safetensors", "safetensors", tmp_path / "back", "dcp").ok
    assert_bitwise(dcp_load(tmp_path / "back", state), state)


# ---- the converted model computes what the source model computes


def test_converted_twins_forward_matches_torch(tmp_path):
    """A torchside Linear + LayerNormMLP saved by DCP, converted to Orbax, loaded into the jaxside twins."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    import jaxside.modules as jm
    import torchside.modules as tm
    from bridge import params
    from bridge.numerics import relative_error, tolerance

    torch.manual_seed(0)
    torch_models = {"proj": tm.Linear(32, 48, config=tm.ModuleConfig()), "mlp": tm.LayerNormMLP(48, 96, config=tm.ModuleConfig())}
    jax_models = {  # abstract (no initialization): every parameter comes from the checkpoint
        "proj": nnx.eval_shape(lambda: jm.Linear(32, 48, config=jm.ModuleConfig(), rngs=nnx.Rngs(1))),
        "mlp": nnx.eval_shape(lambda: jm.LayerNormMLP(48, 96, config=jm.ModuleConfig(), rngs=nnx.Rngs(2))),
    }
    state = {f"model.{name}.{p}": t.detach() for name, m in torch_models.items() for p, t in m.named_parameters()}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert convert(tmp_path / "dcp", "dcp", tmp_path / "step-0", "orbax").ok

    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(tmp_path / "step-0")["model"]
    for name, model in jax_models.items():
        values = {path: jnp.asarray(tree[name][params.dotted(path)]) for path in params.jax_parameters(model)}
        params.load_into_jax(model, values)

    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch_models["mlp"](torch_models["proj"](x)).numpy()
    got = np.asarray(jax_models["mlp"](jax_models["proj"](jnp.asarray(x.numpy()))))
    assert relative_error(got, expected) <= tolerance("off", "forward").relative


# ---- cross topology: saved by 4 ranks (FSDP x TP), converted on 8 JAX devices and on 2 ranks (threads:
# torch's threaded process group runs DTensor, FSDP2 and DCP's collectives without starting processes)


def _reference_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def _save_fsdp_tp(rank, world, directory, reference):
    import copy

    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # A copy of one model built before the threads start: they share the global RNG.
    model = parallelize_module(copy.deepcopy(reference), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    state = get_model_state_dict(model)
    dcp.save({"model": state}, checkpoint_id=directory)
    return {k: str(v.placements) for k, v in state.items()}


def _convert_on_ranks(rank, world, directory):
    convert(directory / "dcp4", "dcp", directory / "out.safetensors", "safetensors")
    result = convert(directory / "dcp4", "dcp", directory / "dcp2", "dcp")
    return result.ok


def test_cross_topology_exact(tmp_path):
    placements = run_threads(_save_fsdp_tp, 4, tmp_path / "dcp4", _reference_model())
    assert "_StridedShard" in placements[0]["0.weight"]  # the FSDP x TP layout, not a plain row split
    reference = {f"model.{k}": v.detach() for k, v in _reference_model().state_dict().items()}

    assert convert(tmp_path / "dcp4", "dcp", tmp_path / "step-0", "orbax").ok
    saved = orbax_restore(tmp_path / "step-0")
    for key, value in reference.items():
        jax_key = key.replace("weight", "kernel")
        expected = value.numpy().T if value.dim() == 2 else value.numpy()
        assert np.array_equal(saved[jax_key], expected), key

    assert run_threads(_convert_on_ranks, 2, tmp_path) == [True, True]
    assert_bitwise(load_file(tmp_path / "out.safetensors"), reference)
    assert_bitwise(dcp_load(tmp_path / "dcp2", reference), reference)
    from torch.distributed.checkpoint import FileSystemReader

    chunks = FileSystemReader(tmp_path / "dcp2").read_metadata().state_dict_metadata["model.0.weight"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (16, 0)]  # one dim-0 block per converting rank


# ---- bounded memory

# Peak RSS is the kernel's high-water mark of this process image (VmHWM). ru_maxrss would not do: Linux
# carries it across exec, so a child forked from the big pytest process would report the parent's size.
_RSS_SCRIPT = """
import gc, json, re, sys
import psutil
from bridge.convert import convert
from bridge.convert import dcp, safetensors  # noqa: F401  (imported before the baseline)
import torch.distributed.checkpoint  # noqa: F401
gc.collect()
baseline = psutil.Process().memory_info().rss
convert(sys.argv[1] + "/in.safetensors", "safetensors", sys.argv[1] + "/dcp", "dcp")
convert(sys.argv[1] + "/dcp", "dcp", sys.argv[1] + "/out.safetensors", "safetensors")
peak_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({"baseline": baseline, "peak": peak_kib * 1024}))
"""
# Fixed overhead beyond the boxes: lazily imported modules and pickling/file buffers of DCP's
# torch.save and torch.load, and the allocator's slack: measured 5.5 MiB here; 32 MiB leaves margin
# while staying far below one more copy of the 64 MiB tensor.
RSS_OVERHEAD = 32 << 20


@pytest.mark.slow
def test_peak_rss_is_two_shards_plus_overhead(tmp_path):
    big = torch.randn(4096, 4096)  # 64 MiB fp32: the largest tensor, one process owns all of it
    save_file({"model.big.weight": big, "model.big.bias": torch.randn(4096)}, tmp_path / "in.safetensors")
    del big
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=True
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    largest_shard = 64 << 20
    growth = measured["peak"] - measured["baseline"]
    print(f"peak RSS growth {growth / 2**20:.1f} MiB (bound {(2 * largest_shard + RSS_OVERHEAD) / 2**20:.0f} MiB)")
    assert growth <= 2 * largest_shard + RSS_OVERHEAD
    assert_bitwise(load_file(tmp_path / "out.safetensors"), load_file(tmp_path / "in.safetensors"))


# ---- errors: a clear message, and nothing left behind


def test_plan_errors_name_the_problem(tmp_path):
    state = app_state()
    index = {k: convert_plan.TensorInfo(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}
    with pytest.raises(ValueError, match="unknown architecture 'llama'"):
        convert_plan.make_plan(index, "dcp", "orbax", 1, architecture="llama")
    no_scale = {k: v for k, v in index.items() if k != "model.down.weight.rowwise_scale_inv"}
    with pytest.raises(ValueError, match="rowwise_data has no model.down.weight.rowwise_scale_inv"):
        convert_plan.make_plan(no_scale, "dcp", "orbax", 1)
    wrong = dict(index, **{"optim.up.weight.exp_avg": convert_plan.TensorInfo("optim.up.weight.exp_avg", (64, 31), "float32")})
    with pytest.raises(ValueError, match=r"shape mismatch: optim.up.weight.exp_avg is \[64, 31\]"):
        convert_plan.make_plan(wrong, "dcp", "orbax", 1, with_optimizer=True)
    with pytest.raises(ValueError, match="in no known section"):
        convert_plan.make_plan({"fc1.weight": index["model.up.weight"]}, "dcp", "orbax", 1)
    plan = convert_plan.make_plan(index, "dcp", "orbax", 1)
    with pytest.raises(ValueError, match=r"missing tensors: model.extra.kernel; shape mismatch: model.up.kernel is \[32, 64\]"):
        convert_plan.check_against(plan, {"model.extra.kernel": (2, 2), "model.up.kernel": (64, 32)})


def test_failed_conversion_leaves_nothing(tmp_path, capsys):
    state = {k: v for k, v in app_state().items() if k.startswith("model.up")}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    data_file = next(p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated: reading fails mid-conversion
    for fmt, name in (("dcp", "out"), ("safetensors", "out.safetensors"), ("orbax", "step-3")):
        with pytest.raises(ValueError, match=f"reading model.up.bias from {data_file} failed"):
            convert(tmp_path / "dcp", "dcp", tmp_path / name, fmt)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"], fmt  # no target, no .partial

    assert cli.main(["convert", str(tmp_path / "dcp"), str(tmp_path / "o"), "--from", "dcp", "--to", "orbax", "--arch", "x"]) == 2
    assert "unknown architecture 'x'" in capsys.readouterr().err
    os.mkdir(tmp_path / "exists")
    assert cli.main(["convert", str(tmp_path / "dcp"), str(tmp_path / "exists"), "--from", "dcp", "--to", "dcp"]) == 2
    assert "exists; pass a new path" in capsys.readouterr().err


def test_orbax_target_records_each_arrays_crc32(tmp_path):
    """The checksum file beside an Orbax target holds the CRC32 of each whole array, joined from 8 device boxes."""
    import zlib

    from jaxside.checkpoint import recorded_checksums

    state = {k: v for k, v in app_state().items() if not k.startswith("rng.")}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    convert(tmp_path / "dcp", "dcp", tmp_path / "step-1", "orbax", with_optimizer=True)
    arrays = orbax_restore(tmp_path / "step-1")
    expected = {key: zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()) for key, a in arrays.items()}
    assert recorded_checksums(tmp_path / "step-1") == expected


def test_output_to_a_pipe_keeps_whole_tensor_names(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe as a user's shell gives it (pytest-xdist's workers set 80)
    long_name = "model." + ".".join(f"block{i}" for i in range(12)) + ".weight"
    dcp.save({long_name: torch.ones(4, 4)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert cli.main(["convert", str(tmp_path / "dcp"), str(tmp_path / "out"), "--from", "dcp", "--to", "dcp"]) == 0
    assert any(long_name in line for line in capsys.readouterr().out.splitlines())


def test_dry_run_prints_plan_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(cli, "Console", lambda: Console(width=200, color_system=None))
    dcp.save(app_state(), checkpoint_id=tmp_path / "dcp", no_dist=True)
    argv = ["convert", str(tmp_path / "dcp"), str(tmp_path / "step-0"), "--from", "dcp", "--to", "orbax", "--dry-run"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "step-0").exists()
    assert "transpose" in out and "dim 0 split" in out and "bytes written" in out
    assert "rng.rank0.cpu" in out and "--with-optimizer" in out

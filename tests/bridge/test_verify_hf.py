"""`shardbridge verify --model llama --hf HF_DIR`: torch's and JAX's load_hf of one checkpoint, logits compared.

Fast: bad input exits 2 with one line before any process starts; the logits check (TP meshes)
fails when the checkpoint's file changes between the torch and the JAX load; a failing report makes
the CLI exit 1 naming the logits; on one process (--mesh dp=1) the CLI runs bridge.compare, passes a
faithful checkpoint (FP8 off and current) with every block's check in its JSON, and exits 1 naming
the block when one JAX block differs (a loaded weight, an activation); a data-parallel mesh starts
bridge.compare's worker. Slow (CI): 2 data-parallel processes pass under current scaling and name a
planted block; 2 co-located processes on TP 2 pass from the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bridge.cli import main
from bridge.numerics import TensorCheck, Tolerance, VerifyReport
from twinspec import hf_llama
from tests.bridge.hf_cases import TOLERANCE, fp8_hf_checkpoint, hf_model, save
from tests.selection import in_ci


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """transformers' tiny GQA Llama (4 heads, 2 KV heads, vocabulary 129, tied), one file."""
    return save(hf_model("gqa_tied_odd_vocab"), tmp_path_factory.mktemp("hf"), sharded=False)


def _no_launch(monkeypatch) -> None:
    from bridge import runtime

    monkeypatch.setattr(runtime, "launch", lambda *args, **kwargs: pytest.fail("processes started before the check"))


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--hf", "{hf}"], "--hf with --model mlp: an HF checkpoint is a Llama; pass --model llama"),
        (["--model", "llama"], "--model llama needs --hf HF_DIR (a Hugging Face Llama directory) or --plan PLAN"),
        (["--model", "llama", "--hf", "{hf}", "--plan", "plan.toml"], "--plan with --hf: a checkpoint loads by"),
        (["--model", "llama", "--hf", "{hf}/config.json"], "config.json: not a directory"),
        (["--model", "llama", "--hf", "{mistral}"], "architectures=['MistralForCausalLM'], not ['LlamaForCausalLM']"),
        (["--model", "llama", "--hf", "{hf}", "--mesh", "tp=4"], "num_gqa_groups=2 (key/value heads) does not divide"),
        # on a TP mesh (its own shards in each process) torch's FSDP2 would take dp=3; JAX shards only dims the mesh
        # divides (hidden 64)
        (["--model", "llama", "--hf", "{hf}", "--mesh", "dp=3,tp=2", "--batch-size", "6"], "('embed') has size 64"),
        (["--model", "llama", "--hf", "{hf}", "--mesh", "dp=2", "--batch-size", "3"], "--batch-size 3 must divide"),
        (["--model", "llama", "--hf", "{hf}", "--steps", "2"], "--steps: options of the built-in stacks"),
        (["--model", "llama", "--hf", "{fp8}", "--recipe", "current"], "FP8 block-scaled checkpoint: compare it with"),
        # FSDP2's 64-row shards of a 256-row FP8 weight would split its 128-row scale blocks
        (["--model", "llama", "--hf", "{fp8}", "--mesh", "dp=4,tp=2"], "proj.weight: FSDP2 over dp_shard=4 cuts its"),
        # ffn 96 over TP 2: fc2's 48-wide shards cut MXFP8's 32-element tiles (the processes' first FP8 forward)
        (["--model", "llama", "--hf", "{hf}", "--mesh", "tp=2", "--recipe", "mxfp8"], "fc2_weight: MXFP8BlockScaling"),
        (["--seq-len", "64"], "--seq-len: options of --model llama --hf"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_process_starts(
    monkeypatch, capsys, tmp_path, checkpoint, arguments, message
):
    _no_launch(monkeypatch)
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    config = json.loads((checkpoint / hf_llama.CONFIG_FILE).read_text())
    (mistral / hf_llama.CONFIG_FILE).write_text(json.dumps(config | {"architectures": ["MistralForCausalLM"]}))
    fp8 = tmp_path / "fp8"
    if "{fp8}" in arguments:
        fp8_hf_checkpoint(fp8, num_attention_heads=4, num_key_value_heads=2)  # TP 2 splits its 2 KV heads
        capsys.readouterr()  # transformers' progress bar
    paths = {"hf": checkpoint, "mistral": mistral, "fp8": fp8}
    arguments = [a.format(**paths) for a in arguments]
    assert main(["verify", "--device", "cpu", *arguments]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_logits_check_fails_when_the_file_changes_between_the_two_loads(
    one_rank_world, reference_kernels, checkpoint, tmp_path
):
    """The check's reference is torch's load of the file; JAX loading an altered copy must fail it.

    One weight of layer 1's down projection moves by 0.05 (its values are about 0.2): only the logits
    can show it, and they must, beyond FP8 off's 1e-5. The same file passes (the comparison's baseline).
    """
    import shutil

    from safetensors.torch import load_file, save_file

    from bridge.hf_check import logits_report, random_tokens
    from jaxside.models import llama as jax_llama
    from torchside.models import llama as torch_llama
    from torchside.models.llama_parallel import LlamaMeshes

    world, mesh = one_rank_world
    meshes = LlamaMeshes(world, None, None, None)
    model = torch_llama.load_hf(checkpoint, dtype=torch.float32)
    tokens = random_tokens(model.config.vocab_size, 2, 16)

    def report(directory: Path) -> VerifyReport:
        twin = jax_llama.load_hf(directory, mesh=mesh)
        return logits_report(model, twin, meshes, mesh, "off", tokens, "cpu")

    same = report(checkpoint)
    assert same.passed and same.checks[0].relative <= TOLERANCE
    altered = tmp_path / "altered"
    shutil.copytree(checkpoint, altered)
    file = altered / hf_llama.SINGLE_FILE
    tensors = load_file(file)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 0.05
    save_file(tensors, file, metadata={"format": "pt"})
    differs = report(altered)
    first = differs.first_divergence
    assert not differs.passed and first.name == "logits" and first.stage == "forward"
    assert first.relative > TOLERANCE


def test_a_divergence_exits_1_naming_the_logits(monkeypatch, capsys, checkpoint):
    """The CLI's verdict from the processes' reports: a failing check is exit 1 and one error line naming it."""
    from bridge import runtime

    report = VerifyReport(f"llama {checkpoint}", "tp=2", "off", 0)
    report.checks.append(TensorCheck(0, "forward", "logits", 3e-4, 0.01, False, Tolerance(1e-5), False))
    monkeypatch.setattr(runtime, "launch", lambda *args, **kwargs: [[report.to_json()]])
    assert main(["verify", "--model", "llama", "--hf", str(checkpoint), "--mesh", "tp=2", "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    assert "first divergence step 0, forward, layer logits, tensor logits: relative 3.000e-04" in captured.out
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("error: torch and JAX diverge") and "logits (forward, step 0)" in captured.err


ONE_PROCESS = ["verify", "--model", "llama", "--mesh", "dp=1", "--device", "cpu", "--batch-size", "2"]


@pytest.mark.parametrize("recipe", in_ci(["off", "current"], ["off"]))  # current: the planted test below runs it
def test_one_process_passes_every_block_teacher_forced(monkeypatch, capsys, reference_kernels, checkpoint, recipe):
    """--mesh dp=1 runs bridge.compare: the JSON holds each block's own check and the logits', all passing."""
    _no_launch(monkeypatch)
    assert main([*ONE_PROCESS, "--hf", str(checkpoint), "--recipe", recipe, "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert (report["model"], report["recipe"], report["passed"]) == (f"llama {checkpoint}", recipe, True)
    blocks = {c["name"] for c in report["checks"] if c["stage"] == "forward"}
    assert {"layers.0", "layers.1", "layers.1.layernorm_mlp", "layers.1.self_attention"} <= blocks
    assert "output" in {c["name"] for c in report["checks"] if c["stage"] == "end_to_end_forward"}


def _planted_load_hf(monkeypatch, plant) -> None:
    """jaxside's load_hf, then `plant` applied to layer 1's LayerNormMLP of the loaded twin (test only)."""
    from jaxside.models import llama as jax_llama

    load_hf = jax_llama.load_hf

    def planted(*args, **kwargs):
        twin = load_hf(*args, **kwargs)
        plant(twin.layers[1].layernorm_mlp)
        return twin

    monkeypatch.setattr(jax_llama, "load_hf", planted)


def _moved_weight(mlp) -> None:  # one fc2 weight of about 0.2 moved by 0.05: a loader's slip
    mlp.fc2_kernel.set_value(mlp.fc2_kernel.get_value().at[0, 0].add(0.05))


def _other_activation(mlp) -> None:  # GELU for SiLU in the gated MLP: an implementation's slip
    assert mlp.activation == "swiglu"
    mlp.activation = "geglu"


@pytest.mark.parametrize("plant, recipe", [(_moved_weight, "off"), (_other_activation, "current")])
def test_one_process_names_the_one_jax_block_that_differs(
    monkeypatch, capsys, reference_kernels, checkpoint, plant, recipe
):
    """JAX's layer 1 MLP differs (its loaded weight or its norm): exit 1 naming that block, not only the logits."""
    _no_launch(monkeypatch)
    _planted_load_hf(monkeypatch, plant)
    assert main([*ONE_PROCESS, "--hf", str(checkpoint), "--recipe", recipe]) == 1
    captured = capsys.readouterr()
    assert "first divergence step 0, forward, layer layers.1, tensor layers.1.layernorm_mlp:" in captured.out
    assert captured.err.count("\n") == 1
    assert "torch and JAX diverge" in captured.err and "layers.1.layernorm_mlp (forward, step 0)" in captured.err


@pytest.mark.parametrize("mesh, processes", [("dp=2", 2), ("rep=2,dp=2", 4)])
def test_a_data_parallel_mesh_runs_bridge_compare_in_that_many_processes(launches, capsys, checkpoint, mesh,
                                                                         processes):  # fmt: skip
    """Without tp, several processes run bridge.compare's data-parallel worker, not the logits-only check."""
    assert main(["verify", "--model", "llama", "--hf", str(checkpoint), "--mesh", mesh, "--device", "cpu"]) == 130
    asked = [(launch.worker, launch.processes, launch.device_type) for launch in launches]
    assert asked == [("compare_hf_ranks", processes, "cpu")]
    assert capsys.readouterr().err == "error: interrupted\n"


def _faithful_then_planted(runtime, case):
    """One rank of a data-parallel mesh: the checkpoint as it is under `case`'s recipes, then, FP8 off, with JAX's
    layer 1 MLP weight moved (`_moved_weight`, in this process only)."""
    import dataclasses

    from bridge import hf_check
    from jaxside.models import llama as jax_llama

    faithful = hf_check.compare_hf_ranks(runtime, case)
    load_hf = jax_llama.load_hf

    def planted(*args, **kwargs):
        twin = load_hf(*args, **kwargs)
        _moved_weight(twin.layers[1].layernorm_mlp)
        return twin

    jax_llama.load_hf = planted
    try:
        return faithful, hf_check.compare_hf_ranks(runtime, dataclasses.replace(case, recipes=("off",)))
    finally:
        jax_llama.load_hf = load_hf


@pytest.mark.slow
@pytest.mark.multiprocess
# Under current scaling the faithful run also compiles each block's FP8 programs and runs FP8 off for the noise-aware
# verdict over both ranks' rows: about 3 min on 2 shared cores, the grid.
@pytest.mark.parametrize("recipe", ["off", pytest.param("current", marks=pytest.mark.grid)])
def test_two_data_parallel_processes_pass_every_block_and_name_a_planted_one(checkpoint, recipe):
    """dp=2 on CPU processes through bridge.compare: every block and the logits pass; JAX's layer 1 MLP with a
    moved weight is named by its block (FP8 off)."""
    from bridge import runtime
    from bridge.hf_check import HFCase
    from twinspec.mesh import MeshShape

    case = HFCase(str(checkpoint), MeshShape(dp_shard=2), (recipe,), batch_size=4, seq_len=32)
    results = runtime.launch(_faithful_then_planted, 2, case, device_type="cpu")
    assert results[0] == results[1]  # one verdict on every rank
    (faithful,), (planted,) = results[0]
    assert (faithful["mesh"], faithful["recipe"], faithful["passed"]) == ("dp_shard=2", recipe, True)
    names = {(c["stage"], c["name"]) for c in faithful["checks"]}
    assert {("forward", "layers.0"), ("forward", "layers.1.layernorm_mlp"), ("end_to_end_forward", "output")} <= names
    first = planted["first_divergence"]
    assert (planted["passed"], first["stage"], first["name"]) == (False, "forward", "layers.1.layernorm_mlp")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_on_tp_2_agree_from_the_cli(tmp_path, monkeypatch, checkpoint):
    """2 co-located gloo processes, TP 2 (KV heads split, vocabulary 129 padded to 130), FP8 off: the logits of
    torch's and JAX's load_hf agree to 1e-5 (transformers' own logits: tests/bridge/test_hf_llama.py)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    report_file = tmp_path / "report.json"
    arguments = ["verify", "--model", "llama", "--hf", str(checkpoint), "--mesh", "tp=2", "--device", "cpu",
                 "--batch-size", "2", "--seq-len", "16", "--report", str(report_file)]  # fmt: skip
    assert main(arguments) == 0
    (report,) = json.loads(report_file.read_text())
    assert (report["mesh"], report["recipe"], report["passed"]) == ("tp=2", "off", True)
    (check,) = report["checks"]
    assert check["name"] == "logits" and check["relative"] <= TOLERANCE


def test_load_hf_on_a_cpu_mesh_warns_nothing_of_dtensor_random_ops(one_rank_world, checkpoint):
    """Issue 42: `verify --hf` printed "DTensor random operators may not have complete support on cpu device
    mesh" from materializing the model before the file's values replace every parameter."""
    import warnings

    from torchside.models import llama as torch_llama

    world, _ = one_rank_world
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_llama.load_hf(checkpoint, mesh=world["dp_shard"], tp_mesh=world["tp"], dtype=torch.float32)
    assert [str(w.message) for w in caught if "DTensor random" in str(w.message)] == []

"""`shardbridge demo` end to end (smallest settings), and its refusal of bad options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bridge import cli, logits
from bridge.demo import jax_side as demo_jax
from tests.selection import in_ci

EXPECTED_CHECKS = (
    "training {recipe}, FSDP2 2 x TP 2: loss falls",
    "layouts: torch DTensor = JAX NamedSharding",
    "shards moved into JAX: bitwise",
    "forward JAX vs torch: logits",
    "DCP reload on FSDP2 2: bitwise",
    "DCP -> Orbax: CRC32 read back",
    "Orbax restore in JAX: bitwise",
)


@pytest.mark.slow
@pytest.mark.multiprocess
# CI runs every stage with FP8 off (~40 s on 2 cores); the default recipe, current scaling, compiles the JAX twin's
# FP8 forward on 4 processes (~30 s more): the grid. In CI the twin's FP8 logits are test_verify_hf's and
# test_compare_fp8's, FP8 training on FSDP2 x TP tests/torchside's.
@pytest.mark.parametrize("recipe", in_ci(["off", "current"], ["off"]))
def test_demo_end_to_end(tmp_path, recipe):
    # As a user runs it: no TRITON_INTERPRET (the test session sets it; the demo's CPU path is the reference
    # kernels) and JAX's own device count (the runtime gives each process one CPU device anyway).
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "bridge", "demo", "--steps", "8", "--recipe", recipe, "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    names = [check["name"] for check in report["checks"]]
    assert names == [name.format(recipe=recipe) for name in EXPECTED_CHECKS]
    failed = [check for check in report["checks"] if not check["passed"]]
    assert report["passed"] and not failed, failed
    assert len(report["losses"]) == 8
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["layouts: torch DTensor = JAX NamedSharding"]["detail"] == "14 params, whole model"  # 12 + emb, norm
    assert checks["forward JAX vs torch: logits"]["detail"].startswith("whole model, sharded;")
    for picture in ("layouts.png", "loss.png"):
        assert (out / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "every check passed" in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps 0"),
        (["--recipe", "fp16"], "recipe 'fp16'"),
        (["--seq-len", "40"], "multiple of 32"),
        (["--dp", "2", "--tp", "1", "--reload-dp", "2"], "training topology"),
        (["--batch-size", "3"], "must divide"),
        (["--steps", "many"], "invalid int value"),
    ],
)
def test_demo_refuses_bad_options(argv, message, capsys):
    if argv == ["--steps", "many"]:  # argparse's own type check: usage and exit 2
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["demo", *argv])
        assert exit_info.value.code == 2
    else:  # the options' check: the CLI contract's one error line
        assert cli.main(["demo", *argv]) == 2
    assert message in capsys.readouterr().err


def test_scaling_state_is_the_state_the_next_forward_quantizes_with(monkeypatch):
    """The twin gets the DelayedScaling scales torch's forward uses: a copy taken before, not the live buffers.

    The demo once read them after torch's forward, through `.cpu()`, which on a CPU run is the live buffer:
    the twin then cast with the scales of the update at that forward's exit (relative error 0.03 vs 1e-4).
    """
    from torchside.autocast import fp8_autocast
    from torchside.modules import Linear, ModuleConfig
    from torchside.recipe import DelayedScaling

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the reference kernels: a 64 x 64 cast needs no interpreter
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Linear(64, 64, config=ModuleConfig(amax_history_len=4))])
    recipe = DelayedScaling(amax_history_len=4)
    with fp8_autocast(recipe=recipe):  # a first step: the scales leave their initial 1
        model.layers[0](torch.randn(64, 64))
    before = {name: buffer.clone() for name, buffer in model.layers.named_buffers(prefix="layers")}
    snapshot = demo_jax._scaling_state(model)
    with torch.no_grad(), fp8_autocast(recipe=recipe):
        model.layers[0](4 * torch.randn(64, 64))  # larger amaxes: the exit moves the input scale
    live_scale = model.layers[0].fp8_forward_scale
    assert not torch.equal(live_scale, before["layers.0.fp8_forward_scale"]), "the forward must move the scale"
    assert snapshot.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(snapshot[name], value), name


def test_logits_check_fails_when_one_embedding_weight_differs(one_rank_world, reference_kernels):
    """The demo's numerics check covers the embedding and the tied head: one changed element fails it.

    The reference is the torch Llama itself (FP8 off: agreement to fp32 order, 1e-5); the twin gets its weights
    through bridge.params' pairing, as the demo's does.
    """
    import jax.numpy as jnp

    import jaxside.modules as JM
    from bridge import params
    from bridge.numerics import tolerance
    from torchside.models.llama import LLAMA_CONFIGS, Llama

    world, mesh = one_rank_world
    torch.manual_seed(0)
    model = Llama(LLAMA_CONFIGS["tiny"])
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch_logits = model(tokens)
    twin = demo_jax.jax_twin(model)
    values = {}
    for pair in params.pair_models(model, twin):
        values[pair.jax_path] = jnp.asarray(pair.layout.to_jax(model.get_parameter(pair.torch_name).detach()).numpy())
    limit = tolerance("off", "forward")

    def check(jax_values) -> float:
        params.load_into_jax(twin, jax_values)
        JM.place(twin, mesh)
        relative, _, nan = logits.compare_logits(None, twin, tokens, torch_logits, world, mesh)
        assert not nan
        return relative

    assert check(values) <= limit.relative
    path = ("embedding", "kernel")
    token = int(tokens[0, 0])
    changed = {**values, path: values[path].at[0, token].add(0.02)}  # one weight of a token the batch holds
    assert check(changed) > limit.relative


@pytest.mark.parametrize(
    "requested, processes, gpus, device, says",
    [
        (None, 4, 8, "cuda", None),
        (None, 4, 4, "cuda", None),
        (None, 4, 1, "cpu", "4 processes need 4 GPUs but torch sees 1: running 4 CPU processes"),
        (None, 4, 0, "cpu", None),
        ("cpu", 4, 8, "cpu", None),
        ("cuda", 2, 2, "cuda", None),
    ],
)
def test_default_device_runs_cpu_processes_where_gpus_are_too_few(requested, processes, gpus, device, says):
    from bridge.runtime import choose_device_type

    assert choose_device_type(requested, processes, gpus) == (device, says)


def test_explicit_cuda_with_too_few_gpus_is_an_error():
    from bridge.runtime import choose_device_type

    with pytest.raises(ValueError, match="4 processes per node need 4 GPUs but torch sees 1"):
        choose_device_type("cuda", 4, 1)


def test_demo_on_one_gpu_says_it_runs_on_the_cpu(monkeypatch, launches, tmp_path):
    """Finding 11: the default device with one GPU for a 2 x 2 mesh: CPU processes, announced in one line."""
    from bridge import demo
    from bridge.demo.options import DemoOptions

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    said = []
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(DemoOptions(out=str(tmp_path)), status=said.append)
    assert [launch.device_type for launch in launches] == ["cpu"]
    assert said[0] == "4 processes need 4 GPUs but torch sees 1: running 4 CPU processes"


def test_demo_out_that_cannot_be_created_is_refused_before_any_work(monkeypatch, capsys):
    from bridge import demo

    monkeypatch.setattr(demo, "run_demo", lambda *args, **kwargs: pytest.fail("ran before checking --out"))
    assert cli.main(["demo", "--out", "/proc/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --out /proc/x: cannot create the directory")


def test_demo_with_explicit_cuda_and_too_few_gpus_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.main(["demo", "--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4 processes per node need 4 GPUs but torch sees 1" in err


def test_a_mesh_the_model_cannot_split_is_refused_before_any_process_or_folder(monkeypatch, tmp_path, capsys):
    """Issue 42: --tp 3 (the tiny Llama's 2 key/value heads) ran 38 s of tracebacks and left an empty --out."""
    from bridge import runtime

    monkeypatch.setattr(runtime, "launch", lambda *args, **kwargs: pytest.fail("a process started"))
    out = tmp_path / "out"
    assert cli.main(["demo", "--tp", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --dp 2 --tp 3: ")
    assert "num_gqa_groups=2 (key/value heads) does not divide by tp_size=3" in err
    assert not out.exists()

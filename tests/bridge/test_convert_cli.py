"""`shardbridge convert` as a new user meets it (issue 42): a mistyped path is answered before torch or
jax loads, a write prints no warnings, and an Orbax root converts its latest committed step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from bridge import cli
from bridge.convert import convert

REPO = Path(__file__).resolve().parents[2]

# Runs the CLI on each argv of argv[1] (JSON) in a fresh process; prints each exit code and stderr,
# and which frameworks got imported.
PROBE = """
import contextlib, io, json, sys
from bridge import cli
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        results.append((cli.main(["convert", *argv]), err.getvalue()))
frameworks = sorted(name for name in ("torch", "jax", "orbax", "tensorstore") if name in sys.modules)
print(json.dumps({"results": results, "frameworks": frameworks}))
"""


def test_bad_paths_are_refused_before_torch_or_jax_loads(tmp_path):
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"only the path is looked at")
    (tmp_path / "taken").mkdir()
    out = str(tmp_path / "out")
    cases = [
        ([str(tmp_path / "missing"), out, "--from", "dcp", "--to", "orbax"], f"source {tmp_path / 'missing'} does not exist"),
        ([str(file), out, "--from", "orbax", "--to", "dcp"], "--from orbax reads a directory"),
        ([str(tmp_path), out, "--from", "safetensors", "--to", "dcp"], "--from safetensors reads a file"),
        ([str(file), str(tmp_path / "taken"), "--from", "safetensors", "--to", "dcp"], f"target {tmp_path / 'taken'} exists"),
        ([str(file), "/sys/shardbridge-convert/out", "--from", "safetensors", "--to", "dcp"], "cannot create target"),
        ([str(file), out, "--from", "safetensors", "--to", "hf", "--config", str(tmp_path / "nope.json")], "--config"),
    ]
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([argv for argv, _ in cases])],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    report = json.loads(probe.stdout)
    assert report["frameworks"] == []
    for (code, stderr), (argv, expected) in zip(report["results"], cases):
        (line,) = stderr.splitlines()
        assert code == 2 and line.startswith("error:") and expected in line, (argv, stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken", "weights.safetensors"]


def test_dcp_writes_and_reads_warn_nothing_and_leave_the_filters_alone(tmp_path):
    save_file({"model.up.weight": torch.randn(64, 32), "model.up.bias": torch.randn(64)}, tmp_path / "src.safetensors")
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert convert(tmp_path / "src.safetensors", "safetensors", tmp_path / "dcp", "dcp").ok  # writes, reads back
        assert convert(tmp_path / "dcp", "dcp", tmp_path / "back.safetensors", "safetensors").ok  # reads
    assert [str(w.message) for w in caught] == []
    assert warnings.filters == filters  # silenced where DCP raises them, not for the whole process


def _save_orbax_step(root: Path, step: int, bias: np.ndarray) -> Path:
    import jax.numpy as jnp

    from jaxside import checkpoint

    return checkpoint.save(root, step, {"model": {"up": {"bias": jnp.asarray(bias)}}})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (the test's own dcp.load)
def test_an_orbax_root_converts_its_latest_committed_step_and_says_which(tmp_path, capsys):
    rng = np.random.default_rng(0)
    biases = {step: rng.standard_normal(8, dtype=np.float32) for step in (10, 30, 40)}
    root = tmp_path / "orbax"
    for step, bias in biases.items():
        _save_orbax_step(root, step, bias)
    unfinished = root / "step-40.orbax-checkpoint-tmp-1234"
    (root / "step-40").rename(unfinished)  # a save that never committed is not the latest step
    assert cli.main(["convert", str(root), str(tmp_path / "dcp"), "--from", "orbax", "--to", "dcp"]) == 0
    out, err = capsys.readouterr()
    assert f"read {root / 'step-30'} (the latest committed step in {root})" in " ".join(out.split())
    assert err == ""
    loaded = {"model.up.bias": torch.empty(8)}
    dcp.load(loaded, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert torch.equal(loaded["model.up.bias"], torch.from_numpy(biases[30]))

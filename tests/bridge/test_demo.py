"""`shardbridge demo` end to end (smallest settings), and its refusal of bad options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bridge import cli

EXPECTED_CHECKS = (
    "training current, FSDP2 2 x TP 2: loss falls",
    "layouts: torch DTensor = JAX NamedSharding",
    "shards moved into JAX: bitwise",
    "forward JAX vs torch: layers.0",
    "forward JAX vs torch: layers.1",
    "DCP reload on FSDP2 2: bitwise",
    "DCP -> Orbax: CRC32 read back",
    "Orbax restore in JAX: bitwise",
)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_demo_end_to_end(tmp_path):
    # As a user runs it: no TRITON_INTERPRET (the test session sets it; the demo's CPU path is the reference
    # kernels) and JAX's own device count (the runtime gives each process one CPU device anyway).
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "bridge", "demo", "--steps", "8", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    names = [check["name"] for check in report["checks"]]
    assert names == list(EXPECTED_CHECKS)
    failed = [check for check in report["checks"] if not check["passed"]]
    assert report["passed"] and not failed, failed
    assert len(report["losses"]) == 8
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
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

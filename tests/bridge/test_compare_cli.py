"""`shardbridge verify --torch/--jax` (bridge.compare from the command line) and examples/compare_attention.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODELS = "tests.bridge.compare_models"


def _verify(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["verify", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_factories_pass_and_fail_with_the_exit_contract(capsys):
    code, out, err = _verify(capsys, "--torch", f"{MODELS}:torch_stack", "--jax", f"{MODELS}:jax_stack", "--json")
    assert code == 0, err
    (report,) = json.loads(out)
    assert report["passed"] and report["recipe"] == "off"
    code, out, err = _verify(capsys, "--torch", f"{MODELS}:torch_stack", "--jax", f"{MODELS}:jax_stack_tanh_gelu")
    assert code == 1
    assert "blocks.1.act" in out and err.startswith("error: torch and JAX diverge")
    assert "Traceback" not in err


def test_verify_factories_take_steps(capsys):
    factories = ("--torch", f"{MODELS}:torch_stack", "--jax", f"{MODELS}:jax_stack")
    code, out, err = _verify(capsys, *factories, "--steps", "1", "--json")
    assert code == 0, err
    (report,) = json.loads(out)
    assert report["steps"] == 1 and {"param", "exp_avg", "exp_avg_sq"} <= {c["stage"] for c in report["checks"]}


def test_verify_factories_bad_input_is_exit_2(capsys):
    code, _, err = _verify(capsys, "--torch", f"{MODELS}:nothing", "--jax", f"{MODELS}:jax_stack")
    assert code == 2 and "--torch tests.bridge.compare_models:nothing" in err
    code, _, err = _verify(capsys, "--torch", f"{MODELS}:torch_stack")
    assert code == 2 and "--torch and --jax go together" in err
    code, _, err = _verify(capsys, "--torch", f"{MODELS}:torch_stack", "--jax", f"{MODELS}:jax_stack", "--mesh", "dp=2")
    assert code == 2 and "--mesh" in err


def _run_example(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "examples/compare_attention.py", *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_attention_example_passes():
    assert "agree" in _run_example()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_attention_example_passes_on_two_data_parallel_processes():
    out = _run_example("--mesh", "dp=2")
    assert "on dp=2 (2 processes)" in out and "agree" in out

"""`shardbridge verify --torch/--jax` (bridge.compare from the command line) and examples/compare_attention.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = "tests.bridge.compare_models"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_verify_factories_pass_and_fail_with_the_exit_contract():
    passed = _run("-m", "bridge", "verify", "--torch", f"{MODELS}:torch_stack", "--jax", f"{MODELS}:jax_stack", "--json")
    assert passed.returncode == 0, passed.stderr
    (report,) = json.loads(passed.stdout)
    assert report["passed"] and report["recipe"] == "off"
    failed = _run("-m", "bridge", "verify", "--torch", f"{MODELS}:torch_stack", "--jax", f"{MODELS}:jax_stack_tanh_gelu")
    assert failed.returncode == 1
    assert "blocks.1.act" in failed.stdout and failed.stderr.startswith("error: torch and JAX diverge")
    assert "Traceback" not in failed.stderr


def test_verify_factories_bad_input_is_exit_2():
    missing = _run("-m", "bridge", "verify", "--torch", f"{MODELS}:nothing", "--jax", f"{MODELS}:jax_stack")
    assert missing.returncode == 2 and "--torch tests.bridge.compare_models:nothing" in missing.stderr
    alone = _run("-m", "bridge", "verify", "--torch", f"{MODELS}:torch_stack")
    assert alone.returncode == 2 and "--torch and --jax go together" in alone.stderr
    mixed = _run("-m", "bridge", "verify", "--torch", f"{MODELS}:torch_stack", "--jax", f"{MODELS}:jax_stack", "--mesh", "dp=2")
    assert mixed.returncode == 2 and "--mesh" in mixed.stderr


def test_the_attention_example_passes():
    result = _run("examples/compare_attention.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "agree" in result.stdout

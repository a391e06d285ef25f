"""Ctrl-C during `shardbridge convert`, as a user gives it: a real SIGINT to the process group of a real
CLI process, sent while the target is being written (when the staging directory holds a given
share of the target's bytes). Every time: exit 130, one `error: interrupted` line and nothing else
on stderr, no target, no staging directory, and the source and an earlier target untouched.

The source is an HF Llama directory written here (random weights, about 60 MB), so one source
serves every target format, the HF one included (its config.json is carried, no --config).
The grid (-m grid) interrupts each format at 0, 10, 50 and 90 % of the bytes written.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bridge.convert import convert
from bridge.convert.interrupts import deferred_interrupts
from twinspec import hf_llama

REPO = Path(__file__).resolve().parents[2]
# `python -m bridge ARGS`, with Ctrl-C raising KeyboardInterrupt even where this test was started with SIGINT
# ignored (a shell's background job hands that down, and Python then keeps it ignored)
CLI = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('bridge', run_name='__main__', alter_sys=True)"
)
TARGETS = {"dcp": "out-dcp", "orbax": "step-7", "safetensors": "out.safetensors", "hf": "out-hf"}
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """An HF Llama directory of HF_CONFIG's shapes with random fp32 weights, and an earlier DCP target beside it."""
    root = tmp_path_factory.mktemp("interrupt")
    directory = root / "hf"
    directory.mkdir()
    (directory / hf_llama.CONFIG_FILE).write_text(json.dumps(HF_CONFIG, indent=2) + "\n")
    (directory / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
    config, _ = hf_llama.parse_config(HF_CONFIG, directory / hf_llama.CONFIG_FILE)
    generator = torch.Generator().manual_seed(0)
    shapes = hf_llama.hf_shapes(config)
    save_file({name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}, directory / hf_llama.SINGLE_FILE)
    assert convert(directory, "hf", root / "earlier", "dcp").ok
    return directory


def _digests(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _written_bytes(directory: Path) -> int:
    """Bytes on disk under `directory` (allocated blocks: a safetensors target is sized before it is filled)."""
    total = 0
    for folder, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:  # renamed or removed while we looked (Orbax's temporary files)
                pass
    return total


def interrupt_while_writing(source: Path, fmt: str, share: float, folder: Path) -> tuple[int, str, Path]:
    """Run `shardbridge convert` from `source` to `fmt` in `folder`; SIGINT once staging holds `share` of the
    source's bytes. (exit code, stderr, target)."""
    target = folder / TARGETS[fmt]
    staging = target.with_name(f".{target.name}.partial")
    size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    argv = [sys.executable, "-c", CLI, "convert", str(source), str(target), "--from", "hf", "--to", fmt]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    sent = False
    try:
        deadline = time.monotonic() + 240
        while process.poll() is None and time.monotonic() < deadline:
            if staging.exists() and not target.exists() and _written_bytes(staging) >= share * size:
                os.killpg(process.pid, signal.SIGINT)
                sent = True
                break
            time.sleep(0.002)
        _, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
    assert sent, f"the conversion ended (exit {process.returncode}) before it could be interrupted: {stderr}"
    return process.returncode, stderr, target


def check_left_nothing(source: Path, fmt: str, share: float, folder: Path) -> None:
    before = {**_digests(source), **_digests(source.parent / "earlier")}
    code, stderr, target = interrupt_while_writing(source, fmt, share, folder)
    assert (code, stderr.splitlines()) == (130, ["error: interrupted"]), stderr
    assert not os.path.lexists(target) and os.listdir(folder) == []  # no target, no staging directory
    assert {**_digests(source), **_digests(source.parent / "earlier")} == before
    assert sorted(p.name for p in source.parent.iterdir()) == ["earlier", "hf"]


@pytest.mark.parametrize("fmt", TARGETS)
def test_ctrl_c_while_writing_leaves_nothing(source, fmt, tmp_path):
    check_left_nothing(source, fmt, 0.3, tmp_path)


@pytest.mark.grid
@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("fmt", TARGETS)
def test_ctrl_c_at_any_point_of_the_write_leaves_nothing(source, fmt, share, tmp_path):
    check_left_nothing(source, fmt, share, tmp_path)


@pytest.fixture
def python_sigint_handler():
    """A fresh CLI process has Python's own SIGINT handler; an earlier test in this worker may have left torch's."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_deferred_sigint_is_raised_at_the_next_check_or_at_the_end(python_sigint_handler):
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts() as interrupts:
            signal.raise_signal(signal.SIGINT)
            steps.append("went on")  # not interrupted here
            interrupts.check()
            steps.append("after the check")
    assert steps == ["went on"]
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            signal.raise_signal(signal.SIGINT)  # after the last check: raised when the context ends
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

"""`shardbridge quantize` writes the reference's bytes, compares implementations, rejects bad input."""

import io

import numpy as np
import pytest
import torch
from rich.console import Console

from bridge import cli
from kernels import reference as R
from kernels._backend import Backend, backend_for

# CLI arguments -> the reference call they stand for, written out by hand
CASES = {
    "current-grad": (
        ["--recipe", "current", "--role", "grad"],
        lambda x: R.quantize_tensorwise(x, "e5m2", columnwise=True),
    ),
    "delayed": (["--recipe", "delayed"], lambda x: R.quantize_tensorwise(x, "e4m3", torch.ones(1), columnwise=True)),
    "block-weight": (
        ["--recipe", "block", "--role", "weight", "--format", "e5m2"],
        lambda x: R.quantize_blockwise(x, "e5m2", (128, 128), columnwise=True),
    ),
    "mxfp8-floor": (
        ["--recipe", "mxfp8", "--scale-rounding", "floor"],
        lambda x: R.quantize_mxfp8(x, "e4m3", scale_rounding="floor", columnwise=True),
    ),
    "nvfp4-input": (["--recipe", "nvfp4"], lambda x: R.quantize_nvfp4(x, hadamard=True, columnwise=True)),
}


@pytest.fixture
def console(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "Console", lambda: Console(file=buffer, width=120, color_system=None))
    return buffer


@pytest.fixture
def array_path(tmp_path):
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32) * 4
    x[3, :32] = 0  # an all-zero block
    path = tmp_path / "x.npy"
    np.save(path, x)
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_npz_holds_the_reference_bytes(name, array_path, tmp_path, console):
    args, reference = CASES[name]
    out = tmp_path / "q.npz"
    assert cli.main(["quantize", str(array_path), "--out", str(out), *args]) == 0
    expected = reference(torch.from_numpy(np.load(array_path)))
    saved = dict(np.load(out))
    wanted = {
        "data": expected.data,
        "scale_inv": expected.scale_inv,
        "columnwise_data": expected.columnwise_data,
        "columnwise_scale_inv": expected.columnwise_scale_inv,
    }
    if expected.fmt == "e2m1":
        wanted["global_scale_inv"] = expected.amax / (448 * 6)
        wanted["columnwise_global_scale_inv"] = expected.columnwise_amax / (448 * 6)
    assert sorted(saved) == sorted(wanted)
    for key, value in wanted.items():
        assert saved[key].dtype == value.numpy().dtype and np.array_equal(saved[key], value.numpy()), key
    assert "wrote" in console.getvalue()


def test_bf16_cast_before_quantizing(array_path, tmp_path, console):
    out = tmp_path / "q.npz"
    assert (
        cli.main(
            [
                "quantize",
                str(array_path),
                "--recipe",
                "block",
                "--usage",
                "rowwise",
                "--dtype",
                "bf16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    expected = R.quantize_blockwise(torch.from_numpy(np.load(array_path)).bfloat16())
    saved = np.load(out)
    assert sorted(saved) == ["data", "scale_inv"]
    assert np.array_equal(saved["data"], expected.data.numpy()) and np.array_equal(
        saved["scale_inv"], expected.scale_inv.numpy()
    )


def test_compare_counts_mismatches_per_buffer(array_path, tmp_path, console):
    code = cli.main(["quantize", str(array_path), "--recipe", "mxfp8", "--out", str(tmp_path / "q.npz"), "--compare"])
    text = console.getvalue()
    assert code == 0 and "columnwise_scale_inv" in text
    if backend_for("cuda" if torch.cuda.is_available() else "cpu") is Backend.REFERENCE:
        assert "not compared" in text
    else:  # the interpreter (tests/conftest.py) or a GPU: a column of zero mismatches against the reference
        row = next(line for line in text.splitlines() if "columnwise_data" in line and "wrote" not in line)
        assert row.rstrip(" │|").split()[-1] == "0"
    header = next(line for line in text.splitlines() if "buffer" in line)
    assert header.rstrip(" ┃|").split()[-1] == "jax"  # jaxside is always one of the compared implementations
    for buffer in ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv"):
        row = next(line for line in text.splitlines() if line.strip("│ ").startswith(buffer + " "))
        assert row.rstrip(" │|").split()[-1] == "0", row


def test_compare_reports_a_jax_mismatch(array_path, tmp_path, console, monkeypatch):
    """The table is a real comparison: a flipped byte on the JAX side shows up and fails the command."""
    from bridge.commands import quantize as command

    honest = command._quantize_in_jax

    def one_byte_off(*args):
        buffers = honest(*args)
        buffers["data"] = buffers["data"].copy()
        buffers["data"].flat[0] ^= 1
        return buffers

    monkeypatch.setattr(command, "_quantize_in_jax", one_byte_off)
    code = cli.main(["quantize", str(array_path), "--recipe", "mxfp8", "--out", str(tmp_path / "q.npz"), "--compare"])
    row = next(line for line in console.getvalue().splitlines() if line.strip("│ ").startswith("data "))
    assert code == 1 and row.rstrip(" │|").split()[-1] == "1"


@pytest.mark.parametrize(
    "make_input, args, message",
    [
        (None, ["--recipe", "current"], "no such file"),
        (lambda: np.zeros((4, 32)), ["--recipe", "current"], "float64"),
        (lambda: np.zeros((4, 40), np.float32), ["--recipe", "mxfp8"], "multiple of 32"),
        (lambda: np.zeros((4, 32), np.float32), ["--recipe", "nvfp4", "--format", "e5m2"], "drop --format"),
        (lambda: np.zeros((4, 32), np.float32), ["--recipe", "block", "--scale-rounding", "up"], "mxfp8 only"),
        (lambda: np.float32(1.0), ["--recipe", "current"], "0-d"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_code_2(make_input, args, message, tmp_path, console, capsys):
    path = tmp_path / "in.npy"
    if make_input is not None:
        np.save(path, make_input())
    assert cli.main(["quantize", str(path), "--out", str(tmp_path / "q.npz"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and message in err
    assert not (tmp_path / "q.npz").exists()

"""`shardbridge quantize` writes the reference's bytes, compares implementations, rejects bad input."""

import io

import numpy as np
import pytest
import torch
from rich.console import Console

from bridge import cli
from fp8kernels import reference as R
from fp8kernels._backend import Backend, backend_for

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
    assert not (tmp_path / "q.npz").exists()  # bytes the implementations disagree on are not written


def test_block_compare_matches_the_reference_and_writes_its_bytes(tmp_path, console, monkeypatch):
    """Issue 42: under the interpreter --recipe block --compare wrote --out, then failed on the Triton 1x128
    scales' storage order (rows-contiguous: with two or more blocks per row a byte view needs C order)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = np.random.default_rng(2).standard_normal((32, 256)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "q.npz"
    assert cli.main(["quantize", str(tmp_path / "x.npy"), "--recipe", "block", "--out", str(out), "--compare"]) == 0
    expected = R.quantize_blockwise(torch.from_numpy(x), "e4m3", (1, 128), columnwise=True)
    with np.load(out) as written:
        for key in ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv"):
            np.testing.assert_array_equal(written[key], getattr(expected, key).contiguous().numpy(), err_msg=key)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["q.npz", "x.npy"]  # no partial file left


def test_a_failed_comparison_writes_nothing(array_path, tmp_path, console, monkeypatch, capsys):
    from bridge.commands import quantize as command

    def broken(results, console):
        raise ValueError("the comparison failed")

    monkeypatch.setattr(command, "_compare_table", broken)
    out = tmp_path / "q.npz"
    assert cli.main(["quantize", str(array_path), "--recipe", "current", "--out", str(out), "--compare"]) == 2
    assert capsys.readouterr().err == "error: the comparison failed\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["x.npy"]


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


@pytest.mark.parametrize("recipe", ["current", "delayed", "block", "mxfp8", "nvfp4"])
def test_compare_works_for_every_recipe(recipe, tmp_path, console, monkeypatch):
    """Finding 4: the JAX twin quantizes under every recipe, byte for byte with the reference.

    Rowwise only and without the Triton interpreter (TRITON_INTERPRET=0), because JAX's compile of each
    copy dominates the time: the MXFP8 test above runs the interpreter, and test_quantize_cross.py
    compares both copies of every recipe bit for bit.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    path = tmp_path / "x.npy"
    np.save(path, np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32))
    out = str(tmp_path / "q.npz")
    code = cli.main(["quantize", str(path), "--recipe", recipe, "--out", out, "--usage", "rowwise", "--compare"])
    text = console.getvalue()
    assert code == 0, text
    header = next(line for line in text.splitlines() if "buffer" in line)
    assert header.split("┃")[-2].strip() == "jax"
    assert "data " in text and "scale_inv " in text


@pytest.mark.parametrize(
    "write, message",
    [
        (lambda file: np.savez(file, x=np.zeros((4, 32), np.float32)), "is a .npz archive"),
        (lambda file: file.write(b"1.0, 2.0\n3.0, 4.0\n"), "is not a .npy array"),
        (lambda file: file.write(b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'"), "damaged .npy"),
    ],
)
def test_input_that_is_not_a_npy_array_is_named(write, message, tmp_path, console, capsys):
    path = tmp_path / "in.npy"
    with open(path, "wb") as file:
        write(file)
    assert cli.main(["quantize", str(path), "--recipe", "current", "--out", str(tmp_path / "q.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}") and message in err
    assert "allow_pickle" not in err


def test_missing_out_directory_is_refused_before_quantizing(array_path, tmp_path, console, capsys, monkeypatch):
    from bridge.commands import quantize as command

    monkeypatch.setattr(command, "_quantize_everywhere", lambda *args: pytest.fail("quantized before checking --out"))
    out = tmp_path / "missing" / "q.npz"
    assert cli.main(["quantize", str(array_path), "--recipe", "current", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out}: directory {out.parent} does not exist" in err


def test_out_is_written_exactly_at_the_path_given(array_path, tmp_path, console):
    out = tmp_path / "noext"
    assert cli.main(["quantize", str(array_path), "--recipe", "current", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noext", "x.npy"]
    assert f"wrote {out}:" in console.getvalue()
    assert set(np.load(out)) == {"data", "scale_inv", "columnwise_data", "columnwise_scale_inv"}


@pytest.mark.parametrize("recipe", ["current", "delayed", "block", "mxfp8", "nvfp4"])
def test_non_finite_input_is_counted_in_a_warning(recipe, tmp_path, console, capsys):
    x = np.ones((32, 32), np.float32)
    x[0, 0], x[1, 1], x[2, 2] = np.nan, np.inf, -np.inf
    path = tmp_path / "x.npy"
    np.save(path, x)
    assert cli.main(["quantize", str(path), "--recipe", recipe, "--out", str(tmp_path / "q.npz")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"warning: 3 non-finite values (1 NaN, 2 Inf) in {path}; under {recipe} they ")


def test_finite_input_warns_nothing(array_path, tmp_path, console, capsys):
    assert cli.main(["quantize", str(array_path), "--recipe", "current", "--out", str(tmp_path / "q.npz")]) == 0
    assert capsys.readouterr().err == ""

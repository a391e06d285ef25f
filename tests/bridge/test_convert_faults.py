"""`shardbridge convert` under faults: corrupted, damaged, foreign and unfinished sources; interrupted,
refused and concurrent targets. Each case: the error (or exit code) and its message naming the file,
and nothing committed under the target's name, nor left beside it.

Sources "written by us" come from the writers the project ships (torchside's checksummed DCP
writer, jaxside.checkpoint.save, the converter's safetensors writer); the corruption is 8 flipped
bytes found by searching the raw files for the tensor's own bytes (random bits: no format compresses
them, so the flip is invisible to the format itself, as it was in the issue).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from bridge import cli
from bridge import convert as convert_module
from bridge.convert import convert
from bridge.convert import orbax as convert_orbax
from bridge.errors import CheckFailed
from torchside.checkpoint.checksums import ChecksummedWriter

FORMATS = ("dcp", "safetensors", "orbax")
TARGET_NAMES = {"dcp": "out-dcp", "safetensors": "out.safetensors", "orbax": "step-9"}
CRCS = r"CRC32 [0-9a-f]{8}, but [0-9a-f]{8} was recorded"


def _random_bits(*shape: int, seed: int) -> torch.Tensor:
    raw = np.random.default_rng(seed).integers(0, 1 << 8, size=4 * int(np.prod(shape)), dtype=np.uint8)
    return torch.from_numpy(raw).view(torch.float32).reshape(shape)


def _state() -> dict[str, torch.Tensor]:
    return {"model.up.weight": _random_bits(64, 32, seed=0), "model.up.bias": _random_bits(64, seed=1)}


def _write_source(fmt: str, root: Path) -> Path:
    """A checkpoint of `_state()` in `fmt`, with the checksums its writer records."""
    state = _state()
    if fmt == "dcp":
        dcp.save(state, storage_writer=ChecksummedWriter(root / "src-dcp"), no_dist=True)
        return root / "src-dcp"
    if fmt == "orbax":
        import jax.numpy as jnp

        from jaxside import checkpoint

        up = {"kernel": jnp.asarray(state["model.up.weight"].numpy().T), "bias": jnp.asarray(state["model.up.bias"].numpy())}
        tree = {"model": {"up": up}}
        return checkpoint.save(root / "src-orbax", 1, tree)
    dcp.save(state, storage_writer=ChecksummedWriter(root / "tmp-dcp"), no_dist=True)
    convert(root / "tmp-dcp", "dcp", root / "src.safetensors", "safetensors")
    return root / "src.safetensors"


def _flip(source: Path, fmt: str) -> Path:
    """Flip 8 bytes inside the stored weight's bytes; the file that held them."""
    weight = _state()["model.up.weight"]
    stored = weight.numpy().T.copy() if fmt == "orbax" else weight.numpy()
    needle = stored.tobytes()[4096:4160]
    files = [source] if source.is_file() else [p for p in source.rglob("*") if p.is_file()]
    hits = [(p, p.read_bytes().find(needle)) for p in files]
    hits = [(p, at) for p, at in hits if at >= 0]
    assert len(hits) == 1, hits
    path, at = hits[0]
    raw = bytearray(path.read_bytes())
    raw[at + 8 : at + 16] = bytes(b ^ 0xFF for b in raw[at + 8 : at + 16])
    path.write_bytes(bytes(raw))
    return path


def _left(root: Path) -> list[str]:
    """Everything in `root` whose name is not a source's (targets, staging directories, temporaries)."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(("src", "tmp-")))


@pytest.mark.parametrize("target", FORMATS)
@pytest.mark.parametrize("source", FORMATS)
def test_corrupted_source_stops_the_conversion(tmp_path, source, target):
    path = _write_source(source, tmp_path)
    assert convert(path, source, tmp_path / "x", target, dry_run=True).source_verified
    damaged = _flip(path, source)
    named = damaged if source == "dcp" else path  # Orbax names the array (its chunk files are OCDBT's)
    tensor = "model.up.kernel" if source == "orbax" else "model.up.weight"
    with pytest.raises(CheckFailed, match=CRCS) as error:
        convert(path, source, tmp_path / TARGET_NAMES[target], target)
    assert str(named) in str(error.value) and tensor in str(error.value)
    assert _left(tmp_path) == []


def test_corrupted_source_exits_1_naming_the_file(tmp_path, capsys):
    path = _write_source("dcp", tmp_path)
    damaged = _flip(path, "dcp")
    assert cli.main(["convert", str(path), str(tmp_path / "out"), "--from", "dcp", "--to", "safetensors"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and damaged.name in err and "model.up.weight" in err
    assert _left(tmp_path) == []


def test_foreign_source_converts_and_says_it_was_not_verified(tmp_path, capsys):
    dcp.save(_state(), checkpoint_id=tmp_path / "src", no_dist=True)  # DCP's own writer: no checksums
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--from", "dcp", "--to", "dcp"]) == 0
    assert "source not verifiable" in capsys.readouterr().out
    result = convert(tmp_path / "out", "dcp", tmp_path / "again.safetensors", "safetensors")  # our output is checksummed
    assert result.source_verified and result.ok


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage(case: str, root: Path) -> tuple[Path, str, str]:
    """(source, its format, text the error must hold) for one kind of damaged or unfit input."""
    if case in ("dcp-truncated", "dcp-deleted", "metadata-truncated", "metadata-flipped", "checksums-garbled"):
        source = _write_source("dcp", root)
        data = next(source.glob("*.distcp"))
        if case == "dcp-truncated":
            _truncate(data)
            return source, "dcp", f"{data} is truncated"
        if case == "dcp-deleted":
            data.unlink()
            return source, "dcp", f"{data} is missing"
        if case == "checksums-garbled":
            (source / "__0_checksums.json").write_text('{"__0_0.distcp": [12, ')
            return source, "dcp", f"{source / '__0_checksums.json'} is damaged"
        metadata = source / ".metadata"
        if case == "metadata-truncated":
            _truncate(metadata)
        else:
            raw = bytearray(metadata.read_bytes())
            raw[: len(raw) // 2] = bytes(b ^ 0x5A for b in raw[: len(raw) // 2])
            metadata.write_bytes(bytes(raw))
        return source, "dcp", f"{metadata} is damaged"
    if case == "foreign-dcp-truncated":
        dcp.save(_state(), checkpoint_id=root / "src", no_dist=True)
        data = next((root / "src").glob("*.distcp"))
        _truncate(data)
        return root / "src", "dcp", f"from {data} failed"
    if case == "safetensors-truncated":
        source = _write_source("safetensors", root)
        _truncate(source)
        return source, "safetensors", f"{source} is truncated"
    if case == "safetensors-fake":
        (root / "src.safetensors").write_text("not a tensor file, just some text\n" * 4)
        return root / "src.safetensors", "safetensors", f"{root / 'src.safetensors'} is not a safetensors file"
    if case == "orbax-given-dcp":
        return _write_source("dcp", root), "orbax", "it is a DCP checkpoint: pass --from dcp"
    if case == "dcp-unfinished-save":
        source = _write_source("dcp", root)
        staging = root / "src-root" / "step-00000001.tmp"
        staging.parent.mkdir()
        source.rename(staging)
        return staging, "dcp", f"{staging} is an unfinished save (no commit)"
    assert case == "orbax-unfinished-save"
    source = _write_source("orbax", root)
    staging = source.with_name("step-1.orbax-checkpoint-tmp-1234")
    source.rename(staging)
    return staging, "orbax", f"{staging} is an unfinished save (no commit)"


DAMAGE = (
    "dcp-truncated", "dcp-deleted", "metadata-truncated", "metadata-flipped", "checksums-garbled",
    "foreign-dcp-truncated", "safetensors-truncated", "safetensors-fake", "orbax-given-dcp",
    "dcp-unfinished-save", "orbax-unfinished-save",
)  # fmt: skip


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_or_unfit_source_is_a_value_error_naming_the_file(tmp_path, case):
    source, fmt, expected = _damage(case, tmp_path)
    with pytest.raises(ValueError) as error:
        convert(source, fmt, tmp_path / "out.safetensors", "safetensors")
    assert expected in str(error.value)
    assert _left(tmp_path) == []


def test_damaged_source_exits_2_naming_the_file(tmp_path, capsys):
    source, fmt, expected = _damage("metadata-truncated", tmp_path)
    assert cli.main(["convert", str(source), str(tmp_path / "out"), "--from", fmt, "--to", "dcp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and str(source / ".metadata") in " ".join(err.split())
    assert _left(tmp_path) == []


# ---- targets: interrupted, refused, raced


def _interrupt(key: str, nbytes: int) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("target", FORMATS)
def test_interrupted_conversion_leaves_nothing(tmp_path, target):
    source = _write_source("dcp", tmp_path)
    with pytest.raises(KeyboardInterrupt):
        convert(source, "dcp", tmp_path / TARGET_NAMES[target], target, on_box=_interrupt)
    assert _left(tmp_path) == []


def test_interrupted_orbax_save_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """Ctrl-C while Orbax commits in its background thread (after every box was produced)."""
    import orbax.checkpoint as ocp

    source = _write_source("dcp", tmp_path)
    monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", lambda self: _interrupt("", 0))
    with pytest.raises(KeyboardInterrupt):
        convert(source, "dcp", tmp_path / "step-9", "orbax")
    assert _left(tmp_path) == []


@pytest.mark.parametrize("target", FORMATS)
def test_interrupted_read_back_commits_nothing(tmp_path, monkeypatch, target):
    """The read-back runs on the staging copy: interrupted there, no unverified target is left."""
    source = _write_source("dcp", tmp_path)
    monkeypatch.setattr(convert_module, "_read_back", lambda *args: _interrupt("", 0))
    with pytest.raises(KeyboardInterrupt):
        convert(source, "dcp", tmp_path / TARGET_NAMES[target], target)
    assert _left(tmp_path) == []


def test_interrupted_cli_conversion_exits_130(tmp_path, monkeypatch):
    source = _write_source("dcp", tmp_path)
    monkeypatch.setattr(convert_orbax, "_array", lambda *args: _interrupt("", 0))
    assert cli.main(["convert", str(source), str(tmp_path / "step-9"), "--from", "dcp", "--to", "orbax"]) == 130
    assert _left(tmp_path) == []


def test_written_copy_that_reads_back_differently_is_not_committed(tmp_path, monkeypatch):
    source = _write_source("dcp", tmp_path)
    real = convert_module._read_back

    def one_box_flipped(*args):
        crcs = real(*args)
        first = sorted(crcs)[0]
        return {**crcs, first: crcs[first] ^ 1}

    monkeypatch.setattr(convert_module, "_read_back", one_box_flipped)
    with pytest.raises(CheckFailed, match=r"model.up.bias: produced [0-9a-f]{8}, read back [0-9a-f]{8}"):
        convert(source, "dcp", tmp_path / "out-dcp", "dcp")
    assert _left(tmp_path) == []


READ_ONLY = [pytest.param("/sys", id="read-only-filesystem")]
if os.geteuid() != 0:  # root ignores mode bits, so 0555 refuses nothing there
    READ_ONLY.append(pytest.param("0555", id="mode-0555"))


@pytest.mark.parametrize("parent", READ_ONLY)
def test_unwritable_target_directory_is_refused(tmp_path, capsys, parent):
    source = _write_source("dcp", tmp_path)
    if parent == "0555":
        parent = tmp_path / "locked"
        parent.mkdir(mode=0o555)
    target = Path(parent) / "shardbridge-convert-target"
    with pytest.raises(OSError, match="write shardbridge-convert-target into a directory you can write to"):
        convert(source, "dcp", target, "dcp")
    assert cli.main(["convert", str(source), str(target), "--from", "dcp", "--to", "dcp"]) == 2
    assert "cannot create" in capsys.readouterr().err
    assert not os.path.lexists(target)


@pytest.mark.parametrize("target", FORMATS)
def test_target_in_a_missing_directory_is_written_there(tmp_path, target):
    source = _write_source("dcp", tmp_path)
    assert convert(source, "dcp", tmp_path / "new" / "dir" / TARGET_NAMES[target], target).ok
    assert os.listdir(tmp_path / "new" / "dir") == [TARGET_NAMES[target]]


def test_concurrent_conversions_into_one_target(tmp_path):
    """The second writer of a target is refused while the first writes; the first's target stays intact."""
    source = _write_source("dcp", tmp_path)
    target = tmp_path / "out.safetensors"
    writing, go_on, outcome = threading.Event(), threading.Event(), {}

    def first_on_box(key: str, nbytes: int) -> None:
        writing.set()
        assert go_on.wait(30)

    def first() -> None:
        outcome["first"] = convert(source, "dcp", target, "safetensors", on_box=first_on_box)

    thread = threading.Thread(target=first)
    thread.start()
    assert writing.wait(30)
    with pytest.raises(ValueError, match="another process is writing"):
        convert(source, "dcp", target, "safetensors")
    go_on.set()
    thread.join(30)
    assert outcome["first"].ok
    with pytest.raises(ValueError, match="exists; pass a new path"):
        convert(source, "dcp", target, "safetensors")
    from safetensors.torch import load_file

    loaded = load_file(target)
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in _state().items())
    assert _left(tmp_path) == ["out.safetensors"]

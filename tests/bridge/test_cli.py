import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from bridge import cli, environment
from bridge.errors import CheckFailed

ROOT = Path(__file__).parents[2]


def test_env_reports_every_framework_and_where_kernels_run():
    rows = {row.name: row.value for row in environment.collect()}
    import jax
    import torch

    assert rows["torch"] == torch.__version__.split("+")[0] or rows["torch"] == torch.__version__
    assert rows["jax"] == jax.__version__
    assert rows["jax devices"].startswith(f"{len(jax.devices())} ")
    assert rows["triton kernels"]


def test_help_lists_the_commands():
    """Each command is a line of the COMMAND list (name, then its help), above the exit codes epilog."""
    out = subprocess.run([sys.executable, "-m", "bridge", "--help"], capture_output=True, text=True, check=True).stdout
    commands = out.split("positional arguments:")[1].split("options:")[0]
    listed = re.findall(r"^    (\S+)", commands, flags=re.MULTILINE)  # continuation lines are indented further
    assert listed == list(cli.COMMANDS)


def test_env_renders_a_table(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "Console", lambda: Console(file=buffer, width=100, color_system=None))
    assert cli.main(["env"]) == 0
    assert "torch devices" in buffer.getvalue()


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: shardbridge" in capsys.readouterr().out


def _env_raising(monkeypatch, error: BaseException) -> None:
    """`shardbridge env` raising `error`, as any verb's library code would."""
    from bridge.commands import env

    def raising(args, console):
        raise error

    monkeypatch.setattr(env, "run", raising)


@pytest.mark.parametrize(
    "error, code, message",
    [
        (CheckFailed("checksums differ: w.safetensors"), 1, "error: checksums differ: w.safetensors"),
        (ValueError("--out x: pick another path"), 2, "error: --out x: pick another path"),
        (TypeError("shape must be ints"), 2, "error: shape must be ints"),
        (PermissionError(13, "Permission denied", "/ro/target"), 2, "Permission denied: '/ro/target'"),
        (FileNotFoundError(2, "No such file or directory", "/gone"), 2, "No such file or directory: '/gone'"),
        (OSError("disk full\nwhile writing /t"), 2, "error: disk full while writing /t"),
        (KeyboardInterrupt(), 130, "error: interrupted"),
    ],
)
def test_exceptions_map_to_exit_codes_and_one_error_line(monkeypatch, capsys, error, code, message):
    _env_raising(monkeypatch, error)
    assert cli.main(["env"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_debug_prints_the_traceback_too(monkeypatch, capsys):
    _env_raising(monkeypatch, ValueError("bad input"))
    assert cli.main(["--debug", "env"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1] == "error: bad input"


def test_a_long_error_is_not_wrapped(monkeypatch, capsys):
    long_path = "/data/" + "x" * 150 + "/checkpoint.safetensors"
    _env_raising(monkeypatch, ValueError(f"{long_path}: truncated; write it again"))
    assert cli.main(["env"]) == 2
    assert capsys.readouterr().err == f"error: {long_path}: truncated; write it again\n"


def test_help_states_the_exit_codes_and_debug():
    out = subprocess.run([sys.executable, "-m", "bridge", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--debug" in out
    for line in ("0    done", "1    a check or verification failed", "2    bad input", "130  interrupted"):
        assert line in out


def test_output_to_a_pipe_is_not_wrapped(monkeypatch, capsys):
    """No terminal (a pipe, a file): tables take the width they need; a long parameter name stays on one line."""
    from bridge import runtime
    from bridge.numerics import TensorCheck, Tolerance, VerifyReport

    name = "model.layers.11.self_attention.layernorm_qkv.layer_norm_weight"
    report = VerifyReport("mlp", "dp_shard=2,tp=2", "current", 1)
    report.checks.append(TensorCheck(0, "weight_grad", name, 0.01, 0.02, False, Tolerance(0.125), True))
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(runtime, "launch", lambda *args, **kwargs: [[report.to_json()]])
    assert cli.main(["verify", "--device", "cpu"]) == 0
    assert f"{name} (step 0)" in capsys.readouterr().out


def test_ctrl_c_under_torchrun_exits_130(monkeypatch, capsys, tmp_path):
    """torchrun's agent reports Ctrl-C as SignalException(SIGINT); the CLI still says `interrupted`, exit 130."""
    import signal

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def interrupted(argv):
        raise SignalException("Process 1 got signal: 2", signal.SIGINT)

    script = tmp_path / "script.py"
    script.write_text("")
    monkeypatch.setattr(torchrun, "main", interrupted)
    assert cli.main(["run", "-n", "2", str(script)]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"


@pytest.mark.parametrize("argv", [["plan", "show", "--png"], ["demo", "--out"], ["verify", "--report"]])
def test_an_output_path_under_a_file_says_it_is_a_file(tmp_path, capsys, argv):
    """Issue 42: `--out text.npy/sub.npz` said "directory text.npy does not exist" while it is a file."""
    blocking = tmp_path / "text.npy"
    blocking.write_text("")
    out = blocking / "sub" / "x.png"
    assert cli.main([*argv, str(out)]) == 2
    said = f"error: {argv[-1]} {out}: {blocking} is a file, not a folder; pick another path\n"
    assert capsys.readouterr().err == said
    assert blocking.is_file()


def test_run_names_a_missing_script(capsys):
    assert cli.main(["run", "-n", "2", "/nonexistent/train.py"]) == 2
    assert capsys.readouterr().err == "error: /nonexistent/train.py: no such script; pass the path of a Python file\n"


def test_the_readme_test_command_is_the_one_ci_runs():
    """Issue 42: the README's command differed from .ci/run's (no --durations=15 and more)."""
    readme = (ROOT / "README.md").read_text().split("## Tests (one command)")[1]
    readme_command = readme.split("```bash\n")[1].split("\n```")[0]
    ci_commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if "-m pytest" in line]
    assert ci_commands == [readme_command]


def test_run_help_and_the_readme_point_to_an_example_that_exists(capsys):
    example = "examples/run_colocated.py"
    assert (ROOT / example).is_file()
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert f"shardbridge run -n 2 {example}" in capsys.readouterr().out
    rows = (ROOT / "README.md").read_text().splitlines()
    run_row = next(line for line in rows if line.startswith("| `shardbridge run"))
    assert f"`shardbridge run -n 2 {example}`" in run_row

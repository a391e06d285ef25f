import io
import subprocess
import sys

from rich.console import Console

from bridge import cli, environment


def test_env_reports_every_framework_and_where_kernels_run():
    rows = {row.name: row.value for row in environment.collect()}
    import jax
    import torch

    assert rows["torch"] == torch.__version__.split("+")[0] or rows["torch"] == torch.__version__
    assert rows["jax"] == jax.__version__
    assert rows["jax devices"].startswith(f"{len(jax.devices())} ")
    assert rows["triton kernels"]


def test_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "bridge", "--help"], capture_output=True, text=True, check=True).stdout
    assert "env" in out


def test_env_renders_a_table(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "Console", lambda: Console(file=buffer, width=100, color_system=None))
    assert cli.main(["env"]) == 0
    assert "torch devices" in buffer.getvalue()


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: shardbridge" in capsys.readouterr().out

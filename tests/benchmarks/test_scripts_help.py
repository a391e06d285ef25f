"""Every benchmark script (benchmarks/**/*.py run as `__main__`) imports and answers `--help` on a CPU.

One subprocess runs them all (importing torch and JAX once, not per script, and keeping the scripts'
module-level state out of the test process); each script is its own test case, found by glob, so a
new script is covered without a line here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    path.relative_to(REPO).as_posix()
    for path in (REPO / "benchmarks").rglob("*.py")
    if 'if __name__ == "__main__":' in path.read_text()
)
# Runs each script as __main__ with `--help`: (exit code, stdout, error) per script, as one JSON line.
RUN_ALL_WITH_HELP = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for script in sys.argv[1:]:
    out = io.StringIO()
    code, error = None, None
    sys.argv = [script, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        code = exit.code
    except BaseException:
        error = traceback.format_exc(limit=-3)
    results[script] = (code, out.getvalue(), error)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def help_results() -> dict[str, tuple]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    env.pop("COLUMNS", None)
    done = subprocess.run(
        [sys.executable, "-c", RUN_ALL_WITH_HELP, *SCRIPTS], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_glob_finds_the_scripts():
    assert "benchmarks/bench/bench_gemm.py" in SCRIPTS and "benchmarks/harness.py" not in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_imports_and_prints_its_help(script, help_results):
    code, out, error = help_results[script]
    assert error is None, f"{script} --help raised:\n{error}"
    assert code == 0 and out.startswith("usage:"), f"{script} --help exited {code!r}, printed {out[:300]!r}"

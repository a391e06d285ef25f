"""Test setup that must happen before jax or triton are imported.

- JAX gets 8 host CPU devices (this only affects JAX's CPU platform; a GPU run keeps its GPUs).
- The run's processes (xdist workers, launched ranks) share one JAX compilation cache, removed at the end.
- Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1).
- `gpu` tests are skipped without CUDA.
- `reference_kernels`: the fixture for tests that run kernels through their pure-torch reference.
- With PYTEST_INSTAFAIL=1 a failure's traceback prints when it happens (GPU runs under a time limit
  would otherwise lose it with the end-of-run summary).
"""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# One JAX compilation cache for the run's processes (pytest-xdist's workers and every launched rank inherit the
# variable): a program one of them compiled is loaded by the others (NVFP4's steps take a minute on 2 cores).
_OWN_JAX_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_JAX_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardbridge-jax-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def reference_kernels(monkeypatch):
    """Every kernel through its pure-torch reference (fp8kernels._backend reads TRITON_INTERPRET when called):
    thread-safe, unlike the Triton interpreter, so threaded ranks can run it, and fast on small shapes.
    One intra-op thread: tensors this small only spin a second one on a shared 2-core machine."""
    from fp8kernels._backend import Backend, backend_for

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend_for("cpu") is Backend.REFERENCE
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; runs on the GPU machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    if report.failed and os.environ.get("PYTEST_INSTAFAIL") == "1":
        print(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}", flush=True)


def pytest_sessionfinish(session):
    if _OWN_JAX_CACHE:  # the process that made the cache (not a worker, which inherited it)
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

"""Test setup that must happen before jax or triton are imported.

- JAX gets 8 host CPU devices (this only affects JAX's CPU platform; a GPU run keeps its GPUs).
- Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1).
- `gpu` tests are skipped without CUDA.
- With PYTEST_INSTAFAIL=1 a failure's traceback prints when it happens (GPU runs under a time limit
  would otherwise lose it with the end-of-run summary).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


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

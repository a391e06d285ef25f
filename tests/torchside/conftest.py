"""Fixtures shared by torchside's test modules."""

import pytest


@pytest.fixture(scope="module")
def fp8_adam_one_process():
    """fp8_adam_runs.train on one process. From here to the module's end the kernels run through their
    pure-torch reference, in rank threads and in spawned processes too (they inherit TRITON_INTERPRET=0):
    thread-safe, unlike the Triton interpreter, and fast on these shapes."""
    from tests.torchside import fp8_adam_runs

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        yield fp8_adam_runs.train(0, 1, None)

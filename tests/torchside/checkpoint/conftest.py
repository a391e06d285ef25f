"""Every checkpoint test trains the 2-block stack, on threaded ranks or one process: the reference kernels."""

import pytest


@pytest.fixture(autouse=True)
def _reference_kernels(reference_kernels):
    """tests/conftest.py's `reference_kernels`, for every test here."""

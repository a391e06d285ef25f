"""Dependency direction: torchside never loads jax, jaxside never loads torch (DESIGN.md)."""

import subprocess
import sys

import pytest

FORBIDDEN = {"torchside": "jax", "kernels": "jax", "jaxside": "torch"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_load_the_other_framework(package):
    forbidden = FORBIDDEN[package]
    code = (
        f"import sys, importlib, pkgutil; import {package}\n"
        f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
        "    importlib.import_module(m.name)\n"
        f"loaded = sorted(m for m in sys.modules if m == '{forbidden}' or m.startswith('{forbidden}.'))\n"
        "print(len(loaded), loaded[:5])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("0 "), f"importing {package} and its submodules loaded {forbidden}: {out}"

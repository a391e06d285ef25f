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


# TransformerEngine's names, importable from the top-level package (te.pytorch.Linear -> torchside.Linear).
TOP_LEVEL = {
    "torchside.modules": (
        "Linear", "LayerNormLinear", "LayerNormMLP", "LayerNorm", "RMSNorm", "TransformerLayer", "GroupedLinear",
        "DotProductAttention", "MultiheadAttention", "TransformerConfig", "ModuleConfig",
    ),
    "torchside.autocast": ("fp8_autocast", "quantized_model_init"),
    "torchside.recipe": (
        "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
        "Format",
    ),
}  # fmt: skip


@pytest.mark.parametrize("module, name", [(module, name) for module, names in TOP_LEVEL.items() for name in names])
def test_public_api_is_importable_from_torchside(module, name):
    import importlib

    import torchside

    assert getattr(torchside, name) is getattr(importlib.import_module(module), name)
    assert name in torchside.__all__ and name in dir(torchside)


def test_modules_load_on_first_use_only():
    code = (
        "import sys, torchside\n"
        "before = 'torchside.modules' in sys.modules\n"
        "from torchside import Linear\n"
        "print(before, 'torchside.modules' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_an_unknown_name_is_an_attribute_error():
    import torchside

    with pytest.raises(AttributeError, match="has no attribute 'Linaer'"):
        torchside.Linaer  # noqa: B018


def test_the_readme_python_example_runs(capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    example = re.search(r"## Use the modules from Python.*?```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(example, "README.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == [
        "torch.Size([64, 512]) torch.Size([64, 256]) torch.Size([512, 256])",
        "QuantizedTensor",
    ]


def test_cli_help_and_the_layout_and_demo_packages_load_neither_framework():
    # `shardbridge layout` draws shard maps without torch; the demo's stages load torch inside run_demo.
    code = (
        "import contextlib, io, sys\n"
        "import bridge.demo, bridge.demo.options, bridge.demo.report, bridge.layout, bridge.layout.draw\n"
        "import bridge.layout.text, bridge.layout.translate\n"
        "from bridge import cli\n"
        "for argv in ([], ['layout'], ['demo']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        cli.main([*argv, '--help'])\n"
        "print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

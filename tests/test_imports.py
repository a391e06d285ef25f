"""Dependency direction (docs/design.md): twinspec <- fp8kernels <- torchside <- bridge -> jaxside -> twinspec.

Two checks: at run time, importing a package and all its submodules loads no module of the other
framework; statically, no import statement anywhere in a package (lazy ones inside functions
included) names a package it must not use (twinspec imports no framework and none of our packages;
torch and JAX stay apart). And no file under tests/ or the script folders (benchmarks/, examples/)
imports a test module: shared helpers live in conftest.py files and helper modules (names without the
`test_` prefix); the scripts import only names that exist.
"""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OUR_TOP_LEVEL = ("twinspec", "fp8kernels", "torchside", "jaxside", "bridge")
FORBIDDEN = {"torchside": ("jax",), "fp8kernels": ("jax",), "jaxside": ("torch",), "twinspec": ("torch", "jax")}
# package -> top-level modules no import in it may name
FORBIDDEN_IMPORTS = {
    "fp8kernels": {"torchside", "jaxside", "bridge", "jax"},
    "torchside": {"bridge", "jax", "jaxside", "flax"},
    "jaxside": {"torch", "torchside", "fp8kernels", "bridge"},
    "twinspec": {"torch", "jax", "flax", "triton", "fp8kernels", "torchside", "jaxside", "bridge"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_load_the_other_framework(package):
    forbidden = FORBIDDEN[package]
    code = (
        f"import sys, importlib, pkgutil; import {package}\n"
        f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
        "    importlib.import_module(m.name)\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})\n"
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
    "torchside.autocast": ("fp8_autocast", "quantized_model_init", "fp8_model_init"),
    "torchside.recipe": (
        "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
        "Format", "recipe_from_name", "recipe_names",
    ),
}  # fmt: skip


@pytest.mark.parametrize("module, name", [(module, name) for module, names in TOP_LEVEL.items() for name in names])
def test_public_api_is_importable_from_torchside(module, name):
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


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module `path` imports: import statements at any depth (relative ones
    resolved against the file's package) and importlib.import_module calls with a literal name."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            found.append((node.lineno, base))  # `from a import b` may also import module a.b:
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            argument = node.args[0]
            options = [argument.body, argument.orelse] if isinstance(argument, ast.IfExp) else [argument]
            found += [(node.lineno, o.value) for o in options if isinstance(o, ast.Constant) and isinstance(o.value, str)]
    return found


def python_files(folder: str) -> list[Path]:
    return sorted(p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_no_import_in_a_package_goes_against_the_direction(package):
    files = python_files(package)
    assert files, f"no Python files under {package}/"
    wrong = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in files
        for line, name in imported_modules(path)
        if name.split(".")[0] in FORBIDDEN_IMPORTS[package]
    ]
    assert not wrong, f"{package} must not import {sorted(FORBIDDEN_IMPORTS[package])}:\n" + "\n".join(wrong)


def test_only_the_command_line_imports_the_command_modules():
    """Library code returns data (bridge/cli.py): a library caller must not load a CLI verb's module."""
    commands = ("bridge/cli.py", "bridge/__main__.py", "bridge/commands/")
    wrong = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in python_files("bridge")
        if not str(path.relative_to(REPO)).startswith(commands)
        for line, name in imported_modules(path)
        if name == "bridge.commands" or name.startswith("bridge.commands.")
    ]
    assert not wrong, "library modules import a command module:\n" + "\n".join(wrong)


def is_test_module(name: str) -> bool:
    return name.split(".")[0] == "tests" and name.split(".")[-1].startswith("test_")


# Folders of scripts that exercise the packages: they may import any package, but no test module, and
# only names that exist (a script is run by hand, on a GPU machine, long after a rename broke it).
SCRIPT_FOLDERS = ("benchmarks", "examples")


@pytest.mark.parametrize("folder", SCRIPT_FOLDERS)
def test_scripts_import_no_test_module_and_only_names_that_exist(folder):
    ours = {*OUR_TOP_LEVEL, *SCRIPT_FOLDERS, "tests"}
    wrong = []
    for path in python_files(folder):
        for line, name in imported_modules(path):
            if is_test_module(name):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {name} is a test module")
            elif name.split(".")[0] in ours and not _exists(name):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {name} does not exist")
    assert not wrong, "\n".join(wrong)


def _exists(name: str) -> bool:
    """`name` is a module, or a name a module defines (`from module import name`)."""
    try:
        importlib.import_module(name)
        return True
    except ModuleNotFoundError:
        module, _, attribute = name.rpartition(".")
        try:
            return bool(module) and hasattr(importlib.import_module(module), attribute)
        except ModuleNotFoundError:
            return False


def test_no_file_under_tests_imports_a_test_module():
    wrong = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in python_files("tests")
        for line, name in imported_modules(path)
        if is_test_module(name)
    ]
    assert not wrong, (
        "move what these share into a conftest.py (fixtures) or a helper module without the test_ prefix:\n"
        + "\n".join(wrong)
    )


def test_the_static_checks_see_every_kind_of_import(tmp_path, monkeypatch):
    """A file with each form the checks must catch (a wrong direction and a test-module import)."""
    folder = tmp_path / "tests" / "torchside"
    folder.mkdir(parents=True)
    source = folder / "helpers.py"
    source.write_text(
        "import tests.fp8kernels.test_gemm\n"
        "from tests.torchside import test_attention\n"
        "from . import test_modules\n"
        "def lazy():\n"
        "    from bridge.layout import from_dtensor\n"
        "    importlib.import_module('jax.numpy' if x else 'numpy')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    names = [name for _, name in imported_modules(source)]
    assert [n for n in names if is_test_module(n)] == [
        "tests.fp8kernels.test_gemm",
        "tests.torchside.test_attention",
        "tests.torchside.test_modules",
    ]
    assert "bridge.layout" in names and "jax.numpy" in names


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


def test_our_top_level_names_are_ours_alone():
    """No other installed distribution claims one of our import names (Hugging Face's `kernels` did)."""
    from importlib.metadata import packages_distributions

    claimed = packages_distributions()
    others = {name: sorted(set(claimed.get(name, [])) - {"shardbridge"}) for name in OUR_TOP_LEVEL}
    assert not any(others.values()), f"other distributions install these import names: {others}"
    assert set(OUR_TOP_LEVEL) == {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}


def test_transformers_imports_from_the_repository_root():
    """transformers (>= 5.25 imports Hugging Face's `kernels`) loads its Llama with the repository first on the path."""
    code = "from transformers import LlamaForCausalLM; print(LlamaForCausalLM.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "LlamaForCausalLM", out.stderr[-2000:]

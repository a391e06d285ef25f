"""`shardbridge quantize`: quantize a .npy array under a recipe and save the bytes as .npz.

The .npz holds `data` (uint8), `scale_inv` (fp32, or uint8 E8M0/E4M3 codes), and where
produced `columnwise_data`, `columnwise_scale_inv`, `global_scale_inv` (NVFP4:
amax / (448 * 6)) and `columnwise_global_scale_inv`. With --compare, every implementation
available here quantizes the same input and a table counts the elements whose bytes differ
from the reference's. Exit codes: 0 done (and identical), 1 a mismatch, 2 bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from twinspec.recipe import recipe_names

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"  # a .npz is a zip archive
# What a NaN or Inf element changes beyond itself, per recipe (the amax it enters scales this much).
NON_FINITE_REACH = {
    "current": "the whole tensor (its one amax is not finite)",
    "delayed": "their own elements in this cast (it uses the stored scale) and the amax history of later scales",
    "block": "their 1x128 (128x128 for weights) blocks' scales",
    "mxfp8": "their 32-element blocks' E8M0 scales",
    "nvfp4": "the whole tensor (the global amax is not finite) and their 16-element blocks",
}
USAGES = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}
# .npz key -> field of fp8kernels.reference.Quantized (the global scales are derived from amaxes)
NPZ_KEYS = {
    "data": "data",
    "scale_inv": "scale_inv",
    "columnwise_data": "columnwise_data",
    "columnwise_scale_inv": "columnwise_scale_inv",
    "global_scale_inv": "amax",
    "columnwise_global_scale_inv": "columnwise_amax",
}


def register(verbs) -> None:
    parser = verbs.add_parser(
        "quantize",
        help="quantize a .npy array under an FP8/FP4 recipe, save the bytes, compare implementations",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("input", metavar="IN.npy", help="a float32 or float16 array (cast it with --dtype)")
    parser.add_argument(
        "--recipe", required=True, choices=recipe_names(fp8_off=False), help="delayed casts with its first scale, 1 (no amax history yet)"
    )
    parser.add_argument(
        "--role", default="input", choices=("input", "weight", "grad"), help="the tensor's role (default input)"
    )
    parser.add_argument("--out", required=True, metavar="OUT.npz", help="written at exactly this path")
    parser.add_argument("--format", choices=("e4m3", "e5m2"), help="FP8 format (default: the recipe's)")
    parser.add_argument("--scale-rounding", choices=("up", "floor"), help="MXFP8 E8M0 scale rounding (default up)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="cast the input to this dtype before quantizing")
    parser.add_argument("--usage", choices=tuple(USAGES), default="both", help="which copies to produce")
    parser.add_argument("--compare", action="store_true", help="quantize with every implementation available here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from bridge.cli import check_output_path

    out = check_output_path("--out", args.out)
    recipe = _recipe(args)
    x = _load(Path(args.input), args.dtype)
    _warn_non_finite(x, args.input, args.recipe)
    results, unavailable = _quantize_everywhere(x, recipe, args.role, USAGES[args.usage], args.compare)
    if args.compare:  # compared before anything is written: a failure leaves no output behind
        mismatches = _compare_table(results, console)
        if unavailable:
            console.print(f"not compared: {escape(unavailable)}", soft_wrap=True)
        if mismatches:
            console.print(f"not written: {escape(str(out))} (the implementations differ; without --compare the "
                          "default implementation's bytes are written)", soft_wrap=True)  # fmt: skip
            return 1
    written = next(iter(results.values()))
    _save_npz_atomically(out, written)
    summary = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in written.items())
    console.print(f"wrote {escape(str(out))}: {summary}", soft_wrap=True)
    return 0


def _save_npz_atomically(out: Path, arrays: dict) -> None:
    """`arrays` as an .npz at exactly `out` (no suffix added), whole or not at all: a partial file, then renamed."""
    import os

    import numpy as np

    partial = out.with_name(f".{out.name}.partial")
    try:
        with open(partial, "wb") as file:  # a file object: numpy appends no .npz
            np.savez(file, **arrays)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


def _load(path: Path, dtype: str | None):
    """The input as a torch tensor, checked and cast; ValueError with the fix otherwise."""
    import numpy as np
    import torch

    if not path.is_file():
        raise ValueError(f"{path}: no such file; pass a .npy array saved with numpy.save")
    with open(path, "rb") as file:
        magic = file.read(len(NPY_MAGIC))
    if magic.startswith(ZIP_MAGIC):
        raise ValueError(f"{path} is a .npz archive of arrays; save the one array to quantize with numpy.save as .npy")
    if magic != NPY_MAGIC:
        raise ValueError(f"{path} is not a .npy array (no numpy header); save the array with numpy.save")
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as error:  # truncated or damaged header/data
        raise ValueError(f"{path} is a damaged .npy array ({error}); save it again with numpy.save") from error
    if array.dtype not in (np.float32, np.float16):
        raise ValueError(f"{path} holds {array.dtype}; save it as float32 or float16 (cast bf16 with --dtype bf16)")
    if array.ndim == 0:
        raise ValueError(f"{path} holds a 0-d array; save it with at least one dim")
    x = torch.from_numpy(np.ascontiguousarray(array))
    return x.to(getattr(torch, DTYPES[dtype])) if dtype else x


def _warn_non_finite(x, path: str, recipe: str) -> None:
    """One stderr line when the input holds NaN or Inf: how many, and how far their effect reaches."""
    import torch

    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    if nan + inf:
        Console(stderr=True, soft_wrap=True, highlight=False).print(
            f"[bold yellow]warning:[/] {nan + inf} non-finite values ({nan} NaN, {inf} Inf) in {escape(path)}; "
            f"under {recipe} they reach {NON_FINITE_REACH[recipe]}: docs/quantization.md says which bytes are written"
        )


def _recipe(args: argparse.Namespace):
    from torchside.recipe import Format, recipe_from_name

    if args.scale_rounding and args.recipe != "mxfp8":
        raise ValueError(f"--scale-rounding applies to --recipe mxfp8 only, not {args.recipe}; drop it")
    if args.format and args.recipe == "nvfp4":
        raise ValueError("--recipe nvfp4 stores E2M1 values with E4M3 scales; drop --format")
    options = {"fp8_format": Format(args.format)} if args.format else {}
    if args.recipe == "mxfp8":
        options["scale_rounding"] = args.scale_rounding or "up"
    return recipe_from_name(args.recipe, **options)


def _quantize_everywhere(x, recipe, role: str, usage: tuple[bool, bool], compare: bool):
    """{implementation: npz arrays}, the default one first, and why others were not run ('' if none)."""
    import torch

    from fp8kernels import _backend
    from fp8kernels.ops import implementation
    from torchside.quantization.quantizer import Quantizer

    rowwise, columnwise = usage
    device = "cuda" if torch.cuda.is_available() and _backend.backend_for("cuda") is _backend.Backend.TRITON else "cpu"
    default = _backend.backend_for(device)
    backends = [default] + (
        [_backend.Backend.REFERENCE] if compare and default is not _backend.Backend.REFERENCE else []
    )
    # One call's arguments for all: the same scale and seed, so only the implementations differ.
    name, kwargs = Quantizer(recipe, role, rowwise=rowwise, columnwise=columnwise, device=device).kernel_call(
        x.to(device)
    )
    results = {}
    for b in backends:
        q = getattr(implementation(b), name)(x.to(device), **kwargs)
        results[b.value] = _npz_arrays({field: getattr(q, field) for field in NPZ_KEYS.values()}, q.fmt)
    if compare:
        results["jax"] = _npz_arrays(_quantize_in_jax(x, name, kwargs), q.fmt)
    unavailable = "" if len(backends) > 1 or not compare else f"Triton kernels: {_backend.describe()}"
    return results, unavailable


def _quantize_in_jax(x, name: str, kwargs: dict) -> dict:
    """The same quantizer call through jaxside (bf16 crosses as the same bit patterns)."""
    import ml_dtypes
    import torch

    from jaxside.quantize import quantize_numpy

    host = x.cpu()
    values = host.view(torch.uint16).numpy().view(ml_dtypes.bfloat16) if host.dtype == torch.bfloat16 else host.numpy()
    kwargs = {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return quantize_numpy(values, name, **kwargs)


def _npz_arrays(fields: dict, fmt: str) -> dict:
    """The .npz arrays of one quantizer result (numpy, on the host); amaxes become NVFP4 global scale_invs."""
    import numpy as np

    from twinspec.formats import NVFP4_GLOBAL_MAX

    arrays = {}
    for key, field in NPZ_KEYS.items():
        value = fields.get(field)
        if value is None or (field.endswith("amax") and fmt != "e2m1"):
            continue
        # Values are the contract, storage order is not (docs/quantization.md): block1x128 scales come
        # rows-contiguous from Triton, row-major from the reference; byte views and the .npz need C order.
        value = np.ascontiguousarray(value.cpu().numpy() if hasattr(value, "cpu") else value)
        arrays[key] = (value / np.float32(NVFP4_GLOBAL_MAX)) if field.endswith("amax") else value
    return arrays


def _compare_table(results: dict, console: Console) -> int:
    """Print mismatch counts per buffer against the reference; return the total."""
    import numpy as np

    reference = results.get("reference")
    others = [name for name in results if name != "reference"]
    table = Table(title="elements whose bytes differ from the reference")
    table.add_column("buffer", style="bold")
    table.add_column("shape")
    table.add_column("dtype")
    for name in others:
        table.add_column(name, justify="right")
    total = 0
    for key, expected in reference.items():
        cells = []
        for name in others:
            got = results[name].get(key)
            if got is None or got.shape != expected.shape or got.dtype != expected.dtype:
                cells.append("[red]missing or reshaped[/]")
                total += 1
                continue
            width = expected.dtype.itemsize
            differ = got.view(np.uint8).reshape(-1, width) != expected.view(np.uint8).reshape(-1, width)
            count = int(differ.any(axis=1).sum())
            total += count
            cells.append(f"[red]{count}[/]" if count else "0")
        table.add_row(key, str(expected.shape), str(expected.dtype), *cells)
    console.print(table)
    return total

"""Importing a ~1B-parameter Hugging Face Llama onto one GPU: torch and JAX `load_hf` against the disk and transformers.

The checkpoint: a random bf16 Llama of Llama 3.2 1B's shape (hidden 2048, 16 layers, FFN 8192, 32
heads, 8 KV heads, vocabulary 128256, tied head: 1.24B parameters, 2.47 GB), written straight with
safetensors (no transformers model is built) as `model-0000k-of-0000n.safetensors` files with an
index and a config.json, into a temporary directory that is removed at the end.

Timed, each onto one device (CUDA when there is one), with the page cache dropped before the call
("cold": the files come from the disk) and right after it ("hot": from the page cache):
    torch     torchside.models.llama.load_hf(path, device=...)
    JAX       jaxside.models.llama.load_hf(path) on a one-device mesh
    peer      transformers' LlamaForCausalLM.from_pretrained(path, dtype=bfloat16, device_map=...) (without
              accelerate, which device_map needs: loaded on the host, then .to(device); the notes say which;
              on a CPU with disable_mmap, else its tensors stay views of the files' mappings, unread)
Floor: the checkpoint's bytes / the sequential read bandwidth of the same files in the same run
(64 MiB reads, after dropping them from the page cache; hot: read again). Whether the drop took is
measured (mincore: the fraction of the files' pages still cached) and reported. Each loader first
loads a tiny checkpoint (imports, CUDA and JAX start-up), and its result is checked: the last
layer's down_proj must be the file's bytes.

Usage (repository root): PYTHONPATH=. python3 benchmarks/bench/bench_hf_import.py [--small | --layers N] [--dir DIR]
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.harness import Result, argument_parser, cached_fraction, drop_from_page_cache, report, sequential_read_s
from twinspec import hf_llama

LLAMA_3_2_1B = {"hidden": 2048, "layers": 16, "intermediate": 8192, "heads": 32, "kv_heads": 8, "vocab": 128256}
SMALL = {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 512}
PEER = "transformers from_pretrained"
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


def hf_config(sizes: dict[str, int]) -> dict:
    """config.json of a tied bf16 Llama 3 of these sizes, as transformers writes it."""
    return {
        "architectures": [hf_llama.ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": sizes["hidden"],
        "num_hidden_layers": sizes["layers"],
        "intermediate_size": sizes["intermediate"],
        "num_attention_heads": sizes["heads"],
        "num_key_value_heads": sizes["kv_heads"],
        "vocab_size": sizes["vocab"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    }


def write_checkpoint(directory: Path, sizes: dict[str, int], files: int, device: str) -> list[Path]:
    """A random HF Llama directory (module docstring), the tensors in transformers' order split into `files`
    files of about equal bytes; returns the safetensors files."""
    config = hf_config(sizes)
    ours, _ = hf_llama.parse_config(config, directory / hf_llama.CONFIG_FILE)
    shapes, order = hf_llama.hf_shapes(ours), hf_llama.hf_order(ours)
    total = sum(math.prod(shapes[name]) for name in order)
    groups: list[list[str]] = [[] for _ in range(files)]
    done = 0
    for name in order:
        groups[min(files - 1, done * files // total)].append(name)
        done += math.prod(shapes[name])
    groups = [group for group in groups if group]
    directory.mkdir(parents=True)
    paths = [directory / f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)]
    generator = torch.Generator(device).manual_seed(0)
    for path, group in zip(paths, groups):
        tensors = {name: (0.02 * torch.randn(shapes[name], generator=generator, device=device)).bfloat16().cpu()
                   for name in group}  # fmt: skip
        save_file(tensors, path, metadata={"format": "pt"})
    weight_map = {name: path.name for path, group in zip(paths, groups) for name in group}
    index = {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}
    (directory / hf_llama.INDEX_FILE).write_text(json.dumps(index, indent=2))
    (directory / hf_llama.CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return paths


@dataclass(frozen=True)
class Loader:
    name: str
    load: Callable[[Path], object]  # returns only when the weights are on the device
    down_proj: Callable[[object], torch.Tensor]  # the last layer's down_proj as HF stores it, on the host
    on_torch: bool = True  # its device memory is torch's (the peak is torch's allocator's)


def loaders(device: str) -> list[Loader]:
    def torch_load(path: Path):
        from torchside.models.llama import load_hf

        model = load_hf(path, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
        return model

    def jax_load(path: Path):
        import jax
        from flax import nnx

        from jaxside.models.llama import load_hf

        model = load_hf(path)
        jax.block_until_ready(nnx.state(model))
        return model

    def transformers_load(path: Path):
        from transformers import LlamaForCausalLM

        placement = {"device_map": device} if HAS_ACCELERATE else {}  # transformers needs accelerate for it
        if device == "cpu":  # its CPU tensors would stay views of the files' mappings, nothing read yet
            placement["disable_mmap"] = True
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **placement).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        return model

    def from_jax(model) -> torch.Tensor:  # a kernel is the transposed weight
        kernel = np.asarray(model.layers[-1].layernorm_mlp.fc2_kernel.get_value()).T
        return torch.from_numpy(kernel.view(np.uint16).copy()).view(torch.bfloat16)

    found = [
        Loader("torch load_hf", torch_load, lambda m: m.layers[-1].layernorm_mlp.fc2_weight.detach().cpu()),
        Loader("jax load_hf", jax_load, from_jax, on_torch=False),
    ]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return found
    return [*found, Loader(PEER, transformers_load,
                           lambda m: m.model.layers[-1].mlp.down_proj.weight.detach().cpu())]  # fmt: skip


def expected_down_proj(directory: Path, layers: int) -> torch.Tensor:
    name = f"model.layers.{layers - 1}.mlp.down_proj.weight"
    file = json.loads((directory / hf_llama.INDEX_FILE).read_text())["weight_map"][name]
    with safe_open(str(directory / file), framework="pt") as handle:
        return handle.get_tensor(name).clone()  # not a view of the file: its pages could not leave the page cache


def timed_load(loader: Loader, directory: Path, expected: torch.Tensor) -> tuple[float, float | None]:
    """(seconds, peak device GiB of this call or None) of one load, checked against the file's bytes."""
    on_cuda = torch.cuda.is_available() and loader.on_torch
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = loader.load(directory)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None
    got = loader.down_proj(model)
    if not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
        raise AssertionError(f"{loader.name}: the last layer's down_proj is not the checkpoint's")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds, peak


def read_floors(files: list[Path], nbytes: int) -> tuple[dict[str, float], list[Result], float]:
    """({"cold": s, "hot": s} of reading the files once in order, after dropping them and again), their rows, and
    the fraction of the files' pages that stayed cached through the drop."""
    floors, rows, cached = {}, [], {}
    for cache in ("cold", "hot"):
        if cache == "cold":
            drop_from_page_cache(files)
        cached[cache] = cached_fraction(files)
        floors[cache] = sequential_read_s(files)
        extra = {"GB/s": nbytes / floors[cache] / 1e9, "cached before": f"{cached[cache]:.0%}"}
        rows.append(Result(f"sequential read, {cache} cache", floors[cache], None, unit="s", extra=extra))
    return floors, rows, cached["cold"]


def notes(nbytes: int, floors: dict[str, float], cold_cached: float, device: str) -> list[str]:
    bandwidth = {cache: f"{nbytes / seconds / 1e9:.2f} GB/s {cache}" for cache, seconds in floors.items()}
    if cold_cached < 0.01:
        cache = "dropped before each cold row (mincore: under 1% of the files' pages cached)"
    else:
        cache = (f"NOT dropped ({cold_cached:.0%} of the files' pages stayed cached: tmpfs, or the kernel ignored "
                 "posix_fadvise): the cold rows read the page cache")  # fmt: skip
    placement = (
        f"device_map={device!r}" if HAS_ACCELERATE else f"no accelerate: loaded on the host, then .to({device!r})"
    )
    checked = "every load was checked against the file's bytes (the last layer's down_proj)"
    return [
        f"- floor: {nbytes / 1e9:.2f} GB / the sequential read of the same files in this run ({', '.join(bandwidth.values())})",
        f"- page cache: {cache}",
        f"- device: {device}; each loader loaded a tiny checkpoint first (imports, start-up); {checked}; transformers: {placement}",
    ]  # fmt: skip


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--small", action="store_true", help="a tiny model (seconds on a CPU): checks the script")
    parser.add_argument("--layers", type=int, help="layers of the full-size model (default 16; fewer: a quicker run)")
    parser.add_argument("--files", type=int, default=2, help="safetensors files to split the checkpoint into")
    parser.add_argument("--dir", default=None, help="where the temporary checkpoint goes (default: $TMPDIR)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = SMALL if args.small else LLAMA_3_2_1B | ({"layers": args.layers} if args.layers else {})
    root = Path(tempfile.mkdtemp(prefix="bench_hf_import_", dir=args.dir))
    try:
        warmup, directory = root / "warmup", root / "hf"
        write_checkpoint(warmup, SMALL, 2, device)
        files = write_checkpoint(directory, sizes, args.files, device)
        nbytes = sum(path.stat().st_size for path in files)
        expected = expected_down_proj(directory, sizes["layers"])
        warmup_expected = expected_down_proj(warmup, SMALL["layers"])
        floors, rows, cold_cached = read_floors(files, nbytes)
        timings = {}  # (cache, loader name) -> (seconds, device peak GiB, cached fraction before)
        for loader in loaders(device):
            timed_load(loader, warmup, warmup_expected)  # imports, CUDA / JAX start-up
            for cache in floors:
                if cache == "cold":
                    drop_from_page_cache(files)
                cached = cached_fraction(files)
                timings[(cache, loader.name)] = (*timed_load(loader, directory, expected), cached)
        for (cache, name), (seconds, peak, cached) in sorted(timings.items(), key=lambda item: item[0][0]):
            peer_s = None if name == PEER else timings.get((cache, PEER), (None,))[0]
            extra = {"GB/s": nbytes / seconds / 1e9, "cached before": f"{cached:.0%}", "device peak GiB": peak}
            rows.append(Result(f"import, {cache} cache", seconds, floors[cache], unit="s", provider=name,
                               peer=peer_s, peer_name=PEER if peer_s else "", extra=extra))  # fmt: skip
        config, _ = hf_llama.parse_config(hf_config(sizes), directory / hf_llama.CONFIG_FILE)
        params = sum(math.prod(shape) for shape in hf_llama.hf_shapes(config).values())
        title = f"bench_hf_import, random Llama {params / 1e9:.2f}B parameters bf16, {len(files)} files, {nbytes / 1e9:.2f} GB"
        report(title, rows, args.json, notes(nbytes, floors, cold_cached, device))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

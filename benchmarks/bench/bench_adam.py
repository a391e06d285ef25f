"""FusedAdam step time on one GPU against the bandwidth floor and torch's fused AdamW.

537M parameters as 32 tensors of 4096 x 4096. Floor = bytes moved / 4.24 TB/s (the H200 copy
bandwidth in DESIGN.md; the copy measured in this run is printed too). Bytes per element:

    fp32 params, fp32 moments      read p g m v (16), write p m v (12)             = 28
    bf16 params, fp32 master       read g master m v (14), write p master m v (14) = 28
    bf16 params, remainder master  read p rem g m v (14), write p rem m v (12)     = 26
    fp32 params, bf16 moments      read p g m v (12), write p m v (8)              = 20

Peers, measured in the same run: torch.optim.AdamW(fused=True) on fp32 tensors; for bf16
parameters, fused AdamW on fp32 masters followed by a copy into the bf16 parameters.
Usage (repository root, CUDA machine): python benchmarks/bench_adam.py
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.floors import COPY_BYTES_PER_S  # noqa: E402
from kernels.adam import MultiTensorAdam  # noqa: E402
from torchside.optim import FusedAdam  # noqa: E402

N_TENSORS, ROWS, COLS = 32, 4096, 4096
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _time_ms(step: Callable[[], None], iters: int = 10, repeats: int = 5) -> float:
    """GPU time of one call: `iters` calls back to back between CUDA events (the host runs ahead, as
    in training, so Python overhead hides behind the GPU), median over `repeats`."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(ROWS, COLS, device="cuda", dtype=dtype)) for _ in range(N_TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _copy_tbps() -> float:
    source = torch.empty(1 << 30, dtype=torch.float32, device="cuda")  # 4 GiB
    target = torch.empty_like(source)
    ms = _time_ms(lambda: target.copy_(source))
    return 2 * source.numel() * 4 / (ms * 1e-3) / 1e12


def _ours_ms(param_dtype: torch.dtype, **options) -> float:
    params = _params(param_dtype)
    optimizer = FusedAdam(params, **HYPER, **options)
    ms = _time_ms(optimizer.step)
    del optimizer, params
    torch.cuda.empty_cache()
    return ms


def _peer_ms(bf16_params: bool) -> float:
    masters = _params(torch.float32)
    optimizer = torch.optim.AdamW(masters, **HYPER, fused=True)
    if not bf16_params:
        step = optimizer.step
    else:
        params = [m.detach().bfloat16() for m in masters]

        def step():
            optimizer.step()
            torch._foreach_copy_(params, masters)

    ms = _time_ms(step)
    del optimizer, masters
    torch.cuda.empty_cache()
    return ms


def _launch_config_sweep() -> list[tuple[int, int, float]]:
    """fp32 kind at other (block, num_warps) choices, to confirm or move the defaults."""
    params = [p.detach() for p in _params(torch.float32)]
    grads = [torch.randn_like(p) for p in params]
    moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    results = []
    for block in (1024, 2048, 4096, 8192):
        for num_warps in (4, 8):
            adam = MultiTensorAdam(params, *moments, [None] * len(params), block=block, num_warps=num_warps)
            ms = _time_ms(lambda: adam.step(grads, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                                            weight_decay=0.01, adam_w_mode=True, step=1))  # fmt: skip
            results.append((block, num_warps, ms))
    return results


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_adam needs a CUDA device")
    elements = N_TENSORS * ROWS * COLS
    copy_tbps = _copy_tbps()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {elements / 1e6:.0f}M params")
    print(f"# copy measured now: {copy_tbps:.2f} TB/s; floor uses {COPY_BYTES_PER_S / 1e12} TB/s (DESIGN.md)")
    cases = [
        ("fp32 params, fp32 moments", 28, lambda: _ours_ms(torch.float32), lambda: _peer_ms(False)),
        ("bf16 params, fp32 master", 28, lambda: _ours_ms(torch.bfloat16, master_weights=True), lambda: _peer_ms(True)),
        ("bf16 params, remainder master", 26,
         lambda: _ours_ms(torch.bfloat16, master_weights=True, store_param_remainders=True), lambda: _peer_ms(True)),
        ("fp32 params, bf16 moments", 20,
         lambda: _ours_ms(torch.float32, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
         lambda: _peer_ms(False)),
    ]  # fmt: skip
    header = f"{'case':32} {'ours ms':>8} {'floor ms':>9} {'of floor':>9} {'TB/s':>6} {'peer ms':>8} {'speedup':>8}"
    print(header)
    for name, bytes_per_element, ours, peer in cases:
        ours_ms, peer_ms = ours(), peer()
        floor_ms = elements * bytes_per_element / COPY_BYTES_PER_S * 1e3
        tbps = elements * bytes_per_element / (ours_ms * 1e-3) / 1e12
        print(f"{name:32} {ours_ms:8.3f} {floor_ms:9.3f} {floor_ms / ours_ms:9.1%} {tbps:6.2f} {peer_ms:8.3f} "
              f"{peer_ms / ours_ms:7.2f}x")  # fmt: skip
    print("# launch configurations, fp32 kind (kernel only; defaults: block 4096, 8 warps)")
    for block, num_warps, ms in _launch_config_sweep():
        print(f"block {block:5} warps {num_warps}: {ms:7.3f} ms  {elements * 28 / (ms * 1e-3) / 1e12:5.2f} TB/s")


if __name__ == "__main__":
    main()

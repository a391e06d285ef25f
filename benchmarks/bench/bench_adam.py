"""FusedAdam step time on one GPU against the bandwidth floor and torch's fused AdamW.

537M parameters as 32 tensors of 4096 x 4096. Floor = bytes moved / 4.24 TB/s (the H200 copy
bandwidth in benchmarks/harness.py; the copy measured in this run is printed too). Bytes per element:

    fp32 params, fp32 moments      read p g m v (16), write p m v (12)             = 28
    bf16 params, fp32 master       read g master m v (14), write p master m v (14) = 28
    bf16 params, remainder master  read p rem g m v (14), write p rem m v (12)     = 26
    fp32 params, bf16 moments      read p g m v (12), write p m v (8)              = 20

Peers, measured in the same run: torch.optim.AdamW(fused=True) on fp32 tensors; for bf16
parameters, fused AdamW on fp32 masters followed by a copy into the bf16 parameters.
Times: benchmarks.harness.device_ms on the eager steps (graph=False): an optimizer step keeps host
state, and at 3-5 ms of device time its host time hides behind the GPU as in training.
Usage (repository root, CUDA machine): PYTHONPATH=. python3 benchmarks/bench/bench_adam.py [--json PATH]
"""

from __future__ import annotations

import torch

from benchmarks.harness import COPY_BYTES_PER_S, Result, argument_parser, device_ms, report
from fp8kernels.adam import MultiTensorAdam
from torchside.optim import FusedAdam

N_TENSORS, ROWS, COLS = 32, 4096, 4096
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(ROWS, COLS, device="cuda", dtype=dtype)) for _ in range(N_TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _copy() -> Result:
    source = torch.empty(1 << 30, dtype=torch.float32, device="cuda")  # 4 GiB
    target = torch.empty_like(source)
    ms = device_ms(lambda: target.copy_(source))
    moved = 2 * source.numel() * 4
    return Result("copy, 4 GiB fp32", ms, moved / COPY_BYTES_PER_S * 1e3, extra={"TB/s": moved / (ms * 1e-3) / 1e12})


def _ours_ms(param_dtype: torch.dtype, **options) -> float:
    params = _params(param_dtype)
    optimizer = FusedAdam(params, **HYPER, **options)
    ms = device_ms(optimizer.step, graph=False)
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

    ms = device_ms(step, graph=False)
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
            ms = device_ms(lambda: adam.step(grads, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                                              weight_decay=0.01, adam_w_mode=True, step=1), graph=False)  # fmt: skip
            results.append((block, num_warps, ms))
    return results


def main() -> None:
    args = argument_parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_adam needs a CUDA device")
    elements = N_TENSORS * ROWS * COLS
    rows = [_copy()]
    cases = [
        ("fp32 params, fp32 moments", 28, lambda: _ours_ms(torch.float32), lambda: _peer_ms(False)),
        ("bf16 params, fp32 master", 28, lambda: _ours_ms(torch.bfloat16, master_weights=True), lambda: _peer_ms(True)),
        ("bf16 params, remainder master", 26,
         lambda: _ours_ms(torch.bfloat16, master_weights=True, store_param_remainders=True), lambda: _peer_ms(True)),
        ("fp32 params, bf16 moments", 20,
         lambda: _ours_ms(torch.float32, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
         lambda: _peer_ms(False)),
    ]  # fmt: skip
    for name, bytes_per_element, ours, peer in cases:
        ours_ms, peer_ms = ours(), peer()
        floor_ms = elements * bytes_per_element / COPY_BYTES_PER_S * 1e3
        tbps = elements * bytes_per_element / (ours_ms * 1e-3) / 1e12
        rows.append(Result(name, ours_ms, floor_ms, peer=peer_ms, peer_name="torch AdamW(fused=True)",
                           extra={"TB/s": tbps}))  # fmt: skip
    notes = ["# launch configurations, fp32 kind (kernel only; defaults: block 1024, 4 warps)"]
    for block, num_warps, ms in _launch_config_sweep():
        notes.append(f"block {block:5} warps {num_warps}: {ms:7.3f} ms  {elements * 28 / (ms * 1e-3) / 1e12:5.2f} TB/s")
    report(f"bench_adam, FusedAdam, {elements / 1e6:.0f}M params", rows, args.json, notes)


if __name__ == "__main__":
    main()

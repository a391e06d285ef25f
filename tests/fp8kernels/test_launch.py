"""fp8kernels._launch.Launcher: a cached launch computes what Triton's own launch computes, one compiled kernel per
specialization (dtype, alignment, ints, constexprs), and call sites that break its convention fail loudly."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fp8kernels._launch import Launcher
from tests.fp8kernels.devices import DEVICES


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, a, n, ADD_ONE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(y_ptr + offsets, x * a + (1.0 if ADD_ONE else 0.0), mask=offsets < n)


@triton.jit
def _constexpr_first_kernel(BLOCK: tl.constexpr, x_ptr):
    pass


def _grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(4096, meta["BLOCK"]),)


@pytest.mark.parametrize("device", DEVICES)
def test_each_specialization_launches_its_own_kernel_and_runtime_values_are_not_baked_in(device, monkeypatch):
    launcher = Launcher(_axpb_kernel)
    front_end_launches = []
    run = launcher.jit.run
    monkeypatch.setattr(launcher.jit, "run", lambda *a, **k: front_end_launches.append(1) or run(*a, **k))
    base = torch.randn(4097, device=device)
    cases = [  # (x, a, n, ADD_ONE): aligned, the same again with other runtime values, misaligned, odd n, constexpr
        (base[:4096], 2.0, 4096, False),
        (base[:4096], -3.5, 4096, False),
        (base[1:], 0.5, 4096, False),  # 4 bytes past a 16-byte boundary: Triton compiles this pointer apart
        (base[:4001], 1.5, 4001, False),
        (base[:4096], 2.0, 4096, True),
        (base[1:], 0.25, 4096, False),
    ]
    for x, a, n, add_one in cases:
        y = torch.full((4096,), float("nan"), device=device)
        launcher[_grid](x, y, a, n, ADD_ONE=add_one, BLOCK=1024)
        expected = x[:n].double() * a + (1.0 if add_one else 0.0)
        torch.testing.assert_close(y[:n].double(), expected, rtol=1e-6, atol=1e-6)
    if device == "cuda":  # four specializations, each through Triton once; the repeats use the kept kernel
        assert len(launcher.compiled) == 4
        assert len(front_end_launches) == 2 * 4  # the first launch of a key, then its warmup lookup
    else:  # the interpreter: every launch through Triton
        assert len(front_end_launches) == len(cases) and not launcher.compiled


@pytest.mark.parametrize("device", DEVICES)
def test_an_autotuned_launcher_keeps_one_of_its_candidates(device):
    candidates = [{"BLOCK": 512, "num_warps": 4}, {"BLOCK": 1024, "num_warps": 8}]
    launcher = Launcher(_axpb_kernel, candidates, ["n"])
    x = torch.randn(4096, device=device)
    for a in (2.0, 3.0):  # tunes, then launches the kept config
        y = torch.empty_like(x)
        launcher[_grid](x, y, a, 4096, ADD_ONE=True)
        torch.testing.assert_close(y.double(), x.double() * a + 1, rtol=1e-6, atol=1e-6)
    for _, meta, _ in launcher.compiled.values():
        assert any(all(meta[name] == value for name, value in c.items()) for c in candidates), meta


def test_call_sites_must_pass_runtime_arguments_positionally():
    launcher = Launcher(_axpb_kernel)
    x = torch.zeros(16)
    with pytest.raises(TypeError, match="runtime arguments positionally"):
        launcher[(1,)](x, x, n=16, a=1.0, ADD_ONE=False, BLOCK=16)
    with pytest.raises(TypeError, match=r"by keyword, not \['n'\]"):
        launcher[(1,)](x, x, 1.0, 16, n=16, ADD_ONE=False, BLOCK=16)
    with pytest.raises(TypeError, match="runtime parameters first"):
        Launcher(_constexpr_first_kernel)

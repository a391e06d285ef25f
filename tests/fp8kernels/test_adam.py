"""The multi-tensor Adam kernel against its pure-torch spec, torch's own Adam, and bit-exact casts.

On CPU the kernel runs under the Triton interpreter (tests/conftest.py); `gpu` tests rerun the
comparisons on CUDA at sizes that exercise the vectorized full chunks.
"""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8kernels import adam_reference
from fp8kernels.adam import MultiTensorAdam, _adam_kernel, adam_step
from fp8kernels.multi_tensor import aligned

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
# Sizes that cover one element, a partial chunk, a full chunk plus a tail, and a chunk boundary.
SIZES = (1, 1023, 4097, 4096)

KINDS = [  # (param dtype, master format, moment dtype)
    (torch.float32, "none", torch.float32),
    (torch.float32, "none", torch.bfloat16),
    (torch.bfloat16, "none", torch.float32),
    (torch.bfloat16, "fp32", torch.float32),
    (torch.bfloat16, "fp32", torch.bfloat16),
    (torch.bfloat16, "remainder", torch.float32),
    (torch.bfloat16, "remainder", torch.bfloat16),
    (torch.float16, "none", torch.bfloat16),
    (torch.float16, "fp32", torch.float32),
]


def _tensors(sizes, param_dtype, master, moment_dtype, device="cpu", seed=0, misaligned=False):
    """params, grads, exp_avgs, exp_avg_sqs, masters; `misaligned` puts each tensor 1 element off 16 bytes."""
    g = torch.Generator().manual_seed(seed)

    def make(values, dtype):
        if not misaligned:
            return values.to(dtype).to(device)
        buffer = torch.empty(values.numel() + 1, dtype=dtype, device=device)
        view = buffer[1:]
        view.copy_(values)
        return view

    params, grads, exp_avgs, exp_avg_sqs, masters = [], [], [], [], []
    for n in sizes:
        master32 = torch.randn(n, generator=g)
        if master == "remainder":
            high, low = adam_reference.split_master(master32)
            params.append(make(high, torch.bfloat16))
            masters.append(make(low, torch.int16))
        else:
            params.append(make(master32, param_dtype))
            masters.append(make(master32, torch.float32) if master == "fp32" else None)
        grads.append(make(torch.randn(n, generator=g), param_dtype))
        exp_avgs.append(make(0.1 * torch.randn(n, generator=g), moment_dtype))
        exp_avg_sqs.append(make(0.01 * torch.rand(n, generator=g), moment_dtype))
    return params, grads, exp_avgs, exp_avg_sqs, masters


def _clone(tensors):
    return [[None if t is None else t.clone() for t in group] for group in tensors]


def _as_fp32(params, masters):
    """What each tensor's fp32 value is: the master where there is one."""
    out = []
    for param, master in zip(params, masters):
        if master is None:
            out.append(param.float())
        elif master.dtype == torch.int16:
            out.append(adam_reference.join_master(param, master))
        else:
            out.append(master)
    return out


def _assert_close(actual, expected, dtype):
    # fp32: FMAs and the GPU's approximate sqrt/div; 16-bit: a rounding flip, up to two units in the last place.
    rtol = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-9}[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=rtol, atol=1e-6)


def _check_against_reference(kind, adam_w_mode, device, sizes, misaligned=False):
    param_dtype, master, moment_dtype = kind
    tensors = _tensors(sizes, param_dtype, master, moment_dtype, device, misaligned=misaligned)
    assert aligned(tensors[0]) != misaligned
    expected = _clone(tensors)
    step_args = dict(HYPER, adam_w_mode=adam_w_mode, step=3)
    adam_step(*tensors, **step_args)
    adam_reference.adam_step(*expected, **step_args)
    params, _, exp_avgs, exp_avg_sqs, masters = tensors
    ref_params, _, ref_exp_avgs, ref_exp_avg_sqs, ref_masters = expected
    for actual, wanted in zip(_as_fp32(params, masters), _as_fp32(ref_params, ref_masters)):
        _assert_close(actual, wanted, torch.float32 if master != "none" else param_dtype)
    for actual, wanted in zip(exp_avgs + exp_avg_sqs, ref_exp_avgs + ref_exp_avg_sqs):
        _assert_close(actual, wanted, moment_dtype)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{str(k[0])[6:]}-{k[1]}-{str(k[2])[6:]}")
def test_kernel_matches_reference(kind, adam_w_mode):
    _check_against_reference(kind, adam_w_mode, "cpu", SIZES)


def test_misaligned_tensors_take_the_unaligned_path():
    _check_against_reference((torch.bfloat16, "fp32", torch.bfloat16), True, "cpu", (1023, 4097), misaligned=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN inputs, on purpose
def test_bf16_outputs_round_to_nearest_even_exactly():
    """lr=0 leaves the fp32 master as it is; the bf16 parameter must be torch's RNE of it, bit for bit."""
    low_bits = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    high_bits = torch.tensor([0x0000, 0x0001, 0x3F80, 0x3F81, 0x7F7F, 0x7F80, 0x8000, 0xBF80, 0xFF7F, 0xFF80])
    bits = (high_bits[:, None] << 16 | low_bits[None, :]).flatten()
    special = torch.tensor([float("nan"), -float("nan"), 3.4028235e38, 1e-45, -1e-40])
    master = torch.cat([adam_reference._as_int32(bits).view(torch.float32), special])
    n = master.numel()
    param = torch.zeros(n, dtype=torch.bfloat16)
    zeros = [torch.zeros(n) for _ in range(3)]
    adam_step([param], [zeros[0].bfloat16()], [zeros[1]], [zeros[2]], [master.clone()],
              **dict(HYPER, lr=0.0, weight_decay=0.0), adam_w_mode=True, step=1)  # fmt: skip
    expected = master.to(torch.bfloat16)
    assert torch.equal(param.isnan(), expected.isnan())  # NaN bit patterns differ between platforms
    finite = ~expected.isnan()
    assert torch.equal(param[finite].view(torch.int16), expected[finite].view(torch.int16))


def test_master_remainder_split_is_exact_and_rounds_to_nearest():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**32, (1 << 16,), generator=g, dtype=torch.int64)
    bits[:4] = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF])  # three ties, the max
    master = adam_reference._as_int32(bits).view(torch.float32)
    param, remainder = adam_reference.split_master(master)
    assert torch.equal(adam_reference.join_master(param, remainder).view(torch.int32), master.view(torch.int32))
    # Away from exact ties (low bits 0x8000) the parameter is the ordinary RNE rounding.
    not_tie = ((bits & 0xFFFF) != 0x8000) & ~master.isnan()
    assert torch.equal(param[not_tie].view(torch.int16), master[not_tie].bfloat16().view(torch.int16))
    tie_results = param[:3].view(torch.int16).to(torch.int64) & 0xFFFF
    assert tie_results.tolist() == [0x3F81, 0x3F82, 0xBF81]  # ties go away from zero (RNE: 0x3F80, ..., 0xBF80)

    # In the kernel, lr=0 must give back (param, remainder) bit for bit.
    finite = ~(master.isnan() | master.isinf())
    param, remainder = adam_reference.split_master(master[finite])
    n = param.numel()
    before = (param.clone(), remainder.clone())
    zeros = [torch.zeros(n) for _ in range(2)]
    adam_step([param], [torch.zeros(n, dtype=torch.bfloat16)], zeros[:1], zeros[1:], [remainder],
              **dict(HYPER, lr=0.0, weight_decay=0.0), adam_w_mode=True, step=1)  # fmt: skip
    assert torch.equal(param.view(torch.int16), before[0].view(torch.int16)) and torch.equal(remainder, before[1])


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_reference_matches_torch_adam(adam_w_mode):
    """The spec itself against torch.optim, 20 steps (pure torch, no kernel)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(37, generator=g), torch.randn(5, 7, generator=g)]
    ours = [p.clone() for p in params]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    optim_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    optim = optim_cls(theirs, lr=HYPER["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for step in range(1, 21):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, grad in zip(theirs, grads):
            p.grad = grad.clone()
        optim.step()
        adam_reference.adam_step(ours, grads, exp_avgs, exp_avg_sqs, [None, None],
                                 **HYPER, adam_w_mode=adam_w_mode, step=step)  # fmt: skip
    for mine, torchs in zip(ours, theirs):
        torch.testing.assert_close(mine, torchs.detach(), rtol=1e-6, atol=1e-7)


def test_grad_scaler_inputs():
    tensors = _tensors((100, 5000), torch.float32, "none", torch.float32)
    scaled, skipped, plain = _clone(tensors), _clone(tensors), _clone(tensors)
    scaled[1] = [grad * 8 for grad in scaled[1]]
    step_args = dict(HYPER, adam_w_mode=True, step=2)
    adam_step(*plain, **step_args, found_inf=torch.zeros(1))
    adam_step(*scaled, **step_args, inv_scale=torch.full((1,), 0.125))
    adam_step(*skipped, **step_args, found_inf=torch.ones(()))
    for group in (0, 2, 3):
        for a, b, before, skip in zip(plain[group], scaled[group], tensors[group], skipped[group]):
            assert torch.equal(a, b)  # 8 and 1/8 are exact: the same update, bit for bit
            assert torch.equal(skip, before) and not torch.equal(a, before)


def test_scalars_from_device_tensors_match_host_scalars():
    """The CUDA-graph path: lr and step live in tensors and the scalars are computed on the device."""
    tensors = _tensors((300, 4097), torch.bfloat16, "fp32", torch.float32)
    on_device = _clone(tensors)
    adam_step(*tensors, **HYPER, adam_w_mode=True, step=7)
    hyper = dict(HYPER, lr=torch.tensor(HYPER["lr"]))
    adam_step(*on_device, **hyper, adam_w_mode=True, step=torch.tensor(7.0))
    for a, b in zip(tensors[4] + tensors[2], on_device[4] + on_device[2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_tables_are_reused_and_follow_new_grads():
    tensors = _tensors((10, 4100), torch.float32, "none", torch.float32)
    fresh = _clone(tensors)
    params, grads, exp_avgs, exp_avg_sqs, masters = tensors
    adam = MultiTensorAdam(params, exp_avgs, exp_avg_sqs, masters)
    step_args = dict(HYPER, adam_w_mode=True)
    adam.step(grads, **step_args, step=1)
    new_grads = [grad.flip(0) for grad in grads]  # other storage: the table must follow
    adam.step(new_grads, **step_args, step=2)
    adam_step(*fresh, **step_args, step=1)
    adam_step(fresh[0], new_grads, *fresh[2:], **step_args, step=2)
    for a, b in zip(params + exp_avgs, fresh[0] + fresh[2]):
        assert torch.equal(a, b)
    assert adam.matches(params, exp_avgs, exp_avg_sqs, masters)
    assert not adam.matches(params, [e.clone() for e in exp_avgs], exp_avg_sqs, masters)


def test_zero_element_tensors_are_skipped():
    tensors = _tensors((0, 33, 0), torch.float32, "none", torch.float32)
    expected = _clone(tensors)
    adam_step(*tensors, **HYPER, adam_w_mode=True, step=1)
    adam_reference.adam_step(*expected, **HYPER, adam_w_mode=True, step=1)
    _assert_close(tensors[0][1], expected[0][1], torch.float32)


def test_input_errors_name_the_fix():
    params, grads, exp_avgs, exp_avg_sqs, masters = _tensors((8,), torch.float32, "none", torch.float32)
    with pytest.raises(ValueError, match="equal lengths"):
        MultiTensorAdam(params, exp_avgs, exp_avg_sqs, [])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        MultiTensorAdam(params, [e.half() for e in exp_avgs], exp_avg_sqs, masters)
    with pytest.raises(TypeError, match="only bfloat16 params"):
        MultiTensorAdam(params, exp_avgs, exp_avg_sqs, [torch.zeros(8, dtype=torch.int16)])
    with pytest.raises(ValueError, match="contiguous"):
        MultiTensorAdam([torch.zeros(4, 4).t()], [torch.zeros(16)], [torch.zeros(16)], [None])
    with pytest.raises(ValueError, match="power of two"):
        MultiTensorAdam(params, exp_avgs, exp_avg_sqs, masters, block=1000)
    with pytest.raises(ValueError, match="must be contiguous and match"):
        MultiTensorAdam(params, exp_avgs, exp_avg_sqs, masters).step(
            [grads[0].double()], **HYPER, adam_w_mode=True, step=1
        )


WIDE_ACCESS_CASES = {  # kind -> the vector access its full chunks must use
    ("fp32", "none", "fp32"): "v4.b32",  # 16 bytes of fp32
    ("bf16", "fp32", "bf16"): "v2.b32",  # 8 bytes of bf16, so fp32 and bf16 share one layout
    ("bf16", "remainder", "fp32"): "v2.b32",
}


def compile_report_for_sm90() -> dict[str, dict]:
    """Compile each case for an H100/H200 (ptxas ships with triton: no GPU needed) and summarize it.

    Runs in a process without TRITON_INTERPRET (the kernel must be a compilable JITFunction).
    """
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {"tensor_table_ptr": "*i64", "chunk_table_ptr": "*i32", "n_tensors": "i32", "n_chunks": "i32",
             "scalars_ptr": "*fp32", "inv_scale_ptr": "*fp32", "found_inf_ptr": "*fp32"}  # fmt: skip
    report = {}
    for param, master, moment in WIDE_ACCESS_CASES:
        constexprs = dict(PARAM=param, MASTER=master, EXP_AVG=moment, EXP_AVG_SQ=moment, L2=False,
                          SCALARS_IN_MEMORY=False, HAS_INV_SCALE=True, HAS_FOUND_INF=False, ALIGNED=True,
                          GRAD_ALIGNED=True, BLOCK=4096)  # fmt: skip
        signature = {a: "constexpr" if a in constexprs else types.get(a, "fp32") for a in _adam_kernel.arg_names}
        compiled = triton_compile(
            ASTSource(_adam_kernel, signature, constexprs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 8, "enable_fp_fusion": True},
        )
        ptx = compiled.asm["ptx"]
        report[f"{param}-{master}-{moment}"] = {
            "loads": sorted(set(re.findall(r"ld\.global(?:\.\w+)*\.v[24]\.b32", ptx))),
            "stores": sorted(set(re.findall(r"st\.global(?:\.\w+)*\.v[24]\.b32", ptx))),
            "shared_bytes": compiled.metadata.shared,
        }
    return report


@functools.cache
def _sm90_report() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from tests.fp8kernels.test_adam import compile_report_for_sm90 as r; print(json.dumps(r()))"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", list(WIDE_ACCESS_CASES), ids="-".join)
def test_full_chunks_compile_to_wide_accesses_in_one_layout(case):
    """The bandwidth design, checked in the generated code: 16-byte fp32 and 8-byte 16-bit accesses,
    every tensor in one register layout (no shared-memory shuffles between them)."""
    summary = _sm90_report()["-".join(case)]
    access = WIDE_ACCESS_CASES[case]
    assert any(access in op for op in summary["loads"]), summary
    assert any(access in op for op in summary["stores"]), summary
    assert summary["shared_bytes"] == 0, summary


@pytest.mark.gpu
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{str(k[0])[6:]}-{k[1]}-{str(k[2])[6:]}")
def test_kernel_matches_reference_on_cuda(kind, adam_w_mode, misaligned):
    _check_against_reference(kind, adam_w_mode, "cuda", (1, 4095, 4096 * 3 + 7, 1 << 20), misaligned=misaligned)

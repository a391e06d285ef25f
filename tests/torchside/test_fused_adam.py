"""FusedAdam on one process: against torch.optim.AdamW/Adam, master weights, compressed moments,
checkpoints, the grad scaler and the CUDA-graph (capturable) path.

Kernels run under the Triton interpreter on CPU (tests/conftest.py); `gpu` tests rerun on CUDA.
"""

import pytest
import torch

from bridge.numerics import relative_error
from fp8kernels.adam_reference import split_master
from torchside.optim import FusedAdam

SHAPES = [(33, 17), (7,), (1500,)]  # 2-D, tiny, 1-D: one chunk each (kernel tests cover chunk edges)
# Measured and explained in torchside/optim/moment_formats.py; about twice the measured error.
MOMENT_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float8_e4m3fn: 2.5e-1}


def _params(dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(device=device, dtype=dtype)) for shape in SHAPES]


def _groups(params):
    """Two groups with their own lr and weight decay."""
    return [dict(params=params[:2], lr=1e-2, weight_decay=0.1), dict(params=params[2:], lr=3e-3, weight_decay=0.0)]


def _grads(params, generator):
    """fp32 CPU grads, reproducible from `generator`, with an elementwise scale as real grads have."""
    return [torch.randn(p.shape, generator=generator) * 2 * torch.rand(p.shape, generator=generator) for p in params]


def _train(optimizer, params, steps, grad_dtype=None, seed=1):
    """`steps` steps on reproducible grads, rounded to `grad_dtype` (default: the parameter's dtype)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, grad in zip(params, _grads(params, generator)):
            p.grad = grad.to(grad_dtype or p.dtype).to(device=p.device, dtype=p.dtype)
        optimizer.step()


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_fp32_matches_torch_over_50_steps(adam_w_mode):
    ours, theirs = _params(), _params()
    optimizer = FusedAdam(_groups(ours), betas=(0.9, 0.99), eps=1e-8, adam_w_mode=adam_w_mode)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    reference = torch_cls(_groups(theirs), betas=(0.9, 0.99), eps=1e-8)
    _train(optimizer, ours, 50)
    _train(reference, theirs, 50)
    for mine, torchs in zip(ours, theirs):
        assert relative_error(mine.detach(), torchs.detach()) < 1e-6
        for name in ("exp_avg", "exp_avg_sq"):
            assert relative_error(optimizer.state[mine][name], reference.state[torchs][name]) < 1e-6


def test_bf16_params_with_fp32_master_follow_fp32_adamw():
    """The master follows fp32 AdamW fed the same (bf16) grads; the parameter is its RNE rounding."""
    ours, theirs = _params(torch.bfloat16), [torch.nn.Parameter(p.detach().float()) for p in _params(torch.bfloat16)]
    optimizer = FusedAdam(_groups(ours), master_weights=True)
    reference = torch.optim.AdamW(_groups(theirs))
    _train(optimizer, ours, 20)
    _train(reference, theirs, 20, grad_dtype=torch.bfloat16)  # the same bf16 values, in fp32 storage
    for mine, torchs in zip(ours, theirs):
        master = optimizer.state[mine]["master_param"]
        assert master.dtype == torch.float32
        assert relative_error(master, torchs.detach()) < 1e-6
        assert torch.equal(mine.detach(), master.bfloat16())


def test_param_remainders_hold_the_same_master_in_half_the_memory():
    full, halves = _params(torch.bfloat16), _params(torch.bfloat16)
    with_fp32 = FusedAdam(_groups(full), master_weights=True)
    with_remainders = FusedAdam(_groups(halves), master_weights=True, store_param_remainders=True)
    _train(with_fp32, full, 20)
    _train(with_remainders, halves, 20)
    exported_state = with_remainders.state_dict()["state"]
    for index, (p_full, p_half) in enumerate(zip(full, halves)):
        assert with_remainders.state[p_half]["master_param"].dtype == torch.int16
        master = with_fp32.state[p_full]["master_param"]
        exported = exported_state[index]["master_param"]
        assert torch.equal(exported, master)  # bit for bit: the same fp32 arithmetic on the same bits
        assert torch.equal(p_half.detach(), split_master(master)[0])


@pytest.fixture(scope="module")
def fp32_moment_run():
    """Parameters before and after 50 steps with fp32 moments: the baseline for compressed moments."""
    exact = _params()
    start = [p.detach().clone() for p in exact]
    _train(FusedAdam(exact, lr=1e-3, weight_decay=0.01), exact, 50)
    return start, exact


@pytest.mark.parametrize("dtype", list(MOMENT_TOLERANCE), ids=str)
def test_low_precision_moments_stay_near_fp32_moments(dtype, fp32_moment_run):
    start, exact = fp32_moment_run
    compressed = _params()
    optimizer = FusedAdam(compressed, lr=1e-3, weight_decay=0.01, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    _train(optimizer, compressed, 50)
    assert optimizer.state[compressed[0]]["exp_avg"].dtype == dtype
    for p0, p_exact, p_compressed in zip(start, exact, compressed):
        error = (p_compressed.detach() - p_exact.detach()).norm() / (p_exact.detach() - p0).norm()
        assert error < MOMENT_TOLERANCE[dtype]


def test_state_dict_is_unscaled_fp32_and_load_reencodes():
    params = _params()
    optimizer = FusedAdam(params, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.bfloat16)
    _train(optimizer, params, 3)
    state_dict = optimizer.state_dict()
    for state in state_dict["state"].values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert "exp_avg_scale_inv" not in state
    state = optimizer.state[params[0]]
    decoded = state["exp_avg"].float() * state["exp_avg_scale_inv"]
    assert torch.equal(state_dict["state"][0]["exp_avg"], decoded)

    into_fp32 = FusedAdam(_params())
    into_fp32.load_state_dict(state_dict)
    assert torch.equal(into_fp32.state[into_fp32.param_groups[0]["params"][0]]["exp_avg"], decoded)

    again = FusedAdam(_params(), exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.bfloat16)
    again.load_state_dict(state_dict)
    reloaded = again.state[again.param_groups[0]["params"][0]]
    assert reloaded["exp_avg"].dtype == torch.float8_e4m3fn
    # The same values; the bytes may differ by a power of two when rounding moved the amax.
    assert torch.equal(reloaded["exp_avg"].float() * reloaded["exp_avg_scale_inv"], decoded)
    assert reloaded["step"].item() == 3


def test_grad_scaler_unscales_and_skips_steps_with_inf():
    scaled, plain = _params(), _params()
    optimizer, reference = FusedAdam(scaled), FusedAdam(plain)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))  # what scaler.scale(loss) does first: create the scale
    generator = torch.Generator().manual_seed(3)
    for p_scaled, p_plain, grad in zip(scaled, plain, _grads(scaled, generator)):
        p_scaled.grad, p_plain.grad = grad * 2.0**10, grad.clone()
    scaler.step(optimizer)
    scaler.update()
    reference.step()
    for a, b in zip(scaled, plain):
        assert torch.equal(a, b)  # a power-of-two scale is exact

    before = [p.detach().clone() for p in scaled]
    scaled[1].grad[3] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(scaled, before))
    assert optimizer.state[scaled[0]]["step"].item() == 1 and scaler.get_scale() == 2.0**9


def test_explicit_inv_scale_and_found_inf():
    scaled, plain = _params(), _params()
    optimizer, reference = FusedAdam(scaled), FusedAdam(plain)
    generator = torch.Generator().manual_seed(3)
    for p_scaled, p_plain, grad in zip(scaled, plain, _grads(scaled, generator)):
        p_scaled.grad, p_plain.grad = grad * 4, grad.clone()
    optimizer.step(inv_scale=torch.tensor(0.25), found_inf=torch.tensor(0.0))
    reference.step()
    assert all(torch.equal(a, b) for a, b in zip(scaled, plain))
    optimizer.step(found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(scaled, plain))


def test_capturable_keeps_counts_on_device_and_matches():
    on_device, on_host = _params(torch.bfloat16), _params(torch.bfloat16)
    capturable = FusedAdam(_groups(on_device), master_weights=True, capturable=True)
    reference = FusedAdam(_groups(on_host), master_weights=True)
    _train(capturable, on_device, 10)
    _train(reference, on_host, 10)
    for a, b in zip(on_device, on_host):
        assert capturable.state[a]["step"].device == a.device
        master, expected = capturable.state[a]["master_param"], reference.state[b]["master_param"]
        torch.testing.assert_close(master, expected, rtol=1e-5, atol=0)  # device-side scalars: fp32 rounding

    before = [capturable.state[p]["master_param"].clone() for p in on_device]
    capturable.step(found_inf=torch.tensor(1.0))  # stays on the device: no host sync decides the skip
    assert all(torch.equal(capturable.state[p]["master_param"], b) for p, b in zip(on_device, before))
    assert capturable.state[on_device[0]]["step"].item() == 10


def test_parameters_that_miss_steps_keep_their_own_step_count():
    ours, theirs = _params(), _params()
    optimizer = FusedAdam(ours, lr=1e-2, weight_decay=0.01)
    reference = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.01)
    generator = torch.Generator().manual_seed(5)
    for step in range(6):
        grads = _grads(ours, generator)
        for mine, torchs, grad in zip(ours, theirs, grads):
            has_grad = mine is not ours[1] or step % 2 == 0
            mine.grad = grad.clone() if has_grad else None
            torchs.grad = grad.clone() if has_grad else None
        optimizer.step()
        reference.step()
    assert optimizer.state[ours[1]]["step"].item() == 3
    for mine, torchs in zip(ours, theirs):
        assert relative_error(mine.detach(), torchs.detach()) < 1e-6


def test_zero_grad_and_after_step_hooks():
    params = _params()
    optimizer = FusedAdam(params)
    calls = []
    handle = optimizer.register_after_step_hook(params[0], lambda p: calls.append(p.detach().clone()))
    _train(optimizer, params, 2)
    assert len(calls) == 2 and torch.equal(calls[-1], params[0].detach())
    optimizer.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)
    optimizer.step()  # no grads: nothing runs, no hook
    handle.remove()
    _train(optimizer, params, 1)
    assert len(calls) == 2


def test_reference_backend_matches_the_kernel(monkeypatch):
    """Without the interpreter a CPU optimizer runs the pure-torch spec; both agree."""
    kernel_params, reference_params = _params(torch.bfloat16), _params(torch.bfloat16)
    _train(FusedAdam(_groups(kernel_params), master_weights=True), kernel_params, 5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _train(FusedAdam(_groups(reference_params), master_weights=True), reference_params, 5)
    for a, b in zip(kernel_params, reference_params):
        assert relative_error(a.detach(), b.detach()) < 1e-6


def test_configuration_errors_name_the_fix():
    params = _params()
    with pytest.raises(ValueError, match="set master_weights=True"):
        FusedAdam(params, store_param_remainders=True)
    with pytest.raises(ValueError, match="capturable=True supports"):
        FusedAdam(params, capturable=True, exp_avg_dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        FusedAdam(params, exp_avg_dtype=torch.uint8)
    with pytest.raises(ValueError, match="betas"):
        FusedAdam(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr must be"):
        FusedAdam(params, lr=-1.0)
    fp16 = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))]
    fp16[0].grad = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(TypeError, match="needs bfloat16 parameters"):
        FusedAdam(fp16, master_weights=True, store_param_remainders=True).step()
    ints = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    ints[0].grad = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(TypeError, match="updates float32, bfloat16, float16 and QuantizedTensor"):
        FusedAdam(ints).step()


@pytest.mark.gpu
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_matches_torch_fused_adamw_on_cuda(adam_w_mode):
    ours, theirs = _params(device="cuda"), _params(device="cuda")
    optimizer = FusedAdam(_groups(ours), adam_w_mode=adam_w_mode)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    reference = torch_cls(_groups(theirs), fused=True)
    _train(optimizer, ours, 50)
    _train(reference, theirs, 50)
    for mine, torchs in zip(ours, theirs):
        assert relative_error(mine.detach(), torchs.detach()) < 1e-6


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_steps():
    graphed, eager = _params(torch.bfloat16, "cuda"), _params(torch.bfloat16, "cuda")
    lr = torch.tensor(1e-2, device="cuda")
    optimizer = FusedAdam(graphed, lr=lr, master_weights=True, capturable=True)
    reference = FusedAdam(eager, lr=lr.clone(), master_weights=True, capturable=True)
    generator = torch.Generator().manual_seed(1)
    static_grads = [torch.zeros_like(p) for p in graphed]
    for p, grad in zip(graphed, static_grads):
        p.grad = grad
    optimizer.step()  # warm-up: builds state and tables outside the capture
    reference_grads = [torch.zeros_like(p) for p in eager]
    for p, grad in zip(eager, reference_grads):
        p.grad = grad
    reference.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        optimizer.step()
    for _ in range(5):
        new = [g.to("cuda", torch.bfloat16) for g in _grads(graphed, generator)]
        for static, eager_grad, value in zip(static_grads, reference_grads, new):
            static.copy_(value)
            eager_grad.copy_(value)
        graph.replay()
        reference.step()
    for a, b in zip(graphed, eager):
        assert torch.equal(optimizer.state[a]["master_param"], reference.state[b]["master_param"])
        assert torch.equal(a, b)

"""QuantizedTensor: its bytes are the kernels' bytes, and the ops FSDP2/DCP use keep them.

Each case quantizes through a Quantizer (the recipe table) and, independently, by calling
fp8kernels.reference with the arguments the recipe stands for. Bytes are compared exactly.
"""

import copy
import io
import pickle
import warnings
from typing import NamedTuple

import pytest
import torch

import torchside
from fp8kernels import reference as R
from fp8kernels._backend import Backend, backend_for
from torchside.quantization import FALLBACK_CALLS, QuantizedTensor, Quantizer, ops
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

# QuantizedTensor buffer -> the kernels' Quantized field holding the same bytes
FIELDS = {
    "rowwise_data": "data",
    "rowwise_scale_inv": "scale_inv",
    "columnwise_data": "columnwise_data",
    "columnwise_scale_inv": "columnwise_scale_inv",
    "tensor_amax": "amax",
    "columnwise_amax": "columnwise_amax",
}


class Case(NamedTuple):
    recipe: object
    role: str
    shape: tuple
    reference: object  # x -> fp8kernels.reference.Quantized, the arguments written out by hand
    row_step: int  # dim-0 slices must start on multiples of this


CASES = {
    "current": Case(
        Float8CurrentScaling(), "input", (96, 64), lambda x: R.quantize_tensorwise(x, "e4m3", columnwise=True), 1
    ),
    "delayed-grad": Case(
        DelayedScaling(),
        "grad",
        (96, 64),
        lambda x: R.quantize_tensorwise(x, "e5m2", torch.ones(1), columnwise=True),
        1,
    ),
    "block1x128": Case(
        Float8BlockScaling(),
        "input",
        (256, 192),
        lambda x: R.quantize_blockwise(x, "e4m3", (1, 128), columnwise=True),
        128,
    ),
    "block128x128": Case(
        Float8BlockScaling(power_2_scale=False),
        "weight",
        (256, 192),
        lambda x: R.quantize_blockwise(x, "e4m3", (128, 128), power_2_scale=False, columnwise=True),
        128,
    ),
    "mxfp8": Case(
        MXFP8BlockScaling(fp8_format=Format.E5M2, scale_rounding="floor"),
        "input",
        (64, 96),
        lambda x: R.quantize_mxfp8(x, "e5m2", scale_rounding="floor", columnwise=True),
        32,
    ),
    "nvfp4-grad": Case(
        NVFP4BlockScaling(stochastic_rounding_seed=7),
        "grad",
        (32, 48),
        lambda x: R.quantize_nvfp4(x, block=(1, 16), hadamard=True, stochastic_seed=7, columnwise=True),
        16,
    ),
    "nvfp4-weight": Case(
        NVFP4BlockScaling(), "weight", (32, 48), lambda x: R.quantize_nvfp4(x, block=(16, 16), columnwise=True), 16
    ),
}


def same_bytes(a, b) -> bool:
    """Both absent, or equal shape, dtype and bytes (NaN-safe)."""
    if a is None or b is None:
        return a is None and b is None
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(flat(a), flat(b))


def assert_bytes(q: QuantizedTensor, expected: R.Quantized) -> None:
    for buffer, field in FIELDS.items():
        assert same_bytes(getattr(q, buffer), getattr(expected, field)), buffer


def fallback_total() -> int:
    return sum(FALLBACK_CALLS.values())


@pytest.fixture(params=list(CASES))
def case(request):
    c = CASES[request.param]
    x = torch.randn(c.shape, generator=torch.Generator().manual_seed(0)) * 3
    q = Quantizer(c.recipe, c.role).quantize(x, backend=Backend.REFERENCE)
    return c, x, q


def test_bytes_and_dequantize_equal_the_reference(case):
    c, x, q = case
    expected = c.reference(x)
    assert type(q) is QuantizedTensor and q.shape == x.shape and q.dtype == x.dtype
    assert_bytes(q, expected)
    assert torch.equal(q.dequantize(), R.dequantize(expected))
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_columnwise_only_dequantizes_its_copy(case):
    c, x, _ = case
    q = Quantizer(c.recipe, c.role, rowwise=False).quantize(x, backend=Backend.REFERENCE)
    assert q.rowwise_data is None
    assert torch.equal(q.dequantize(), R.dequantize(c.reference(x), columnwise=True))


@pytest.mark.parametrize("name", list(CASES))
def test_triton_implementation_gives_the_reference_bytes(name):
    c = CASES[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend_for(device) is Backend.REFERENCE:
        pytest.skip("no Triton here: needs TRITON_INTERPRET=1 (tests/conftest.py sets it) or CUDA")
    x = torch.randn(c.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = Quantizer(c.recipe, c.role, device=device).quantize(x.to(device))
    assert_bytes(q.to("cpu"), c.reference(x))


def test_aliases_share_buffers_and_copies_do_not(case):
    _, _, q = case
    before = fallback_total()
    for alias in (q.detach(), q.view(q.shape), q[:], torch.as_strided(q, q.shape, q.stride())):
        assert type(alias) is QuantizedTensor and alias.rowwise_data.data_ptr() == q.rowwise_data.data_ptr()
    for duplicate in (q.clone(), copy.deepcopy(q), q.to("cpu", copy=True)):
        assert type(duplicate) is QuantizedTensor and duplicate.rowwise_data.data_ptr() != q.rowwise_data.data_ptr()
        assert all(same_bytes(getattr(duplicate, b), getattr(q, b)) for b in FIELDS)
    assert fallback_total() == before


def test_copy_into_an_empty_like_tensor(case):
    _, _, q = case
    before = fallback_total()
    for target in (q.new_empty(q.shape), torch.empty_like(q)):
        target.copy_(q)
        assert all(same_bytes(getattr(target, b), getattr(q, b)) for b in FIELDS)
    assert fallback_total() == before


def test_copy_refuses_what_it_cannot_do_exactly():
    q = torchside.quantize(torch.randn(32, 32), Float8CurrentScaling())
    with pytest.raises(TypeError, match="quantize the source"):
        q.copy_(torch.zeros(32, 32))
    other = torchside.quantize(torch.randn(32, 32), MXFP8BlockScaling())
    with pytest.raises(ValueError, match="cannot copy"):
        q.copy_(other)
    plain = torch.zeros(32, 32)
    before = fallback_total()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-op warning is tested below
        plain.copy_(q)  # a plain destination takes the values, through the counted fallback
    assert torch.equal(plain, q.dequantize()) and fallback_total() == before + 1


def test_new_tensors_have_the_layout_a_fresh_quantization_would(case):
    c, _, q = case
    rows = 2 * c.row_step
    shape = (rows, q.shape[1])
    fresh = c.reference(torch.zeros(shape))
    for made in (q.new_empty(shape), q.new_zeros(shape)):
        assert type(made) is QuantizedTensor and made.shape == shape
        for buffer, field in FIELDS.items():
            want = getattr(fresh, field)
            got = getattr(made, buffer)
            assert (got is None) == (want is None) and (
                got is None or (got.shape, got.dtype) == (want.shape, want.dtype)
            )
    assert torch.equal(q.new_zeros(shape).dequantize(), torch.zeros(shape))
    assert q.new_zeros(shape, dtype=torch.bfloat16).dtype == torch.bfloat16  # another dtype: a plain tensor


def test_new_tensors_refuse_shapes_the_blocks_cannot_tile():
    q = Quantizer(MXFP8BlockScaling(), "input").quantize(torch.randn(64, 64), backend=Backend.REFERENCE)
    with pytest.raises(ValueError, match="multiple of 32"):
        q.new_empty((64, 40))


def test_dim0_slices_and_splits_are_views_on_block_boundaries(case):
    c, _, q = case
    before = fallback_total()
    full = q.dequantize()
    step = c.row_step
    part = q[step : 2 * step]
    assert type(part) is QuantizedTensor and torch.equal(part.dequantize(), full[step : 2 * step])
    pieces = torch.split(q, [step, q.shape[0] - step])
    assert torch.equal(torch.cat([p.dequantize() for p in pieces]), full)
    assert torch.equal(torch.cat([p.dequantize() for p in q.chunk(2)]), full)
    part.copy_(q[:step])  # a slice is a view: writing it writes the parent
    assert torch.equal(q[step : 2 * step].dequantize(), full[:step])
    assert fallback_total() == before


def test_slices_that_cut_a_scale_block_are_refused():
    q = Quantizer(Float8BlockScaling(), "weight").quantize(torch.randn(256, 128), backend=Backend.REFERENCE)
    with pytest.raises(ValueError, match="multiples of 128"):
        q[64:]
    with pytest.raises(ValueError, match="multiples of 128"):
        q.split(96)


def test_reshaped_views_keep_the_bytes():
    q = torchside.quantize(torch.randn(4, 32, 32), MXFP8BlockScaling(), role="weight")
    before = fallback_total()
    flat = q.view(-1)
    assert flat.shape == (4 * 32 * 32,) and torch.equal(flat.dequantize(), q.dequantize().reshape(-1))
    assert torch.equal(flat.view(4, 32, 32).dequantize(), q.dequantize())
    assert torch.equal(q[1:3].dequantize(), q.dequantize()[1:3])  # dim 0 spans 32 rows of [128, 32]
    assert fallback_total() == before
    with pytest.raises(ValueError, match="whole rows"):
        flat[:100]


def test_untyped_storage_is_the_rowwise_bytes_storage(case):
    c, x, q = case
    assert q.untyped_storage().data_ptr() == q.rowwise_data.untyped_storage().data_ptr()
    columnwise_only = Quantizer(c.recipe, c.role, rowwise=False).quantize(x, backend=Backend.REFERENCE)
    assert columnwise_only.untyped_storage().data_ptr() == columnwise_only.columnwise_data.untyped_storage().data_ptr()


def test_torch_save_load_weights_only_round_trips_the_bytes(case):
    _, _, q = case
    before = fallback_total()
    buffer = io.BytesIO()
    torch.save({"w": q, "w_rows": q[: q.shape[0] // 2]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    for name, original in (("w", q), ("w_rows", q[: q.shape[0] // 2])):
        got = loaded[name]
        assert type(got) is QuantizedTensor and (got.shape, got.dtype) == (original.shape, original.dtype)
        assert all(same_bytes(getattr(got, b), getattr(original, b)) for b in FIELDS)
    assert fallback_total() == before


def test_flatten_unflatten_round_trip(case):
    _, _, q = case
    names, metadata = q.__tensor_flatten__()
    rebuilt = QuantizedTensor.__tensor_unflatten__({n: getattr(q, n) for n in names}, metadata, q.shape, q.stride())
    assert all(same_bytes(getattr(rebuilt, b), getattr(q, b)) for b in FIELDS) and rebuilt.dtype == q.dtype


def test_other_ops_dequantize_warn_once_per_op_and_are_counted(monkeypatch):
    monkeypatch.setattr(ops, "_WARNED", set())
    q = torchside.quantize(torch.randn(16, 32), Float8CurrentScaling())
    before = FALLBACK_CALLS["aten.sin.default"]
    with pytest.warns(UserWarning, match="aten.sin.default .* dequantized"):
        result = torch.sin(q)
    assert type(result) is torch.Tensor and torch.equal(result, torch.sin(q.dequantize()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call must not warn again
        torch.sin(q)
    assert FALLBACK_CALLS["aten.sin.default"] == before + 2
    with pytest.raises(TypeError, match="writes into a QuantizedTensor"):
        q.mul_(2)


def test_a_second_registration_of_an_op_is_refused():
    with pytest.raises(RuntimeError, match="already runs"):
        ops.implements([torch.ops.aten.detach.default])(lambda *a: None)


def test_zero_size_tensors():
    x = torch.randn(0, 64)
    q = Quantizer(Float8BlockScaling(), "input").quantize(x, backend=Backend.REFERENCE)
    assert q.shape == (0, 64) and q.dequantize().shape == (0, 64)
    big = Quantizer(Float8CurrentScaling(), "weight").quantize(torch.randn(3, 64), backend=Backend.REFERENCE)
    empty = big[3:]
    assert empty.shape == (0, 64) and same_bytes(empty.rowwise_scale_inv, big.rowwise_scale_inv)
    assert [p.shape[0] for p in big.split(2)] == [2, 1]
    assert big.new_empty((0,)).shape == (0,)  # FSDP2's placeholder for a rank without rows
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True).shape == (0, 64)


def test_public_quantize_validates_recipe_and_role():
    x = torch.randn(32, 32)
    q = torchside.quantize(x, Float8CurrentScaling(), role="grad")
    assert q.rowwise_data is not None and q.columnwise_data is not None and q.quantized_storage.fmt == "e5m2"
    with pytest.raises(TypeError, match="not a recipe"):
        torchside.quantize(x, "current")
    with pytest.raises(ValueError, match="role='bias'"):
        torchside.quantize(x, Float8CurrentScaling(), role="bias")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        torchside.quantize(x.double(), Float8CurrentScaling())


def test_delayed_scaling_quantizer_records_amaxes_and_updates_in_place():
    recipe = DelayedScaling(margin=1, amax_history_len=4, fp8_format=Format.E4M3)
    quantizer = Quantizer(recipe, "input")
    scale, history = quantizer.scale, quantizer.amax_history
    steps = [[2.0, 5.0], [0.5], [0.0]]  # amaxes quantized within each step
    model_history = [0.0] * 4
    model_scale = 1.0
    for amaxes in steps:
        for amax in amaxes:
            x = torch.tensor([[amax, -amax / 2]])
            q = quantizer.quantize(x, backend=Backend.REFERENCE)
            assert same_bytes(q.rowwise_scale_inv, 1 / torch.tensor([model_scale]))  # cast with the current scale
        model_history[0] = max(amaxes)
        quantizer.update()
        window = max(model_history)
        model_scale = 448.0 / window / 2 if window > 0 else model_scale
        model_history = [0.0] + model_history[2:] + model_history[:1]  # roll by -1, then zero row 0
        assert torch.allclose(quantizer.scale, torch.tensor([model_scale]), rtol=1e-6)
        assert quantizer.amax_history.tolist() == model_history
    assert quantizer.scale is scale and quantizer.amax_history is history  # fixed tensors, updated in place


def test_quantizer_pickles_and_deepcopies_without_its_process_group():
    quantizer = Quantizer(DelayedScaling(amax_history_len=8), "weight", amax_reduction_group=object())
    quantizer.amax_history[0] = 3.0
    for clone in (pickle.loads(pickle.dumps(quantizer)), copy.deepcopy(quantizer)):
        assert clone.amax_reduction_group is None and clone.recipe == quantizer.recipe
        assert (
            torch.equal(clone.amax_history, quantizer.amax_history) and clone.amax_history is not quantizer.amax_history
        )


def test_quantizer_refuses_what_its_recipe_cannot_do():
    with pytest.raises(ValueError, match="amax_reduction_group"):
        Quantizer(MXFP8BlockScaling(), "input", amax_reduction_group=object())
    with pytest.raises(ValueError, match="enable at least one usage"):
        Quantizer(Float8CurrentScaling(), "input", rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="device='meta'"):
        Quantizer(DelayedScaling(), "input").quantize(torch.randn(4, 4, device="meta"))


def test_stochastic_rounding_seed_advances_per_quantization():
    quantizer = Quantizer(NVFP4BlockScaling(stochastic_rounding_seed=5), "grad", columnwise=False)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    for seed in (5, 6):
        expected = R.quantize_nvfp4(x, block=(1, 16), hadamard=True, stochastic_seed=seed)
        assert same_bytes(quantizer.quantize(x, backend=Backend.REFERENCE).rowwise_data, expected.data)


def test_stochastic_rounding_counter_stays_a_tensor_and_a_huge_seed_wraps_mod_2_32():
    """The seed is read on the device (what a CUDA graph replays), and only its low 32 bits count."""
    quantizer = Quantizer(NVFP4BlockScaling(stochastic_rounding_seed=2**70 + 9), "grad", columnwise=False)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    _, kwargs = quantizer.kernel_call(x)
    assert isinstance(kwargs["stochastic_seed"], torch.Tensor) and int(quantizer.stochastic_step) == 1
    expected = R.quantize_nvfp4(x, block=(1, 16), hadamard=True, stochastic_seed=(2**70 + 10) % 2**32)
    assert same_bytes(quantizer.quantize(x, backend=Backend.REFERENCE).rowwise_data, expected.data)

"""Triton quantizers (fp8kernels.quantize) byte-for-byte against the torch reference (fp8kernels.reference).

Every scheme, both roles, bf16 and fp32 inputs of several shapes, and an edge set generated
from the format specs. On CPU the kernels run in the interpreter; the same tests run compiled
on CUDA with `pytest -m gpu`, against the reference computed on the GPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8kernels import quantize as triton_quantize
from fp8kernels import reference
from fp8kernels._backend import Backend, backend_for
from tests.fp8kernels.byte_exact import assert_same_bytes, random_input
from tests.fp8kernels.devices import DEVICES
from tests.fp8kernels.format_models import edge_values
from tests.transformer_engine_models import transformer_engine_e8m0

# name -> (function name, keyword arguments, shape family)
SCHEMES = {
    "tensorwise_e4m3": ("quantize_tensorwise", {"fmt": "e4m3"}, "any"),
    "tensorwise_e5m2_pow2_eps": (
        "quantize_tensorwise", {"fmt": "e5m2", "power_2_scale": True, "amax_epsilon": 0.5}, "any"
    ),
    "tensorwise_e4m3_delayed": ("quantize_tensorwise", {"fmt": "e4m3", "scale": 0.37}, "any"),
    # a given amax (as reduced over shards) below most inputs' own: tiles overflow and clamp
    "tensorwise_e4m3_given_amax": ("quantize_tensorwise", {"fmt": "e4m3", "amax": 3.0}, "any"),
    "tensorwise_e5m2_pow2_eps_given_amax": (
        "quantize_tensorwise", {"fmt": "e5m2", "power_2_scale": True, "amax_epsilon": 0.5, "amax": 0.25}, "any"
    ),
    "block1x128_e4m3": ("quantize_blockwise", {"fmt": "e4m3", "block": (1, 128)}, "any"),
    "block1x128_e5m2_fp32_scale": ("quantize_blockwise", {"fmt": "e5m2", "power_2_scale": False}, "any"),
    "block128x128_e4m3": ("quantize_blockwise", {"fmt": "e4m3", "block": (128, 128)}, "any"),
    "mxfp8_e4m3_up": ("quantize_mxfp8", {"fmt": "e4m3"}, "by32"),
    "mxfp8_e5m2_floor": ("quantize_mxfp8", {"fmt": "e5m2", "scale_rounding": "floor"}, "by32"),
    "nvfp4_1x16": ("quantize_nvfp4", {}, "by16"),
    "nvfp4_16x16": ("quantize_nvfp4", {"block": (16, 16)}, "by16"),
    "nvfp4_1x16_hadamard_stochastic": ("quantize_nvfp4", {"hadamard": True, "stochastic_seed": 2**33 + 5}, "by16"),
}
# shape family -> shapes quantized with both roles (tails, one row and primes where the blocks allow)
SHAPES = {
    "any": [(128, 256), (130, 200), (1, 384), (37, 131)],
    "by32": [(128, 256), (96, 160), (32, 32)],
    "by16": [(128, 256), (48, 80), (16, 16)],
}
ELEMENT_FORMAT = {"quantize_nvfp4": "e2m1"}
# numpy inside the interpreter warns on the 1/0 that fmax/amax and global/block-scale divisions meet on purpose
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:overflow:RuntimeWarning")


def _quantize_both(name: str, x: torch.Tensor, **roles) -> tuple[reference.Quantized, reference.Quantized]:
    function, kwargs, _ = SCHEMES[name]
    kwargs = dict(kwargs)
    for given in ("scale", "amax"):
        if given in kwargs:
            kwargs[given] = torch.tensor([kwargs[given]], device=x.device)
    assert backend_for(x.device) is not Backend.REFERENCE, "the kernels must run, not fall back to the reference"
    got = getattr(triton_quantize, function)(x, **kwargs, **roles)
    expected = getattr(reference, function)(x, **kwargs, **roles)
    return got, expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_random_inputs_give_identical_bytes(device, dtype, name):
    for shape in SHAPES[SCHEMES[name][2]]:
        x = random_input(shape, dtype, device, seed=shape[0])
        got, expected = _quantize_both(name, x, rowwise=True, columnwise=True)
        assert_same_bytes(got, expected, x)


ROLE_SHAPES = {"any": (37, 131), "by32": (37, 64), "by16": (37, 48)}  # rows not a block multiple


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_each_role_alone_gives_identical_bytes(device, name):
    rows, cols = ROLE_SHAPES[SCHEMES[name][2]]
    rowwise_input = random_input((rows, cols), torch.bfloat16, device, seed=1)
    got, expected = _quantize_both(name, rowwise_input, rowwise=True, columnwise=False)
    assert_same_bytes(got, expected, rowwise_input)
    columnwise_input = random_input((cols, rows), torch.float32, device, seed=2)  # columns not a block multiple
    got, expected = _quantize_both(name, columnwise_input, rowwise=False, columnwise=True)
    assert_same_bytes(got, expected, columnwise_input)


@pytest.mark.parametrize("device", DEVICES)
def test_1x128_scales_are_stored_rows_contiguous_as_cublaslt_reads_them(device):
    x = random_input((260, 300), torch.bfloat16, device, seed=5)
    got = triton_quantize.quantize_blockwise(x, block=(1, 128), rowwise=True, columnwise=True)
    assert got.scale_inv.shape == (260, 3) and got.scale_inv.stride() == (1, 260)
    assert got.columnwise_scale_inv.shape == (300, 3) and got.columnwise_scale_inv.stride() == (1, 300)
    square = triton_quantize.quantize_blockwise(x, block=(128, 128), rowwise=True, columnwise=True)
    assert square.scale_inv.is_contiguous() and square.columnwise_scale_inv.is_contiguous()


def edge_matrix(fmt: str, cols: int, rows_multiple: int) -> torch.Tensor:
    """An fp32 [R, cols] input from the format's edge set: every value, the ties between them,
    subnormals, +-max and beyond, +-inf, NaN, zeros; plus an all-zero row, rows with one huge
    outlier per 16 elements, and rows of fp32-subnormal values. R is a multiple of rows_multiple."""
    generator = torch.Generator().manual_seed(3)
    edges = edge_values(fmt)
    edges = edges[edges.abs().argsort()]  # neighbours share blocks, so some blocks have amax == max
    edges = torch.cat([edges, torch.zeros(-edges.numel() % cols)]).reshape(-1, cols)
    outliers = torch.randn(2, cols, generator=generator)
    outliers[:, ::16] = 1e30
    tiny = torch.randn(2, cols, generator=generator) * 1e-39
    matrix = torch.cat([edges, torch.zeros(1, cols), outliers, tiny])
    padding = torch.randn(-matrix.shape[0] % rows_multiple, cols, generator=generator)
    return torch.cat([matrix, padding])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_edge_values_give_identical_bytes(device, dtype, name):
    function, kwargs, _ = SCHEMES[name]
    fmt = ELEMENT_FORMAT.get(function, kwargs.get("fmt"))
    x = edge_matrix(fmt, cols=128, rows_multiple=32).to(dtype).to(device)
    got, expected = _quantize_both(name, x, rowwise=True, columnwise=True)
    assert_same_bytes(got, expected, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_up_gives_a_tiny_block_code_0_and_leaves_it_unscaled(device, fmt):
    """Issue 29, finding 10: a block whose amax / fmax is at most 2^-127 gets E8M0 code 0 (not 1) and its
    elements are cast unscaled, so they are +-0, as TransformerEngine's MXFP8 cast writes them."""
    fmax = reference.FORMATS[fmt].max
    boundary = float(np.float32(fmax * 2.0**-127))  # amax * fp32(1/fmax) lands near 2^-127 around here
    amaxes = [1e-45, 1e-40, 2.0**-126, boundary * 0.5, boundary, boundary * 1.01, 2.0**-110]
    x = torch.linspace(-1, 1, 32).repeat(len(amaxes), 1) * torch.tensor(amaxes)[:, None]
    x[:, 7] = torch.tensor(amaxes)
    expected = [transformer_engine_e8m0(float(a), fmax) for a in x[:, 7]]
    assert expected[:4] == [0, 0, 0, 0] and expected[-1] > 1  # the test spans both sides of the rule
    zero_rows = torch.tensor(expected) == 0
    for implementation in (reference, triton_quantize):
        q = implementation.quantize_mxfp8(x.to(device), fmt)
        assert q.scale_inv[:, 0].tolist() == expected, implementation.__name__
        data = q.data.cpu()[zero_rows]
        assert not (data & 0x7F).any() and torch.equal(data >> 7, x[zero_rows].signbit().to(torch.uint8))


# Each tile checks its own amaxes and casts on the short path when nothing in it is NaN or past the
# rounding limit: a tensor with one bad corner mixes both paths in one launch.
MIXED_TILE_SCHEMES = ["tensorwise_e4m3_delayed", "block1x128_e4m3", "mxfp8_e4m3_up", "mxfp8_e5m2_floor", "nvfp4_1x16"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MIXED_TILE_SCHEMES)
def test_tiles_on_the_short_path_and_tiles_off_it_give_identical_bytes(device, name):
    x = random_input((256, 256), torch.float32, "cpu", seed=5)
    x[:3, :3] = torch.tensor([[math.nan, math.inf, -math.inf], [1e30, -1e30, 3e38], [-0.0, 1e-40, -1e-45]])
    x[200, 130] = 464.0 / 0.37  # the rounding limit of e4m3 under the delayed scale 0.37
    x = x.to(device)
    got, expected = _quantize_both(name, x, rowwise=True, columnwise=True)
    assert_same_bytes(got, expected, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [-3.0, 0.0, math.inf])
def test_odd_delayed_scales_give_identical_bytes(device, scale):
    """The in-range test bounds |amax * scale|: a negative, zero or infinite scale must not slip through."""
    x = random_input((64, 96), torch.bfloat16, device, seed=6)
    assert backend_for(x.device) is not Backend.REFERENCE, "the kernels must run, not fall back to the reference"
    kwargs = {"scale": torch.tensor([scale], device=device), "rowwise": True, "columnwise": True}
    got, expected = triton_quantize.quantize_tensorwise(x, **kwargs), reference.quantize_tensorwise(x, **kwargs)
    assert_same_bytes(got, expected, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "function, kwargs, shape, message",
    [
        ("quantize_mxfp8", {}, (64, 48), "multiple of 32"),
        ("quantize_mxfp8", {"columnwise": True, "rowwise": False}, (40, 64), "multiple of 32"),
        ("quantize_nvfp4", {}, (16, 24), "multiple of 16"),
        ("quantize_nvfp4", {"columnwise": True}, (24, 32), "multiple of 16"),
        ("quantize_blockwise", {"block": (1, 32)}, (16, 32), "not supported"),
    ],
)
def test_shapes_the_blocks_cannot_tile_raise_the_same_error(device, function, kwargs, shape, message):
    x = torch.zeros(shape, device=device)
    for implementation in (triton_quantize, reference):
        with pytest.raises(ValueError, match=message):
            getattr(implementation, function)(x, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_high_rank_inputs(device):
    empty = torch.zeros(0, 64, device=device)
    assert_same_bytes(*_quantize_both("tensorwise_e4m3", empty, columnwise=True), empty)
    x = random_input((2, 16, 64), torch.bfloat16, device)
    assert_same_bytes(*_quantize_both("mxfp8_e4m3_up", x, columnwise=True), x)


# kernel -> the schemes that launch it; every autotune candidate of every kernel must give the same bytes
SCHEMES_BY_KERNEL = {
    "amax": ["tensorwise_e4m3", "nvfp4_1x16_hadamard_stochastic"],
    "tensorwise": ["tensorwise_e4m3", "tensorwise_e4m3_delayed", "tensorwise_e4m3_given_amax"],
    "blockwise": ["block1x128_e4m3", "block128x128_e4m3"],
    "mxfp8": ["mxfp8_e4m3_up"],
    "nvfp4": ["nvfp4_1x16_hadamard_stochastic", "nvfp4_16x16"],
}
CONFIGS = [(kernel, index) for kernel, entry in triton_quantize._KERNELS.items() for index in range(len(entry[1]))]
# The interpreter takes 3-8 s a config of these: CI runs their first, the grid and `-m gpu` (compiled) run all.
SLOW_TO_INTERPRET = {"amax", "nvfp4"}
CONFIG_PARAMS = [
    pytest.param(kernel, index, id=f"{kernel}-{index}",
                 marks=[pytest.mark.grid] if kernel in SLOW_TO_INTERPRET and index else [])
    for kernel, index in CONFIGS
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel, index", CONFIG_PARAMS)
def test_every_tile_config_gives_identical_bytes(device, kernel, index, monkeypatch):
    function, candidates, key = triton_quantize._KERNELS[kernel]
    monkeypatch.setitem(triton_quantize._KERNELS, kernel, (function, [candidates[index]], key))
    triton_quantize._kernel.cache_clear()
    try:
        x = random_input((160, 288), torch.bfloat16, device, seed=index)  # partial tiles for every candidate
        for name in SCHEMES_BY_KERNEL[kernel]:
            got, expected = _quantize_both(name, x, rowwise=True, columnwise=True)
            assert_same_bytes(got, expected, x)
    finally:
        triton_quantize._kernel.cache_clear()


@pytest.mark.parametrize("device", DEVICES)
def test_tuned_kernels_keep_a_config_per_key_and_give_identical_bytes(device, monkeypatch):
    """Tensors past _AUTOTUNE_MIN_ELEMENTS tune once per autotune key, then launch with the kept config."""
    monkeypatch.setattr(triton_quantize, "_AUTOTUNE_MIN_ELEMENTS", 0)
    triton_quantize._kernel.cache_clear()
    try:
        x = random_input((160, 288), torch.bfloat16, device, seed=3)
        for _ in range(2):  # the first round tunes, the second launches the kept configs
            for name in ("tensorwise_e4m3", "nvfp4_16x16"):
                got, expected = _quantize_both(name, x, rowwise=True, columnwise=True)
                assert_same_bytes(got, expected, x)
        got, expected = _quantize_both("nvfp4_16x16", x, rowwise=False, columnwise=True)  # a key of its own
        assert_same_bytes(got, expected, x)
        if device == "cuda":  # compiled: one kernel kept per key (the interpreter launches through Triton)
            nvfp4 = triton_quantize._kernel("nvfp4", tuned=True)[0]
            assert len(nvfp4.compiled) == 2
            candidates = triton_quantize._KERNELS["nvfp4"][1]
            for _, meta, _ in nvfp4.compiled.values():
                assert any(all(meta[name] == value for name, value in c.items()) for c in candidates), meta
    finally:
        triton_quantize._kernel.cache_clear()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
def test_nvfp4_shards_given_the_global_amax_cast_as_the_whole_tensor(device, block):
    """A row shard quantized with the whole tensor's amax holds exactly the whole tensor's bytes for its rows:
    the small-values shard alone would pick a finer global scale (and other bytes)."""
    whole = random_input((64, 96), torch.bfloat16, device)
    whole[:32] *= 2.0**-6  # shard 0 holds much smaller values than shard 1
    roles = {"block": block, "rowwise": True, "columnwise": True}
    global_amax = whole.float().abs().amax().reshape(1)
    expected = reference.quantize_nvfp4(whole.cpu(), **roles)
    for name, implementation in (("reference", reference), ("triton", triton_quantize)):
        shard = implementation.quantize_nvfp4(whole[:32], **roles, global_amax=global_amax)
        assert torch.equal(shard.data.cpu(), expected.data[:32]), name
        assert torch.equal(shard.scale_inv.cpu(), expected.scale_inv[: 32 // block[0]]), name
        assert torch.equal(shard.columnwise_data.cpu(), expected.columnwise_data[:, :16]), name  # [K, M/2]
        assert torch.equal(shard.amax.cpu(), expected.amax), name
        alone = implementation.quantize_nvfp4(whole[:32], **roles)
        assert not torch.equal(alone.data.cpu(), expected.data[:32]), f"{name}: the test cannot tell the amaxes apart"


@pytest.mark.parametrize("device", DEVICES)
def test_tensorwise_shards_given_the_whole_amax_cast_as_the_whole_tensor(device):
    """Current scaling from the amax of all shards: each shard holds the whole tensor's bytes for its rows,
    and its amax stays its own (what delayed scaling's history and a checkpoint record)."""
    whole = random_input((64, 96), torch.bfloat16, device)
    whole[:32] *= 2.0**-6
    whole_amax = whole.float().abs().amax().reshape(1)
    expected = reference.quantize_tensorwise(whole.cpu(), rowwise=True, columnwise=True)
    for name, implementation in (("reference", reference), ("triton", triton_quantize)):
        shard = implementation.quantize_tensorwise(whole[:32], amax=whole_amax, rowwise=True, columnwise=True)
        assert torch.equal(shard.data.cpu(), expected.data[:32]), name
        assert torch.equal(shard.columnwise_data.cpu(), expected.columnwise_data[:, :32]), name
        assert torch.equal(shard.scale_inv.cpu(), expected.scale_inv), name
        assert torch.equal(shard.columnwise_scale_inv.cpu(), expected.scale_inv), name
        assert torch.equal(shard.amax.cpu(), whole[:32].float().abs().amax().reshape(1).cpu()), name
        alone = implementation.quantize_tensorwise(whole[:32])
        assert not torch.equal(alone.data.cpu(), expected.data[:32]), f"{name}: the test cannot tell the amaxes apart"


@pytest.mark.parametrize("device", DEVICES)
def test_tensorwise_takes_a_scale_or_an_amax_not_both(device):
    x = random_input((32, 32), torch.float32, device)
    one = torch.ones(1, device=device)
    for implementation in (reference, triton_quantize):
        with pytest.raises(ValueError, match="not both"):
            implementation.quantize_tensorwise(x, scale=one, amax=one)
        with pytest.raises(TypeError, match="amax must be an fp32 tensor of one element"):
            implementation.quantize_tensorwise(x, amax=torch.ones(2, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_global_amax_is_refused_where_it_cannot_apply(device):
    x = random_input((32, 32), torch.float32, device)
    with pytest.raises(ValueError, match="Hadamard-rotated"):
        triton_quantize.quantize_nvfp4(x, hadamard=True, columnwise=True, global_amax=x.abs().amax().reshape(1))
    with pytest.raises(TypeError, match="fp32 tensor of one element"):
        reference.quantize_nvfp4(x, global_amax=torch.ones(2, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_seed_in_a_device_tensor_draws_the_int_seeds_bits(device):
    """A seed counter on the device (what a CUDA graph replays) rounds like the same seed as an int."""
    x = random_input((48, 80), torch.bfloat16, device, seed=4)
    seed = 2**33 + 5  # beyond 32 bits: both spellings keep seed mod 2^32
    for implementation in (triton_quantize, reference):
        as_int = implementation.quantize_nvfp4(x, hadamard=True, columnwise=True, stochastic_seed=seed)
        seed_tensor = torch.tensor([seed], dtype=torch.int64, device=device)
        as_tensor = implementation.quantize_nvfp4(x, hadamard=True, columnwise=True, stochastic_seed=seed_tensor)
        assert_same_bytes(as_tensor, as_int, x)
        other = implementation.quantize_nvfp4(x, hadamard=True, columnwise=True, stochastic_seed=seed_tensor + 1)
        assert not torch.equal(other.data, as_int.data), "another seed must draw other bits"
    with pytest.raises(TypeError, match="stochastic_seed"):
        triton_quantize.quantize_nvfp4(x, stochastic_seed=torch.tensor([1.5], device=device))

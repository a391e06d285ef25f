"""fp8kernels.quantize.quantize_tensorwise_split (one launch for every row group) byte-for-byte against
fp8kernels.reference.quantize_tensorwise run on each group's rows alone.

Uneven splits with empty groups and row counts that are not multiples of 4 (the transposed stores
then go byte by byte) or all multiples of 4 (packed words); bf16 and fp32; current scaling (own
amaxes, power-of-2 scales with an epsilon, given amaxes) and delayed scaling; groups of edge
values (NaN, inf, beyond max, subnormals, zeros). On CPU the kernel runs in the interpreter; the
same tests run compiled on CUDA with `pytest -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from fp8kernels import quantize as triton_quantize
from fp8kernels import reference
from fp8kernels._backend import Backend, backend_for
from tests.fp8kernels.devices import DEVICES
from tests.fp8kernels.format_models import edge_values
from tests.fp8kernels.byte_exact import assert_same_bytes, random_input

# name -> (fmt, keyword arguments; "scales"/"amaxes": one value per group, made by _per_group)
MODES = {
    "current_e4m3": ("e4m3", {}),
    "current_e5m2_pow2_eps": ("e5m2", {"power_2_scale": True, "amax_epsilon": 0.5}),
    "delayed_e4m3": ("e4m3", {"scales": (0.37, 1.0, 2.0**-6, 3.0e4)}),
    "given_amaxes_e4m3": ("e4m3", {"amaxes": (3.0, 0.0, 1.0e4, 0.25)}),  # below most groups' own: overflow
}
SPLITS = {
    "uneven": (5, 0, 19, 42),  # an empty group; rows not a multiple of 4: bytewise transposed stores
    "by4": (8, 0, 20, 36),  # every group a multiple of 4: transposes packed as int32 words
}
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:overflow:RuntimeWarning")


def _per_group(kwargs: dict, groups: int, device: str) -> dict:
    """The mode's arguments with its per-group values as an fp32 (groups,) tensor on the device."""
    def values(cycle):  # as many values as groups, repeating the mode's
        return torch.tensor([cycle[g % len(cycle)] for g in range(groups)], dtype=torch.float32, device=device)

    return {name: values(value) if name in ("scales", "amaxes") else value for name, value in kwargs.items()}


def _each_group_alone(x: torch.Tensor, splits, fmt: str, kwargs: dict, **roles) -> list[reference.Quantized]:
    """The spec: reference.quantize_tensorwise on each group's rows, with that group's scale or amax."""
    results = []
    for g, part in enumerate(x.split(list(splits))):
        one = {name: value[g : g + 1] if name in ("scales", "amaxes") else value for name, value in kwargs.items()}
        scale, amax = one.pop("scales", None), one.pop("amaxes", None)
        results.append(reference.quantize_tensorwise(part, fmt, scale, amax=amax, **one, **roles))
    return results


def _check_split(x: torch.Tensor, splits, mode: str, **roles) -> None:
    fmt, kwargs = MODES[mode]
    kwargs = _per_group(kwargs, len(splits), x.device)
    assert backend_for(x.device) is not Backend.REFERENCE, "the kernel must run, not fall back to the reference"
    got = triton_quantize.quantize_tensorwise_split(x, list(splits), fmt, **kwargs, **roles)
    expected = _each_group_alone(x, splits, fmt, kwargs, **roles)
    assert len(got) == len(expected)
    for g, (got_g, expected_g) in enumerate(zip(got, expected, strict=True)):
        try:
            assert_same_bytes(got_g, expected_g, x.split(list(splits))[g])
        except AssertionError as error:
            raise AssertionError(f"group {g} of m_splits={splits}, {mode}: {error}") from None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("mode", list(MODES))
def test_split_gives_each_groups_own_bytes(device, dtype, splits, mode):
    x = random_input((sum(splits), 131), dtype, device, seed=len(mode))  # a partial column tile
    x[: splits[0]] *= 2.0**-6  # groups of very different magnitudes: different scales
    _check_split(x, splits, mode, rowwise=True, columnwise=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["current_e4m3", "current_e5m2_pow2_eps", "delayed_e4m3"])
def test_groups_of_edge_values_give_each_groups_own_bytes(device, dtype, mode):
    """A group of the format's edge set (NaN, inf, ties, beyond max, subnormals), one of zeros, an empty one
    and one of huge outliers: NaN and inf stay in their group (its scale is 1), the others scale alone."""
    fmt = MODES[mode][0]
    edges = edge_values(fmt)
    edges = torch.cat([edges, torch.zeros(-edges.numel() % 128)]).reshape(-1, 128)
    generator = torch.Generator().manual_seed(4)
    groups = [edges, torch.zeros(3, 128), torch.zeros(0, 128), torch.randn(5, 128, generator=generator) * 1e30]
    x = torch.cat(groups).to(dtype).to(device)
    splits = tuple(len(group) for group in groups)
    _check_split(x, splits, mode, rowwise=True, columnwise=True)


TENSORWISE_CONFIGS = range(len(triton_quantize._KERNELS["tensorwise"][1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", TENSORWISE_CONFIGS)
def test_every_tile_config_finds_each_groups_tiles(device, index, monkeypatch):
    """Groups spanning several row tiles of every autotune candidate (BLOCK_M 64 and 128), partial column tiles;
    row counts in units of 1 and of 16 rows."""
    function, candidates, key = triton_quantize._KERNELS["tensorwise"]
    monkeypatch.setitem(triton_quantize._KERNELS, "tensorwise", (function, [candidates[index]], key))
    triton_quantize._kernel.cache_clear()
    try:
        for splits in ((5, 0, 150, 70), (16, 0, 144, 64)):
            x = random_input((sum(splits), 160), torch.bfloat16, device, seed=index)
            _check_split(x, splits, "delayed_e4m3", rowwise=True, columnwise=True)
    finally:
        triton_quantize._kernel.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["current_e4m3", "delayed_e4m3"])
@pytest.mark.parametrize("multiple", [1, 4], ids=["uneven", "by4"])
def test_moe_sized_split_on_cuda(mode, multiple):
    """GroupedLinear's benchmark split (8 experts, 16384 tokens) plus an empty expert: big enough to autotune."""
    splits = [m // multiple * multiple for m in (2861, 1024, 3517, 611, 2290, 1999, 3077, 0)]
    splits[-1] = 16384 - sum(splits)
    splits.append(0)
    x = random_input((sum(splits), 512), torch.bfloat16, "cuda", seed=multiple)
    _check_split(x, splits, mode, rowwise=True, columnwise=True)


@pytest.mark.parametrize("device", DEVICES)
def test_each_role_alone_and_the_layout_grouped_gemm_reads(device):
    """One copy at a time; group g's rowwise copy is rows [start_g, start_g + m_g) of one [M, K] buffer and
    its columnwise copy the [K, m_g] block at element K * start_g of another; every group's scale_inv starts
    on a 16-byte boundary (cuBLASLt refuses others: CUBLAS_STATUS_NOT_SUPPORTED on the H200)."""
    splits, K = (3, 0, 6, 7), 40
    x = random_input((sum(splits), K), torch.bfloat16, device, seed=9)
    _check_split(x, splits, "current_e4m3", rowwise=True, columnwise=False)
    _check_split(x, splits, "delayed_e4m3", rowwise=False, columnwise=True)
    got = triton_quantize.quantize_tensorwise_split(x, list(splits), rowwise=True, columnwise=True)
    starts = torch.tensor((0, *splits)).cumsum(0).tolist()
    for g, (q, start) in enumerate(zip(got, starts, strict=False)):
        assert q.data.shape == (splits[g], K) and q.columnwise_data.shape == (K, splits[g])
        assert q.data.is_contiguous() and q.columnwise_data.is_contiguous()
        assert q.scale_inv.data_ptr() % 16 == 0 and q.columnwise_scale_inv.data_ptr() % 16 == 0
        if splits[g]:
            assert q.data.data_ptr() == got[0].data.data_ptr() + K * start
            assert q.columnwise_data.data_ptr() == got[0].columnwise_data.data_ptr() + K * start


@pytest.mark.parametrize("device", DEVICES)
def test_reference_split_and_empty_inputs_loop_over_the_groups(device):
    """The REFERENCE backend's function (and the fallback for an empty x) is the per-group loop."""
    splits = (2, 0, 5)
    x = random_input((7, 32), torch.float32, device, seed=3)
    scales = torch.tensor([0.5, 2.0, 8.0], device=device)
    for got, expected in zip(
        reference.quantize_tensorwise_split(x, list(splits), scales=scales, columnwise=True),
        _each_group_alone(x, splits, "e4m3", {"scales": scales}, rowwise=True, columnwise=True),
        strict=True,
    ):
        assert_same_bytes(got, expected, x)
    empty = triton_quantize.quantize_tensorwise_split(torch.zeros(0, 32, device=device), [0, 0], columnwise=True)
    assert [q.data.shape for q in empty] == [(0, 32), (0, 32)] and all(q.scale_inv.item() == 1.0 for q in empty)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "m_splits, kwargs, error, message",
    [
        ([3, 4], {}, ValueError, "sum to x's 8 rows"),
        ([9, -1], {}, ValueError, "integers >= 0"),
        ([True, 7], {}, ValueError, "integers >= 0"),
        (torch.tensor([4, 4]), {}, TypeError, "list of row counts"),
        ([4, 4], {"scales": "ones3"}, TypeError, r"shape \(2,\)"),
        ([4, 4], {"scales": "ones2", "amaxes": "ones2"}, ValueError, "not both"),
        ([4, 4], {"scales": "ones2", "power_2_scale": True}, ValueError, "power_2_scale"),
    ],
)
def test_bad_splits_and_scales_raise_the_same_error(device, m_splits, kwargs, error, message):
    x = torch.zeros(8, 16, device=device)
    values = {"ones2": torch.ones(2, device=device), "ones3": torch.ones(3, device=device)}
    kwargs = {name: values.get(value, value) if isinstance(value, str) else value for name, value in kwargs.items()}
    for implementation in (triton_quantize, reference):
        with pytest.raises(error, match=message):
            implementation.quantize_tensorwise_split(x, m_splits, **kwargs)

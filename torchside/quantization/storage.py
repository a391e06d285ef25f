"""The raw buffers of one quantized tensor, and what their layout allows (slicing, gathering).

Shapes: a tensor is quantized as a matrix [M, K] (M = product of the leading dims, K = the
last dim). Columnwise buffers are the rowwise quantization of the transpose, stored [K, M]
(docs/quantization.md). The stored scale is `scale_inv`: dequant = q * scale_inv.

Every buffer field is annotated once: which copy it belongs to, what it holds and its name
in `fp8kernels.reference.Quantized`. Slicing rows, the FSDP2 all-gather, flatten/unflatten
and pickling all derive from those annotations and the scheme's block.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, NamedTuple

import torch
from torch import Tensor

from fp8kernels import reference
from twinspec.formats import SCHEME_BLOCKS


class Buffer(NamedTuple):
    """The annotation of one buffer field."""

    orientation: str  # "rowwise" (M is axis 0), "columnwise" (M is axis 1) or "shared"
    kind: str  # "data", "scale_inv" or "amax"
    quantized_name: str  # the same buffer's field in fp8kernels.reference.Quantized


OptionalTensor = Tensor | None


@dataclass(frozen=True, eq=False)
class QuantizedStorage:
    """Plain buffers of one quantized [rows, cols] matrix: cheap, no torch.Tensor behaviour."""

    scheme: str  # a key of fp8kernels.formats.SCHEME_BLOCKS
    fmt: str  # "e4m3" | "e5m2" | "e2m1"
    rows: int  # M
    cols: int  # K
    hadamard: bool = False  # nvfp4: the columnwise copy quantizes the Hadamard-rotated x.T
    rowwise_data: Annotated[OptionalTensor, Buffer("rowwise", "data", "data")] = None
    rowwise_scale_inv: Annotated[OptionalTensor, Buffer("rowwise", "scale_inv", "scale_inv")] = None
    columnwise_data: Annotated[OptionalTensor, Buffer("columnwise", "data", "columnwise_data")] = None
    columnwise_scale_inv: Annotated[OptionalTensor, Buffer("columnwise", "scale_inv", "columnwise_scale_inv")] = None
    tensor_amax: Annotated[OptionalTensor, Buffer("shared", "amax", "amax")] = None  # of x; nvfp4: rowwise global
    columnwise_amax: Annotated[OptionalTensor, Buffer("shared", "amax", "columnwise_amax")] = None

    @property
    def block(self) -> tuple[int, int] | None:
        return SCHEME_BLOCKS[self.scheme]

    @property
    def elements_per_byte(self) -> int:
        return 2 if self.fmt == "e2m1" else 1  # E2M1 packs element 2i in the low nibble

    @property
    def rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def columnwise(self) -> bool:
        return self.columnwise_data is not None

    @property
    def device(self) -> torch.device:
        return next(t for name in BUFFER_FIELDS if (t := getattr(self, name)) is not None).device

    def buffers(self) -> dict[str, Tensor]:
        """The buffers present, by field name, in field order."""
        return {name: getattr(self, name) for name in BUFFER_FIELDS if getattr(self, name) is not None}

    def metadata(self) -> tuple[str, str, int, int, bool]:
        """Everything but the buffers, as plain values (for flatten, pickling and FSDP metadata)."""
        return self.scheme, self.fmt, self.rows, self.cols, self.hadamard

    def with_buffers(self, fn: Callable[[str, Tensor], Tensor]) -> QuantizedStorage:
        """A storage with `fn(name, buffer)` in place of every buffer (clone, move, slice...)."""
        return dataclasses.replace(self, **{name: fn(name, t) for name, t in self.buffers().items()})

    def row_axis(self, name: str) -> tuple[int, int] | None:
        """(axis, rows per index) along which buffer `name` runs over M; None if it has no M axis."""
        buffer = BUFFERS[name]
        block = self.block
        if buffer.orientation == "shared" or (buffer.kind == "scale_inv" and block is None):
            return None  # one value for the whole tensor
        if buffer.orientation == "rowwise":
            return 0, 1 if buffer.kind == "data" else block[0]
        # Columnwise buffers quantize x.T: M is their last axis, packed or blocked as K is rowwise.
        return 1, self.elements_per_byte if buffer.kind == "data" else block[1]

    def row_granularity(self) -> int:
        """The smallest row count a slice may start at (and end at, except the last row)."""
        steps = [axis_step[1] for name in self.buffers() if (axis_step := self.row_axis(name))]
        return math.lcm(1, *steps)

    def slice_rows(self, start: int, stop: int) -> QuantizedStorage:
        """Rows [start, stop) as views of these buffers; ValueError if the cut splits a scale block."""
        step = self.row_granularity()
        if start % step or (stop % step and stop != self.rows):
            raise ValueError(
                f"rows [{start}, {stop}) of a {self.rows}-row '{self.scheme}' tensor cut through a group of "
                f"{step} rows sharing a scale or a byte: slice, split or shard on multiples of {step} rows"
            )

        def cut(name: str, t: Tensor) -> Tensor:
            axis_step = self.row_axis(name)
            if axis_step is None:
                return t  # shared by every slice (a per-tensor scale or amax)
            axis, per_index = axis_step
            return t.narrow(axis, start // per_index, math.ceil(stop / per_index) - start // per_index)

        return dataclasses.replace(self.with_buffers(cut), rows=stop - start)

    def copy_(self, src: QuantizedStorage, non_blocking: bool = False) -> None:
        """Copy `src`'s bytes into these buffers; both must have the same layout."""
        if self.metadata() != src.metadata() or list(self.buffers()) != list(src.buffers()):
            raise ValueError(
                f"cannot copy a {src.describe()} into a {self.describe()}: quantize the source with the "
                "destination's recipe and usages first"
            )
        for name, t in self.buffers().items():
            t.copy_(getattr(src, name), non_blocking=non_blocking)

    def to_quantized(self) -> reference.Quantized:
        """These buffers as the kernels' result type, shaped [rows, cols]."""
        named = {buffer.quantized_name: getattr(self, name) for name, buffer in BUFFERS.items()}
        return reference.Quantized(self.scheme, self.fmt, (self.rows, self.cols), hadamard=self.hadamard, **named)

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """The values as a [rows, cols] tensor of `dtype`, from the rowwise copy if there is one."""
        return reference.dequantize(self.to_quantized(), dtype, columnwise=not self.rowwise)

    def describe(self) -> str:
        usages = "+".join(u for u in ("rowwise", "columnwise") if getattr(self, u)) or "no data"
        return f"{self.scheme}/{self.fmt} [{self.rows}, {self.cols}] {usages} quantized tensor"


def _annotated_buffers() -> dict[str, Buffer]:
    hints = typing.get_type_hints(QuantizedStorage, include_extras=True)
    return {name: hint.__metadata__[0] for name, hint in hints.items() if typing.get_origin(hint) is Annotated}


BUFFERS: dict[str, Buffer] = _annotated_buffers()
BUFFER_FIELDS = tuple(BUFFERS)


def from_quantized(q: reference.Quantized) -> QuantizedStorage:
    """The buffers of a kernel result, with its [M, K] matrix shape."""
    rows, cols = math.prod(q.shape[:-1]), q.shape[-1]
    buffers = {name: getattr(q, b.quantized_name) for name, b in BUFFERS.items()}
    return QuantizedStorage(q.scheme, q.fmt, rows, cols, q.hadamard, **buffers)


def buffer_shapes(like: QuantizedStorage, rows: int, cols: int) -> dict[str, tuple[int, ...]]:
    """The shape of every buffer `like` would hold for a [rows, cols] matrix."""
    per_byte, block = like.elements_per_byte, like.block
    tiles_exactly = like.scheme == "mxfp8" or like.fmt == "e2m1"  # docs/quantization.md, shape rules
    shapes: dict[str, tuple[int, ...]] = {}
    for usage, outer, inner in (("rowwise", rows, cols), ("columnwise", cols, rows)):
        if not getattr(like, usage):
            continue
        if tiles_exactly and inner % block[1]:
            raise ValueError(
                f"a '{like.scheme}' {usage} copy of a [{rows}, {cols}] tensor needs {inner} to be a multiple of "
                f"{block[1]}: choose such a shape"
            )
        shapes[f"{usage}_data"] = (outer, inner // per_byte)
        scales = (1,) if block is None else (math.ceil(outer / block[0]), math.ceil(inner / block[1]))
        shapes[f"{usage}_scale_inv"] = scales
    for name in ("tensor_amax", "columnwise_amax"):
        if getattr(like, name) is not None:
            shapes[name] = (1,)
    return shapes


def empty_storage(
    like: QuantizedStorage, rows: int, cols: int, *, device: torch.device, zeroed: bool, pin_memory: bool = False
) -> QuantizedStorage:
    """New buffers for a [rows, cols] matrix laid out like `like`, with its per-tensor scale and amaxes.

    Zeroed data decodes to 0 in every format. Per-tensor buffers are copied, so that a tensor
    made "like" a shard (FSDP2's empty and padding shards) dequantizes with the same scale.
    """
    buffers = {}
    for name, shape in buffer_shapes(like, rows, cols).items():
        template = getattr(like, name)
        if like.row_axis(name) is None:
            buffers[name] = template.to(device, copy=True)
        else:
            make = torch.zeros if zeroed else torch.empty
            buffers[name] = make(shape, dtype=template.dtype, device=device)
        buffers[name] = buffers[name].pin_memory() if pin_memory else buffers[name]
    return dataclasses.replace(like, rows=rows, cols=cols, **{n: buffers.get(n) for n in BUFFER_FIELDS})

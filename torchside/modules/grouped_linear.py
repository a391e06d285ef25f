"""`GroupedLinear`: num_gemms linear layers over consecutive row groups of one input (MoE experts).

Shape legend: T tokens (all leading dims of the input, flattened), I in features, O out features,
E groups (num_gemms). Parameters `weight0` .. `weight{E-1}` [O, I] and `bias0` .. `bias{E-1}` [O],
TransformerEngine's te.GroupedLinear names. `forward(x, m_splits)`: rows m_splits[0] of x go through
group 0, the next m_splits[1] through group 1, and so on (a split may be 0).

Inside fp8_autocast every group has its own FP8 quantizers (input, weight, grad; scales per group).
The groups' rows of x and of dy are quantized by one `quantize_split` each: one cast launch for all
groups under the tensorwise recipes (on an H200 a launch costs the host ~100 us, more than the
groups' casts cost the GPU). Each of the three GEMM kinds is one `fp8kernels.grouped_gemm.grouped_scaled_mm`
call over all groups (on CUDA a cuBLASLt GEMM per group where cuBLASLt takes every group, else one grouped
Triton launch), writing each group's rows of y and dx, and each dw_g, in place:

    fprop  y_g  = x_g @ w_g.T + b_g      dgrad  dx_g = dy_g @ w_g      wgrad  dw_g = dy_g.T @ x_g

The wgrad reduces over each group's token count; grouped_scaled_mm appends zero codes to the two
columnwise copies when it is not a multiple of 16 (one padded copy of each, per backward).

A group with no rows gets zero weight and bias gradients. MXFP8 and NVFP4 blocks run along the
rows of the wgrad copies, so with gradients every split must be a multiple of 32 (MXFP8) or 16
(NVFP4): pad the groups as TransformerEngine's Fp8Padding does. FP8 off: one torch linear per group.

Tensor parallelism (`ModuleConfig(parallel_mode=..., tp_size=...)`): every group's weight and bias
is split by the placement table's linear rows, all groups alike. "column": this rank holds
`weight{g}` [O/tp, I] and `bias{g}` [O/tp] and writes its O/tp output features (the input's
gradient is summed over TP); "row": `weight{g}` [O, I/tp], x holds this rank's I/tp input features,
the partial outputs are all-reduced and then each group's full bias `bias{g}` [O] is added to its
rows. No sequence parallelism: the rows are routed tokens of every sequence position, and the
groups cut them by m_splits, not by TP rank (gather them before, as TransformerEngine's MoE does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from fp8kernels._checks import check_splits
from fp8kernels.ops import grouped_scaled_mm
from fp8kernels.reference import Quantized
from torchside import autocast
from torchside.modules.base import FP8Module, ParamSpec, default_init_method
from torchside.modules.config import ModuleConfig, check_parallel_mode, check_size
from torchside.modules.functions import GemmQuantizers, _columnwise_only, _quantized, linear
from torchside.modules.transformer_config import InitMethod
from torchside.quantization import QuantizedStorage, Quantizer, quantize_split
from torchside.recipe import MXFP8BlockScaling, NVFP4BlockScaling

_SPLIT_MULTIPLE = {MXFP8BlockScaling.__name__: 32, NVFP4BlockScaling.__name__: 16}  # rows per wgrad block


def _quantize_groups(
    operand: Tensor, m_splits: Sequence[int], live: list[int], quantizers: list[Quantizer]
) -> dict[int, QuantizedStorage]:
    """Each live group's (one with rows) rows of x [T, I] or dy [T, O], with that group's quantizer: one cast
    launch for all groups under the tensorwise recipes."""
    parts = quantize_split([quantizers[g] for g in live], operand, [m_splits[g] for g in live])
    return dict(zip(live, parts, strict=True))


class _GroupedFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, quantizers: tuple[GemmQuantizers, ...], on_backward_done, has_bias, *params):
        groups = len(m_splits)
        weights, biases = params[:groups], params[groups:] if has_bias else None
        x_TI = x.reshape(-1, x.shape[-1])
        live = [g for g in range(groups) if m_splits[g]]  # groups with rows: the only ones in the GEMMs
        x_fp8 = _quantize_groups(x_TI, m_splits, live, [q.input for q in quantizers])
        w_fp8 = {g: _quantized(weights[g], quantizers[g].weight) for g in live}
        y_TO = torch.empty(x_TI.shape[0], weights[0].shape[0], dtype=x.dtype, device=x.device)
        y_parts = y_TO.split(m_splits)
        if live:
            grouped_scaled_mm(
                [x_fp8[g].to_quantized() for g in live],
                [w_fp8[g].to_quantized() for g in live],
                out_dtype=x.dtype,
                bias=[biases[g] for g in live] if has_bias else None,
                out=[y_parts[g] for g in live],
            )
        needs_wgrad = any(ctx.needs_input_grad[5 : 5 + groups])
        # Keep only what the backward reads: the columnwise copies (x for wgrad, w for dgrad).
        ctx.x_columnwise = {g: _columnwise_only(x_fp8[g]) for g in live} if needs_wgrad else None
        ctx.w_columnwise = {g: _columnwise_only(w_fp8[g]) for g in live} if ctx.needs_input_grad[0] else None
        ctx.m_splits, ctx.live, ctx.quantizers, ctx.on_backward_done = m_splits, live, quantizers, on_backward_done
        ctx.x_shape, ctx.x_dtype, ctx.w_shape, ctx.w_dtype = x.shape, x.dtype, weights[0].shape, weights[0].dtype
        ctx.bias_dtype = biases[0].dtype if has_bias else None
        return y_TO.reshape(*x.shape[:-1], y_TO.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        groups, live = len(ctx.m_splits), ctx.live
        # ctx attributes outlive the backward (torchside.modules.functions._FP8Linear): drop the FP8 copies now
        x_saved, w_saved, ctx.x_columnwise, ctx.w_columnwise = ctx.x_columnwise, ctx.w_columnwise, None, None
        dy_TO = dy.reshape(-1, dy.shape[-1])
        dy_parts = dy_TO.split(ctx.m_splits)
        dy_fp8 = _quantize_groups(dy_TO, ctx.m_splits, live, [q.grad_output for q in ctx.quantizers])
        dy_fp8 = {g: storage.to_quantized() for g, storage in dy_fp8.items()}
        dx = None
        if ctx.needs_input_grad[0]:
            dx_TI = torch.empty(dy_TO.shape[0], ctx.w_shape[1], dtype=ctx.x_dtype, device=dy.device)
            dx_parts = dx_TI.split(ctx.m_splits)
            if live:
                grouped_scaled_mm(
                    [dy_fp8[g] for g in live],
                    [w_saved[g].to_quantized() for g in live],
                    b_columnwise=True,
                    out_dtype=ctx.x_dtype,
                    out=[dx_parts[g] for g in live],
                )
            dx = dx_TI.reshape(ctx.x_shape)
        weight_grads = [None] * groups
        if x_saved is not None:
            weight_grads = [  # an empty group's gradient is zero; grouped_scaled_mm writes the others
                (torch.empty if g in live else torch.zeros)(ctx.w_shape, dtype=ctx.w_dtype, device=dy.device)
                for g in range(groups)
            ]
            if live:
                grouped_scaled_mm(
                    [dy_fp8[g] for g in live],
                    [x_saved[g].to_quantized() for g in live],
                    a_columnwise=True,
                    b_columnwise=True,
                    out_dtype=ctx.w_dtype,
                    out=[weight_grads[g] for g in live],
                )
        bias_grads = []
        if ctx.bias_dtype is not None:
            bias_grads = [part.sum(dim=0, dtype=torch.float32).to(ctx.bias_dtype) for part in dy_parts]
        _record_grad_amaxes(ctx.quantizers, dy_fp8, dy.device)
        if ctx.on_backward_done is not None:
            ctx.on_backward_done()
        return dx, None, None, None, None, *weight_grads, *bias_grads


def _record_grad_amaxes(
    quantizers: tuple[GemmQuantizers, ...], dy_fp8: dict[int, Quantized], device: torch.device
) -> None:
    """torch.compile with DelayedScaling: each group's record_grad_amax, an empty group's with amax 0 (its slot
    still rolls, as the region's sync rolls every slot of the module)."""
    for g, q in enumerate(quantizers):
        if q.record_grad_amax is not None:
            q.record_grad_amax(dy_fp8[g].amax if g in dy_fp8 else torch.zeros(1, device=device))


def _check_m_splits(m_splits: object, groups: int, tokens: int) -> list[int]:
    if not isinstance(m_splits, list | tuple) or len(m_splits) != groups:
        raise ValueError(f"m_splits={m_splits!r}: pass a list of {groups} row counts (one per group) summing to T")
    return check_splits(m_splits, tokens)


class GroupedLinear(FP8Module):
    """E linear layers on consecutive row groups of one input, with TransformerEngine's te.GroupedLinear arguments."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: InitMethod | None = None,
        config: ModuleConfig | None = None,
        tp_mesh: DeviceMesh | None = None,
        weight_mesh: DeviceMesh | None = None,
    ) -> None:
        owner = "GroupedLinear"
        if config is not None and config.sequence_parallel and config.tp_size > 1:
            raise ValueError(
                f"{owner} does not take sequence_parallel=True: its rows are routed tokens grouped by m_splits, not "
                "sequence positions split over TP; gather the tokens before the experts and pass "
                "ModuleConfig(sequence_parallel=False)"
            )
        mode = check_parallel_mode(owner, config, ("column", "row", None))
        groups = check_size(owner, "num_gemms", num_gemms)
        in_features = check_size(owner, "in_features", in_features)
        out_features = check_size(owner, "out_features", out_features)
        init = init_method or default_init_method
        weight_shape = (out_features, in_features)
        params = {f"weight{g}": ParamSpec(weight_shape, init, "linear_weight", mode, gemm=g) for g in range(groups)}
        if bias:
            params |= {f"bias{g}": ParamSpec((out_features,), nn.init.zeros_, "linear_bias", mode) for g in range(groups)}
        meshes = {"tp_mesh": tp_mesh, "weight_mesh": weight_mesh}
        super().__init__(params, groups, params_dtype=params_dtype, device=device, config=config, **meshes)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.parallel_mode = mode

    def forward(self, x_TI: Tensor, m_splits: Sequence[int]) -> Tensor:
        """y [..., O] (column: this rank's O/tp): rows m_splits[g] of x (in order) through weight{g} and bias{g}."""
        # forward_param: the local tensors FSDP2 keeps updating when the parameters are DTensors
        weights = [self.forward_param(f"weight{g}") for g in range(self.num_gemms)]
        biases = [self.forward_param(f"bias{g}") for g in range(self.num_gemms)] if self.use_bias else []
        local_in = weights[0].shape[1]  # I, or I/tp when row-parallel
        if not isinstance(x_TI, Tensor) or x_TI.dim() < 1 or x_TI.shape[-1] != local_in:
            got = list(x_TI.shape) if isinstance(x_TI, Tensor) else type(x_TI).__name__
            raise ValueError(f"GroupedLinear takes x [..., {local_in}] (this rank's in-features), got {got}")
        splits = _check_m_splits(m_splits, self.num_gemms, x_TI.numel() // local_in)
        parallel = self.linear_parallelism("weight0")  # every group is split alike
        if parallel is not None and parallel.mode == "column":
            x_TI = parallel.comm.all_reduce_grad(x_TI)  # dx sums what every rank's output features feed back
        row = parallel is not None and parallel.mode == "row"
        y = self._local_groups(x_TI, splits, weights, [] if row else biases)
        if not row:
            return y
        y = parallel.comm.all_reduce(y)  # partial sums over the split in-features
        if not biases:
            return y
        bias_rows = torch.cat([b.expand(m, -1) for b, m in zip(biases, splits, strict=True)])  # once, after the sum
        return y + bias_rows.reshape(y.shape)

    def _local_groups(self, x_TI: Tensor, splits: list[int], weights: list[Tensor], biases: list[Tensor]) -> Tensor:
        """Every group's GEMM on this rank's shards: grouped FP8 GEMMs, or a torch linear per group."""
        out_features = weights[0].shape[0]
        plan = self.fp8_plan(x_TI.device)
        if plan is None:
            x_parts = x_TI.reshape(-1, x_TI.shape[-1]).split(splits)
            parts = [linear(x_parts[g], weights[g], biases[g] if biases else None, None) for g in range(self.num_gemms)]
            return torch.cat(parts).reshape(*x_TI.shape[:-1], out_features)
        recipe_name = type(autocast.fp8_frame().recipe).__name__
        multiple = _SPLIT_MULTIPLE.get(recipe_name)
        if multiple and torch.is_grad_enabled() and any(m % multiple for m in splits):
            raise ValueError(
                f"m_splits={splits}: with gradients, {recipe_name} needs every split to be a multiple of "
                f"{multiple} (its wgrad blocks run along the rows): pad each group's rows"
            )
        return _GroupedFP8Linear.apply(
            x_TI, tuple(splits), plan.gemms, plan.on_backward_done, len(biases) > 0, *weights, *biases
        )  # len(), not bool(): torch 2.11's Dynamo cannot trace bool(list)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, parallel_mode={self.parallel_mode}, tp_size={self.tp_size}"
        )


__all__ = ["GroupedLinear"]

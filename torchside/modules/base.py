"""`FP8Module`: parameters made from specs, FP8 quantizer slots per GEMM operand, DelayedScaling state.

A module declares its parameters as `ParamSpec`s (global shape, init function, role and parallel
mode for the placement table, and for a GEMM weight the index of its GEMM) and how many GEMMs it
runs. The base then

- creates this rank's shard of every parameter on `device` (meta included; the shard shapes and
  `set_device_mesh` come from `torchside.parallel.TensorParallelMixin`) and fills them with
  `reset_parameters()`; under `quantized_model_init` the GEMM weights become FP8 QuantizedTensor
  parameters, every shard scaled by the amax of the whole weight, and no high-precision copy is
  kept (unless asked for);
- holds the DelayedScaling state of every GEMM operand in four fixed-shape fp32 buffers that any
  recipe's state_dict carries as plain tensors (no pickled `_extra_state`, FP8_STATE_BUFFERS):
  `fp8_forward_scale` [2G] and `fp8_forward_amax_history` [amax_history_len, 2G] for the input
  (slot 2g) and weight (slot 2g + 1) of GEMM g, `fp8_backward_scale` [G] and
  `fp8_backward_amax_history` [amax_history_len, G] for its grad_output; and NVFP4's stochastic
  rounding counter `fp8_stochastic_step` [G] (int64), so a resumed run draws the same random bits;
- builds, in each forward, the quantizers of each GEMM from the active fp8_autocast frame, their
  amax groups following the GEMM's tensor-parallel split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fp8kernels.reference import delayed_scaling_update
from twinspec.formats import FORMATS
from torchside import autocast
from torchside.modules.config import ModuleConfig, check_params_dtype
from torchside.modules.functions import BackwardHook, GemmQuantizers, GradAmaxHook, gathers_fp8
from torchside.parallel.module_mesh import (
    TensorParallelMixin,
    group_ranks,
    local_tensor,
    rewrap_like,
)
from torchside.parallel.placements import check_recipe_fits_shard
from torchside.parallel.tp_comm import has_per_tensor_scale
from torchside.quantization import QuantizedTensor, Quantizer
from torchside.quantization.quantizer import nan_as_inf
from torchside.recipe import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, Recipe

# The FP8 scaling state every FP8 module keeps as buffers (plain tensors: checkpoints reshard them).
FP8_STATE_BUFFERS = (
    "fp8_forward_scale",
    "fp8_forward_amax_history",
    "fp8_backward_scale",
    "fp8_backward_amax_history",
    "fp8_stochastic_step",
)


def default_init_method(weight: Tensor) -> None:
    """TransformerEngine's default weight init: normal, mean 0, std 0.023."""
    nn.init.normal_(weight, mean=0.0, std=0.023)


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is made: global shape, in-place init, placement-table key, and the GEMM it feeds."""

    shape: tuple[int, ...]  # global: the constructor allocates this rank's shard of it
    init: Callable[[Tensor], object]
    role: str  # a role of torchside.parallel.placements: "linear_weight", "linear_bias" or "norm"
    parallel_mode: str | None = None  # "column", "row" or None: this parameter's TP split
    gemm: int | None = None  # an index: this is that GEMM's weight operand (FP8 under quantized_model_init)


@dataclass(frozen=True)
class ForwardPlan:
    """One forward's FP8 work: the quantizers of each GEMM and the hook the module's first function calls."""

    gemms: tuple[GemmQuantizers, ...]
    on_backward_done: BackwardHook


def _share_state(quantizer: Quantizer, scale: Tensor, amax_history: Tensor | None) -> Quantizer:
    """Point a DelayedScaling quantizer's state at views of the module buffers.

    Adapter: Quantizer allocates its own state and has no argument for given tensors, so the two
    fields of the frozen dataclass are set here, as its own __post_init__ does.
    """
    object.__setattr__(quantizer, "scale", scale)
    object.__setattr__(quantizer, "amax_history", amax_history)
    return quantizer


def resized_amax_history(history: Tensor, length: int) -> Tensor:
    """An amax history [rows, ...] with `length` rows: row 0 (this step's) and the newest past rows kept.

    The update rolls the history up by one (fp8kernels.reference.delayed_scaling_update), so the past
    steps run oldest to newest from row 1 to the last row: a longer history gets zero rows (no amax
    yet) after row 0, a shorter one drops the oldest rows after row 0.
    """
    rows = history.shape[0]
    if length >= rows:
        return torch.cat([history[:1], history.new_zeros(length - rows, *history.shape[1:]), history[1:]])
    return torch.cat([history[:1], history[rows - length + 1 :]])


def _initial_weight_recipe(recipe: Recipe) -> Recipe:
    # An FP8 parameter is cast once, before any history exists: a DelayedScaling scale of 1 would
    # flush an init of std 0.023 into E4M3 subnormals, so the first cast scales from the weight itself.
    if isinstance(recipe, DelayedScaling):
        return Float8CurrentScaling(fp8_format=recipe.fp8_format)
    return recipe


class FP8Module(TensorParallelMixin, nn.Module):
    """Base of the FP8 modules: see the module docstring."""

    def __init__(
        self,
        params: dict[str, ParamSpec],
        num_gemms: int,
        *,
        params_dtype: torch.dtype | None,
        device: torch.device | str | None,
        config: ModuleConfig | None,
        tp_mesh: DeviceMesh | None = None,
        weight_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.config = ModuleConfig() if config is None else config
        if not isinstance(self.config, ModuleConfig):
            raise TypeError(f"{owner}(config={config!r}): pass a torchside.modules.ModuleConfig or None")
        self._init_tensor_parallel()
        self.params_dtype = check_params_dtype(owner, params_dtype)
        self.num_gemms = num_gemms
        self._param_specs = dict(params)
        self.quantized_init = autocast.model_init()  # the quantized_model_init built under; None: high precision
        self._gemm_weight_names = {spec.gemm: name for name, spec in self._param_specs.items() if spec.gemm is not None}
        self._quantizer_cache: tuple | None = None  # (key, state buffers, quantizers) of the last FP8 forward
        if num_gemms:
            history_len = self.config.amax_history_len or DelayedScaling().amax_history_len  # None: a recipe's, later
            self.register_buffer("fp8_forward_scale", torch.ones(2 * num_gemms, device=device))
            self.register_buffer("fp8_forward_amax_history", torch.zeros(history_len, 2 * num_gemms, device=device))
            self.register_buffer("fp8_backward_scale", torch.ones(num_gemms, device=device))
            self.register_buffer("fp8_backward_amax_history", torch.zeros(history_len, num_gemms, device=device))
            # NVFP4: how many grads each GEMM has rounded stochastically (the seed offset of the next one)
            self.register_buffer("fp8_stochastic_step", torch.zeros(num_gemms, dtype=torch.int64, device=device))
        for name, spec in self._param_specs.items():
            empty = torch.empty(self.tp_local_shape(name, spec), dtype=self.params_dtype, device=device)
            self.register_parameter(name, nn.Parameter(empty))
        if tp_mesh is not None or weight_mesh is not None:
            self.set_device_mesh(tp_mesh, weight_mesh)  # before the FP8 cast, which needs the weight's amax group
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @property
    def builds_fp8_weights(self) -> bool:
        """Whether reset_parameters makes the GEMM weights FP8 (built under quantized_model_init)."""
        return self.quantized_init is not None

    # ---- parameters

    def reset_parameters(self) -> None:
        """Fill every parameter's local shard from its spec (spec order: a seed fixes the values); clear the FP8 state.

        After building on the meta device, call `to_empty(device=...)` first. Each rank fills its own
        shard; runs that must equal a single-device initialization load a seed checkpoint instead.
        """
        for name, spec in self._param_specs.items():
            local = local_tensor(getattr(self, name))
            if local.is_meta:
                raise ValueError(
                    f"{type(self).__name__}.{name} is on the meta device: call module.to_empty(device=...) "
                    "before reset_parameters()"
                )
            if spec.gemm is None or self.quantized_init is None:
                with torch.no_grad():
                    spec.init(local)
                continue
            values = torch.empty(local.shape, dtype=self.params_dtype, device=local.device)
            with torch.no_grad():
                spec.init(values)
            if isinstance(local, QuantizedTensor):
                self.quantize_weight_(name, values)  # in place: FSDP2 keeps the storage of its shard
            else:
                self.register_parameter(name, self._fp8_parameter(name, values))
            if self.quantized_init.preserve_high_precision_init_val:
                getattr(self, name).high_precision_init_val = values.detach().to("cpu", copy=True)
        for name in FP8_STATE_BUFFERS if self.num_gemms else ():
            getattr(self, name).fill_(1.0 if name.endswith("scale") else 0.0)

    def quantize_weight_(self, name: str, values: Tensor) -> None:
        """Cast high-precision values of this rank's shard into FP8 weight `name` in place (e.g. from a master)."""
        owner = type(self).__name__
        local = local_tensor(getattr(self, name))
        if not isinstance(local, QuantizedTensor):
            raise TypeError(f"{owner}.{name} is not an FP8 weight: build the module under quantized_model_init")
        if tuple(values.shape) != tuple(local.shape):
            raise ValueError(f"{owner}.{name}: values of shape {tuple(values.shape)} for a {tuple(local.shape)} shard")
        fp8 = self._weight_quantizer(name).quantize(values.to(local.device, local.dtype))
        with torch.no_grad():
            local.copy_(fp8)

    def _weight_quantizer(self, name: str) -> Quantizer:
        """The quantizer of an FP8 weight: one scale for the whole weight, whichever ranks hold its shards."""
        recipe = _initial_weight_recipe(self.quantized_init.recipe)
        spec = self._param_specs[name]
        check_recipe_fits_shard(recipe, type(self).__name__, name, self.tp_local_shape(name, spec), self.tp_size)
        group = None
        if has_per_tensor_scale(recipe) or isinstance(recipe, NVFP4BlockScaling):  # NVFP4: its global amax
            group = self.weight_shard_group(name)
        return Quantizer(recipe, "weight", rowwise=True, columnwise=True, amax_reduction_group=group)

    def _fp8_parameter(self, name: str, values: Tensor) -> nn.Parameter:
        param = getattr(self, name)
        if isinstance(param, DTensor) and param.device_mesh is not self._tp_mesh:
            raise ValueError(
                f"{type(self).__name__}.{name} was sharded before it became FP8: FSDP2 chooses the FP8 all-gather "
                "at fully_shard, so build the model on the device or use torchside.parallel.parallelize, which "
                "materializes FP8 blocks before sharding them"
            )
        return rewrap_like(param, self._weight_quantizer(name).quantize(values))

    def _load_from_state_dict(self, state_dict, prefix, *args):
        # A checkpoint loads into either kind of weight: quantize high-precision values for an FP8
        # parameter, dequantize FP8 values for a high-precision one (DTensors: DCP's resharding path).
        for name, spec in self._param_specs.items():
            value = state_dict.get(prefix + name)
            param = getattr(self, name)
            if value is None or spec.gemm is None or param.is_meta or isinstance(param, DTensor):
                continue
            if isinstance(param, QuantizedTensor) and not isinstance(value, QuantizedTensor):
                recipe = _initial_weight_recipe(self.quantized_init.recipe)
                state_dict[prefix + name] = Quantizer(recipe, "weight", device=param.device).quantize(
                    value.to(param.device, param.dtype)
                )
            elif isinstance(value, QuantizedTensor) and not isinstance(param, QuantizedTensor):
                state_dict[prefix + name] = value.dequantize(param.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args)

    # ---- FP8 quantizers

    def fp8_plan(self, device: torch.device) -> ForwardPlan | None:
        """The quantizers of this forward's GEMMs under the active fp8_autocast; None when FP8 is off."""
        frame = autocast.fp8_frame()
        if frame is None or not self.num_gemms:
            return None
        recipe = frame.recipe
        compiling = torch.compiler.is_compiling()
        if isinstance(recipe, DelayedScaling) and compiling:
            self._check_compiles_delayed_scaling(recipe, frame.amax_reduction_group)
        if isinstance(recipe, DelayedScaling) and self.config.amax_history_len is None:
            self._fit_amax_histories(recipe.amax_history_len)
        forward_q, backward_q = self._quantizers(recipe, device)
        on_backward_done = None
        grad_amax_hooks = [None] * self.num_gemms
        if isinstance(recipe, DelayedScaling):
            self._check_gathered_scales_agree(recipe, frame.amax_reduction_group)
            # A history of another length than the recipe's (a ModuleConfig length) updates in a sync of its own.
            rows = self.fp8_forward_amax_history.shape[0]
            sync_recipe = recipe if rows == recipe.amax_history_len else replace(recipe, amax_history_len=rows)
            forward_sync, backward_sync = frame.region.syncs(sync_recipe, frame.amax_reduction_group)
            fmax = {role: FORMATS[recipe.fp8_format.for_role(role)].max for role in ("input", "grad")}
            forward_sync.add(self, self.fp8_forward_amax_history, self.fp8_forward_scale, fmax["input"])
            if compiling:  # the region's backward sync is Python state: each GEMM's backward updates its slot
                grad_amax_hooks = [self._grad_state_update(g, sync_recipe, fmax["grad"]) for g in range(self.num_gemms)]
            elif backward_sync.add(self, self.fp8_backward_amax_history, self.fp8_backward_scale, fmax["grad"]):
                on_backward_done = backward_sync.reduce_and_update
        gemms = []
        for g in range(self.num_gemms):
            weight_is_fp8 = isinstance(local_tensor(getattr(self, self._gemm_weight_names[g])), QuantizedTensor)
            weight_q = None if weight_is_fp8 else forward_q[2 * g + 1]  # an FP8 parameter is cast already
            gemms.append(GemmQuantizers(forward_q[2 * g], weight_q, backward_q[g], record_grad_amax=grad_amax_hooks[g]))
        return ForwardPlan(tuple(gemms), on_backward_done)

    def _check_compiles_delayed_scaling(self, recipe: DelayedScaling, group: dist.ProcessGroup | None) -> None:
        """DelayedScaling under torch.compile: the GEMMs record dy's amax through GemmQuantizers.record_grad_amax,
        without an amax group (no all-reduce in the backward graph yet)."""
        owner = type(self).__name__
        if group is not None and recipe.reduce_amax:
            raise NotImplementedError(
                f"{owner} under torch.compile with DelayedScaling and an amax_reduction_group: the grad amaxes "
                "are not all-reduced in the graph yet (docs/compile.md); pass DelayedScaling(reduce_amax=False), "
                "no group, or run eagerly"
            )

    def _grad_state_update(self, slot: int, recipe: DelayedScaling, fmax: float) -> GradAmaxHook:
        """torch.compile's stand-in for the region's backward sync, for GEMM `slot`: record dy's amax in row 0,
        then set the slot's next scale and roll its history, by whole-buffer copies (AOTAutograd takes no
        in-place write to a view of a forward input in the backward graph). The sync's values: it updates each
        slot alone; a module called twice in one region would update twice."""
        history, scale = self.fp8_backward_amax_history, self.fp8_backward_scale

        def record_and_update(amax: Tensor) -> None:
            recorded = torch.cat([torch.maximum(history[:1, slot], nan_as_inf(amax)), history[1:, slot]])
            column, slot_scale = delayed_scaling_update(
                recorded, scale[slot : slot + 1], fmax, margin=recipe.margin, algo=recipe.amax_compute_algo
            )
            history.copy_(torch.cat([history[:, :slot], column[:, None], history[:, slot + 1 :]], dim=1))
            scale.copy_(torch.cat([scale[:slot], slot_scale, scale[slot + 1 :]]))

        return record_and_update

    def _fit_amax_histories(self, length: int) -> None:
        """Give both amax histories `length` rows (the recipe's, as TransformerEngine does), keeping the newest."""
        for name in ("fp8_forward_amax_history", "fp8_backward_amax_history"):
            history = getattr(self, name)
            if history.shape[0] != length:
                self.register_buffer(name, resized_amax_history(history, length))

    def _gathers_fp8(self, gemm: int, recipe: Recipe) -> bool:
        return gathers_fp8(self.linear_parallelism(self._gemm_weight_names[gemm]), recipe)

    def _check_gathered_scales_agree(self, recipe: DelayedScaling, group: dist.ProcessGroup | None) -> None:
        """FP8 bytes gathered over TP need one DelayedScaling scale on every TP rank: the region's amax group."""
        if not any(self._gathers_fp8(g, recipe) for g in range(self.num_gemms)):
            return
        tp_ranks = set(group_ranks(self.tp_comm.group))
        if group is None or not tp_ranks <= set(group_ranks(group)):
            raise ValueError(
                f"{type(self).__name__} all-gathers sequence-parallel activations as FP8 bytes, which needs one "
                f"DelayedScaling scale on TP ranks {sorted(tp_ranks)}: pass fp8_autocast(amax_reduction_group=...) a "
                "group containing them (e.g. dist.group.WORLD), or ModuleConfig(fp8_all_gather=False)"
            )

    def _quantizers(self, recipe: Recipe, device: torch.device) -> tuple[tuple[Quantizer, ...], tuple[Quantizer, ...]]:
        """(forward slots, backward slots), reused while the recipe, usage, groups and state buffers stay the same.

        torch.compile traces them once per compiled graph: there a cache would only add a guard on it, and
        with it a recompile on the second call."""
        columnwise = torch.is_grad_enabled()  # the copies dgrad and wgrad read
        buffers = tuple(getattr(self, name) for name in FP8_STATE_BUFFERS)
        caching = not torch.compiler.is_compiling()  # (an id() while tracing would guard every block apart)
        key = (recipe, torch.device(device), columnwise, id(self.tp_comm)) if caching else None
        cached = self._quantizer_cache if caching else None
        if cached is not None and cached[0] == key and all(a is b for a, b in zip(cached[1], buffers, strict=True)):
            return cached[2]
        forward_q, backward_q = [], []
        for g, name in sorted(self._gemm_weight_names.items()):
            spec = self._param_specs[name]
            check_recipe_fits_shard(recipe, type(self).__name__, name, self.tp_local_shape(name, spec), self.tp_size)
            # Float8CurrentScaling reduces each amax where its tensor is split: the single-device scale.
            groups = self.amax_groups(name) if isinstance(recipe, Float8CurrentScaling) else (None, None, None)
            gathers_fp8 = self._gathers_fp8(g, recipe)
            input_columnwise = columnwise and not gathers_fp8  # else rebuilt after the gather
            # A column GEMM that gathers its input in high precision casts it whole: no amax to reduce.
            input_group = groups[0] if spec.parallel_mode != "column" or gathers_fp8 else None
            forward_q.append(Quantizer(recipe, "input", True, input_columnwise, input_group, device=device))
            forward_q.append(Quantizer(recipe, "weight", True, columnwise, groups[1], device=device))
            backward_q.append(Quantizer(recipe, "grad", amax_reduction_group=groups[2], device=device))
        if isinstance(recipe, DelayedScaling):
            for slot, q in enumerate(forward_q):
                _share_state(q, self.fp8_forward_scale[slot : slot + 1], self.fp8_forward_amax_history[:, slot])
            for slot, q in enumerate(backward_q):  # compiled: the GEMM's record_grad_amax records dy's amax
                history = self.fp8_backward_amax_history[:, slot] if caching else None
                _share_state(q, self.fp8_backward_scale[slot : slot + 1], history)
        for slot, q in enumerate(backward_q):
            if q.stochastic_step is not None:  # the counter lives in a buffer, so a checkpoint resumes it
                object.__setattr__(q, "stochastic_step", self.fp8_stochastic_step[slot : slot + 1])
        quantizers = (tuple(forward_q), tuple(backward_q))
        if caching:
            self._quantizer_cache = (key, buffers, quantizers)
        return quantizers


def high_precision_init_val(param: Tensor) -> Tensor | None:
    """The CPU copy of an FP8 parameter's initial value, kept by preserve_high_precision_init_val=True."""
    return getattr(param, "high_precision_init_val", None)


def clear_high_precision_init_val(param: Tensor) -> None:
    """Drop the CPU copy of an FP8 parameter's initial value."""
    if hasattr(param, "high_precision_init_val"):
        del param.high_precision_init_val


__all__ = [
    "FP8_STATE_BUFFERS",
    "FP8Module",
    "ForwardPlan",
    "ParamSpec",
    "clear_high_precision_init_val",
    "default_init_method",
    "high_precision_init_val",
]

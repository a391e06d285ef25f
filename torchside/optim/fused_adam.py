"""FusedAdam: Adam/AdamW for whole parameter groups in one Triton launch, with master weights,
compressed moments, and DTensor states that DCP can reshard.

State per parameter (for a DTensor parameter: built on its local shard, then wrapped as a DTensor
with the parameter's mesh, placements and global shape, so DCP saves shards, never a global copy):

- `step`: float32 scalar (on the CPU; on the parameter's device when `capturable`).
- `exp_avg`, `exp_avg_sq`: in `exp_avg_dtype` / `exp_avg_sq_dtype` (see `moment_formats`); the
  scaled formats add `exp_avg_scale_inv` / `exp_avg_sq_scale_inv` (per local shard, never saved).
- `master_param` (bf16/fp16 parameters with `master_weights=True`): an fp32 copy, or with
  `store_param_remainders=True` (bf16 only) an int16 remainder: the fp32 master is the parameter's
  16 bits plus these 16 low bits, and the parameter is the master rounded to nearest
  (`fp8kernels.adam_reference` defines the format). Same master, half the memory.
  Quantized (FP8/FP4 `QuantizedTensor`) parameters always keep an fp32 master, and need
  `master_weights=True`: the kernel steps the master, and a hook re-quantizes the parameter from it
  after the step (`torchside.optim.requantize_fp8_weights` registers one per FP8 weight of a model,
  with the weight's own recipe and amax group). A quantized parameter without a hook is refused.

`state_dict()` holds every moment and master as unscaled fp32 (DTensors for DTensor parameters) and
`load_state_dict()` encodes them again, so a checkpoint does not depend on the compression chosen.

Cost: one kernel launch per parameter group and kind (see `fp8kernels.adam`); launch tables are built
once and reused. Scaled moments (fp16, E4M3) save memory between steps, not time: each step decodes
them to fp32 for the kernel and re-encodes them after, in torch ops. A found_inf from a grad scaler
costs one host sync unless `capturable`, where step counts and bias corrections stay on the device.
"""

from __future__ import annotations

from collections import OrderedDict  # RemovableHandle needs a weak-referenceable dict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fp8kernels.adam import MultiTensorAdam
from fp8kernels.adam_reference import join_master, split_master
from torchside.optim import moment_formats
from torchside.quantization import QuantizedTensor

_MOMENTS = ("exp_avg", "exp_avg_sq")
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class _Entry:
    """One parameter in a step: the parameter, the local tensors the kernel updates, its grad, its state.

    `local` is the parameter's local shard, or for a quantized parameter its fp32 master's (then
    `master` is None: the kernel has no separate master to write).
    """

    param: torch.Tensor
    local: torch.Tensor
    master: torch.Tensor | None
    grad: torch.Tensor
    state: dict[str, Any]


class FusedAdam(torch.optim.Optimizer):
    """Adam (L2) or AdamW (`adam_w_mode`, the default) over fp32, bf16, fp16 and quantized parameters (or DTensors)."""

    # torch.amp.GradScaler then hands over `grad_scale` and `found_inf` instead of unscaling grads itself.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adam_w_mode: bool = True,
        master_weights: bool = False,
        store_param_remainders: bool = False,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        capturable: bool = False,
    ):
        moment_formats.check_moment_dtype(exp_avg_dtype, "exp_avg_dtype")
        moment_formats.check_moment_dtype(exp_avg_sq_dtype, "exp_avg_sq_dtype")
        if store_param_remainders and not master_weights:
            raise ValueError("store_param_remainders=True keeps master weights as remainders: set master_weights=True")
        scaled = [d for d in (exp_avg_dtype, exp_avg_sq_dtype) if moment_formats.is_scaled(d)]
        if capturable and (store_param_remainders or scaled):
            raise ValueError(
                "capturable=True supports fp32 masters with float32 or bfloat16 moments; "
                f"got store_param_remainders={store_param_remainders}, scaled moments {scaled}"
            )
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self._scaled_moments = bool(scaled)
        self.master_weights, self.store_param_remainders = master_weights, store_param_remainders
        self.capturable = capturable
        self._launchers: dict[tuple[int, int], MultiTensorAdam] = {}
        self._after_step_hooks: OrderedDict[int, tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = OrderedDict()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, checking its hyperparameters."""
        super().add_param_group(param_group)
        _check_hyperparameters(self.param_groups[-1])

    def register_after_step_hook(self, param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """Call `hook(param)` after every step that updates `param`.

        The extension point for parameters the kernel does not write itself: a quantized parameter
        needs one that re-quantizes it from `state[param]["master_param"]` (see the module docstring).
        """
        handle = RemovableHandle(self._after_step_hooks)
        self._after_step_hooks[handle.id] = (param, hook)
        return handle

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        inv_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """One step; grads are multiplied by `inv_scale`, and a nonzero `found_inf` skips the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inv_scale, found_inf = self._grad_scaler_inputs(inv_scale, found_inf)
        if found_inf is not None and not self.capturable:
            if found_inf.item() != 0:  # one host sync, as GradScaler's own check costs
                return loss
            found_inf = None
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group, inv_scale, found_inf)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state with unscaled fp32 moments and masters (DTensors for DTensor parameters)."""
        state_dict = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        state_dict["state"] = {index: self._exported_state(params[index]) for index in state_dict["state"]}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyperparameters and fp32 states, re-encoding moments in this optimizer's dtypes."""
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        saved_ids = [saved_id for group in saved_groups for saved_id in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            if saved_id in saved_state:
                self._load_param_state(param, saved_state[saved_id])
        self._launchers.clear()

    # ---- step ----

    def _grad_scaler_inputs(self, inv_scale, found_inf):
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        if grad_scale is not None:
            if inv_scale is not None:
                raise ValueError("pass inv_scale or step through a GradScaler, not both")
            inv_scale = grad_scale.double().reciprocal()
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        return _as_scalar(inv_scale), _as_scalar(found_inf)

    def _step_group(self, index: int, group: dict[str, Any], inv_scale, found_inf) -> None:
        hooked = {id(param) for param, _ in self._after_step_hooks.values()}
        entries = [self._entry(p, hooked) for p in group["params"] if p.grad is not None]
        if not entries:
            return
        steps = [entry.state["step"] for entry in entries]
        torch._foreach_add_(steps, 1.0 if found_inf is None else 1.0 - found_inf)
        beta1, beta2 = group["betas"]
        hyperparameters = dict(
            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            adam_w_mode=group["adam_w_mode"], inv_scale=inv_scale, found_inf=found_inf,
        )  # fmt: skip
        for ordinal, (step, part) in enumerate(self._by_step(entries)):
            live = [entry for entry in part if entry.local.numel() > 0]  # empty FSDP shards: nothing to do
            if not live:
                continue
            moments = {name: [self._kernel_moment(e.state, name) for e in live] for name in _MOMENTS}
            masters = [e.master for e in live]
            locals_ = [e.local for e in live]
            launcher = self._launchers.get((index, ordinal))
            if launcher is None or not launcher.matches(locals_, *moments.values(), masters):
                launcher = MultiTensorAdam(locals_, *moments.values(), masters)
                if not self._scaled_moments:  # their fp32 copies are new every step: keep no tables to them
                    self._launchers[(index, ordinal)] = launcher
            lr = group["lr"] if self.capturable else float(group["lr"])
            launcher.step([e.grad for e in live], lr=lr, step=step, **hyperparameters)
            for name in _MOMENTS:
                if moment_formats.is_scaled(self.moment_dtypes[name]):
                    for entry, values in zip(live, moments[name]):
                        state = entry.state
                        scale_inv, root = state[f"{name}_scale_inv"], name == "exp_avg_sq"
                        moment_formats.encode_into(self._local(state[name]), scale_inv, values, root=root)
        self._run_after_step_hooks(entries)

    def _by_step(self, entries: list[_Entry]) -> list[tuple[float | torch.Tensor, list[_Entry]]]:
        """Entries grouped by step count (they differ when some parameters skipped steps without a grad)."""
        if self.capturable:  # counts stay on the device; a CUDA-graphed group steps every parameter alike
            return [(entries[0].state["step"], entries)]
        parts: dict[float, list[_Entry]] = {}
        for entry in entries:
            parts.setdefault(entry.state["step"].item(), []).append(entry)
        return sorted(parts.items(), key=lambda item: item[0])

    def _entry(self, param: torch.Tensor, hooked: set[int]) -> _Entry:
        """Check a parameter with a grad, unwrap DTensors to local shards, create its state if new."""
        grad = param.grad
        if isinstance(param, DTensor) != isinstance(grad, DTensor):
            raise TypeError(
                f"a parameter is a {type(param).__name__} but its grad a {type(grad).__name__}: DTensor and plain "
                "tensors cannot be mixed for one parameter; shard the grad like the parameter (FSDP2 does)"
            )
        if isinstance(param, DTensor) and (grad.device_mesh, grad.placements) != (param.device_mesh, param.placements):
            raise ValueError(
                f"a grad has placements {grad.placements}, its parameter {param.placements}: "
                "redistribute the grad to the parameter's placements before the step"
            )
        local, local_grad = self._local(param), self._local(grad)
        quantized = isinstance(local, QuantizedTensor)
        if quantized:
            self._check_quantized(param, hooked)
        elif type(local) not in (torch.Tensor, torch.nn.Parameter) or local.dtype not in _PARAM_DTYPES:
            raise TypeError(
                f"FusedAdam updates float32, bfloat16, float16 and QuantizedTensor parameters, not a "
                f"{type(local).__name__} of {local.dtype}"
            )
        if not local.is_contiguous() or local_grad.is_sparse or local_grad.shape != local.shape:
            raise ValueError(
                f"FusedAdam needs contiguous parameters and dense grads of the same shape; got a parameter "
                f"{tuple(local.shape)} (contiguous={local.is_contiguous()}) and a grad {tuple(local_grad.shape)}"
            )
        state = self.state[param]
        if not state:
            self._init_state(param, local)
        master = self._local(state["master_param"]) if "master_param" in state else None
        if quantized:  # the kernel steps the fp32 master; the after-step hook re-quantizes the parameter
            local, master = master, None
        return _Entry(param, local, master, local_grad.to(local.dtype).contiguous(), state)

    def _check_quantized(self, param: torch.Tensor, hooked: set[int]) -> None:
        """A quantized parameter trains on an fp32 master and is re-quantized by its hook: both must exist."""
        if not self.master_weights:
            raise ValueError(
                "a QuantizedTensor parameter is updated through an fp32 master copy: build FusedAdam with "
                "master_weights=True"
            )
        if id(param) not in hooked:
            raise ValueError(
                f"a QuantizedTensor parameter of shape {tuple(param.shape)} has no after-step hook to re-quantize "
                "it from its master: call torchside.optim.requantize_fp8_weights(optimizer, model) (or "
                "register_after_step_hook) before the first step"
            )

    def _kernel_moment(self, state: dict[str, Any], name: str) -> torch.Tensor:
        """The tensor the kernel updates: the stored moment, or an fp32 copy of a scaled one."""
        stored = self._local(state[name])
        if moment_formats.is_scaled(stored.dtype):
            return moment_formats.decode(stored, state[f"{name}_scale_inv"], root=name == "exp_avg_sq")
        return stored

    def _run_after_step_hooks(self, entries: list[_Entry]) -> None:
        stepped = {id(entry.param) for entry in entries}
        for param, hook in list(self._after_step_hooks.values()):
            if id(param) in stepped:
                hook(param)

    # ---- state ----

    def _init_state(self, param: torch.Tensor, local: torch.Tensor) -> None:
        state = self.state[param]
        state["step"] = torch.zeros((), dtype=torch.float32, device=local.device if self.capturable else "cpu")
        for name in _MOMENTS:
            self._set_moment(param, name, torch.zeros(local.shape, dtype=torch.float32, device=local.device))
        if self._keeps_master(local):
            self._set_master(param, local, _values(local))

    def _set_moment(self, param: torch.Tensor, name: str, values: torch.Tensor) -> None:
        stored, scale_inv = moment_formats.encode(values, self.moment_dtypes[name], root=name == "exp_avg_sq")
        self.state[param][name] = _like_param(param, stored)
        if scale_inv is not None:
            self.state[param][f"{name}_scale_inv"] = scale_inv

    def _set_master(self, param: torch.Tensor, local: torch.Tensor, master: torch.Tensor) -> None:
        if self.store_param_remainders and not isinstance(local, QuantizedTensor):
            high, low = split_master(master)
            local.copy_(high)  # the master is the truth: the parameter is its rounding
            master = low
        self.state[param]["master_param"] = _like_param(param, master)

    def _keeps_master(self, local: torch.Tensor) -> bool:
        """fp32 parameters are their own master; bf16/fp16 and quantized ones get one when master_weights=True."""
        if isinstance(local, QuantizedTensor):
            return True  # always an fp32 master: remainders need the parameter's own 16 high bits
        if not self.master_weights or local.dtype == torch.float32:
            return False
        if self.store_param_remainders and local.dtype != torch.bfloat16:
            raise TypeError(f"store_param_remainders=True needs bfloat16 parameters, got {local.dtype}")
        return True

    def _exported_state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        exported = {"step": state["step"]}
        for name in _MOMENTS:
            values = self._kernel_moment(state, name).float()
            exported[name] = _like_param(param, values)
        if "master_param" in state:
            master = self._local(state["master_param"])
            if master.dtype == torch.int16:
                master = join_master(self._local(param), master)
            exported["master_param"] = _like_param(param, master)
        return exported

    def _load_param_state(self, param: torch.Tensor, saved: dict[str, Any]) -> None:
        local = self._local(param)
        state = self.state[param]
        step_device = local.device if self.capturable else "cpu"
        state["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().to(step_device)
        for name in _MOMENTS:
            self._set_moment(param, name, self._saved_local(param, saved[name], name))
        if self._keeps_master(local):
            saved_master = saved.get("master_param")  # absent when saved without master weights
            master = _values(local) if saved_master is None else self._saved_local(param, saved_master, "master_param")
            self._set_master(param, local, master)

    def _saved_local(self, param: torch.Tensor, value: torch.Tensor, name: str) -> torch.Tensor:
        """A saved state's local fp32 values, checked against the parameter's sharding."""
        if isinstance(param, DTensor) != isinstance(value, DTensor):
            raise TypeError(
                f"state '{name}' is a {type(value).__name__} but its parameter a {type(param).__name__}: "
                "DTensor and plain tensors cannot be mixed; load through torch.distributed.checkpoint"
            )
        if isinstance(value, DTensor):
            if (value.device_mesh, value.placements, value.shape) != (param.device_mesh, param.placements, param.shape):
                raise ValueError(
                    f"state '{name}' is sharded {value.placements} with shape {tuple(value.shape)}, its parameter "
                    f"{param.placements} {tuple(param.shape)}: reshard it (torch.distributed.checkpoint does)"
                )
        local = self._local(value)
        if local.shape != self._local(param).shape:
            raise ValueError(f"state '{name}' has shape {tuple(local.shape)}, its parameter {tuple(param.shape)}")
        return local.to(device=self._local(param).device, dtype=torch.float32)

    @staticmethod
    def _local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _values(local: torch.Tensor) -> torch.Tensor:
    """A parameter's local values as a new fp32 tensor (a quantized one dequantized)."""
    if isinstance(local, QuantizedTensor):
        return local.dequantize(torch.float32)
    return local.float()


def _as_scalar(value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.detach().reshape(()).to(torch.float32)


def _like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a state of `param`: a DTensor with the parameter's mesh, placements and global shape."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )


def _check_hyperparameters(group: dict[str, Any]) -> None:
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"a tensor lr must hold one value, got shape {tuple(lr.shape)}")
    if float(lr) < 0:
        raise ValueError(f"lr must be >= 0, got {float(lr)}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {group['betas']}")
    if eps < 0 or weight_decay < 0:
        raise ValueError(f"eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")

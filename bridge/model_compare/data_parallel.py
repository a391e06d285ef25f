"""`bridge.compare(..., mesh="dp=2")`: the comparison in co-located data-parallel processes (bridge.runtime).

A model we did not write cannot be split by us (its tensor-parallel layout is its author's), but any
model can run data-parallel: in each of dp processes (one torch rank and one JAX process on the same
device) both factories build the model, torch's parameters are broadcast from rank 0 (JAX takes them
as before), and each rank compares on its rows of the inputs (dim 0 split over the ranks; `batch_dim`
for verify's [S, B, H] stacks):
- every submodule's inputs, outputs and input gradients are local: each rank checks its own and the
  relative errors are summed over ranks (bridge.numerics.local_stats / reduce_stats, as verify does);
- weight gradients are summed over the ranks by each framework's own collective: torch's all-reduce
  over its process group (what DDP does), and a jitted sum over a JAX mesh of the same devices (XLA's
  all-reduce), so every rank holds each side's full-batch gradient; their bounds add the rounding of
  that sum of dp terms. The Adam steps then run on those gradients on every rank alike;
- under an FP8 recipe each rank's casts see its own rows on both sides, and the noise-aware verdict
  gathers every rank's rows (its row tests are over the whole batch).
Tensor parallelism (tp > 1) is a ValueError: verify the torchside/jaxside stacks on a TP mesh with
`shardbridge verify --model mlp|transformer --mesh dp=2,tp=2`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bridge.numerics import FP32_U, rounding_error
from twinspec.mesh import MeshShape, parse_mesh


@dataclass(frozen=True)
class DataParallel:
    """This process's place among `size` data-parallel ranks, and each framework's sum over them."""

    size: int
    rank: int
    jax_mesh: Any  # a 1-D JAX mesh ("dp",) of every process's device, rank r's device at r
    batch_dim: int = 0  # the inputs' dim split over the ranks

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.chunk(self.size, dim=self.batch_dim)[self.rank].contiguous()

    def torch_sum(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        total = x.detach().clone()
        dist.all_reduce(total)
        return total

    def jax_sum(self, x: np.ndarray) -> np.ndarray:
        """The sum of every rank's `x`, by a JAX program over the mesh (XLA's all-reduce)."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = NamedSharding(self.jax_mesh, PartitionSpec("dp"))
        local = jax.device_put(np.asarray(x)[None], jax.local_devices()[0])
        stacked = jax.make_array_from_single_device_arrays((self.size, *np.shape(x)), sharding, [local])
        total = _summed(NamedSharding(self.jax_mesh, PartitionSpec()))(stacked)
        return np.array(total.addressable_data(0))  # a copy: torch.from_numpy wants a writable array

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the batch dim (the whole batch), on every rank."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=self.batch_dim)

    def sum_error(self, elements: int) -> float:
        """The relative rounding of a sum of `size` partial gradients, as two orders may take it (bridge.numerics)."""
        return rounding_error(self.size, elements, FP32_U, positive=False)


def summed_torch_grads(run, dp: DataParallel | None):
    """A bridge.model_compare.torch_run.TorchRun whose weight gradients are summed over the ranks by torch."""
    if dp is not None:
        run.grads = {name: dp.torch_sum(grad) for name, grad in run.grads.items()}
    return run


def summed_jax_grads(jax_result, dp: DataParallel | None):
    """(outputs, param grads, arg grads) of a JAX call with the param grads summed over the ranks by JAX."""
    if dp is None:
        return jax_result
    outputs, param_grads, arg_grads = jax_result
    return outputs, {path: dp.jax_sum(grad) for path, grad in param_grads.items()}, arg_grads


@functools.lru_cache(maxsize=8)
def _summed(out_sharding):
    import jax

    return jax.jit(lambda a: a.sum(0), out_shardings=out_sharding)


def data_parallel_size(mesh: str | MeshShape) -> int:
    """The number of data-parallel processes of `mesh`; ValueError for a tensor-parallel one (module docstring)."""
    shape = parse_mesh(mesh) if isinstance(mesh, str) else mesh
    if not isinstance(shape, MeshShape):
        raise TypeError(f"mesh={mesh!r}: pass a mesh like 'dp=2' (twinspec.mesh.parse_mesh) or a MeshShape")
    if shape.tp > 1:
        raise ValueError(
            f"mesh {mesh!r}: bridge.compare runs your models data-parallel only (the batch split over dp, parameters "
            "replicated); tensor parallelism needs models built from torchside/jaxside modules: verify those with "
            "`shardbridge verify --model mlp|transformer --mesh dp=2,tp=2`, or pass a mesh without tp"
        )
    return shape.data_parallel_size


def load_factory(option: str, spec: str) -> Callable[[], Any]:
    """The function `spec` ("pkg.module:function") names; ValueError naming the option and the fix."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"{option} {spec}: write PKG.MODULE:FACTORY, e.g. mymodels.block:build")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        reason = f"cannot import {module_name} ({error})"
        raise ValueError(f"{option} {spec}: {reason}; check the name and PYTHONPATH") from error
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ValueError(f"{option} {spec}: {module_name} has no function {function_name!r}")
    return factory


def load_model_factory(name: str, value: Any) -> Callable[[], Any]:
    """A zero-argument model factory given as "package.module:function" or a module-level function."""
    if isinstance(value, str):
        return load_factory(name, value)
    qualified = getattr(value, "__qualname__", "")
    if not callable(value) or "<" in qualified or getattr(value, "__module__", None) is None:
        raise TypeError(
            f"{name}: with mesh=, pass a factory the worker processes can import ('package.module:function' or a "
            f"module-level function returning the model), not {value!r}"
        )
    return value


def rank_of(runtime, batch_dim: int = 0) -> DataParallel:
    """This runtime's process as one rank of a data-parallel mesh of all its processes, splitting `batch_dim`."""
    from torch.distributed.device_mesh import init_device_mesh

    from bridge.runtime import jax_mesh

    world = init_device_mesh(runtime.device_type, (runtime.world_size,), mesh_dim_names=("dp",))
    return DataParallel(runtime.world_size, runtime.rank, jax_mesh(world), batch_dim)


def worker(runtime, factories: tuple[Any, Any], inputs: tuple[torch.Tensor, ...], options: dict) -> Any:
    """One rank: build both models, broadcast torch's parameters, compare on this rank's rows (module docstring)."""
    import torch.distributed as dist

    from bridge.model_compare.core import compare_here

    torch.manual_seed(0)
    torch_model = load_model_factory("torch_model", factories[0])()
    jax_model = load_model_factory("jax_model", factories[1])()
    torch_model.to(runtime.torch_device)
    with torch.no_grad():
        for tensor in [*torch_model.parameters(), *torch_model.buffers()]:
            dist.broadcast(tensor, src=0)
    dp = rank_of(runtime)
    local = tuple(dp.rows(x).to(runtime.torch_device) for x in inputs)
    return compare_here(torch_model, jax_model, local, dp=dp, **options)


__all__ = [
    "DataParallel",
    "data_parallel_size",
    "load_factory",
    "load_model_factory",
    "rank_of",
    "summed_jax_grads",
    "summed_torch_grads",
    "worker",
]

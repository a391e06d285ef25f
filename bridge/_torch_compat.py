"""torch's private APIs the bridge reads, in one place.

- Everything torchside.parallel._torch_compat wraps (`_StridedShard`, ...) is forwarded, loaded on
  first use: bridge.layout and friends name `_torch_compat.<helper>` at call time, so that importing
  them (the CLI's startup, JAX-only layout questions) does not load torch.
- `fake_store`: the store of torch's "fake" process group (its testing module registers the backend),
  which `shardbridge plan` joins as rank 0 of a whole mesh without starting the other ranks.
- `fsdp_unit`: what FSDP2 keeps private about one fully_shard unit (reshard after forward, the
  all-gather and reduce dtypes), which `shardbridge plan` prices the collectives of.
Both exist alike in torch 2.11 and 2.13.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def __getattr__(name: str) -> Any:
    from torchside.parallel import _torch_compat

    return getattr(_torch_compat, name)


def fake_store():
    """A store for `init_process_group("fake", ...)` (importing it registers the "fake" backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@dataclass(frozen=True)
class FSDPUnit:
    """One fully_shard unit as FSDP2 runs it: its parameters, and whether and how it communicates."""

    params: tuple[Any, ...]  # the sharded parameters it gathers (DTensors)
    reshard_after_forward: bool  # gathered again in backward
    param_dtype: Any  # torch.dtype all-gathered (None: each parameter's own)
    reduce_dtype: Any  # torch.dtype reduce-scattered (None: the all-gather dtype)


def fsdp_unit(module) -> FSDPUnit | None:
    """The unit `fully_shard(module)` made, or None when it manages no parameter."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return None
    policy = group.mp_policy
    params = tuple(fsdp_param.sharded_param for fsdp_param in group.fsdp_params)
    return FSDPUnit(params, group.post_forward_mesh_info is not None, policy.param_dtype, policy.reduce_dtype)

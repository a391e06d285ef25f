"""torchside.parallel._torch_compat (the project's one wrapper of torch's private `_StridedShard`), loaded on first use.

A forwarder, not a second copy: bridge.layout and friends name `_torch_compat.<helper>` at call time,
so that importing them (the CLI's startup, JAX-only layout questions) does not load torch.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from torchside.parallel import _torch_compat

    return getattr(_torch_compat, name)

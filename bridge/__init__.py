"""Where torchside and jaxside meet: layouts, weight transfer, numerics cross-checks, CLI.

`bridge.compare(torch_model, jax_model, inputs)` checks your own pair of models (bridge/model_compare/);
it loads on first use, so `import bridge` stays cheap.
"""

from typing import Any

_LAZY = {"compare": "bridge.model_compare", "CompareReport": "bridge.model_compare"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'bridge' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)

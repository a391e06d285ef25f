"""Shared by the shard-map tests (test_layout, test_layout_live, test_layout_cli): the golden maps,
value checks and the Hypothesis strategy of torch placements."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from bridge import layout
from bridge._torch_compat import make_strided_shard
from bridge.layout import MeshSpec, ShardMap

GOLDEN_DIR = Path(__file__).parents[1] / "assets" / "shardmaps"
GOLDEN_NAMES = sorted(path.stem for path in GOLDEN_DIR.glob("*.json"))


def load_golden(name: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{name}.json").read_text())


def arange_global(shape: tuple[int, ...]) -> np.ndarray:
    """Every element carries its own flat index, so a shard's values say where it came from."""
    return np.arange(math.prod(shape), dtype=np.float64).reshape(shape)


def assert_same(left: ShardMap, right: ShardMap) -> None:
    comparison = layout.compare(left, right)
    assert comparison.equal, comparison.reason


@st.composite
def placement_cases(draw, mesh: MeshSpec, partial: bool = True) -> tuple[tuple, tuple[int, ...]]:
    """(placements, global shape): Shard/_StridedShard/Replicate/Partial, dims divisible or not."""
    sizes = st.one_of(st.integers(1, 12), st.sampled_from([8, 16, 24]))
    shape = tuple(draw(sizes) for _ in range(draw(st.integers(1, 2))))
    # Weighted so that sharded and strided cases dominate; Partial alone is answered with an error.
    kinds = ["replicate"] * 2 + ["shard"] * 3 + ["strided"] * 3 + (["partial"] if partial else [])
    placements = []
    for mesh_dim in range(mesh.ndim):
        kind = draw(st.sampled_from(kinds))
        dim = draw(st.integers(0, len(shape) - 1))
        if kind == "shard":
            placements.append(Shard(dim))
        elif kind == "strided":
            # Often the factor FSDP2 uses (the later axes' sizes), sometimes one no mesh axis explains.
            later = math.prod(mesh.shape[mesh_dim + 1 :])
            placements.append(make_strided_shard(dim, draw(st.sampled_from(sorted({2, 3, 4, max(later, 2)})))))
        elif kind == "partial":
            placements.append(Partial())
        else:
            placements.append(Replicate())
    return tuple(placements), shape

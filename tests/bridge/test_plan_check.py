"""`verify --model llama --plan`'s checks on one process: they pass on the model, and its unsharded check fails
when the sharded torch model holds other values than the unsharded one.

The runs on 4 and 8 processes, under each example plan, are in tests/bridge/test_verify_cli.py (grid);
that the twin's logits check fails on other values: tests/bridge/test_verify_hf.py.
"""

from __future__ import annotations

import pytest

from bridge import plan_check
from twinspec.mesh import MeshShape
from twinspec.plan import Plan

# The embedding split by hidden columns: on one rank a no-op split, but the plan's code path on both sides.
PLAN = Plan.from_dict({"rule": [{"match": "embedding", "tp": "hidden"}]})


@pytest.fixture
def runtime(one_rank_world, monkeypatch):
    """One co-located process, as bridge.runtime starts it: here JAX has 8 host devices in this one process, so
    its mesh is the world fixture's (the first device) instead of the runtime's device of process 0."""
    import jax

    from bridge import runtime

    monkeypatch.setattr(runtime, "jax_mesh", lambda device_mesh: one_rank_world[1])
    return runtime.Runtime(rank=0, local_rank=0, world_size=1, device_type="cpu", jax_device=jax.devices()[0])


def _stages(report: dict) -> dict[str, bool]:
    stages: dict[str, bool] = {}
    for check in report["checks"]:
        stages[check["stage"]] = stages.get(check["stage"], True) and check["passed"]
    return stages


def test_the_checks_pass_and_the_unsharded_one_sees_other_values(runtime, reference_kernels, monkeypatch):
    from torchside.models import llama_parallel

    case = plan_check.PlanCase(PLAN, MeshShape(), ("off",), batch_size=2, seq_len=16)
    (report,) = plan_check.verify_plan(runtime, case)
    assert _stages(report) == {"layout": True, "forward": True, "unsharded": True}

    load = llama_parallel.load_full_state

    def load_other_values(model, full):  # one weight of layer 1's down projection moves by 0.05 (values ~0.01)
        full = dict(full)
        full["layers.1.layernorm_mlp.fc2_weight"] = full["layers.1.layernorm_mlp.fc2_weight"].clone()
        full["layers.1.layernorm_mlp.fc2_weight"][0, 0] += 0.05
        load(model, full)

    monkeypatch.setattr(llama_parallel, "load_full_state", load_other_values)
    (report,) = plan_check.verify_plan(runtime, case)
    # the twin takes the torch model's values: only the unsharded model differs from it
    assert _stages(report) == {"layout": True, "forward": True, "unsharded": False}
    unsharded = next(c for c in report["checks"] if c["stage"] == "unsharded")
    assert unsharded["relative"] > unsharded["tolerance"]["relative"]

"""`python -m torchside.train --compile`: each TransformerLayer compiled (fullgraph=True) trains like eager.

A run is `torchside.train.train` itself, eager and with `compile=True`, from the same seed. The compiled runs use
the "aot_eager" backend: Dynamo and AOTAutograd trace each block's forward and backward into graphs of aten ops
and our custom ops (fp8kernels.ops), as for Inductor, and run those ops eagerly: the same kernels as the eager
run, so the loss curves must be equal bit for bit, step after step (Adam at lr 1e-2 turns any gradient
difference into a loss difference at the next step). Each compiled run must also have compiled exactly one
graph: every block and every step reuse it (a block compiled apart, a recompile, or a silent fall-back to eager
once Dynamo's cache limit is hit would show here).

On CPU processes (gloo): FSDP2 over dp_shard=2 with current scaling and TP=2 with FP8 off, in one spawn of two
ranks; the grid adds the other recipe of each, TP with sequence parallelism and FSDP2 x TP on four ranks.
Inductor (its own fused kernels: not bitwise) is in the grid, with the bound it meets.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.distributed import run_processes
from torchside.train import TrainOptions, build_model, parse_args, train

RUN = {"config": "tiny", "steps": 3, "batch_size": 4, "seq_len": 16, "lr": 1e-2, "warmup_steps": 2,
       "log_every": 1, "progress": False}  # fmt: skip
MESHES = {
    "fsdp2": {"dp": 2},
    "tp2": {"tp": 2},
    "tp2sp": {"tp": 2, "sequence_parallel": True},
    "fsdp2xtp2": {"dp": 2, "tp": 2},
}
FAST_MESH_CASES = [("fsdp2", "current"), ("tp2", "off")]  # CI: one spawn of two ranks
GRID_MESH_CASES = [("fsdp2", "off"), ("tp2", "current"), ("tp2sp", "current"), ("fsdp2xtp2", "off"),
                   ("fsdp2xtp2", "current")]  # fmt: skip


def _eager_and_compiled(
    recipe: str, backend: str = "aot_eager", mode: str = "default", **options
) -> tuple[list[float], list[float], int]:
    """(eager losses, compiled losses, graphs the compiled run made), one Dynamo cache per call; `options`: both
    runs' other TrainOptions (the mesh, the device)."""
    torch._dynamo.reset()
    counters.clear()
    eager = train(TrainOptions(**RUN, recipe=recipe, **options)).losses
    compiling = {"compile": True, "compile_backend": backend, "compile_mode": mode}
    compiled = train(TrainOptions(**RUN, recipe=recipe, **compiling, **options)).losses
    return eager, compiled, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--compile-mode", "reduce-overhead"], "add --compile"),
        (["--compile-backend", "aot_eager"], "add --compile"),
        (["--compile", "--compile-mode", "fast"], "compile_mode='fast'"),
        (["--compile", "--compile-backend", "aot_eager", "--compile-mode", "reduce-overhead"], "inductor's"),
        (["--compile", "--compile-mode", "reduce-overhead", "--cuda-graphs", "--device", "cuda"], "captures each"),
    ],
)
def test_bad_compile_flags_exit_with_the_reason(flags, match, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert match in capsys.readouterr().err


def test_compile_flags_reach_the_options():
    options = parse_args(["--compile", "--compile-mode", "max-autotune-no-cudagraphs"])
    assert (options.compile, options.compile_mode, options.compile_backend) == (True, "max-autotune-no-cudagraphs",
                                                                                "inductor")  # fmt: skip


def test_compiled_blocks_keep_the_model_and_its_names():
    """Compiled in place, not wrapped: the layers and state-dict keys (checkpoints, placement plans) of eager."""
    eager, _ = build_model(TrainOptions(**RUN))
    compiled, _ = build_model(TrainOptions(**RUN, compile=True))
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert all(type(block) is type(eager.layers[0]) for block in compiled.layers)


@pytest.mark.parametrize("recipe", ["off", "current"])
def test_a_compiled_run_equals_the_eager_run_bitwise(recipe, reference_kernels):
    eager, compiled, graphs = _eager_and_compiled(recipe)
    assert compiled == eager
    assert graphs == 1


@pytest.mark.grid
@pytest.mark.parametrize("recipe", ["delayed", "block", "mxfp8"])
def test_a_compiled_run_of_every_recipe_equals_the_eager_run_bitwise(recipe, reference_kernels):
    eager, compiled, graphs = _eager_and_compiled(recipe)
    assert compiled == eager
    # DelayedScaling: the first block of an fp8_autocast region creates the region's amax sync, the next ones
    # find it (a guard on that dict, torchside/autocast.py Region.syncs): one graph for each, whatever the depth.
    assert graphs == (2 if recipe == "delayed" else 1)


@pytest.mark.grid
@pytest.mark.parametrize("recipe", ["off", "current"])
def test_an_inductor_run_stays_within_fp32_reordering_of_the_eager_run(recipe, reference_kernels):
    """Inductor fuses the ops between our custom ops (residual adds, rotary, softmax, SwiGLU) into its own
    kernels, which round and sum in another order: measured, the losses equal eager's at steps 0 and 1 and differ
    by 1.7e-7 relative (2 fp32 ulps) at step 2. Bound: 1e-6 for the first step (the same weights), 1e-5 for the
    curve, still 700x below one step's change of the loss (7e-3 here), which a wrong gradient would show."""
    eager, compiled, graphs = _eager_and_compiled(recipe, backend="inductor")
    assert compiled[0] == pytest.approx(eager[0], rel=1e-6, abs=0)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=0)
    assert graphs == 1


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["off", "current"])
def test_reduce_overhead_captures_every_compiled_block_in_cuda_graphs(recipe):
    """--compile-mode reduce-overhead: Inductor's CUDA graphs take each block's forward and backward, none
    skipped (a host read, a CPU tensor or a mutated input would skip one: counted by Inductor, as it counts
    the CPU graphs it does not capture). The losses: Inductor's kernels against eager's, as on the CPU (fp32 sums
    reordered, 2e-7 there), with room for the GPU's reductions; one step changes the loss by 7e-3."""
    with sdpa_kernel(SDPBackend.MATH):  # flash attention's backward sums with atomics: eager would not repeat
        eager, compiled, graphs = _eager_and_compiled(recipe, "inductor", "reduce-overhead", device="cuda")
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert graphs == 1
    assert compiled == pytest.approx(eager, rel=1e-4, abs=0)


# ---- FSDP2 and TP on CPU processes


def _gloo_mesh_cases(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    """{(mesh, recipe): (eager losses, compiled losses, graphs)} of every case, on this group's ranks."""
    from fp8kernels._backend import Backend, backend_for

    assert backend_for("cpu") is Backend.REFERENCE  # TRITON_INTERPRET=0, set before the spawn
    return {(mesh, recipe): _eager_and_compiled(recipe, **MESHES[mesh]) for mesh, recipe in cases}


def _run_on_processes(cases: list[tuple[str, str]], world_size: int) -> dict:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        return run_processes(_gloo_mesh_cases, world_size, cases, timeout=600)[0]


@functools.cache
def _grid_run(mesh: str, recipe: str) -> tuple[list[float], list[float], int]:
    """One grid case on its own spawn of ranks (cached: two tests read the TP ones)."""
    ranks = MESHES[mesh].get("dp", 1) * MESHES[mesh].get("tp", 1)
    return _run_on_processes([(mesh, recipe)], ranks)[mesh, recipe]


@pytest.fixture(scope="module")
def fast_mesh_runs():
    """Both FAST_MESH_CASES, eager and compiled, on one spawn of two ranks (rank 0's results)."""
    return _run_on_processes(FAST_MESH_CASES, 2)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("mesh, recipe", FAST_MESH_CASES)
def test_a_compiled_run_on_a_mesh_equals_the_eager_run_bitwise(mesh, recipe, fast_mesh_runs):
    """FSDP2 (compile each block, then fully_shard) and TP (DTensor parameters inside the graph; the first
    block's input an AsyncCollectiveTensor from the embedding's all-reduce, see setup._waiting_for_collectives)."""
    eager, compiled, graphs = fast_mesh_runs[mesh, recipe]
    assert compiled == eager
    assert graphs == 1


@pytest.mark.grid
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh, recipe", GRID_MESH_CASES)
def test_a_compiled_run_on_every_mesh_equals_the_eager_run_bitwise(mesh, recipe):
    eager, compiled, _ = _grid_run(mesh, recipe)
    assert compiled == eager


@pytest.mark.grid
@pytest.mark.multiprocess
def test_tp_with_current_scaling_compiles_one_graph_for_every_block():
    assert _grid_run("tp2", "current")[2] == 1

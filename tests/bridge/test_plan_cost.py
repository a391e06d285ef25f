"""`bridge.plan.cost` against the live model: allocations after a real step, collectives a real step runs.

Each case builds the model on torch's threaded process group (every rank a thread: FSDP2, DTensor
and our TP collectives run for real), trains one step, and compares the prediction of rank 0's
`price` with what each rank holds and what each rank sent:

- memory: the local bytes of every parameter, gradient and optimizer state tensor;
- communication (forward and backward; the optimizer step must send nothing, or with FP8 weights
  only their amax all-reduces, which are not priced): every call into the threaded process group's collectives (FSDP2's c10d calls,
  DTensor's functional collectives and tp_comm's calls all end there), by the mesh axis of the
  group, with the bytes of the collective's whole buffer (module docstring of bridge.plan.cost).
"""

from __future__ import annotations

import threading
from typing import Self

import pytest
import torch
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

from bridge.plan import build, cost
from tests.distributed import run_threads
from twinspec.mesh import parse_mesh

pytestmark = pytest.mark.usefixtures("reference_kernels")  # tests/conftest.py: what threaded ranks run

# method of the threaded group -> (collective, index of the argument holding the whole buffer)
_COLLECTIVES = {
    "allgather": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "_allgather_base": ("all_gather", 0),
    "all_gather_single_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    # Not predicted for a step: any call fails the comparison.
    "broadcast": ("broadcast", 0),
    "scatter": ("scatter", 0),
    "gather": ("gather", 0),
    "alltoall": ("all_to_all", 0),
    "all_to_all_single": ("all_to_all", 0),
}


class CollectiveCounter:
    """Records, per rank thread that asked for it, (group, collective, bytes) of every threaded-group call.

    The threaded group's own wrappers (all_gather_single chunks its output and calls allgather) run
    inside the call being counted: only the outermost call of a thread counts.
    """

    def __init__(self) -> None:
        self.calls: dict[int, list[tuple[int, str, int]]] = {}
        self._recording: dict[int, int] = {}  # thread id -> rank
        self._inside: set[int] = set()  # threads inside a counted call: only the outermost one counts
        self._originals: dict[str, object] = {}

    def __enter__(self) -> Self:
        for method, (kind, argument) in _COLLECTIVES.items():
            original = getattr(ProcessLocalGroup, method, None)
            if original is None:  # not in this torch release
                continue
            self._originals[method] = original
            setattr(ProcessLocalGroup, method, self._wrap(original, kind, argument))
        return self

    def __exit__(self, *exc) -> None:
        for method, original in self._originals.items():
            setattr(ProcessLocalGroup, method, original)

    def _wrap(self, original, kind: str, argument: int):
        counter = self

        def counted(group, *args, **kwargs):
            thread = threading.get_ident()
            rank = counter._recording.get(thread)
            if rank is None or thread in counter._inside:  # wrappers (all_gather_single...) call the base ones
                return original(group, *args, **kwargs)
            counter.calls[rank].append((id(group), kind, _nbytes(args[argument])))
            counter._inside.add(thread)
            try:
                return original(group, *args, **kwargs)
            finally:
                counter._inside.discard(thread)

        return counted

    def record(self, rank: int):
        """A context for the rank's thread: its calls are recorded inside it."""
        counter = self

        class _Recording:
            def __enter__(self):
                counter.calls[rank] = []
                counter._recording[threading.get_ident()] = rank

            def __exit__(self, *exc):
                del counter._recording[threading.get_ident()]

        return _Recording()


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    return sum(_nbytes(v) for v in value)


def _local_nbytes(tensor) -> int:
    """Bytes a rank holds of a tensor: a DTensor's local shard, an FP8 tensor's buffers."""
    from torchside.parallel.module_mesh import local_tensor

    local = local_tensor(tensor)
    storage = getattr(local, "quantized_storage", None)
    if storage is not None:
        return sum(t.nbytes for t in storage.buffers().values())
    return local.nbytes


def _forward_backward(built: build.BuiltModel) -> None:
    """Forward and backward of the model's training, on this rank's part of a seeded batch."""
    options, meshes = built.options, built.meshes
    generator = torch.Generator().manual_seed(7)
    if options.model == "llama":
        from torchside.train import loss_of

        vocab = built.model.config.vocab_size
        tokens = torch.randint(0, vocab, (options.batch, options.seq + 1), generator=generator)
        tokens = tokens.chunk(meshes.data_parallel_size)[meshes.data_parallel_rank()]
        loss_of(built.model, tokens[:, :-1], tokens[:, 1:], None, None, options.batch * options.seq)
    else:
        shape = (options.seq, options.batch, options.hidden)
        x, dy = (torch.randn(shape, generator=generator) for _ in range(2))
        dp_rank = meshes.data_parallel_rank() if meshes.world is not None else 0
        x, dy = (t.chunk(options.mesh.data_parallel_size, dim=1)[dp_rank] for t in (x, dy))
        if options.sequence_parallel:  # this TP rank's tokens
            tp_rank = meshes.world.get_coordinate()[2]
            x, dy = (t.chunk(options.mesh.tp, dim=0)[tp_rank] for t in (x, dy))
        x = x.contiguous().requires_grad_()
        y, _ = built.model(x)
        y.backward(dy.contiguous())


def _measure(rank, world_size, options, counter, plan):
    import warnings

    warnings.filterwarnings("ignore", message="DTensor random operators")
    built = build.build(options, plan=plan)
    predicted = cost.price(built) if rank == 0 else None
    axis_of = {id(built.meshes.world[name].get_group()): name for name in built.meshes.world.mesh_dim_names}
    with counter.record(rank):
        _forward_backward(built)
    sent = _by_axis(counter.calls[rank], axis_of)
    with counter.record(rank):
        built.optimizer.step()
    stepped = _by_axis(counter.calls[rank], axis_of)
    params = list(built.model.parameters())
    held = {
        "parameters": sum(_local_nbytes(p) for p in params),
        "gradients": sum(_local_nbytes(p.grad) for p in params),
        "optimizer": sum(_local_nbytes(t) for p in params for t in built.optimizer.state[p].values()),
    }
    return predicted, held, sent, stepped


def _by_axis(calls, axis_of) -> dict[tuple[str, str], tuple[int, int]]:
    """(mesh axis, collective) -> (calls, bytes)."""
    sent: dict[tuple[str, str], tuple[int, int]] = {}
    for group, kind, size in calls:
        key = (axis_of.get(group, f"group {group}"), kind)
        calls, total = sent.get(key, (0, 0))
        sent[key] = (calls + 1, total + size)
    return sent


def _run(options: build.PlanOptions, plan=None):
    with CollectiveCounter() as counter:
        results = run_threads(_measure, options.mesh.world_size, options, counter, plan)
    return results[0][0], *([r[i] for r in results] for i in (1, 2, 3))


# Llama without TP: torch's loss_parallel swaps DTensor's global op handlers, which threaded ranks race on.
MEMORY_CASES = {
    "transformer fp32, FSDP x TP": build.PlanOptions("transformer", parse_mesh("dp=2,tp=2"), layers=1, hidden=64),
    "transformer FP8 weights (current scaling), FSDP x TP": build.PlanOptions(
        "transformer", parse_mesh("dp=2,tp=2"), layers=1, hidden=64, fp8_params="current"
    ),
    "llama bf16, masters, fp16/e4m3 moments, HSDP": build.PlanOptions(
        "llama", parse_mesh("rep=2,dp=2"), dtype="bf16", exp_avg_dtype="fp16", exp_avg_sq_dtype="e4m3", batch=4, seq=8
    ),
}


@pytest.mark.parametrize("options", MEMORY_CASES.values(), ids=MEMORY_CASES.keys())
def test_bytes_per_rank_equal_the_live_allocations(options):
    predicted, held, _, _ = _run(options)
    memory = predicted.memory()
    for rank, live in enumerate(held):
        assert {kind: memory[kind][rank] for kind in cost.MEMORY_KINDS} == live, f"rank {rank}"


COMM_CASES = {
    "FSDP x TP": build.PlanOptions("transformer", parse_mesh("dp=2,tp=2"), layers=2, hidden=64, batch=4, seq=8),
    "FSDP x TP, FP8 weights (current scaling)": build.PlanOptions(
        "transformer", parse_mesh("dp=2,tp=2"), layers=1, hidden=64, batch=4, seq=8, fp8_params="current"
    ),
    "HSDP x TP, sequence parallel": build.PlanOptions(
        "transformer", parse_mesh("rep=2,dp=2,tp=2"), layers=2, hidden=64, batch=4, seq=8, sequence_parallel=True
    ),
}


@pytest.mark.parametrize("options", COMM_CASES.values(), ids=COMM_CASES.keys())
def test_step_collectives_equal_what_the_process_group_ran(options):
    _check_collectives(options)


@pytest.fixture
def loss_parallel_on_threads(monkeypatch):
    """torch's loss_parallel installs DTensor's (global) cross-entropy handlers on entry and removes them on
    exit, which rank threads race on (KeyError): install them once for the test, their swaps no-ops."""
    from torch.distributed.tensor.parallel import loss

    loss._enable_custom_loss_ops()
    monkeypatch.setattr(loss, "_enable_custom_loss_ops", lambda: None)
    monkeypatch.setattr(loss, "_disable_custom_loss_ops", lambda: None)
    yield
    monkeypatch.undo()
    loss._disable_custom_loss_ops()


LLAMA_COMM_CASES = {
    "TP": build.PlanOptions("llama", parse_mesh("tp=2"), batch=2, seq=8),
    "FSDP x TP, sequence parallel, bf16": build.PlanOptions(
        "llama", parse_mesh("dp=2,tp=2"), dtype="bf16", batch=4, seq=8, sequence_parallel=True
    ),
}


@pytest.mark.usefixtures("loss_parallel_on_threads")
@pytest.mark.parametrize("options", LLAMA_COMM_CASES.values(), ids=LLAMA_COMM_CASES.keys())
def test_llama_step_collectives_equal_what_the_process_group_ran(options):
    """With the vocabulary-split embedding and head and loss_parallel's cross entropy around the layers."""
    _check_collectives(options)


def _check_collectives(options) -> None:
    predicted, _, sent, stepped = _run(options)
    expected = predicted.communication.totals()
    assert expected, "the case must communicate"
    for rank, ran in enumerate(sent):
        assert ran == expected, f"rank {rank}"
    if options.fp8_params is None:  # FusedAdam works on local shards; FP8 weights all-reduce amaxes (not priced)
        assert stepped == [{}] * options.mesh.world_size


def test_a_plan_is_priced_as_it_places_and_communicates():
    """Attention replicated over tp, FSDP on dim 1 of the MLP's down projection, blocks kept gathered after
    forward: bytes and collectives."""
    from twinspec.plan import Plan

    plan = Plan.from_dict(
        {
            "rule": [
                {"match": "layers.*.self_attention", "tp": "replicate"},
                {"match": "layers.*.layernorm_mlp.fc2_weight", "fsdp_dim": 1},
                {"match": "layers.*", "reshard_after_forward": False},
            ]
        }
    )
    options = build.PlanOptions("transformer", parse_mesh("dp=2,tp=2"), layers=2, hidden=64, batch=4, seq=8)
    predicted, held, sent, _ = _run(options, plan)
    fc2 = next(p for p in predicted.parameters if p.name == "layers.0.layernorm_mlp.fc2_weight")
    assert fc2.placements == "Replicate(), _StridedShard(1, sf=2), Shard(1)" and fc2.same_layout
    expected = predicted.communication.totals()
    assert expected[("dp_shard", "all_gather")][0] == 2  # forward only: no block reshards after it
    assert expected[("tp", "all_reduce")][0] == 2 * 2  # the MLP's two GEMMs per block; attention is not split
    memory = predicted.memory()
    for rank in range(options.mesh.world_size):
        assert {kind: memory[kind][rank] for kind in cost.MEMORY_KINDS} == held[rank], f"rank {rank}"
        assert sent[rank] == expected, f"rank {rank}"

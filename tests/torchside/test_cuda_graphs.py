"""The CUDA-graphed training step (torchside.train.GraphedTrainStep, torchside.cuda_graphs).

CPU (no capture possible): the step's work, run eagerly with the graph's static buffers, reads no device
value on the host for any recipe (what a capture forbids: a replay would reuse the value read at capture),
keeps its grads in place (FusedAdam's launch tables hold their addresses), and trains like train_step.
GPU (`-m gpu`): a graphed run equals the eager run of the same step bit for bit over 20 steps, for every
recipe: losses, grad norms, parameters, optimizer state and FP8 state (scales, amax histories, NVFP4's
stochastic-rounding counter, which must advance on every replay).
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from torchside.corpus import SyntheticCorpus
from torchside.cuda_graphs import CapturedCall, CaptureError
from torchside.models.llama import LLAMA_CONFIGS
from torchside.recipe import recipe_from_name
from torchside.train import GraphedTrainStep, TrainOptions, build_model, build_optimizer, train_step

# What a host read of a device value dispatches to (.item(), int(t), float(t), bool(t), .tolist()).
HOST_READS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero, torch.ops.aten.item}


class HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's value on the host, with where it was called."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READS:
            self.seen.append(f"{func} at\n" + "".join(traceback.format_stack(limit=8)[:-1]))
        return func(*args, **(kwargs or {}))


def _setup(recipe: str, device: str, *, capture: bool, dtype: str = "bf16", **overrides):
    options = TrainOptions(
        config="tiny", steps=20, batch_size=4, seq_len=32, recipe=recipe, dtype=dtype, device=device,
        warmup_steps=5, progress=False, **overrides,
    )  # fmt: skip
    model, _ = build_model(options)
    optimizer = build_optimizer(model, options, capturable=True)
    corpus = SyntheticCorpus(LLAMA_CONFIGS[options.config].vocab_size, seed=options.seed)
    step = GraphedTrainStep(model, optimizer, corpus, options, recipe_from_name(recipe), capture=capture)
    return options, model, optimizer, corpus, step


@pytest.mark.parametrize("recipe", ["off", "delayed", "current", "block", "nvfp4"])
def test_the_graphed_step_reads_no_device_value_on_the_host(recipe, reference_kernels):
    *_, model, _, _, step = _setup(recipe, "cpu", capture=False)
    step(0)  # the first step creates state (optimizer moments, quantizer caches): done before a capture too
    grads = [p.grad for p in model.parameters()]
    with HostReads() as reads:
        step(1)
        step(2)
    assert not reads.seen, "host reads of device values in the step:\n" + "\n".join(reads.seen[:3])
    assert all(p.grad is g for p, g in zip(model.parameters(), grads)), "the grads must stay in place"
    if recipe == "nvfp4":  # the counter advanced on the device, once per stochastically rounded cast
        counters = [b for name, b in model.named_buffers() if name.endswith("fp8_stochastic_step")]
        assert all(torch.equal(c, torch.full_like(c, 3)) for c in counters), counters


def test_the_graphed_steps_work_trains_like_train_step(reference_kernels):
    options, model, _, corpus, step = _setup("delayed", "cpu", capture=False, dtype="fp32")
    _, reference_model, reference_optimizer, _, _ = _setup("delayed", "cpu", capture=False, dtype="fp32")
    recipe = recipe_from_name("delayed")
    for i in range(4):
        _, loss, grad_norm = step(i)
        reference_model.zero_grad(set_to_none=True)
        _, expected_loss, expected_norm = train_step(
            reference_model, reference_optimizer, corpus, options, None, recipe, i
        )
        if i == 0:  # the same parameters and batch: the same forward, to the bit
            assert torch.equal(loss, expected_loss) and torch.equal(grad_norm, expected_norm)
        # later steps: the lr as an fp32 device scalar instead of a Python float rounds a little differently
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for ours, theirs in zip(model.state_dict().values(), reference_model.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_captured_call_needs_cuda_and_runs_eagerly_without_capture():
    calls = []
    eager = CapturedCall(lambda: calls.append(len(calls)) or len(calls), capture=False)
    assert [eager() for _ in range(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="warmup_calls"):
        CapturedCall(lambda: None, warmup_calls=0, capture=False)
    if not torch.cuda.is_available():
        with pytest.raises(CaptureError, match="need a CUDA device"):
            CapturedCall(lambda: None)


def test_options_refuse_cuda_graphs_off_one_cuda_device():
    with pytest.raises(ValueError, match="one CUDA device"):
        TrainOptions(cuda_graphs=True)  # the CPU
    with pytest.raises(ValueError, match="one CUDA device"):
        TrainOptions(cuda_graphs=True, device="cuda", dp=2, batch_size=8)
    options = TrainOptions()
    model, _ = build_model(options)
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedTrainStep(model, build_optimizer(model, options), None, options, None, capture=False)


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer (the FP8 state) and optimizer state tensor, by name."""
    tensors = {f"model.{name}": t for name, t in model.state_dict().items()}
    names = {p: name for name, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        tensors.update({f"optimizer.{names[p]}.{key}": value for key, value in state.items()})
    return tensors


def _differences(run, reference) -> list[str]:
    """What differs between two runs' (losses, grad norms, state), bit for bit: the first step, the tensor names."""
    (losses, norms, state), (expected_losses, expected_norms, expected_state) = run, reference
    found = [f"loss at step {i}: {a.item()!r} vs {b.item()!r}"
             for i, (a, b) in enumerate(zip(losses, expected_losses)) if not torch.equal(a, b)][:1]  # fmt: skip
    found += [f"grad norm at step {i}" for i, (a, b) in enumerate(zip(norms, expected_norms)) if not torch.equal(a, b)][:1]
    if state.keys() != expected_state.keys():
        return [*found, f"state names {sorted(state.keys() ^ expected_state.keys())}"]
    differing = [name for name in state if not torch.equal(state[name], expected_state[name])]
    return found + ([f"{len(differing)} tensors, e.g. {differing[:4]}"] if differing else [])


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["off", "delayed", "current", "block", "mxfp8", "nvfp4"])
def test_a_graphed_step_equals_the_eager_step_bit_for_bit(recipe):
    runs = {}
    # SDPA's math backend: flash attention's backward sums dQ with atomics, so two eager runs could differ
    with sdpa_kernel(SDPBackend.MATH):
        for name, capture in (("eager", False), ("eager again", False), ("graphed", True)):
            options, model, optimizer, _, step = _setup(recipe, "cuda", capture=capture, cuda_graphs=True)
            records = [step(i) for i in range(options.steps)]
            torch.cuda.synchronize()
            assert (step.call.graph is not None) == capture
            runs[name] = ([r[1] for r in records], [r[2] for r in records], _state(model, optimizer))
    # the eager run must repeat itself, or no graph could match it (a failure here is not the graph's)
    assert _differences(runs["eager again"], runs["eager"]) == [], "two eager runs differ"
    assert _differences(runs["graphed"], runs["eager"]) == [], "the graphed run differs from the eager run"
    losses, _, state = runs["graphed"]
    assert losses[-1] < losses[0], "the graphed run must train"
    if recipe == "nvfp4":  # advanced by every replay: 20 steps, the counter read once per grad cast
        counters = [t for name, t in state.items() if name.endswith("fp8_stochastic_step")]
        assert all(bool((c == options.steps).all()) for c in counters), counters
    if recipe == "delayed":  # the histories rolled inside the graph: each step's amaxes moved to the end
        histories = [t for name, t in state.items() if name.endswith("amax_history")]
        assert all(bool((h[-options.steps :] > 0).all()) and not h[: -options.steps].any() for h in histories)

"""One eager training step: this rank's batch, the loss and its backward, clipping, the optimizer."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchside.autocast import fp8_autocast
from torchside.corpus import SyntheticCorpus
from torchside.models.llama import Llama
from torchside.models.llama_parallel import LlamaMeshes, sum_data_parallel_gradients
from torchside.optim import FusedAdam
from torchside.recipe import Recipe
from torchside.train.options import TrainOptions, learning_rate


def host_tokens(corpus: SyntheticCorpus, options: TrainOptions, meshes: LlamaMeshes | None, step: int):
    """This rank's data-parallel rows of batch `step` [b, S + 1] on the host (pinned for a CUDA device)."""
    tokens = corpus.batch(step, options.batch_size, options.seq_len)
    if meshes is not None:
        tokens = tokens.chunk(meshes.data_parallel_size)[meshes.data_parallel_rank()]
    if torch.device(options.device).type == "cuda":
        tokens = tokens.pin_memory()  # an asynchronous copy: the host runs ahead of the GPU
    return tokens


def local_batch(corpus: SyntheticCorpus, options: TrainOptions, meshes: LlamaMeshes | None, step: int):
    """(inputs [b, S], targets [b, S]) of this rank's data-parallel rows of batch `step`, on the device."""
    tokens = host_tokens(corpus, options, meshes, step).to(options.device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(
    model: Llama, inputs_BS, targets_BS, recipe: Recipe | None, amax_group, global_tokens: int
) -> torch.Tensor:
    """This rank's tokens' next-token cross entropy (fp32) over the global batch's `global_tokens`; backward done.

    Summed over the data-parallel ranks (as FSDP2 sums their gradients, see llama_parallel), it is the
    global mean. A vocab-split logits DTensor goes through torch's loss_parallel (no all-gather of V).
    """
    with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=amax_group):
        logits_SBV = model(inputs_BS)
    vocab_split = isinstance(logits_SBV, DTensor)
    with loss_parallel() if vocab_split else contextlib.nullcontext():
        token_losses = F.cross_entropy(logits_SBV.flatten(0, 1).float(), targets_BS.t().flatten(), reduction="sum")
        loss = token_losses / global_tokens
        loss.backward()
    return loss.to_local() if vocab_split else loss


def train_step(
    model: Llama,
    optimizer: FusedAdam,
    corpus: SyntheticCorpus,
    options: TrainOptions,
    meshes: LlamaMeshes | None,
    recipe: Recipe | None,
    step: int,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Step `step` on its batch: (lr, this rank's part of the loss, global gradient norm), on the device.

    The amax group is the world: every rank casts with the single-device run's scales.
    """
    lr = learning_rate(options, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    inputs, targets = local_batch(corpus, options, meshes, step)
    amax_group = dist.group.WORLD if dist.is_initialized() else None
    loss = loss_of(model, inputs, targets, recipe, amax_group, options.batch_size * options.seq_len)
    sum_data_parallel_gradients(model, meshes)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip or math.inf)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, loss, grad_norm

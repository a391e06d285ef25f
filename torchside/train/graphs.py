"""The whole training step captured in a CUDA graph and replayed (`--cuda-graphs`)."""

from __future__ import annotations

import math

import torch

from torchside.corpus import SyntheticCorpus
from torchside.cuda_graphs import CapturedCall
from torchside.models.llama import Llama
from torchside.optim import FusedAdam
from torchside.recipe import Recipe
from torchside.train.options import TrainOptions, learning_rate
from torchside.train.step import host_tokens, loss_of


class GraphedTrainStep:
    """train_step on one device, captured in a CUDA graph after 3 eager warm-up steps (`--cuda-graphs`).

    Static state the graph reads: the token buffer (refilled per step by an asynchronous copy), the
    learning rate (a device scalar in every param group: FusedAdam must be `capturable`) and the grads,
    allocated once and zeroed in place at the start of each step (backward then accumulates into them),
    because FusedAdam's launch tables hold their addresses. The FP8 state (DelayedScaling scales and amax
    histories, rolled by torch ops at the regions' ends) updates inside the graph. `capture=False` runs the
    same work eagerly: the reference a graphed run equals bit for bit. A call returns (lr, loss, grad norm)
    like train_step, the tensors copied out of the graph's static outputs.
    """

    def __init__(
        self,
        model: Llama,
        optimizer: FusedAdam,
        corpus: SyntheticCorpus,
        options: TrainOptions,
        recipe: Recipe | None,
        *,
        capture: bool = True,
    ) -> None:
        if not optimizer.capturable:
            raise ValueError("GraphedTrainStep needs FusedAdam(capturable=True): the step count and lr stay on the device")
        device = torch.device(options.device)
        self.model, self.optimizer, self.corpus, self.options, self.recipe = model, optimizer, corpus, options, recipe
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.device.type != device.type:
                raise ValueError(f"GraphedTrainStep: a parameter is on {p.device}, the step on {device}: move the model")
            p.grad = torch.zeros_like(p)
        self.grads = [p.grad for p in self.params]
        self.tokens = torch.zeros(options.batch_size, options.seq_len + 1, dtype=torch.long, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        self.call = CapturedCall(self._step, capture=capture)

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        torch._foreach_zero_(self.grads)
        global_tokens = self.options.batch_size * self.options.seq_len
        loss = loss_of(self.model, self.tokens[:, :-1], self.tokens[:, 1:], self.recipe, None, global_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.options.clip or math.inf)
        self.optimizer.step()
        return loss.detach(), grad_norm

    def __call__(self, step: int) -> tuple[float, torch.Tensor, torch.Tensor]:
        lr = learning_rate(self.options, step)
        self.lr.fill_(lr)
        self.tokens.copy_(host_tokens(self.corpus, self.options, None, step), non_blocking=True)
        loss, grad_norm = self.call()
        if any(grad is not p.grad for grad, p in zip(self.grads, self.params, strict=True)):
            raise RuntimeError("GraphedTrainStep: a parameter's .grad was replaced; the graph writes the old one")
        return lr, loss.clone(), grad_norm.clone()

"""Train the Llama-style model on the synthetic corpus: `python -m torchside.train --config tiny --steps 100`.

One process per device; several through torchrun, e.g. FSDP 2 x TP 2 on 4 GPUs:

    torchrun --nproc-per-node 4 -m torchside.train --config 125m --dp 2 --tp 2 --recipe current --out runs/a

The mesh is (replicate, dp, tp) (axes named torchside.parallel.MESH_AXES, as JAX's) and must hold the
launcher's world size. Every rank builds batch `step` of the corpus (a pure function of the seed and
the step) and keeps its data-parallel rows; the model starts from one seeded single-device
initialization, whatever the mesh; each step is `train_step` (the demo's too). Output in
`--out`: `losses.jsonl` (one JSON object per step: step, loss, lr, grad_norm) and `losses.png`;
a summary (final loss, tokens/s, non-finite losses) as one JSON line on stdout. With
`--checkpoint-dir`, an async DCP checkpoint every `--checkpoint-every` steps; `--resume` continues
from the latest one, on any mesh: the steps before it stay in the log, the later ones are redone.

Losses are copied to the host once per `--log-every` steps, so that the GPU is never waited on.

`--cuda-graphs` (one CUDA device): after 3 eager warm-up steps the whole step (forward, backward, FP8
scale and amax-history updates, gradient clipping, FusedAdam with the learning rate and step counts on the
device) is captured once in a CUDA graph and replayed; see `GraphedTrainStep` and torchside.cuda_graphs.

`--compile`: each TransformerLayer's forward is compiled by torch.compile (fullgraph=True), before FSDP2 shards
it, as torchtitan does; `--compile-mode` (e.g. reduce-overhead) and `--compile-backend` (inductor; aot_eager to
run the traced graphs' ops eagerly) are torch.compile's. See `setup.compile_blocks` and docs/compile.md.

One job per module: `options` (TrainOptions, TrainSummary, the schedule), `setup` (process group,
model, optimizer), `step` (one eager step), `graphs` (GraphedTrainStep), `checkpointing`, `report`
(the log and the plot), `loop` (`train`) and `cli` (`parse_args`, `main`; `__main__` runs it).
"""

from torchside.train.cli import main, parse_args
from torchside.train.graphs import GraphedTrainStep
from torchside.train.loop import train
from torchside.train.options import COMPILE_MODES, DTYPES, TrainOptions, TrainSummary, learning_rate
from torchside.train.report import LOG_NAME, PLOT_NAME, LossLog, plot_loss_curves
from torchside.train.setup import build_model, build_optimizer
from torchside.train.step import local_batch, loss_of, train_step

__all__ = [
    "COMPILE_MODES",
    "DTYPES",
    "LOG_NAME",
    "PLOT_NAME",
    "GraphedTrainStep",
    "LossLog",
    "TrainOptions",
    "TrainSummary",
    "build_model",
    "build_optimizer",
    "learning_rate",
    "local_batch",
    "loss_of",
    "main",
    "parse_args",
    "plot_loss_curves",
    "train",
    "train_step",
]

"""Every FP8 GEMM of one Llama training step, checked against the pure-torch spec on the same operands.

Wraps the modules' `scaled_mm` for one step (forward + backward) of torchside.train's model and
recipe and, for each call, recomputes `fp8kernels.gemm_reference.scaled_mm` (dequantize, fp32 matmul)
from the very operands the module passed. Prints one line per GEMM shape and provider: calls,
non-finite outputs, worst relative error against the spec, and non-finite values in the operands'
scale_inv (a broken scale, not a broken GEMM). Use it when a recipe's loss or gradient goes NaN.

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/diagnose/check_step_gemms.py --recipe block [--config 125m]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from benchmarks.harness import environment_line
from bridge.numerics import relative_error
import torchside.modules.functions as functions
from fp8kernels import gemm, gemm_reference
from torchside.corpus import SyntheticCorpus
from torchside.models.llama import LLAMA_CONFIGS
from torchside.recipe import recipe_from_name
from torchside.train import TrainOptions, build_model, local_batch, loss_of


def _nonfinite(t: torch.Tensor | None) -> int:
    return 0 if t is None else int((~torch.isfinite(t.float())).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="block")
    parser.add_argument("--config", default="125m")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    print(f"# check_step_gemms, {environment_line()}")
    options = TrainOptions(config=args.config, batch_size=8, seq_len=512, recipe=args.recipe, dtype="bf16",
                           device=args.device)  # fmt: skip
    model, _ = build_model(options)
    rows: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0, 0, 0])  # calls, nonfinite out, worst err, bad scales
    order: list[tuple] = []
    original = functions.scaled_mm

    def checked(a, b, *, a_columnwise=False, b_columnwise=False, out_dtype=torch.bfloat16, bias=None):
        out = original(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias)
        spec = gemm_reference.scaled_mm(
            a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=torch.float32, bias=bias
        )
        a_op, b_op = gemm_reference.gemm_operand(a, a_columnwise, "a"), gemm_reference.gemm_operand(b, b_columnwise, "b")
        path = gemm.cuda_path(a_op, b_op, out_dtype, bias) if out.is_cuda else "interpreter"
        key = (a_op.scheme, a_columnwise, b_columnwise, a_op.rows, b_op.rows, a_op.k,
               path)  # fmt: skip
        if key not in rows:
            order.append(key)
        error = relative_error(out, spec)
        row = rows[key]
        row[0] += 1
        row[1] += _nonfinite(out)
        row[2] = max(row[2], error) if error == error else float("nan")
        row[3] += _nonfinite(a_op.scale_inv) + _nonfinite(b_op.scale_inv)
        row[4] += _nonfinite(spec)
        return out

    functions.scaled_mm = checked
    corpus = SyntheticCorpus(LLAMA_CONFIGS[options.config].vocab_size, seed=0)
    inputs, targets = local_batch(corpus, options, None, 0)
    loss = loss_of(model, inputs, targets, recipe_from_name(args.recipe), None, options.batch_size * options.seq_len)
    functions.scaled_mm = original
    bad_grads = [n for n, p in model.named_parameters() if p.grad is not None and _nonfinite(p.grad)]
    print(f"recipe {args.recipe}, config {args.config}: loss {loss.item():.4f}; parameters with non-finite grads: "
          f"{len(bad_grads)} {bad_grads[:6]}")  # fmt: skip
    print(f"{'A scheme':14} {'a_col':>5} {'b_col':>5} {'M':>6} {'N':>6} {'K':>6} {'provider':17} {'calls':>5} "
          f"{'nonfinite':>9} {'spec nf':>7} {'bad scales':>10} {'rel err':>9}")  # fmt: skip
    for key in order:
        calls, nonfinite, error, bad_scales, spec_nf = rows[key]
        scheme, a_col, b_col, m, n, k, provider = key
        print(f"{scheme:14} {a_col!s:>5} {b_col!s:>5} {m:6d} {n:6d} {k:6d} {provider:17} {calls:5d} {nonfinite:9d} "
              f"{spec_nf:7d} {bad_scales:10d} {error:9.2e}")  # fmt: skip


if __name__ == "__main__":
    main()

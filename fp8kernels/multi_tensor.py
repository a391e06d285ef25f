"""Launch tables for multi-tensor kernels: one launch reaches many tensors through their addresses.

- `addresses` (int64 [n_operands + 1, n_tensors]): row r holds the address of every tensor's r-th
  operand (0 where a tensor has none); the last row holds the element counts.
- `chunks` (int32 [2, n_chunks]): every (tensor index, chunk index) pair. Program i of a flat grid
  handles chunk i: `block` contiguous elements of one tensor, so big and small tensors mix freely.

A kernel turns an address into a typed pointer with `address.to(tl.pointer_type(...))`.
"""

from __future__ import annotations

import torch

ALIGNMENT = 16  # bytes: what a 128-bit load or store needs


def aligned(tensors: list[torch.Tensor | None]) -> bool:
    """True when every tensor starts on a 16-byte boundary (None counts as aligned)."""
    return all(t is None or t.data_ptr() % ALIGNMENT == 0 for t in tensors)


class TensorTable:
    """The address and chunk tables of one launch, built once; an operand row can be re-pointed."""

    def __init__(self, operands: list[list[torch.Tensor | None]], block: int):
        """`operands[r][i]` is tensor i's r-th operand; element counts come from `operands[0]`."""
        first = operands[0]
        table = torch.zeros((len(operands) + 1, len(first)), dtype=torch.int64)
        for row, tensors in enumerate(operands):
            table[row] = torch.tensor([0 if t is None else t.data_ptr() for t in tensors], dtype=torch.int64)
        table[-1] = numels = torch.tensor([t.numel() for t in first], dtype=torch.int64)
        chunks_per_tensor = (numels + block - 1) // block
        tensor_ids = torch.repeat_interleave(torch.arange(len(first)), chunks_per_tensor)
        first_chunk = torch.cumsum(chunks_per_tensor, 0) - chunks_per_tensor
        chunk_ids = torch.arange(len(tensor_ids)) - first_chunk[tensor_ids]
        device = first[0].device
        self.addresses = table.to(device)
        self.chunks = torch.stack([tensor_ids, chunk_ids]).to(torch.int32).to(device)
        self.n_tensors, self.n_chunks = len(first), len(tensor_ids)
        self._rows = [[0 if t is None else t.data_ptr() for t in tensors] for tensors in operands]

    def point_row(self, row: int, tensors: list[torch.Tensor]) -> None:
        """Make row `row` hold these tensors' addresses; uploads only what changed."""
        addresses = [t.data_ptr() for t in tensors]
        if addresses != self._rows[row]:
            if self.addresses.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "a multi-tensor launch table must be re-pointed (a tensor moved, e.g. a grad was re-allocated) "
                    "during a CUDA graph capture, where a host-to-device copy cannot run: keep the tensors in place "
                    "(allocate grads once and zero them in place) and warm up before capturing"
                )
            # Stream-ordered after earlier launches, so a table in use never changes under them.
            self.addresses[row].copy_(torch.tensor(addresses, dtype=torch.int64), non_blocking=True)
            self._rows[row] = addresses

"""Where the kernel tests run: the interpreter on CPU (CI), compiled Triton on CUDA (`pytest -m gpu`)."""

import pytest
import torch

DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the cuda case runs instead")
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]

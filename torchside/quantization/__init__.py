"""Quantized tensors: storage (buffers), tensor (torch behaviour), quantizer (recipes -> tensors).

Importing this package registers the QuantizedTensor pickle constructor as a
`torch.load(weights_only=True)` safe global.
"""

from torchside.quantization.ops import FALLBACK_CALLS
from torchside.quantization.quantizer import Quantizer, quantize_split, reduce_amaxes
from torchside.quantization.storage import QuantizedStorage
from torchside.quantization.tensor import QuantizedTensor

__all__ = ["FALLBACK_CALLS", "QuantizedStorage", "QuantizedTensor", "Quantizer", "quantize_split", "reduce_amaxes"]

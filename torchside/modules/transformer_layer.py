"""`TransformerLayer`: a pre-norm transformer block (Llama's, GPT's) with FP8 GEMMs inside fp8_autocast.

Shape legend: S sequence, B batch, D hidden size, F ffn hidden size. Hidden states are [S, B, D]
("sbhd") or [B, S, D] ("bshd").

    h   = x + dropout(self_attention(x))      self_attention: norm -> QKV -> attention -> proj
    out = h + dropout(layernorm_mlp(h))       layernorm_mlp: norm -> fc1 -> activation -> fc2

`self_attention` is a MultiheadAttention with its input norm, `layernorm_mlp` a LayerNormMLP;
both norms are `TransformerConfig.normalization`. Dropout (`hidden_dropout`) acts in training only.

Tensor parallelism: the TP fields of `config.module_config` (tp_group, tp_size,
sequence_parallel) split the whole layer, as TransformerEngine's arguments do with
set_parallel_mode=True: QKV and fc1 column-parallel, proj and fc2 row-parallel, attention on
this rank's heads. Under sequence parallelism hidden states are [S/tp, B, D] (this rank's
sequence rows, "sbhd") in and out, and the residual adds and norms run on them.
`set_device_mesh(tp_mesh, weight_mesh)` (or the same constructor arguments) reaches every
parameter through the children.

The settings are one `TransformerConfig` (`config=`), or TransformerEngine's keywords
(`TransformerLayer(h, f, n, normalization="RMSNorm", activation="swiglu", tp_size=2, ...)`), which
`te_keywords.TE_KEYWORDS` maps onto its fields; not both for one field.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchside.modules.attention import AttentionMask
from torchside.modules.config import check_size
from torchside.modules.layernorm_mlp import LayerNormMLP
from torchside.modules.multihead_attention import MultiheadAttention, RotaryFreqs, reset_fp8_submodules
from torchside.modules.te_keywords import config_from_te_keywords
from torchside.modules.transformer_config import InitMethod, TransformerConfig, check_layer_parallelism
from torchside.parallel.module_mesh import TensorParallelMixin


class TransformerLayer(TensorParallelMixin, nn.Module):
    """Pre-norm self-attention + MLP block with TransformerEngine's te.TransformerLayer sizes; knobs in the config.

    `te_keywords`: TransformerEngine's keywords for the config's fields (`te_keywords.TE_KEYWORDS`).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        *,
        num_gqa_groups: int | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: InitMethod | None = None,
        output_layer_init_method: InitMethod | None = None,
        config: TransformerConfig | None = None,
        tp_mesh: DeviceMesh | None = None,
        weight_mesh: DeviceMesh | None = None,
        **te_keywords: Any,
    ) -> None:
        super().__init__()
        owner = "TransformerLayer"
        config = config_from_te_keywords(owner, config, te_keywords)
        self._init_tensor_parallel(check_layer_parallelism(owner, config.module_config))
        check_size(owner, "ffn_hidden_size", ffn_hidden_size)
        self._set_own_device_mesh(tp_mesh, weight_mesh)  # checks the meshes before any weight is built
        self.config = config
        # The children get the meshes at construction: FP8 weights are cast with their amax group.
        meshes = {"tp_mesh": tp_mesh, "weight_mesh": weight_mesh}
        inits = {"init_method": init_method, "output_layer_init_method": output_layer_init_method, **meshes}
        self.self_attention = MultiheadAttention(
            hidden_size,
            num_attention_heads,
            num_gqa_groups=num_gqa_groups,
            input_layernorm=True,
            params_dtype=params_dtype,
            device=device,
            config=config,
            **inits,
        )
        norm = config.norm_settings()
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=norm.eps,
            bias=config.bias,
            normalization=norm.normalization,
            activation=config.activation,
            glu_interleave=config.glu_interleave,
            zero_centered_gamma=norm.zero_centered_gamma,
            params_dtype=params_dtype,
            set_parallel_mode=config.mlp_tp == "split",
            device=device,
            config=config.module_config,
            **inits,
        )

    def reset_parameters(self) -> None:
        """Fill every parameter again (after building on meta: call `to_empty(device=...)` first)."""
        reset_fp8_submodules(self)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: AttentionMask = None,
        self_attn_mask_type: str | None = None,
        rotary_pos_emb: RotaryFreqs = None,
    ) -> Tensor:
        """The block's output, shaped like hidden_states ([S, B, D] or [B, S, D] by qkv_format)."""
        dropout = self.config.hidden_dropout
        attention_out = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type,
            rotary_pos_emb=rotary_pos_emb,
        )
        hidden = hidden_states + F.dropout(attention_out, dropout, self.training)
        return hidden + F.dropout(self.layernorm_mlp(hidden), dropout, self.training)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"normalization={c.normalization}, activation={c.activation}, hidden_dropout={c.hidden_dropout}, "
            f"tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )


__all__ = ["TransformerLayer"]

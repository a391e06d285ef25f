"""TransformerLayer built with TransformerEngine's keywords equals the one built from the structured config.

Each case is a call as TE users write it and the TransformerConfig written by hand for it; both
layers are built under one seed and must hold the same config, the same parameters and give the
same output. Values we cannot honour, unknown keywords and a keyword given twice (as TE's keyword
and in config=) are refused with the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_threads
from torchside import ModuleConfig, TransformerConfig, TransformerLayer
from torchside.modules.te_keywords import TE_KEYWORDS

HIDDEN, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 8, 2

# te.pytorch.TransformerLayer's keyword arguments (TransformerEngine 2.x, transformer/transformer.py).
TE_TRANSFORMER_LAYER_KEYWORDS = {
    "num_gqa_groups", "layernorm_epsilon", "hidden_dropout", "attention_dropout", "init_method",
    "output_layer_init_method", "layer_number", "kv_channels", "self_attn_mask_type", "window_size",
    "enc_dec_attn_mask_type", "enc_dec_window_size", "tp_group", "tp_size", "params_dtype", "get_rng_state_tracker",
    "fuse_wgrad_accumulation", "seq_length", "micro_batch_size", "sequence_parallel",
    "apply_residual_connection_post_layernorm", "output_layernorm", "parallel_attention_mlp", "layer_type",
    "drop_path_rate", "set_parallel_mode", "fuse_qkv_params", "zero_centered_gamma", "qkv_weight_interleaved",
    "ub_tp_comm_overlap", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad",
    "bias", "activation", "normalization", "device", "attn_input_format", "name",
}  # fmt: skip

CASES = {  # name: (TE's keywords, num_gqa_groups, the structured config)
    "llama-te-tutorial": (
        {"bias": False, "layernorm_epsilon": 1e-6, "hidden_dropout": 0.0, "attention_dropout": 0.0,
         "fuse_qkv_params": False, "normalization": "RMSNorm", "activation": "swiglu", "attn_input_format": "bshd"},
        2,
        TransformerConfig(bias=False, layernorm_epsilon=1e-6, fuse_qkv_params=False, normalization="RMSNorm",
                          activation="swiglu", qkv_format="bshd"),
    ),
    "gpt": (
        {"normalization": "LayerNorm", "activation": "gelu", "hidden_dropout": 0.1, "attention_dropout": 0.1,
         "self_attn_mask_type": "causal", "layer_type": "encoder", "fuse_qkv_params": True, "set_parallel_mode": True,
         "tp_size": 1, "sequence_parallel": False, "seq_length": SEQ, "micro_batch_size": BATCH},
        None,
        TransformerConfig(hidden_dropout=0.1, attention_dropout=0.1),
    ),
    "srelu-kv-channels": (
        {"activation": "srelu", "kv_channels": 8, "zero_centered_gamma": True, "self_attn_mask_type": "no_mask",
         "output_layernorm": False, "apply_residual_connection_post_layernorm": False, "window_size": None,
         "drop_path_rate": 0.0, "parallel_attention_mlp": False},
        None,
        TransformerConfig(activation="srelu", kv_channels=8, zero_centered_gamma=True, attn_mask_type="no_mask"),
    ),
    "relu-rmsnorm-replicated": (
        {"activation": "relu", "normalization": "RMSNorm", "set_parallel_mode": False, "fuse_wgrad_accumulation": False,
         "get_rng_state_tracker": None, "ub_tp_comm_overlap": False},
        None,
        TransformerConfig(activation="relu", normalization="RMSNorm", attention_tp="replicate", mlp_tp="replicate"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_te_keywords_build_the_layer_of_the_structured_config(case):
    te_keywords, groups, config = CASES[case]
    torch.manual_seed(0)
    te_spelled = TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=groups, **te_keywords).eval()
    torch.manual_seed(0)
    structured = TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=groups, config=config).eval()
    assert te_spelled.config == config
    want = structured.state_dict()
    assert all(torch.equal(value, want[name]) for name, value in te_spelled.state_dict().items())
    x = torch.randn(SEQ, BATCH, HIDDEN)
    assert torch.equal(te_spelled(x), structured(x))


def test_te_tensor_parallel_keywords_set_the_module_config():
    te_keywords = {"tp_size": 2, "sequence_parallel": True, "set_parallel_mode": True}
    layer = TransformerLayer(HIDDEN, FFN, HEADS, device="meta", **te_keywords)
    assert layer.config == TransformerConfig(module_config=ModuleConfig(tp_size=2, sequence_parallel=True))
    assert layer.tp_size == 2 and layer.layernorm_mlp.fc1_weight.shape == (FFN // 2, HIDDEN)


def _built_with_tp_group(rank, world_size):
    group = dist.group.WORLD
    layer = TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group, sequence_parallel=True, device="meta")
    return layer.config == TransformerConfig(module_config=ModuleConfig(tp_group=group, sequence_parallel=True))


def test_te_tp_group_sets_the_module_config_group():
    assert run_threads(_built_with_tp_group, 2) == [True, True]


def test_every_keyword_we_take_is_one_of_transformer_engines():
    assert set(TE_KEYWORDS) <= TE_TRANSFORMER_LAYER_KEYWORDS


def test_fieldless_te_keywords_go_with_a_config():
    config = TransformerConfig(normalization="RMSNorm")
    layer = TransformerLayer(HIDDEN, FFN, HEADS, config=config, layer_type="encoder", seq_length=SEQ, device="meta")
    assert layer.config is config


@pytest.mark.parametrize(
    "te_keyword, in_config",
    [
        ({"normalization": "RMSNorm"}, r"config=TransformerConfig\(normalization=...\)"),
        ({"hidden_dropout": 0.0}, r"config=TransformerConfig\(hidden_dropout=...\)"),
        ({"self_attn_mask_type": "causal"}, r"config=TransformerConfig\(attn_mask_type=...\)"),
        ({"tp_size": 2}, r"config=TransformerConfig\(module_config=ModuleConfig\(tp_size=...\)\)"),
        ({"set_parallel_mode": True}, r"config=TransformerConfig\(attention_tp=...\)"),
    ],
)
def test_a_field_given_as_te_keyword_and_in_config_is_refused(te_keyword, in_config):
    (name,) = te_keyword
    with pytest.raises(TypeError, match=rf"pass {name}= \(TransformerEngine's keyword\) or {in_config}, not both"):
        TransformerLayer(HIDDEN, FFN, HEADS, config=TransformerConfig(), **te_keyword)


@pytest.mark.parametrize(
    "te_keyword, error, match",
    [
        ({"layer_type": "decoder"}, ValueError, r"layer_type='decoder'\).*decoder layers.*supported: 'encoder'"),
        ({"output_layernorm": True}, ValueError, r"output_layernorm=True\).*supported: False"),
        ({"apply_residual_connection_post_layernorm": True}, ValueError, r"post_layernorm=True\).*supported: False"),
        ({"parallel_attention_mlp": True}, ValueError, r"parallel_attention_mlp=True\).*supported: False"),
        ({"window_size": (128, 0)}, ValueError, r"window_size=\(128, 0\)\): sliding-window.*None, \(-1, -1\)"),
        ({"drop_path_rate": 0.1}, ValueError, r"drop_path_rate=0.1\): stochastic depth.*supported: 0.0"),
        ({"fuse_wgrad_accumulation": True}, ValueError, r"fuse_wgrad_accumulation=True\).*main_grad"),
        ({"get_rng_state_tracker": print}, ValueError, r"get_rng_state_tracker=.*supported: None"),
        ({"ub_tp_comm_overlap": True}, ValueError, r"ub_tp_comm_overlap=True\).*supported: False"),
        ({"self_attn_mask_type": "causal_bottom_right"}, ValueError, r"attn_mask_type='causal_bottom_right'.*'causal'"),
        ({"normalization": "rmsnorm"}, ValueError, r"normalization='rmsnorm'\).*'LayerNorm' or 'RMSNorm'"),
        ({"activation": "tanh"}, ValueError, r"activation='tanh'\).*'swiglu'"),
        ({"attn_input_format": "thd"}, ValueError, r"attn_input_format='thd'\).*'sbhd', 'bshd'"),
        ({"hidden_dropout": 1.0}, ValueError, r"hidden_dropout=1.0\).*\[0, 1\)"),
        ({"tp_size": 0}, ValueError, r"tp_size=0\).*integer >= 1"),
        ({"seq_length": 0}, ValueError, r"seq_length=0\).*integer >= 1 or None"),
        ({"set_parallel_mode": "yes"}, TypeError, r"set_parallel_mode='yes'\).*True.*or False"),
        ({"bias": "no"}, TypeError, r"bias='no'\).*True or False"),
        ({"layer_numbr": 1}, TypeError, r"unexpected keyword argument 'layer_numbr'.*normalization"),
    ],
)
def test_te_values_we_cannot_honour_are_refused_with_what_is_supported(te_keyword, error, match):
    with pytest.raises(error, match=match):
        TransformerLayer(HIDDEN, FFN, HEADS, device="meta", **te_keyword)

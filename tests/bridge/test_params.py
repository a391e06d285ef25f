"""bridge.params: the rule table pairs torchside parameters with their jaxside twins, by name and shape.

Live models of both packages (single device, no mesh) must pair completely, with every 2-D GEMM
weight transposed into a Flax kernel and everything else kept; misfits are named. The values
crossing (zero-copy, sharded) are checked against torch in test_runtime.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxside.modules as JM
import torchside.modules as TM
from bridge import params

# What the rules must give, written out by hand: torch name (with shape) -> (JAX name, layout).
EXPECTED = {
    ("layers.0.up.weight", (256, 64)): ("layers.0.up.kernel", "transpose"),
    ("layers.0.up.bias", (256,)): ("layers.0.up.bias", "same"),
    ("mlp.fc1_weight", (256, 64)): ("mlp.fc1_kernel", "transpose"),
    ("mlp.layer_norm_weight", (64,)): ("mlp.layer_norm_weight", "same"),
    ("norm.weight", (64,)): ("norm.weight", "same"),  # a norm's 1-D weight stays a weight
    ("experts.weight3", (32, 64)): ("experts.kernel3", "transpose"),  # GroupedLinear's expert 3
    ("attn.layernorm_qkv.weight", (128, 64)): ("attn.layernorm_qkv.kernel", "transpose"),
}


def _jax_shapes(expected: dict) -> dict:
    """JAX paths and shapes of the expected twins (the transpose of every transposed weight)."""
    shapes = {}
    for (_, shape), (jax_name, layout) in expected.items():
        path = tuple(int(p) if p.isdigit() else p for p in jax_name.split("."))
        shapes[path] = shape[::-1] if layout == "transpose" else shape
    return shapes


def test_rules_give_the_twin_names_and_layouts():
    torch_shapes = {name: shape for name, shape in EXPECTED}
    pairs = params.pair_parameters(torch_shapes, _jax_shapes(EXPECTED))
    got = {(p.torch_name, torch_shapes[p.torch_name]): (p.jax_name, p.layout.name) for p in pairs}
    assert got == EXPECTED


def test_misfits_are_named():
    torch_shapes = {"a.weight": (4, 8), "b.bias": (4,)}
    with pytest.raises(ValueError, match=r"'a\.weight' \[4, 8\] \(transpose\) should be \[8, 4\] in JAX"):
        params.pair_parameters(torch_shapes, {("a", "kernel"): (4, 8), ("b", "bias"): (4,)})
    with pytest.raises(ValueError, match=r"'b\.bias' maps to 'b\.bias', which the JAX model lacks"):
        params.pair_parameters(torch_shapes, {("a", "kernel"): (8, 4)})
    with pytest.raises(ValueError, match=r"JAX 'c\.kernel' has no torch parameter"):
        params.pair_parameters(torch_shapes, {("a", "kernel"): (8, 4), ("b", "bias"): (4,), ("c", "kernel"): (1, 1)})


def test_a_custom_rule_table_is_used_first_match_wins():
    renamed = (params.Rule(r"proj\.w", 2, "out.kernel", params.TRANSPOSE), *params.RULES)
    pairs = params.pair_parameters({"proj.w": (3, 5)}, {("out", "kernel"): (5, 3)}, renamed)
    assert [(p.torch_name, p.jax_name, p.layout.name) for p in pairs] == [("proj.w", "out.kernel", "transpose")]


TWINS = {  # name -> (class name, sizes, arguments): built alike from torchside.modules and jaxside.modules
    "linear": ("Linear", (32, 48), {}),
    "layernorm_linear": ("LayerNormLinear", (32, 48), {}),
    "layernorm_mlp": ("LayerNormMLP", (32, 64), {}),
    "rmsnorm": ("RMSNorm", (32,), {}),
    "grouped_linear": ("GroupedLinear", (3, 32, 48), {}),
    "transformer_gqa": ("TransformerLayer", (64, 128, 4), {"num_gqa_groups": 2}),
}


@pytest.mark.parametrize("name", sorted(TWINS))
def test_live_twins_pair_completely(name):
    cls, sizes, kwargs = TWINS[name]
    torch_module = getattr(TM, cls)(*sizes, **kwargs, device="meta")
    jax_module = nnx.eval_shape(lambda: getattr(JM, cls)(*sizes, **kwargs, rngs=nnx.Rngs(0)))
    pairs = params.pair_models(torch_module, jax_module)
    torch_names = [n for n, _ in torch_module.named_parameters()]
    assert [p.torch_name for p in pairs] == torch_names
    for pair in pairs:
        ndim = torch_module.get_parameter(pair.torch_name).dim()
        assert pair.layout.name == ("transpose" if ndim == 2 else "same"), pair


def test_layouts_move_values_as_the_twins_expect():
    """torch y = x @ w.T equals Flax y = x @ kernel with kernel = TRANSPOSE.to_jax(w), and back."""
    rng = np.random.default_rng(0)
    w_OI, x = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    kernel_IO = params.TRANSPOSE.to_jax(jnp.asarray(w_OI))
    np.testing.assert_allclose(np.asarray(jnp.asarray(x) @ kernel_IO), x @ w_OI.T, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(params.TRANSPOSE.to_torch(kernel_IO)), w_OI)
    np.testing.assert_array_equal(np.asarray(params.SAME.to_jax(jnp.asarray(x))), x)

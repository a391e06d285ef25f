"""jaxside.xla_options: the options FP8 steps compile with reach XLA, and a flag the user set in XLA_FLAGS wins."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxside import xla_options


def test_triton_gemms_are_off_unless_the_user_set_the_flag():
    assert xla_options.compiler_options("") == {"xla_gpu_enable_triton_gemm": False}
    assert xla_options.compiler_options("--xla_force_host_platform_device_count=8") == {
        "xla_gpu_enable_triton_gemm": False
    }
    for user in ("--xla_gpu_enable_triton_gemm=true", "--xla_dump_to=/tmp/x --xla_gpu_enable_triton_gemm=false"):
        assert xla_options.compiler_options(user) == {}


def test_the_environments_xla_flags_is_read_when_called(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert xla_options.compiler_options() == {}
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_options.compiler_options() == {"xla_gpu_enable_triton_gemm": False}


def test_jit_compiles_with_the_options_whichever_way_it_is_compiled(monkeypatch):
    """XLA knows every option's name (a CPU compile accepts the GPU ones) and gets them called or lower().compile()d."""
    double = xla_options.jit(lambda x: 2 * x)
    assert double.lower(jnp.ones(3)).compile()(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]
    monkeypatch.setattr(xla_options, "FP8_STEP_OPTIONS", {"xla_gpu_no_such_option": False})
    for compile_ in (lambda f: f(jnp.ones(3)), lambda f: f.lower(jnp.ones(3)).compile()):
        with pytest.raises(jax.errors.JaxRuntimeError, match="xla_gpu_no_such_option"):
            compile_(xla_options.jit(lambda x: 3 * x))


def test_options_passed_to_jit_reach_xla_too():
    step = xla_options.jit(lambda x: x + 1, compiler_options={"xla_gpu_enable_triton_gemm": True})
    assert step(jnp.zeros(2)).tolist() == [1.0, 1.0]
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        xla_options.jit(lambda x: x - 1, compiler_options={"xla_no_such_option": 1})(jnp.zeros(2))

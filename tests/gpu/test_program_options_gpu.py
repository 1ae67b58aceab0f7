"""The served strategies' per-program XLA options (``served.program_compiler_options``) take effect in a GPU
compile: ``fp8_mgpu``'s sampler is compiled without XLA's command buffers (CPU CI checks the options themselves and
that ``jax.jit`` accepts them)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import served

pytestmark = pytest.mark.gpu


def _chain(x):
    for i in range(8):  # 16 commands (GEMMs and fusions): above XLA's smallest command-buffer region
        x = jnp.tanh(x @ x) + i
    return x


def test_fp8_mgpu_programs_compile_without_command_buffers():
    x = jnp.ones((256, 256), jnp.float32)
    options = served.program_compiler_options("fp8_mgpu", "")  # as if XLA_FLAGS named none of them
    assert options == {"xla_gpu_enable_command_buffer": ""}
    plain = jax.jit(_chain).lower(x).compile().as_text()
    served_program = jax.jit(_chain, compiler_options=options).lower(x).compile().as_text()
    assert "command_buffer" in plain  # XLA's default captures such a chain
    assert "command_buffer" not in served_program
    assert jnp.allclose(jax.jit(_chain, compiler_options=options)(x), jax.jit(_chain)(x))

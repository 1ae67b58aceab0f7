"""The served strategies' per-program XLA options (``served.program_compiler_options``) take effect in a GPU
compile: ``fp8_mgpu``'s sampler is compiled without XLA's command buffers (CPU CI checks the options themselves and
that ``jax.jit`` accepts them).

Command buffers are formed from the GPU program's thunks, after HLO optimisation, so the compiled HLO text never
shows them; XLA's dump of the thunk sequence does (``thunk_kind: "kCommandBuffer"``)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import served

pytestmark = pytest.mark.gpu


def _chain(x):
    for i in range(8):  # 16 commands (GEMMs and fusions): above XLA's smallest command-buffer region
        x = jnp.tanh(x @ x) + i
    return x


def _command_buffer_thunks(dump_dir):
    """How many command-buffer thunks the programs dumped into ``dump_dir`` hold."""
    files = sorted(dump_dir.glob("*thunk_metadata.txt"))
    assert files, f"XLA wrote no thunk metadata into {dump_dir}"
    return sum(f.read_text().count('thunk_kind: "kCommandBuffer"') for f in files)


def test_fp8_mgpu_programs_compile_without_xla_graphs(tmp_path):
    x = jnp.ones((256, 256), jnp.float32)
    options = served.program_compiler_options("fp8_mgpu", "")  # as if XLA_FLAGS named none of them
    assert options == {"xla_gpu_enable_command_buffer": ""}
    plain_dir, served_dir = tmp_path / "plain", tmp_path / "served"
    jax.jit(_chain, compiler_options={"xla_dump_to": str(plain_dir)}).lower(x).compile()
    jax.jit(_chain, compiler_options={**options, "xla_dump_to": str(served_dir)}).lower(x).compile()
    assert _command_buffer_thunks(plain_dir) > 0  # XLA's default captures such a chain
    assert _command_buffer_thunks(served_dir) == 0
    assert jnp.allclose(jax.jit(_chain, compiler_options=options)(x), jax.jit(_chain)(x))

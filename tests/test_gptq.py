"""GPTQ rounding for MXFP4 / NVFP4 (kroquant_jax.gptq): equals round-to-nearest without correlation, beats it with
correlated activations, stays exactly representable, vmaps over layers, rejects bad input by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import formats
from kroquant_jax import gptq
from kroquant_jax.formats import MXFP4, NVFP4

FORMATS = [MXFP4(), NVFP4()]


def _correlated(n=256, d=128, o=64, seed=0):
    """Activations with 4 dominant directions plus small isotropic noise, and a Gaussian weight."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    a = 3.0 * jax.random.normal(k2, (n, 4)) @ jax.random.normal(k1, (4, d)) + 0.3 * jax.random.normal(k3, (n, d))
    w = jax.random.normal(k4, (o, d))
    return a, w, jnp.matmul(a.T, a, precision=jax.lax.Precision.HIGHEST)


def _out_err(a, w, q):
    return float(jnp.linalg.norm(a @ w.T - a @ q.T))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_identity_hessian_is_round_to_nearest(fmt):
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 64)) * jnp.linspace(0.1, 3.0, 64)
    q = gptq.gptq_fake_quant(w, jnp.eye(64), fmt)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(formats.fake_quant(w, fmt)))
    # Act-order on equal diag(H) keeps the order; static scales coincide with the dynamic ones without feedback.
    np.testing.assert_array_equal(np.asarray(gptq.gptq_fake_quant(w, jnp.eye(64), fmt, scales="static")),
                                  np.asarray(q))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_correlated_activations_beat_round_to_nearest(fmt):
    a, w, h = _correlated()
    rtn = _out_err(a, w, formats.fake_quant(w, fmt))
    for kw in ({}, {"act_order": True}, {"scales": "static"}):
        err = _out_err(a, w, gptq.gptq_fake_quant(w, h, fmt, **kw))
        assert err <= 0.9 * rtn, (fmt.name, kw, err, rtn)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_lazy_blocks_equal_one_group_blocks(fmt):
    """The lazy block update is the same arithmetic as updating after every group (up to f32 reassociation)."""
    a, w, h = _correlated(d=128, o=16, seed=3)
    q128 = gptq.gptq_fake_quant(w, h, fmt)
    qg = gptq.gptq_fake_quant(w, h, fmt, block_size=fmt.block_size)
    assert float(jnp.mean(q128 != qg)) < 0.01
    assert abs(_out_err(a, w, q128) - _out_err(a, w, qg)) < 0.01 * _out_err(a, w, q128)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_result_is_exactly_representable(fmt):
    a, w, h = _correlated(d=128, o=16, seed=2)
    for act_order in (False, True):
        q = gptq.gptq_fake_quant(w, h, fmt, act_order=act_order)
        qa = gptq.gptq_quantize(w, h, fmt, act_order=act_order)
        assert qa.shape == w.shape and qa.scales.shape == (16, 128 // fmt.block_size)
        np.testing.assert_array_equal(np.asarray(formats.dequantize(qa, jnp.float32)), np.asarray(q))
        # Round trip through formats.quantize (on the pass's tensor scale): MXFP4 (FLOOR) gives back every value;
        # NVFP4 every value of the groups whose largest code is 6 (the module docstring says why not the others).
        ts = qa.tensor_scale if fmt.has_tensor_scale else None
        back = np.asarray(formats.dequantize(formats.quantize(q, fmt, tensor_scale=ts)))
        codes = np.asarray(formats.unpack_nibbles(qa.codes)).reshape(16, -1, fmt.block_size)
        full = np.max(codes & 7, axis=-1) == 7  # (o, groups): largest magnitude index 7 is 6.0
        keep = np.ones_like(full) if isinstance(fmt, MXFP4) else full
        assert keep.mean() > 0.5
        blocks = lambda x: x.reshape(16, -1, fmt.block_size)
        np.testing.assert_array_equal(blocks(back)[keep], blocks(np.asarray(q))[keep])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_vmap_over_layers_equals_single_calls(fmt):
    ws, hs = [], []
    for seed in range(3):
        _, w, h = _correlated(n=64, d=64, o=8, seed=10 + seed)
        ws.append(w * (1.0 + seed))
        hs.append(h)
    batched = jax.jit(jax.vmap(lambda w, h: gptq.gptq_rounding(w, h, fmt)))(jnp.stack(ws), jnp.stack(hs))
    # The checked public function traces too (its value checks are skipped under vmap / jit).
    wrapped = jax.vmap(lambda w, h: gptq.gptq_fake_quant(w, h, fmt))(jnp.stack(ws), jnp.stack(hs))
    np.testing.assert_array_equal(np.asarray(wrapped), np.asarray(batched.values))
    for i in range(3):
        single = gptq.gptq_quantize(ws[i], hs[i], fmt)
        np.testing.assert_array_equal(np.asarray(batched.values[i]),
                                      np.asarray(formats.dequantize(single, jnp.float32)))
        np.testing.assert_array_equal(np.asarray(batched.scales[i]), np.asarray(single.scales))
        assert float(batched.tensor_scale[i]) == float(single.tensor_scale)


def test_bad_input_raises_naming_the_argument():
    w, h = jnp.ones((8, 64)), jnp.eye(64)
    with pytest.raises(ValueError, match=r"w must be \(o, d\)"):
        gptq.gptq_fake_quant(jnp.ones(64), h)
    with pytest.raises(ValueError, match=r"h must be \(d, d\) = \(64, 64\)"):
        gptq.gptq_fake_quant(w, jnp.eye(32))
    with pytest.raises(ValueError, match=r"d=48 must be a multiple of mxfp4's group size 32"):
        gptq.gptq_fake_quant(jnp.ones((8, 48)), jnp.eye(48))
    with pytest.raises(ValueError, match=r"block_size=48"):
        gptq.gptq_fake_quant(w, h, NVFP4(), block_size=48)
    with pytest.raises(ValueError, match=r"gptq: h: 1 non-finite"):
        gptq.gptq_fake_quant(w, h.at[3, 5].set(jnp.nan))
    with pytest.raises(ValueError, match=r"gptq: w: 1 non-finite"):
        gptq.gptq_fake_quant(w.at[0, 0].set(jnp.inf), h)
    with pytest.raises(ValueError, match=r"scales='fixed'"):
        gptq.gptq_fake_quant(w, h, scales="fixed")
    with pytest.raises(ValueError, match=r"damp=-1"):
        gptq.gptq_fake_quant(w, h, damp=-1.0)
    with pytest.raises(TypeError, match=r"fmt="):
        gptq.gptq_fake_quant(w, h, "mxfp4")
    with pytest.raises(ValueError, match=r"not positive definite"):
        gptq.gptq_fake_quant(w, -jnp.eye(64), damp=0.0)


def test_gptq_rounding_benchmark_smoke(tmp_path):
    """benchmarks/gptq_rounding.py on one tiny correlated layer (subprocess): GPTQ beats round-to-nearest there too."""
    import json
    import os
    import subprocess
    import sys

    from kroquant_jax import layerset

    a, w, _ = _correlated(n=128, d=64, o=16, seed=4)
    path = str(tmp_path / "layers.npz")
    layerset.save_layer_set(path, {"blk.fc": (np.asarray(w), None, np.asarray(a))})
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-m", "benchmarks.gptq_rounding", "--layer-set", path, "--out",
                    str(tmp_path / "r.json")], check=True, env=env, capture_output=True)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["num_layers"] == 1 and result["summary"]["mxfp4/gptq_reduction/w"] > 0.1
    assert set(result["per_layer"]["blk.fc"]) == {"mxfp4", "nvfp4"}

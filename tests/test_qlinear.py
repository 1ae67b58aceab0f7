"""Quantized linear layer: eq. 11, simulate == packed, storage round trips (safetensors store, orbax), errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import qlinear, transforms
from kroquant_jax.formats import MXFP4, NVFP4, QuantizedArray, as_float32, dequantize, fake_quant


def _params(d=128, seed=0):
    p = transforms.get("kron_lu").init(d)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(np.float32), p)


def _layer(lowrank=True, quantized=True, weight_fmt=MXFP4(), seed=0, o=48, d=128, r=32):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((o, d)) * 0.1).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    lr = None
    if lowrank:
        lr = ((rng.standard_normal((o, r)) * 0.1).astype(np.float32), (rng.standard_normal((r, d)) * 0.1).astype(
            np.float32))
    layer = qlinear.build_qlinear(w, b, transform="kron_lu", transform_params=_params(d, seed), lowrank=lr,
                                  lowrank_quantized=quantized, weight_fmt=weight_fmt)
    return layer, w, b, lr


def test_forward_is_eq_11():
    layer, w, b, (left, right) = _layer()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 128)).astype(np.float32))
    p = transforms.get("kron_lu")

    @jax.jit
    def reference(x, w, left, right, b, params):
        x_t = transforms.apply_to_activations(x, p.blocks(params))
        w_t = transforms.apply_to_weights(w, p.inverse_blocks(params))
        branch = fake_quant(left) @ fake_quant(right)  # the branch as stored (MXFP4 along r and along d)
        return fake_quant(x_t) @ fake_quant(w_t - branch).T + x_t @ branch.T + b

    want = reference(x, jnp.asarray(w), jnp.asarray(left), jnp.asarray(right), jnp.asarray(b), _params())
    got = qlinear.qlinear_forward(layer, x)
    assert got.shape == (3, 5, 48)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    # and it approximates the 16-bit layer
    ref = np.asarray(x) @ w.T + b
    assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 0.3


@pytest.mark.parametrize("lowrank,quantized,fmt", [(True, True, MXFP4()), (True, False, MXFP4()),
                                                   (False, False, MXFP4()), (False, False, NVFP4())])
def test_simulate_and_packed_paths_agree(lowrank, quantized, fmt):
    layer, *_ = _layer(lowrank, quantized, fmt)
    assert isinstance(layer.weight, QuantizedArray) and layer.weight.codes.shape == (48, 64)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((7, 128)).astype(np.float32))
    y_sim = qlinear.qlinear_forward(layer, x, path="simulate")
    y_packed = qlinear.qlinear_forward(layer, x, path="packed")
    np.testing.assert_allclose(np.asarray(y_sim), np.asarray(y_packed), rtol=1e-6, atol=1e-6)


def test_jit_grad_and_dtype():
    """Under jit a bf16 input gives a bf16 result: the f32 computation rounded once at the end. The gradient in x is
    the identity STE's: that of the same layer with the activation quantizer taken out, x T (Q(W~ - L R) + L R)^T."""
    layer, *_ = _layer()
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 128)), jnp.bfloat16)
    y = jax.jit(qlinear.qlinear_forward, static_argnames="path")(layer, x)
    assert y.dtype == jnp.bfloat16
    y32 = qlinear.qlinear_forward(layer, x.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y32.astype(jnp.bfloat16), np.float32))
    g = jax.grad(lambda v: jnp.sum(qlinear.qlinear_forward(layer, v)))(x.astype(jnp.float32))
    w_eff = dequantize(layer.weight, jnp.float32) + as_float32(layer.lowrank_left) @ as_float32(layer.lowrank_right)
    want = jax.grad(lambda v: jnp.sum(transforms.apply_to_activations(v, layer.blocks) @ w_eff.T))(
        x.astype(jnp.float32))
    assert float(jnp.max(jnp.abs(g))) > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_shape_mismatch_is_a_clear_error():
    layer, *_ = _layer(lowrank=False)
    with pytest.raises(ValueError, match="in_features=128"):
        qlinear.qlinear_forward(layer, jnp.ones((2, 96)))
    with pytest.raises(ValueError, match="layer 'ff.up'.*low-rank"):
        qlinear.build_qlinear(np.ones((8, 64), np.float32), lowrank=(np.ones((8, 4)), np.ones((4, 32))),
                              name="ff.up")
    w = np.ones((8, 64), np.float32)
    w[0, 0] = np.inf
    with pytest.raises(ValueError, match="layer 'bad'.*non-finite"):
        qlinear.build_qlinear(w, name="bad")


def _assert_same_layer(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8))


@pytest.mark.parametrize("lowrank,quantized,fmt", [(True, True, MXFP4()), (True, False, NVFP4()),
                                                   (False, False, MXFP4())])
def test_safetensors_round_trip(tmp_path, lowrank, quantized, fmt):
    layer, *_ = _layer(lowrank, quantized, fmt)
    path = str(tmp_path / "layer.safetensors")
    qlinear.save_qlinear(path, layer, {"heldout_error": 0.25})
    back, extra = qlinear.load_qlinear(path)
    assert extra == {"heldout_error": 0.25}
    _assert_same_layer(layer, back)
    assert back.config == layer.config and back.weight.fmt == layer.weight.fmt


def test_orbax_round_trip(tmp_path):
    layers = {"blocks.0.attn1.to_q": _layer()[0], "blocks.0.ff.net.2": _layer(False, False, NVFP4(), seed=4)[0]}
    qlinear.save_orbax(str(tmp_path / "ckpt"), layers)
    back = qlinear.restore_orbax(str(tmp_path / "ckpt"))
    assert list(back) == list(layers)
    for n in layers:
        _assert_same_layer(layers[n], back[n])


def test_store_is_atomic_and_lists_names(tmp_path):
    store = qlinear.QLinearStore(str(tmp_path / "store"))
    layer = _layer()[0]
    assert "a/b" not in store
    store.save("a/b", layer, {"chosen": "trained0"})
    store.save("c", layer)
    (tmp_path / "store" / ".tmp-partial.safetensors").write_bytes(b"junk from a crash")  # ignored
    assert "a/b" in store and sorted(store.names()) == ["a/b", "c"]
    back, extra = store.load("a/b")
    assert extra["chosen"] == "trained0" and extra["name"] == "a/b"
    _assert_same_layer(layer, back)
    with pytest.raises(KeyError, match="'zzz'"):
        store.load("zzz")


def test_truncated_or_foreign_stored_layer_is_refused_naming_the_file(tmp_path):
    """A stored layer cut short (a full disk, a copy stopped midway) or a safetensors file of something else: a
    ValueError naming the file, from the resume check (``changes``) and from ``load``, not safetensors' own error."""
    store = qlinear.QLinearStore(str(tmp_path / "store"))
    store.save("a", _layer()[0])
    path = store.path("a")
    data = open(path, "rb").read()
    for cut in (40, len(data) - 100):
        open(path, "wb").write(data[:cut])
        with pytest.raises(ValueError, match=f"{path}: not a readable stored layer .*delete it to recompute"):
            store.changes("a", {})
        with pytest.raises(ValueError, match="not a readable stored layer"):
            store.load("a")
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(4, np.float32)}, path)
    with pytest.raises(ValueError, match=f"{path}: not a layer written by save_qlinear"):
        store.load("a")


def test_effective_weight_absorbs_branch_quantization():
    layer, w, _, _ = _layer()
    p = transforms.get("kron_lu")
    w_t = jax.jit(lambda w, q: transforms.apply_to_weights(w, p.inverse_blocks(q)))(jnp.asarray(w), _params())
    eff = jax.jit(qlinear.effective_weight)(layer)
    # the residual absorbs the branch's own quantization error: error is that of one 4-bit rounding of the residual
    err = np.linalg.norm(np.asarray(eff - w_t)) / np.linalg.norm(np.asarray(w_t))
    plain = np.linalg.norm(np.asarray(jax.jit(fake_quant)(w_t) - w_t)) / np.linalg.norm(np.asarray(w_t))
    assert err < 1.5 * plain
    assert layer.lowrank_left.shape == (48, 32) and layer.lowrank_right.shape == (32, 128)


# ---------------------------------------------------------------------------------------------------------------------
# Traceable layers from given factors (the device-side builders of the benchmarks).
# ---------------------------------------------------------------------------------------------------------------------


def test_qlinear_from_factors_is_build_qlinear_bit_for_bit():
    kw, kt, kl = jax.random.split(jax.random.PRNGKey(0), 3)
    w = jax.random.normal(kw, (48, 64), jnp.float32) * 0.2
    params = qlinear.random_kron_params(kt, 64)
    base = transforms.get("kron_lu").init(64)
    for name in ("a", "b", "c"):  # near the Hadamard init, not on it
        rel = np.abs(np.asarray(params[name]) / np.asarray(base[name]) - 1.0)
        assert 0 < rel.max() < 0.6 and rel.mean() < 0.15
    w_tilde = transforms.apply_to_weights(w, transforms.get("kron_lu").inverse_blocks(params))
    left, right = qlinear.lowrank_factors(w_tilde, kl, 32)
    np.testing.assert_allclose(np.asarray(left.T @ left), np.eye(32), atol=1e-5)  # L = Q orthonormal, R = Q^T W~
    np.testing.assert_allclose(np.asarray(right), np.asarray(left.T @ w_tilde), rtol=1e-5, atol=1e-6)
    mine = jax.jit(qlinear.qlinear_from_factors)(w, params, left, right)
    ref = qlinear.build_qlinear(w, transform="kron_lu", transform_params=params, lowrank=(left, right))
    assert mine.config == ref.config
    for a, b in ((mine.weight, ref.weight), (mine.lowrank_left, ref.lowrank_left),
                 (mine.lowrank_right, ref.lowrank_right)):
        np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
        np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
    np.testing.assert_array_equal(np.asarray(mine.blocks), np.asarray(ref.blocks))
    # random_qlinear: the same three steps from one key
    k_t, k_lr = jax.random.split(kt)
    one = qlinear.random_qlinear(w, kt, 32)
    params2 = qlinear.random_kron_params(k_t, 64)
    w_tilde2 = transforms.apply_to_weights(w, transforms.get("kron_lu").inverse_blocks(params2))
    two = qlinear.qlinear_from_factors(w, params2, *qlinear.lowrank_factors(w_tilde2, k_lr, 32))
    np.testing.assert_array_equal(np.asarray(one.weight.codes), np.asarray(two.weight.codes))


def test_padded_layer_computes_the_unaligned_linear(tmp_path):
    """A linear of width 80 zero-padded to 96 (``pad_to_block`` + ``with_input_pad``) takes width-80 inputs, gives
    the padded layer's output on zero-padded inputs bit for bit, approximates ``x W^T + b`` like an aligned layer,
    and keeps its padding through storage."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 80)) * 0.1).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    a = rng.standard_normal((6, 80)).astype(np.float32)
    w_pad, a_pad, pad = qlinear.pad_to_block(w, a, 32)
    assert pad == 16 and w_pad.shape == (40, 96) and a_pad.shape == (6, 96)
    np.testing.assert_array_equal(w_pad[:, 80:], 0.0)
    np.testing.assert_array_equal(a_pad[:, :80], a)
    inner = qlinear.build_qlinear(w_pad, b, transform="hadamard32")
    layer = qlinear.with_input_pad(inner, pad)
    assert layer.config.input_width == 80 and layer.config.in_features == 96
    x = jnp.asarray(a)
    y = qlinear.qlinear_forward(layer, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(qlinear.qlinear_forward(inner, jnp.asarray(a_pad))))
    exact = a @ w.T + b
    assert np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact) < 0.2
    with pytest.raises(ValueError, match="in_features=96, zero-padded by input_pad=16"):
        qlinear.qlinear_forward(layer, jnp.asarray(a_pad))
    qlinear.save_qlinear(str(tmp_path / "l.safetensors"), layer)
    back, _ = qlinear.load_qlinear(str(tmp_path / "l.safetensors"))
    assert back.config == layer.config
    state, meta = qlinear.to_state(inner)
    del meta["config"]["input_pad"]  # a layer stored before padding existed
    assert qlinear.from_state(state, meta).config.input_pad == 0
    assert qlinear.pad_to_block(w_pad, None, 32)[2] == 0
    with pytest.raises(ValueError, match="pad=96 must be in"):
        qlinear.with_input_pad(inner, 96)


def test_forward_form_keeps_the_output_and_shares_one_program_across_recipes():
    """forward_form: bit-for-bit the same forward; layers of different recipes with the same block shape and branch
    kind get one pytree structure, so a jitted function of the layer traces once for all of them (the testbed's
    sampler compiles once per structure, not once per recipe); diagonal-block recipes form their own group."""
    from models.quantize_model import qlinear_overrides

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((48, 64)), jnp.float32)  # (o, d)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)  # (n, d)
    lowrank = (jnp.asarray(rng.standard_normal((48, 32)), jnp.float32), jnp.asarray(rng.standard_normal((32, 64)),
                                                                                   jnp.float32))
    kron = qlinear.random_kron_params(jax.random.key(1), 64)
    layers = {"hadamard32": qlinear.build_qlinear(w, transform="hadamard32", lowrank=lowrank),
              "kron_lu": qlinear.build_qlinear(w, transform="kron_lu", transform_params=kron, lowrank=lowrank),
              "identity": qlinear.build_qlinear(w, lowrank=lowrank),
              "diagonal": qlinear.build_qlinear(w, transform="diagonal", lowrank=lowrank)}
    traces = []

    @jax.jit
    def run(override, x):
        traces.append(1)
        return override["layer"](x)

    for name, layer in layers.items():
        reduced = qlinear.forward_form(layer)
        assert reduced.transform_params is None
        assert reduced.config.transform == ("dense32" if layer.blocks.shape[1] == 32 else "diagonal"), name
        np.testing.assert_array_equal(np.asarray(qlinear.qlinear_forward(reduced, x)),
                                      np.asarray(qlinear.qlinear_forward(layer, x)), err_msg=name)
        np.testing.assert_array_equal(np.asarray(run(qlinear_overrides({"layer": layer}), x)),
                                      np.asarray(qlinear.qlinear_forward(layer, x)), err_msg=name)
    assert len(traces) == 2  # one program for the 32x32-block recipes, one for the diagonal ones

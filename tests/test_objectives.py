"""Per-layer objective (paper eq. 7-10): loss and λ definitions against numpy, STE gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import objectives, transforms
from kroquant_jax.formats import MXFP4, fake_quant, quantize


def _layer(seed=0, m=40, d=64, o=24):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, d)).astype(np.float32)
    a[:, 3] *= 30.0  # an outlier channel
    w = (rng.standard_normal((o, d)) * 0.1).astype(np.float32)
    return a, w


def _perturbed_kron(d, seed=1, scale=0.2):
    p = transforms.get("kron_lu").init(d)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape).astype(np.float32), p)


def _numpy_terms(params, param, a, w):
    """Direct float64 computation from the dense T (fake quant applied to the f32 operands)."""
    t = np.asarray(transforms.dense_matrix(param.blocks(params)), np.float64)
    a_t = np.asarray(a, np.float64) @ t
    w_t = np.asarray(w, np.float64) @ np.linalg.inv(t).T
    qa = np.asarray(fake_quant(jnp.asarray(a_t, jnp.float32), MXFP4()), np.float64)
    qw = np.asarray(fake_quant(jnp.asarray(w_t, jnp.float32), MXFP4()), np.float64)
    m, d = a.shape
    o = w.shape[0]
    ref = np.asarray(a, np.float64) @ np.asarray(w, np.float64).T
    l_out = np.sum((qa @ qw.T - ref) ** 2) / (m * o)
    l_a = np.sum((qa - a_t) ** 2) / (m * d)
    l_w = np.sum((qw - w_t) ** 2) / (o * d)
    return l_out, l_a, l_w


@pytest.mark.parametrize("init", [True, False])
def test_loss_terms_match_numpy(init):
    a, w = _layer()
    param = transforms.get("kron_lu")
    params = param.init(64) if init else _perturbed_kron(64)
    got = objectives.loss_terms(params, param, jnp.asarray(a), jnp.asarray(w))
    want = _numpy_terms(params, param, a, w)
    np.testing.assert_allclose([float(x) for x in got], want, rtol=2e-3)
    assert want[0] > 0 and want[1] > 0 and want[2] > 0


def test_auto_lambdas_match_definition_at_hadamard():
    a, w = _layer(seed=2)
    param = transforms.get("kron_lu")
    params0 = param.init(64)
    # KroQuant's initial transform is exactly the normalised block Hadamard transform.
    h = transforms.get("hadamard32")
    np.testing.assert_allclose(np.asarray(param.blocks(params0)), np.asarray(h.blocks(h.init(64))), atol=1e-6)
    l_out, l_a, l_w = _numpy_terms(params0, param, a, w)
    lam = objectives.auto_lambdas(objectives.loss_terms(params0, param, jnp.asarray(a), jnp.asarray(w)))
    np.testing.assert_allclose([float(lam.act), float(lam.wgt)], [l_out / l_a, l_out / l_w], rtol=3e-3)
    total = objectives.total_loss(params0, param, jnp.asarray(a), jnp.asarray(w), lam)
    np.testing.assert_allclose(float(total), 3 * l_out, rtol=3e-3)  # each term matches L_out at T_0


def test_auto_lambdas_zero_denominator_gives_zero():
    # Values on the E2M1 grid with power-of-two block maxima quantize exactly: L_A = L_W = 0 under identity.
    grid = np.array([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0], np.float32)
    a = np.tile(grid, (4, 4))  # (4, 32)
    w = np.tile(grid[::-1], (3, 4))
    param = transforms.get("identity")
    terms = objectives.loss_terms(param.init(32), param, jnp.asarray(a), jnp.asarray(w))
    assert float(terms.act) == 0.0 and float(terms.wgt) == 0.0
    lam = objectives.auto_lambdas(terms)
    assert float(lam.act) == 0.0 and float(lam.wgt) == 0.0


def _ste_surrogate(x):
    """``x + stop_gradient(Q(x) - x)``: forward Q(x), identity gradient — the STE by construction."""
    return x + jax.lax.stop_gradient(fake_quant(x, MXFP4()) - x)


def test_output_loss_gradient_is_the_identity_ste():
    a, w = map(jnp.asarray, _layer(seed=3))
    param = transforms.get("kron_lu")
    params = _perturbed_kron(64, seed=4)
    ref = a @ w.T

    def l_out(p):
        return objectives.loss_terms(p, param, a, w).out

    def l_out_surrogate(p):
        a_t = transforms.apply_to_activations(a, param.blocks(p))
        w_t = transforms.apply_to_weights(w, param.inverse_blocks(p))
        out = jnp.einsum("md,od->mo", _ste_surrogate(a_t), _ste_surrogate(w_t), precision="highest")
        return jnp.mean(jnp.square(out - ref))

    g = jax.grad(l_out)(params)
    g_ref = jax.grad(l_out_surrogate)(params)
    for k in ("a", "b", "c"):
        assert float(jnp.max(jnp.abs(g[k]))) > 0
        np.testing.assert_allclose(np.asarray(g[k]), np.asarray(g_ref[k]), rtol=1e-3, atol=1e-6 * float(
            jnp.max(jnp.abs(g_ref[k]))))


def test_regularizer_gradients_under_each_ste():
    """With the identity STE, d/dx (Q(x) - x)^2 = 2 (Q(x) - x)(1 - 1) = 0: L_A and L_W give no gradient (a property
    of the paper's objective as written); the clipped STE leaves a gradient on saturated elements only."""
    a, w = map(jnp.asarray, _layer(seed=5))
    param = transforms.get("kron_lu")
    params = _perturbed_kron(64, seed=6, scale=0.5)
    for ste, nonzero in (("identity", False), ("clipped", True)):
        cfg = objectives.ObjectiveConfig(ste=ste, regularizer_grad="ste")
        g = jax.grad(lambda p: objectives.loss_terms(p, param, a, w, cfg=cfg).act)(params)
        mx = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g))
        assert (mx > 0) == nonzero, (ste, mx)
    # per element of A T: the clipped STE's gradient of L_A is -2 (Q(x) - x) / N where x saturated, 0 elsewhere
    a_t, w_t = objectives.transformed_operands(param.blocks(params), param.inverse_blocks(params), a, w)
    cfg = objectives.ObjectiveConfig(ste="clipped", regularizer_grad="ste")
    ref = objectives.reference_output(a, w, cfg)
    g_at = np.asarray(jax.grad(lambda x: objectives.loss_terms_transformed(x, w_t, ref, cfg).act)(a_t))
    q = quantize(a_t, cfg.fmt)
    blocks = a_t.reshape(*a_t.shape[:-1], -1, cfg.fmt.block_size)
    saturated = np.asarray(cfg.fmt.saturated(blocks, q.scales, q.tensor_scale)).reshape(a_t.shape)
    assert 0 < saturated.sum() < saturated.size  # both kinds of element are present
    expected = np.where(saturated, -2 * (np.asarray(fake_quant(a_t)) - np.asarray(a_t)) / a_t.size, 0.0)
    np.testing.assert_allclose(g_at, expected, rtol=1e-5, atol=1e-12)
    assert np.all(g_at[~saturated] == 0) and np.any(g_at[saturated] != 0)


def test_detached_regularizer_gradient_pulls_towards_the_grid():
    """``regularizer_grad="detached"`` (the default): Q(x) is a constant inside L_A and L_W, so their gradient is that
    of ``mean((c - x)^2)`` with ``c = Q(x)`` frozen: non-zero, unlike the identity STE's; L_out is unchanged."""
    a, w = map(jnp.asarray, _layer(seed=5))
    param = transforms.get("kron_lu")
    params = _perturbed_kron(64, seed=6, scale=0.5)
    cfg = objectives.ObjectiveConfig()
    assert cfg.regularizer_grad == "detached"
    a_t, w_t = objectives.transformed_operands(param.blocks(params), param.inverse_blocks(params), a, w)
    qa, qw = np.asarray(fake_quant(a_t)), np.asarray(fake_quant(w_t))

    def frozen(p):
        at, wt = objectives.transformed_operands(param.blocks(p), param.inverse_blocks(p), a, w)
        return jnp.mean(jnp.square(qa - at)), jnp.mean(jnp.square(qw - wt))

    for i, term in enumerate(("act", "wgt")):
        g = jax.grad(lambda p: getattr(objectives.loss_terms(p, param, a, w, cfg=cfg), term))(params)
        g_ref = jax.grad(lambda p: frozen(p)[i])(params)
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            assert float(jnp.max(jnp.abs(x))) > 0, term
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(y))))
    ste = objectives.ObjectiveConfig(regularizer_grad="ste")
    g_out = jax.grad(lambda p: objectives.loss_terms(p, param, a, w, cfg=cfg).out)(params)
    g_out_ste = jax.grad(lambda p: objectives.loss_terms(p, param, a, w, cfg=ste).out)(params)
    for x, y in zip(jax.tree.leaves(g_out), jax.tree.leaves(g_out_ste)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_relative_output_error_definition():
    a, w = _layer(seed=7)
    param = transforms.get("hadamard32")
    p = param.init(64)
    got = float(objectives.relative_output_error(p, param, jnp.asarray(a), jnp.asarray(w)))
    h = np.asarray(transforms.dense_matrix(param.blocks(p)), np.float64)
    qa = np.asarray(fake_quant(jnp.asarray(a @ h, jnp.float32)), np.float64)
    qw = np.asarray(fake_quant(jnp.asarray(w @ h, jnp.float32)), np.float64)  # H^{-T} = H
    ref = a.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(got, np.linalg.norm(qa @ qw.T - ref) / np.linalg.norm(ref), rtol=1e-4)

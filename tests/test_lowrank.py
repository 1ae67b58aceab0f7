"""LoRaQ and SVDQuant branches: weight error reduction, branch storage, SVD, vmapped == per-layer, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpr_checks import assert_every_dot_highest  # tests/jaxpr_checks.py
from kroquant_jax import layerset, lowrank, synthetic
from kroquant_jax.formats import MXFP4, fake_quant
from kroquant_jax.timing import recorded_compilations


def _weights(names=("a", "b"), o=96, d=128):
    return {n: synthetic.synthetic_layer(n, o, d, 4).weight for n in names}


SMALL = lowrank.LoRaQConfig(rank=32, steps=60, rotation_steps=30)


def test_low_rank_svd_matches_exact():
    w = _weights(("a",), 96, 256)["a"]
    l_e, r_e = lowrank.low_rank_svd(jnp.asarray(w), 16, "exact")
    l_r, r_r = lowrank.low_rank_svd(jnp.asarray(w), 16, "randomized")
    best = np.linalg.svd(w.astype(np.float64), compute_uv=False)
    opt = np.sqrt(np.sum(best[16:] ** 2))
    for left, right in ((l_e, r_e), (l_r, r_r)):
        err = np.linalg.norm(w - np.asarray(left @ right))
        assert err <= opt * 1.01 + 1e-6
        # balanced factors: equal column / row norms
        np.testing.assert_allclose(np.linalg.norm(left, axis=0), np.linalg.norm(right, axis=1), rtol=1e-3)
    with pytest.raises(ValueError, match="rank=200"):
        lowrank.low_rank_svd(jnp.asarray(w), 200)


def test_randomized_svd_of_a_fast_decaying_spectrum_is_finite_and_accurate():
    """Singular values halving per direction leave the sketch numerically rank-deficient in float32: CholeskyQR2's
    Cholesky was NaN there (and with it LoRaQ's SVD candidate and SmoothQuant's search errors); the shifted
    CholeskyQR3 fallback gives a finite, accurate factorization. A well-conditioned sketch keeps an orthonormal
    basis."""
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.standard_normal((256, 256)))
    v, _ = np.linalg.qr(rng.standard_normal((384, 256)))
    spectrum = 100 * 0.5 ** np.arange(256)
    w = ((u * spectrum) @ v.T).astype(np.float32)  # (256, 384)
    y = jnp.asarray(w) @ jax.random.normal(jax.random.key(0), (384, 48))
    q = lowrank._orthonormalize(y)
    assert bool(jnp.all(jnp.isfinite(q)))
    left, right = lowrank.low_rank_svd(jnp.asarray(w), 32, "randomized")
    assert bool(jnp.all(jnp.isfinite(left)) & jnp.all(jnp.isfinite(right)))
    assert np.linalg.norm(w - np.asarray(left @ right)) < 1e-4 * np.linalg.norm(w)
    well = lowrank._orthonormalize(jnp.asarray(rng.standard_normal((256, 48)), jnp.float32))
    np.testing.assert_allclose(np.asarray(well.T @ well), np.eye(48), atol=1e-5)


def test_loraq_reduces_weight_error():
    ws = _weights()
    res = lowrank.loraq_layers(ws, SMALL)
    for n, w in ws.items():
        plain = float(lowrank.weight_error(jnp.asarray(w), None, None))
        r = res[n]
        stored = float(lowrank.weight_error(jnp.asarray(w), jnp.asarray(r.left), jnp.asarray(r.right),
                                            branch_fmt=MXFP4()))
        np.testing.assert_allclose(stored, float(r.error_final), rtol=1e-4)
        assert stored < 0.75 * plain, (n, plain, stored)
        assert float(r.error_final) <= float(r.error_fit) + 1e-7  # rotation keeps its best iterate
        assert r.left.shape == (96, 32) and r.right.shape == (32, 128)


def test_loraq_fit_stage_improves_on_its_init():
    w = jnp.asarray(_weights(("a",))["a"])
    cfg = lowrank.LoRaQConfig(rank=32, steps=80, rotation_steps=0, quantize_branch=False, init="svd_error")
    r = lowrank.loraq_fit(w, cfg)
    assert float(r.error_fit) < float(r.error_init)


def test_rotation_keeps_the_product():
    w = jnp.asarray(_weights(("a",))["a"])
    no_rot = lowrank.loraq_fit(w, dataclasses_replace(SMALL, rotation_steps=0))
    rot = lowrank.loraq_fit(w, SMALL)
    # L O O^T R = L R (O orthogonal): the 16-bit product is unchanged by the rotation
    np.testing.assert_allclose(np.asarray(rot.left @ rot.right), np.asarray(no_rot.left @ no_rot.right), atol=2e-4)


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_loraq_vmapped_equals_single():
    ws = _weights(("a", "b", "c"))
    cfg = dataclasses_replace(SMALL, steps=5, rotation_steps=3)
    stacked = lowrank.loraq_layers(ws, cfg)
    fit = jax.jit(lambda x: lowrank.loraq_fit(x, cfg))  # one jitted function: one compile for the equal shapes
    for n, w in ws.items():
        single = fit(jnp.asarray(w))
        np.testing.assert_allclose(stacked[n].left, np.asarray(single.left), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(stacked[n].error_final), float(single.error_final), rtol=1e-4)


def test_loraq_bad_rank_names_layer():
    with pytest.raises(ValueError, match="layer 'a'.*multiple of the branch format's block 32"):
        lowrank.loraq_layers(_weights(("a",)), dataclasses_replace(SMALL, rank=20))
    w = _weights(("a",))
    w["a"] = w["a"].copy()
    w["a"][0, 0] = np.nan
    with pytest.raises(ValueError, match="layer 'a'.*non-finite"):
        lowrank.loraq_layers(w, SMALL)


def test_svdquant_branch_and_refinement():
    rng = np.random.default_rng(0)
    w = _weights(("a",), 64, 128)["a"]
    a = rng.standard_normal((200, 128)).astype(np.float32)
    plain = lowrank.svdquant_layers({"a": w}, None, lowrank.SVDQuantConfig(rank=32, svd_method="exact"))["a"]
    l_e, r_e = lowrank.low_rank_svd(jnp.asarray(w), 32, "exact")
    np.testing.assert_allclose(plain.left @ plain.right, np.asarray(l_e @ r_e), atol=1e-4)
    assert float(plain.error_final) < float(lowrank.weight_error(jnp.asarray(w), None, None))
    cfg = lowrank.SVDQuantConfig(rank=32, refine_steps=6, svd_method="exact")
    ref = lowrank.svdquant_layers({"a": w}, {"a": a}, cfg)["a"]
    # the returned candidate is the first local minimum of the output error along the refinement sequence
    hi = jax.lax.Precision.HIGHEST
    left, right = l_e, r_e
    cands = [(left, right)]
    for _ in range(6):
        left, right = lowrank.low_rank_svd(jnp.asarray(w) - fake_quant(jnp.asarray(w) - left @ right), 32, "exact")
        cands.append((left, right))
    ref_out = a @ w.T
    errs = []
    for left, right in cands:
        out = (jnp.matmul(fake_quant(jnp.asarray(a)), fake_quant(jnp.asarray(w) - left @ right).T, precision=hi)
               + (a @ np.asarray(right).T) @ np.asarray(left).T)
        errs.append(float(np.mean((np.asarray(out) - ref_out) ** 2)))
    k = next((i for i in range(6) if errs[i + 1] > errs[i]), 6)
    np.testing.assert_allclose(ref.left @ ref.right, np.asarray(cands[k][0] @ cands[k][1]), atol=2e-3)
    with pytest.raises(ValueError, match="needs the calibration activations"):
        lowrank.svdquant_layers({"a": w}, None, cfg)


def test_resolve_rank_scales_with_layer_width():
    assert lowrank.resolve_rank(128, (256, 1024), 32) == 128  # an int is kept as given
    assert lowrank.resolve_rank(0.125, (256, 256), 32) == 32
    assert lowrank.resolve_rank(0.125, (1024, 256), 32) == 32  # min(o, d)
    assert lowrank.resolve_rank(0.125, (1152, 4608), 32) == 160  # 144 rounds to the nearest block multiple
    assert lowrank.resolve_rank(0.01, (256, 256), 32) == 32  # at least one block
    assert lowrank.resolve_rank(1.0, (96, 128), 32) == 96
    assert lowrank.resolve_rank(0.3, (96, 128), None) == 29
    for bad in (0.0, 1.5, -0.1, "32", True):
        with pytest.raises(ValueError, match="layer 'q'.*rank=.*fraction of min"):
            lowrank.resolve_rank(bad, (96, 128), 32, "q")


def test_loraq_fractional_rank_gives_each_shape_its_own_rank():
    ws = {**_weights(("a",), 64, 128), **_weights(("b",), 128, 128)}
    cfg = dataclasses_replace(SMALL, rank=0.5, steps=5, rotation_steps=3)
    res = lowrank.loraq_layers(ws, cfg)
    assert res["a"].left.shape == (64, 32) and res["a"].right.shape == (32, 128)
    assert res["b"].left.shape == (128, 64) and res["b"].right.shape == (64, 128)
    fixed = lowrank.loraq_layers({"b": ws["b"]}, dataclasses_replace(cfg, rank=64))["b"]
    np.testing.assert_allclose(res["b"].left, fixed.left, rtol=1e-5, atol=1e-6)


def test_best_init_is_the_better_of_the_two_candidates():
    """init="best" runs both decompositions through one lax.map: it must return the candidate with the lower fit loss,
    exactly as the single-candidate inits compute it."""
    no_train = dict(steps=0, rotation_steps=0, quantize_branch=False)
    fit = jax.jit(lambda x, init: lowrank.loraq_fit(x, lowrank.LoRaQConfig(rank=32, init=init, **no_train)),
                  static_argnums=1)  # one jitted function for both layers: each init compiles once
    for n, w in _weights(("a", "b"), 96, 128).items():
        w = jnp.asarray(w)
        best, err, wgt = fit(w, "best"), fit(w, "svd_error"), fit(w, "svd_weight")
        pick = err if float(err.error_init) <= float(wgt.error_init) else wgt
        np.testing.assert_allclose(float(best.error_init), min(float(err.error_init), float(wgt.error_init)),
                                   rtol=1e-6, err_msg=n)
        np.testing.assert_allclose(np.asarray(best.left @ best.right), np.asarray(pick.left @ pick.right), atol=1e-5,
                                   err_msg=n)
        assert float(best.error_fit) == float(best.error_init) == float(best.error_final)  # no training stage


def test_reported_errors_belong_to_the_returned_factors():
    """The fit's best loss is tracked inside its loop (one extra evaluation scores the last iterate) and the stored
    branch's error before the rotation is the rotation loop's first loss (O = I): both must match the factors."""
    w = jnp.asarray(_weights(("a",))["a"])
    fit16 = lowrank.loraq_fit(w, lowrank.LoRaQConfig(rank=32, steps=40, rotation_steps=0, quantize_branch=False))
    np.testing.assert_allclose(float(fit16.error_fit), float(lowrank.weight_error(w, fit16.left, fit16.right)),
                               rtol=1e-5)
    assert float(fit16.error_fit) <= float(fit16.error_init)
    unrotated = lowrank.loraq_fit(w, dataclasses_replace(SMALL, rotation_steps=0))
    rotated = lowrank.loraq_fit(w, SMALL)
    np.testing.assert_allclose(float(unrotated.error_final), float(lowrank.weight_error(
        w, unrotated.left, unrotated.right, branch_fmt=MXFP4())), rtol=1e-5)
    np.testing.assert_allclose(float(rotated.error_fit), float(unrotated.error_final), rtol=1e-5)
    np.testing.assert_allclose(float(rotated.error_final), float(lowrank.weight_error(
        w, rotated.left, rotated.right, branch_fmt=MXFP4())), rtol=1e-4)
    assert float(rotated.error_final) <= float(rotated.error_fit)


def test_driver_settings_and_a_smaller_batch_reuse_the_compiled_program():
    """max_layers_per_program and the run's shard / progress are not part of the compiled program, and pad_to sizes a smaller
    batch's program like the full batch's: one XLA compilation for all three calls below."""
    ws = _weights(("a", "b", "c"), 64, 96)
    cfg = lowrank.LoRaQConfig(rank=32, steps=3, rotation_steps=2, max_layers_per_program=2)
    with recorded_compilations("loraq") as compiled:
        full = lowrank.loraq_layers(ws, cfg)  # chunks of 2 (the last one padded)
        alone = lowrank.loraq_layers({"c": ws["c"]}, dataclasses_replace(cfg, max_layers_per_program=4),
                                     run=layerset.RunConfig(shard=False), pad_to=2)
        lowrank.loraq_layers({"b": ws["b"]}, cfg, run=layerset.RunConfig(progress=True), pad_to=2)
    assert compiled == ["jit(loraq_program)"]
    np.testing.assert_allclose(alone["c"].left, full["c"].left, rtol=1e-5, atol=1e-6)


def test_every_loraq_and_svdquant_matmul_asks_for_highest_precision():
    """f32 matmuls left at the default precision may run as TF32 on NVIDIA GPUs (10-bit mantissa): every matmul of
    LoRaQ (SVD init, Adam fit and the Cayley-SGD rotation step, gradients included) and of SVDQuant's refinement asks
    for Precision.HIGHEST, in the jaxpr and in the lowered program."""
    w = jnp.asarray(_weights(("a",), 64, 96)["a"])
    cfg = lowrank.LoRaQConfig(rank=32, steps=2, rotation_steps=2)
    dots = assert_every_dot_highest(lambda x: lowrank.loraq_fit(x, cfg), w, must_include="loraq_fit.<locals>.rot_step")
    # The Cayley step itself: W^ = M X^T - X (X^T M X^T) / 2, M = skew(W^) X, (I + a/2 S) X: 6 products, besides the
    # loss gradient's.
    assert sum("(loraq_fit.<locals>.rot_step)" in where for _, where in dots) >= 6, dots
    a = jnp.asarray(np.random.default_rng(1).standard_normal((80, 96)), jnp.float32)
    assert_every_dot_highest(lambda x, y: lowrank.svdquant_fit(x, y, lowrank.SVDQuantConfig(rank=8, refine_steps=2)),
                             w, a, must_include="svdquant_fit")

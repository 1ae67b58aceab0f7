"""SmoothQuant (α, β) search: γ definition, the searched error against numpy, vmapped == per-layer, padded
programs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_checks import assert_every_dot_highest  # tests/jaxpr_checks.py
from kroquant_jax import layerset, smoothquant, synthetic
from kroquant_jax.formats import fake_quant
from kroquant_jax.timing import recorded_compilations

GRID = (0.0, 0.5, 1.0)
RUN = layerset.RunConfig(num_rows=120, num_validation=40, num_test=40)


def _cfg(**kw):
    base = dict(alphas=GRID, betas=GRID, svd_rank=8, svd_method="exact")
    base.update(kw)
    return smoothquant.SmoothQuantConfig(**base)


def _layers(names=("x", "y")):
    return synthetic.synthetic_layer_set({n: (48, 64) for n in names}, n=200)


def test_smoothing_factors_formula():
    rng = np.random.default_rng(0)
    am, wm = rng.random(8) * 10, rng.random(8)
    am[0] = 0.0
    got = np.asarray(smoothquant.smoothing_factors(jnp.asarray(am), jnp.asarray(wm), 0.7, 0.3, 1e-5))
    np.testing.assert_allclose(got, np.maximum(am, 1e-5) ** 0.7 / np.maximum(wm, 1e-5) ** 0.3, rtol=1e-5)


def test_search_error_matches_numpy_and_picks_the_minimum():
    ls = _layers(("x",))
    cfg = _cfg()
    res = smoothquant.smoothquant_layers(ls, cfg, run=RUN)["x"]
    layer = ls["x"]
    split = RUN.split("x", layer.activations.shape[0])
    assert len(split.calibration) == 120
    a = layer.activations[split.calibration].astype(np.float64)
    w = layer.weight.astype(np.float64)
    for i, al in enumerate(GRID):
        for j, be in enumerate(GRID):
            gamma = np.maximum(np.abs(a).max(0), 1e-5) ** al / np.maximum(np.abs(w).max(0), 1e-5) ** be
            a_s, w_s = a / gamma, w * gamma
            u, s, vt = np.linalg.svd(w_s, full_matrices=False)
            lr = (u[:, :8] * s[:8]) @ vt[:8]
            qa = np.asarray(fake_quant(jnp.asarray(a_s, jnp.float32)), np.float64)
            qw = np.asarray(fake_quant(jnp.asarray(w_s - lr, jnp.float32)), np.float64)
            want = np.mean((qa @ qw.T + a_s @ lr.T - a @ w.T) ** 2)
            np.testing.assert_allclose(res.errors[i, j], want, rtol=2e-2)
    i, j = np.unravel_index(np.argmin(res.errors), res.errors.shape)
    assert (res.alpha, res.beta) == (GRID[i], GRID[j])
    assert res.errors[i, j] < res.errors[0, 0]  # smoothing beats no smoothing on outlier channels
    gamma = np.maximum(np.abs(a).max(0), 1e-5) ** res.alpha / np.maximum(np.abs(w).max(0), 1e-5) ** res.beta
    np.testing.assert_allclose(res.gamma, gamma, rtol=1e-4)


def test_vmapped_equals_per_layer():
    ls = _layers(("x", "y", "z"))
    cfg = _cfg(svd_rank=0)
    stacked = smoothquant.smoothquant_layers(ls, cfg)
    for n in ls:
        single = smoothquant.smoothquant_layers({n: ls[n]}, cfg)[n]
        np.testing.assert_allclose(stacked[n].errors, single.errors, rtol=1e-5)
        np.testing.assert_allclose(stacked[n].gamma, single.gamma, rtol=1e-6)
    assert jax.tree.structure(stacked["x"]) == jax.tree.structure(single)


def test_pad_to_keeps_results_and_a_smaller_batch_reuses_the_program():
    """``pad_to`` sizes a smaller batch's program like the full batch's (one XLA compilation for the three calls
    below; the driver settings are not part of the program either), and the padding layers (copies of the first
    layer) are dropped: every layer gets exactly what an unpadded per-layer run gives it."""
    ls = _layers(("x", "y", "z"))
    cfg = _cfg(alphas=(0.0, 0.25, 0.75), betas=(0.0, 0.5), max_layers_per_program=2)  # a grid no other test compiles
    with recorded_compilations("_search_stacked") as compiled:
        full = smoothquant.smoothquant_layers(ls, cfg)  # chunks of 2 (the last one padded)
        alone = smoothquant.smoothquant_layers({"z": ls["z"]}, dataclasses.replace(cfg, max_layers_per_program=4),
                                               run=layerset.RunConfig(shard=False), pad_to=2)
        pair = smoothquant.smoothquant_layers({"y": ls["y"], "x": ls["x"]}, cfg,
                                              run=layerset.RunConfig(progress=True), pad_to=2)
    assert compiled == ["jit(_search_stacked)"], compiled
    assert list(full) == ["x", "y", "z"] and list(alone) == ["z"] and list(pair) == ["y", "x"]
    for n in ls:
        single = smoothquant.smoothquant_layers({n: ls[n]}, cfg)[n]  # a one-layer program, no padding
        for got in (full[n], (alone if n == "z" else pair)[n]):
            np.testing.assert_array_equal(got.errors, single.errors, err_msg=n)
            np.testing.assert_array_equal(got.gamma, single.gamma, err_msg=n)
            assert (got.alpha, got.beta) == (single.alpha, single.beta), n
    # The layers differ, so a result taken from the padding (a copy of the first layer) would show above.
    assert not np.array_equal(full["z"].errors, full["x"].errors)
    assert not np.array_equal(pair["x"].errors, pair["y"].errors)


def test_fractional_svd_rank_is_resolved_per_layer():
    """``svd_rank`` as a fraction of min(o, d): 0.125 of the 48 x 64 layers is rank 6, the same search as rank 6."""
    ls = _layers(("x",))
    frac = smoothquant.smoothquant_layers(ls, _cfg(svd_rank=0.125), run=RUN)["x"]
    six = smoothquant.smoothquant_layers(ls, _cfg(svd_rank=6), run=RUN)["x"]
    np.testing.assert_array_equal(frac.errors, six.errors)


def test_every_search_matmul_asks_for_highest_precision():
    """Every matmul of the search (randomized and exact SVD branch, candidate errors) asks for Precision.HIGHEST."""
    layer = _layers(("x",))["x"]
    a, w = jnp.asarray(layer.activations[:100]), jnp.asarray(layer.weight)
    for method in ("randomized", "exact"):
        assert_every_dot_highest(lambda x, y: smoothquant.search_one(x, y, _cfg(svd_method=method)), a, w,
                                 must_include="_candidate_error")

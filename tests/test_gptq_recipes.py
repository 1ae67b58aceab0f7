"""GPTQ as the recipes' weight-rounding stage (kroquant_jax.calibrate ``+gptq``): names, held-out error against
round-to-nearest, both orders with the low-rank branch, provenance, the stored layer."""

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import calibrate, formats, gptq, lowrank, provenance, qlinear, transforms
from kroquant_jax.layerset import LayerData
from kroquant_jax.gptq import GPTQConfig

RUN = calibrate.RunConfig(num_rows=384, num_validation=64, num_test=128)
FAST = {"calib_steps": 4, "loraq_steps": 5, "rotation_steps": 5, "rank": 32, "sq_grid": 3}


def _correlated_layer(o=32, d=64, n=600, seed=0):
    """Activations with 4 dominant directions plus small isotropic noise (rows i.i.d., so held-out rows share the
    correlation), a Gaussian weight, a bias."""
    rng = np.random.default_rng(seed)
    a = 3.0 * rng.standard_normal((n, 4)) @ rng.standard_normal((4, d)) + 0.3 * rng.standard_normal((n, d))
    w = rng.standard_normal((o, d)) * 0.1
    return {"blk.proj": (w.astype(np.float32), rng.standard_normal(o).astype(np.float32), a.astype(np.float32))}


def _recipe(name, **settings):
    return calibrate.recipe_from_args(name, {**FAST, **settings}, num_rows=RUN.num_rows,
                                      num_validation=RUN.num_validation, num_test=RUN.num_test)


def test_recipe_names_parse():
    for base in calibrate.RECIPES:
        for suffix in ("+gptq", "+gptq+loraq", "+loraq+gptq"):
            r = calibrate.get_recipe(base + suffix)
            assert r.gptq == GPTQConfig(), (base, suffix)
            assert r.transform == calibrate.RECIPES[base].transform
            assert r.lowrank == ("loraq" if "loraq" in suffix else calibrate.RECIPES[base].lowrank)
        assert calibrate.get_recipe(base).gptq is None
    for bad in ("kroquant+gptq+gptq", "kroquant+gtpq", "gptq", "kroquant+"):
        with pytest.raises(KeyError, match="unknown recipe"):
            calibrate.get_recipe(bad)
    with pytest.raises(ValueError, match="unknown recipe"):
        calibrate.recipe_from_args("smoothed_kroquant+gptq+lora", {})
    r = calibrate.recipe_from_args("smoothed_kroquant+gptq+loraq@64", {"gptq_damp": 0.1, "gptq_act_order": "on",
                                                                      "gptq_order": "gptq_first",
                                                                      "gptq_scales": "static"})
    assert r.gptq == GPTQConfig(damp=0.1, act_order=True, lowrank_order="gptq_first", scales="static")
    assert r.loraq.rank == 64 and r.smooth_init and r.transform == "smoothed_kron"
    # gptq_first stores GPTQ's rounding with a branch fitted to its error: the recipe's choice with the branch (which
    # scores a branch fitted to the rounded-to-nearest residual) is off, and asking for both is refused
    assert calibrate.get_recipe("smoothed_kroquant+gptq+loraq").select_with_branch and not r.select_with_branch
    with pytest.raises(ValueError, match="select_with_branch scores each candidate .* turn one of them off"):
        calibrate.recipe_from_args("smoothed_kroquant+gptq+loraq", {"gptq_order": "gptq_first",
                                                                    "select_with_branch": "on"})
    parser = argparse.ArgumentParser()
    calibrate.add_recipe_arguments(parser)
    args = parser.parse_args(["--gptq-damp", "0.1", "--gptq-act-order", "on", "--gptq-order", "gptq_first",
                              "--gptq-scales", "static"])
    assert calibrate.recipe_from_args("smoothed_kroquant+gptq+loraq@64", args) == r
    assert calibrate.recipe_from_args("svdquant+gptq", parser.parse_args(["--gptq-act-order", "off"])).gptq == \
        GPTQConfig(act_order=False)
    # the GPTQ settings only reach a recipe that runs GPTQ
    assert calibrate.recipe_from_args("smoothed_kroquant+loraq", {"gptq_damp": 0.1}).gptq is None
    with pytest.raises(ValueError, match="damp"):
        calibrate.recipe_from_args("kroquant+gptq", {"gptq_damp": -1.0})
    with pytest.raises(ValueError, match="lowrank_order"):
        GPTQConfig(lowrank_order="interleaved")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``{spec: (layers, reports)}`` of the methods the tests below compare, on one correlated layer (computed once);
    ``"store"``: the folder ``hadamard32+gptq+loraq`` was stored in."""
    layers = _correlated_layer()
    store = str(tmp_path_factory.mktemp("gptq") / "store")
    out = {"store": store}
    for spec in ("smoothquant", "smoothquant+gptq", "hadamard32", "hadamard32+gptq", "hadamard32+loraq",
                 "hadamard32+gptq+loraq", "hadamard32+gptq+loraq:gptq_first"):
        name, _, order = spec.partition(":")
        out[spec] = calibrate.quantize_layer_set(layers, _recipe(name, gptq_order=order or None),
                                                 store=store if spec == "hadamard32+gptq+loraq" else None)
    return out


@pytest.mark.parametrize("name", ["hadamard32", "smoothquant", "hadamard32+loraq"])
def test_gptq_lowers_the_heldout_error_vs_round_to_nearest(results, name):
    gptq_name = name.replace("+loraq", "") + "+gptq" + ("+loraq" if "+loraq" in name else "")
    rtn, gq = results[name][1]["blk.proj"], results[gptq_name][1]["blk.proj"]
    assert gq["rounding"] == "gptq" and "rounding" not in rtn
    assert gq["heldout_error"] <= 0.9 * rtn["heldout_error"], (name, gq["heldout_error"], rtn["heldout_error"])
    # the transform stage is the same; only the rounding of the stored weight differs
    assert gq["transform_test_error"] == pytest.approx(rtn["transform_test_error"])


@pytest.mark.parametrize("spec", ["hadamard32+gptq+loraq", "hadamard32+gptq+loraq:gptq_first"])
def test_gptq_with_the_lowrank_branch(results, spec):
    w, _, a = _correlated_layer()["blk.proj"]
    layer, rep = results[spec][0]["blk.proj"], results[spec][1]["blk.proj"]
    assert layer.config.rank == 32 and layer.lowrank_quantized
    # the branch lowers the error of GPTQ alone
    assert rep["heldout_error"] < results["hadamard32+gptq"][1]["blk.proj"]["heldout_error"]
    # what the order means for the stored weight (H from the transformed calibration rows)
    param = transforms.get("hadamard32")
    blocks = param.blocks(param.init(64))
    a_cal = calibrate.layer_rows("blk.proj", LayerData(w, None, a), RUN).calibration
    h = gptq.hessian(transforms.apply_to_activations(jnp.asarray(a_cal), blocks))
    stored = formats.dequantize(layer.weight, jnp.float32)
    if spec.endswith("gptq_first"):  # GPTQ of W~ itself, the branch fitted to its error afterwards
        expected = gptq.gptq_fake_quant(transforms.apply_to_weights(jnp.asarray(w), blocks), h, formats.MXFP4())
    else:  # GPTQ of the residual against the branch as stored
        resid = qlinear.residual_weight(w, transform="hadamard32", lowrank=(
            formats.dequantize(layer.lowrank_left, jnp.float32), formats.dequantize(layer.lowrank_right, jnp.float32)))
        expected = gptq.gptq_fake_quant(resid, h, formats.MXFP4())
    np.testing.assert_array_equal(np.asarray(stored), np.asarray(expected))
    # the LoRaQ stage's own fit is the branch only in branch_first
    rtn_left = results["hadamard32+loraq"][0]["blk.proj"].lowrank_left
    same = np.array_equal(np.asarray(layer.lowrank_left.codes), np.asarray(rtn_left.codes))
    assert same == (not spec.endswith("gptq_first"))


def test_whitened_low_rank_minimises_the_h_norm():
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((200, 6)) @ rng.standard_normal((6, 32)) + 0.1 * rng.standard_normal((200, 32)),
                    jnp.float32)
    e = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    h = gptq.hessian(a)

    def out_err(b):
        return float(jnp.linalg.norm(a @ (e - b).T))

    left, right = gptq.whitened_low_rank(e, h, 4, damp=1e-4, method="exact")
    plain = lowrank.low_rank_svd(e, 4, "exact")
    assert out_err(left @ right) < 0.7 * out_err(plain[0] @ plain[1])
    assert out_err(left @ right) < 0.5 * out_err(jnp.zeros_like(e))
    full = gptq.whitened_low_rank(e, h, 16, damp=1e-4, method="exact")
    np.testing.assert_allclose(np.asarray(full[0] @ full[1]), np.asarray(e), atol=1e-3)


def test_gptq_layers_equals_one_layer_at_a_time():
    rng = np.random.default_rng(4)
    ws = {f"l{i}": rng.standard_normal((8, 64)).astype(np.float32) for i in range(2)}
    ws["wide"] = rng.standard_normal((8, 128)).astype(np.float32)
    hs = {}
    for n, w in ws.items():
        a = rng.standard_normal((100, 3)) @ rng.standard_normal((3, w.shape[1])) + 0.2 * rng.standard_normal(
            (100, w.shape[1]))
        hs[n] = np.asarray(gptq.hessian(a))
    for fmt, names in ((formats.MXFP4(), list(ws)), (formats.NVFP4(), ["l0", "l1"])):  # NVFP4: a tensor scale each
        cfg = GPTQConfig(act_order=True)
        out = gptq.gptq_layers({n: ws[n] for n in names}, hs, fmt, cfg, pad_to=3)
        assert list(out) == names
        for n in names:
            one = gptq.gptq_quantize(ws[n], hs[n], fmt, act_order=True)
            np.testing.assert_array_equal(np.asarray(formats.dequantize(out[n], jnp.float32)),
                                          np.asarray(formats.dequantize(one, jnp.float32)))
    bad = dict(hs, l1=np.full((64, 64), np.nan, np.float32))  # refused before any compilation
    with pytest.raises(ValueError, match="layer 'l1'"):
        gptq.gptq_layers(ws, bad)
    with pytest.raises(ValueError, match="layer 'wide' has no Hessian"):
        gptq.gptq_layers(ws, {k: v for k, v in hs.items() if k != "wide"})


def test_build_qlinear_checks_the_given_weight():
    w = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    q = formats.quantize(jnp.asarray(w), formats.NVFP4())
    with pytest.raises(ValueError, match="layer 'x': quantized_weight must be a QuantizedArray of mxfp4"):
        qlinear.build_qlinear(w, quantized_weight=q, name="x")
    with pytest.raises(ValueError, match="quantized_weight must be"):
        qlinear.build_qlinear(w, quantized_weight=np.zeros((8, 64)), name="x")


def test_provenance_includes_the_gptq_settings(results):
    layers = _correlated_layer()
    w, b, a = layers["blk.proj"]
    base = _recipe("hadamard32+gptq")
    fp = provenance.layer_fingerprint(w, b, a, base)
    assert fp["recipe"]["gptq.damp"] == 0.01 and fp["recipe"]["gptq.lowrank_order"] == "branch_first"
    for field, value, text in (("damp", 0.05, "gptq.damp: 0.01 -> 0.05"), ("act_order", True,
                                                                           "gptq.act_order: False -> True"),
                               ("lowrank_order", "gptq_first", "gptq.lowrank_order: 'branch_first' -> 'gptq_first'")):
        other = dataclasses.replace(base, gptq=dataclasses.replace(base.gptq, **{field: value}))
        assert provenance.describe_changes(fp, provenance.layer_fingerprint(w, b, a, other)) == [
            f"recipe setting {text}"]
    rtn = dataclasses.replace(base, gptq=None)
    changes = provenance.describe_changes(fp, provenance.layer_fingerprint(w, b, a, rtn))
    assert "recipe setting gptq.damp: 0.01 -> '<unset>'" in changes
    # a fingerprint stored before recipes had a gptq field still matches the round-to-nearest recipe
    old = provenance.layer_fingerprint(w, b, a, rtn)
    del old["recipe"]["gptq"]
    assert provenance.describe_changes(old, provenance.layer_fingerprint(w, b, a, rtn)) == []
    # a store written with the default damp refuses another
    recipe = _recipe("hadamard32+gptq+loraq")
    calibrate.quantize_layer_set(layers, recipe, store=results["store"])  # same settings: resumes
    with pytest.raises(provenance.StaleResultError, match="gptq.damp: 0.01 -> 0.05"):
        calibrate.quantize_layer_set(layers, dataclasses.replace(recipe, gptq=GPTQConfig(damp=0.05)),
                                     store=results["store"])


def test_stored_gptq_layer_round_trips(results):
    layers = _correlated_layer()
    q, rep = results["hadamard32+gptq+loraq"]
    loaded, meta = qlinear.QLinearStore(results["store"]).load("blk.proj")
    for got, want in ((loaded.weight, q["blk.proj"].weight), (loaded.lowrank_left, q["blk.proj"].lowrank_left)):
        np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    x = jnp.asarray(layers["blk.proj"][2][:16])
    np.testing.assert_array_equal(np.asarray(qlinear.qlinear_forward(loaded, x)),
                                  np.asarray(qlinear.qlinear_forward(q["blk.proj"], x)))
    assert meta["rounding"] == "gptq"
    # GPTQ's weight is not the round-to-nearest one of the same residual
    resid = qlinear.residual_weight(layers["blk.proj"][0], transform="hadamard32", lowrank=(
        formats.dequantize(loaded.lowrank_left, jnp.float32), formats.dequantize(loaded.lowrank_right, jnp.float32)))
    assert not np.array_equal(np.asarray(loaded.weight.codes),
                              np.asarray(formats.quantize(resid, formats.MXFP4()).codes))
    _, again = calibrate.quantize_layer_set(layers, _recipe("hadamard32+gptq+loraq"), store=results["store"])
    assert again["blk.proj"]["resumed"] and again["blk.proj"]["heldout_error"] == rep["blk.proj"]["heldout_error"]


@pytest.mark.parametrize("order, rank", [("branch_first", 32), ("gptq_first", 0)])
def test_smoothing_search_models_the_branch_only_when_it_carries_the_weight(monkeypatch, order, rank):
    """The SmoothQuant search's 16-bit SVD branch (default rank 32) stands for a LoRaQ branch that carries the main
    part of W T^-T; under gptq_first the branch fits GPTQ's error only, so the search models no branch (rank 0)."""
    seen = []

    class Stop(Exception):
        pass

    def spy(layers, config, **kwargs):
        seen.append(config.svd_rank)
        raise Stop

    monkeypatch.setattr(calibrate.smoothquant, "smoothquant_layers", spy)
    recipe = calibrate.recipe_from_args("smoothed_kroquant+gptq+loraq", {"gptq_order": order})
    rng = np.random.default_rng(0)
    layer = LayerData(rng.standard_normal((32, 64)).astype(np.float32), None,
                      rng.standard_normal((48, 64)).astype(np.float32))
    with pytest.raises(Stop):
        calibrate.quantize_layer_set({"l": layer}, recipe)
    assert seen == [rank]

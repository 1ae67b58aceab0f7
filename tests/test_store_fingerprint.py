"""Stored calibration results carry the fingerprint of their inputs: a stale one is refused, never reused silently."""

import dataclasses

import numpy as np
import pytest

from kroquant_jax import calibrate, provenance, qlinear


def _layer_set(seed=0, shapes=((32, 64), (32, 64))):
    rng = np.random.default_rng(seed)
    return {f"block{i}.attn": ((rng.standard_normal((o, d)) * 0.05).astype(np.float32),
                               rng.standard_normal(o).astype(np.float32),
                               rng.standard_normal((40, d)).astype(np.float32))
            for i, (o, d) in enumerate(shapes)}


RECIPE = calibrate.get_recipe("hadamard32", run=calibrate.RunConfig(num_rows=24, num_validation=8, num_test=8))


def test_fingerprint_names_each_change():
    w, b, a = _layer_set()["block0.attn"]
    base = provenance.layer_fingerprint(w, b, a, RECIPE)
    assert provenance.describe_changes(base, provenance.layer_fingerprint(w.copy(), b, a, RECIPE)) == []
    w2 = w.copy()
    w2[0, 0] += 1e-3
    assert provenance.describe_changes(base, provenance.layer_fingerprint(w2, b, a, RECIPE)) == ["weight"]
    assert provenance.describe_changes(base, provenance.layer_fingerprint(w, b, a[1:], RECIPE)) == ["activations"]
    assert provenance.describe_changes(base, provenance.layer_fingerprint(w, None, a, RECIPE)) == [
        "bias (present -> none)"]
    other = dataclasses.replace(RECIPE, run=dataclasses.replace(RECIPE.run, num_rows=16))
    assert provenance.describe_changes(base, provenance.layer_fingerprint(w, b, a, other)) == [
        "recipe setting run.num_rows: 24 -> 16"]
    # scheduling settings do not change a result, so they are not part of the fingerprint
    sched = dataclasses.replace(RECIPE, calibration=dataclasses.replace(RECIPE.calibration, max_layers_per_program=3),
                                run=dataclasses.replace(RECIPE.run, progress=True, shard=False))
    assert provenance.describe_changes(base, provenance.layer_fingerprint(w, b, a, sched)) == []
    assert provenance.describe_changes(dict(base, numerics_version=0), base) == ["library numerics version 0 -> 1"]
    assert provenance.describe_changes(None, base) == ["no fingerprint stored (written by an older version)"]
    # a partial fingerprint (before a capture: no activations) checks only what it has
    assert provenance.describe_changes(base, provenance.layer_fingerprint(w, b, None, RECIPE)) == []


def test_matching_rerun_resumes_every_layer(tmp_path):
    store = str(tmp_path / "store")
    first, rep1 = calibrate.quantize_layer_set(_layer_set(), RECIPE, store=store)
    assert not any(r["resumed"] for r in rep1.values())
    again, rep2 = calibrate.quantize_layer_set(_layer_set(), RECIPE, store=store)
    assert all(r["resumed"] for r in rep2.values())
    assert "fingerprint" not in rep2["block0.attn"]
    for n in first:
        np.testing.assert_array_equal(np.asarray(first[n].weight.codes), np.asarray(again[n].weight.codes))
        assert rep2[n]["heldout_error"] == pytest.approx(rep1[n]["heldout_error"])


@pytest.mark.parametrize("change, expected", [
    ("weights", "'block0.attn' was computed from other inputs (weight, bias, activations; 1 more stored layer(s)"),
    ("recipe", "(recipe setting run.num_validation: 8 -> 6; 1 more stored layer(s) differ too)"),
    ("activations", "'block1.attn' was computed from other inputs (activations)"),
])
def test_rerun_with_other_inputs_is_refused(tmp_path, change, expected):
    store = str(tmp_path / "store")
    calibrate.quantize_layer_set(_layer_set(), RECIPE, store=store)
    layer_set, recipe = _layer_set(), RECIPE
    if change == "weights":
        layer_set = _layer_set(seed=1)  # another checkpoint of the same shapes
    elif change == "recipe":
        recipe = dataclasses.replace(RECIPE, run=dataclasses.replace(RECIPE.run, num_validation=6))
    else:
        w, b, a = layer_set["block1.attn"]
        layer_set["block1.attn"] = (w, b, a[::-1].copy())
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "store").iterdir()}
    with pytest.raises(provenance.StaleResultError) as err:
        calibrate.quantize_layer_set(layer_set, recipe, store=store)
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "store").iterdir()} == before  # nothing replaced
    _, rep = calibrate.quantize_layer_set(layer_set, recipe, store=store, overwrite=True)
    assert not any(r["resumed"] for r in rep.values())
    _, rep = calibrate.quantize_layer_set(layer_set, recipe, store=store)  # the store now matches the new inputs
    assert all(r["resumed"] for r in rep.values())


def test_store_without_fingerprint_is_refused(tmp_path):
    layer_set = _layer_set()
    q, _ = calibrate.quantize_layer_set(layer_set, RECIPE)
    store = qlinear.QLinearStore(str(tmp_path / "old"))
    store.save("block0.attn", q["block0.attn"])  # as an older version wrote it
    with pytest.raises(provenance.StaleResultError, match="no fingerprint stored"):
        calibrate.quantize_layer_set(layer_set, RECIPE, store=store)
    w, b, a = layer_set["block0.attn"]
    with pytest.raises(provenance.StaleResultError, match="'block0.attn'"):
        store.load("block0.attn", fingerprint=provenance.layer_fingerprint(w, b, a, RECIPE))
    assert store.load("block0.attn")[1]["name"] == "block0.attn"  # without a fingerprint: loads as before

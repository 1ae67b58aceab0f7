"""Calibration engine: vmapped == per-layer, sharded == unsharded, safeguard, determinism, bad input, resume."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from kroquant_jax import calibrate, layerset, lowrank, objectives, qlinear, smoothquant, transforms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = dict(steps=20)
RUN = calibrate.RunConfig(num_rows=160, num_validation=64, num_test=64)


def _layer_set(shapes=((48, 64), (48, 64), (32, 96)), n=300, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i, (o, d) in enumerate(shapes):
        a = rng.standard_normal((n, d)).astype(np.float32)
        a[:, rng.integers(0, d, 2)] *= 25.0
        w = (rng.standard_normal((o, d)) * 0.05).astype(np.float32)
        out[f"block{i}.attn"] = (w, rng.standard_normal(o).astype(np.float32), a)
    return out


def _assert_same_params(r1, r2, rtol=1e-5, atol=1e-6):
    assert r1.keys() == r2.keys()
    for name in r1:
        assert r1[name].chosen == r2[name].chosen, name
        for x, y in zip(jax.tree.leaves(r1[name].params), jax.tree.leaves(r2[name].params)):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=name)


_STACKED = {}


def _stacked_run():
    """One stacked KroQuant run (10 steps) shared by the tests below (compiles once per test session)."""
    if not _STACKED:
        ls = _layer_set()
        cfg = calibrate.CalibrationConfig(transform="kron_lu", **dict(FAST, steps=10))
        _STACKED.update(ls=ls, cfg=cfg, res=calibrate.calibrate_layers(ls, cfg, run=RUN))
    return _STACKED["ls"], _STACKED["cfg"], _STACKED["res"]


def test_training_lowers_loss_and_validation_and_test_error():
    _, _, res = _stacked_run()
    for name, r in res.items():
        assert r.losses.shape == (1, 10)
        assert r.losses[0, -1] < r.losses[0, 0], name
        assert r.validation_errors["trained0"] < r.validation_errors["init0"], name
        assert r.test_errors["trained0"] < r.test_errors["init0"], name
        assert r.chosen == "trained0"
        assert r.test_error == r.test_errors["trained0"] != r.validation_error


def test_vmapped_equals_per_layer():
    """Stacked programs and a per-layer loop agree to float rounding. (Over many steps, rounding differences of a
    batched vs. unbatched matmul can flip single quantization decisions and the runs drift apart by ~1e-3: 10 steps
    keep the comparison tight.)"""
    ls, cfg, stacked = _stacked_run()
    one_by_one = {n: calibrate.calibrate_layers({n: ls[n]}, cfg, run=RUN)[n] for n in ls}
    _assert_same_params(stacked, one_by_one, rtol=1e-5, atol=1e-5)
    chunked = calibrate.calibrate_layers(ls, dataclasses.replace(cfg, max_layers_per_program=1), run=RUN)
    _assert_same_params(stacked, chunked, rtol=1e-5, atol=1e-5)
    for n in ls:
        np.testing.assert_allclose(stacked[n].test_error, one_by_one[n].test_error, rtol=1e-5)


def test_deterministic_for_a_seed():
    ls, cfg, res = _stacked_run()
    _assert_same_params(res, calibrate.calibrate_layers(ls, cfg, run=RUN), rtol=0, atol=0)


def test_rows_depend_on_seed_and_name_only_and_are_disjoint():
    s1 = layerset.split_rows("a", 1000, 300, 100, 50, seed=0)
    s2 = layerset.split_rows("a", 1000, 300, 100, 50, seed=0)
    s3 = layerset.split_rows("b", 1000, 300, 100, 50, seed=0)
    for field in ("calibration", "validation", "test"):
        np.testing.assert_array_equal(getattr(s1, field), getattr(s2, field))
        assert not np.array_equal(getattr(s1, field), getattr(s3, field))
    assert (len(s1.calibration), len(s1.validation), len(s1.test)) == (300, 100, 50)
    assert not (set(s1.calibration) & set(s1.validation) or set(s1.calibration) & set(s1.test)
                or set(s1.validation) & set(s1.test))
    # The calibration and validation rows do not depend on the test slice's size (the split before the test slice
    # was added drew the same calibration and held-out rows).
    s4 = layerset.split_rows("a", 1000, 300, 100, 200, seed=0)
    np.testing.assert_array_equal(s1.calibration, s4.calibration)
    np.testing.assert_array_equal(s1.validation, s4.validation)
    assert set(s1.test) < set(s4.test)
    small = layerset.split_rows("a", 50, 300, 100, 100, seed=0)  # too few rows: a fifth validates, a fifth tests
    assert (len(small.calibration), len(small.validation), len(small.test)) == (30, 10, 10)
    assert len(set(small.calibration) | set(small.validation) | set(small.test)) == 50
    # fewer rows than asked: never more than asked for, the validation rows unchanged, calibration the first of the
    # full split's (the test slice takes at most a fifth)
    few = layerset.split_rows("a", 1000, 10, 10, 1000, seed=0)
    assert (len(few.calibration), len(few.validation), len(few.test)) == (10, 10, 200)
    full = layerset.split_rows("a", 1500, 1024, 256, 200, seed=0)
    short = layerset.split_rows("a", 1500, 1024, 256, 256, seed=0)
    assert (len(short.calibration), len(short.validation), len(short.test)) == (988, 256, 256)
    np.testing.assert_array_equal(short.validation, full.validation)
    assert set(short.calibration) < set(full.calibration)
    with pytest.raises(ValueError, match="'a'.*at least 3"):
        layerset.split_rows("a", 2, 1, 1, 1, seed=0)
    with pytest.raises(ValueError, match="num_test"):
        calibrate.RunConfig(num_test=0)


def test_safeguard_keeps_the_best_candidate():
    """8 calibration rows and a far too large learning rate make the trained transform worse on validation rows than
    its Hadamard init; the safeguard falls back to the init (paper-literal settings: no best iterate, which would
    itself fall back to the init)."""
    ls = _layer_set(shapes=((48, 64),), n=600)
    kw = dict(transform="kron_lu", steps=20, learning_rate=0.5, lr_schedule="constant", select_every=0)
    run = calibrate.RunConfig(num_rows=8, num_validation=256, num_test=256)
    guarded = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(**kw), run=run)
    plain = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(safeguard=False, **kw), run=run)
    (g,), (p,) = guarded.values(), plain.values()
    assert p.chosen == "trained0"
    assert g.validation_errors["trained0"] > g.validation_errors["init0"]  # it did overfit
    assert g.chosen == "init0" and g.validation_error == min(g.validation_errors.values())
    assert g.validation_error <= p.validation_error
    assert g.test_error == g.test_errors["init0"]


def test_several_inits_and_fixed_transforms():
    ls = _layer_set(shapes=((48, 64),))
    (name,) = ls
    gamma = np.exp(np.random.default_rng(1).normal(size=64) * 0.3).astype(np.float32)
    sk = transforms.get("smoothed_kron")
    inits = {name: [sk.init(64), transforms.smoothed_kron.init_from_scales(gamma)]}
    res = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(transform="smoothed_kron", **FAST), inits=inits,
                                     run=RUN)
    r = res[name]
    assert set(r.validation_errors) == set(r.test_errors) == {"init0", "init1", "trained0", "trained1"}
    assert r.losses.shape == (2, 20) and r.lambdas.shape == (2, 2)
    assert r.validation_error == min(r.validation_errors.values())
    fixed = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(transform="hadamard32", **FAST), run=RUN)[name]
    assert fixed.chosen == "init0" and fixed.losses.shape == (1, 0)
    np.testing.assert_allclose(fixed.test_error, r.test_errors["init0"], rtol=1e-6)
    np.testing.assert_allclose(fixed.validation_error, r.validation_errors["init0"], rtol=1e-6)


@pytest.mark.parametrize("name", ["dense32", "cayley32", "diagonal"])
def test_any_parameterization_runs(name):
    res = calibrate.calibrate_layers(_layer_set(shapes=((16, 32),)), calibrate.CalibrationConfig(transform=name, steps=5),
                                     run=calibrate.RunConfig(num_rows=64, num_validation=32, num_test=32))
    (r,) = res.values()
    assert np.isfinite(r.test_error)
    assert r.validation_error <= r.validation_errors["init0"]


def test_bad_input_names_the_layer():
    ls = _layer_set(shapes=((48, 64), (48, 64)))
    bad = dict(ls)
    w, b, a = bad["block1.attn"]
    a = a.copy()
    a[3, 5] = np.nan
    bad["block1.attn"] = (w, b, a)
    with pytest.raises(ValueError, match=r"block1\.attn.*activations.*non-finite"):
        calibrate.calibrate_layers(bad, calibrate.CalibrationConfig(**FAST))
    bad = dict(ls)
    bad["block1.attn"] = (w, b, np.ones((100, 32), np.float32))
    with pytest.raises(ValueError, match=r"block1\.attn.*disagree on d"):
        calibrate.calibrate_layers(bad, calibrate.CalibrationConfig(**FAST))
    bad = {"odd": (np.ones((8, 40), np.float32), None, np.ones((100, 40), np.float32))}
    with pytest.raises(ValueError, match=r"odd.*multiple of 32"):
        calibrate.calibrate_layers(bad, calibrate.CalibrationConfig(**FAST))
    with pytest.raises(ValueError, match=r"block0\.attn.*bias"):
        calibrate.calibrate_layers({"block0.attn": (w, np.ones(3, np.float32), ls["block0.attn"][2])},
                                   calibrate.CalibrationConfig(**FAST))


def test_layer_set_file_round_trip(tmp_path):
    ls = _layer_set(shapes=((16, 32), (8, 64)))
    ls["no_bias"] = (ls["block0.attn"][0], None, ls["block0.attn"][2])
    for ext in ("npz", "safetensors"):
        path = str(tmp_path / f"layers.{ext}")
        layerset.save_layer_set(path, ls)
        back = layerset.load_layer_set(path)
        assert set(back) == set(ls)
        for n in ls:
            np.testing.assert_array_equal(back[n].weight, ls[n][0])
            np.testing.assert_array_equal(back[n].activations, ls[n][2])
            assert (back[n].bias is None) == (ls[n][1] is None)


_SHARD_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, {repo!r})
    from tests.test_calibrate import _layer_set, FAST
    from kroquant_jax import calibrate
    assert jax.local_device_count() == 4, jax.devices()
    ls = _layer_set(shapes=((48, 64),) * 5)  # 5 jobs: padded to 8 over 4 devices
    out = {{}}
    for shard in (True, False):
        res = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(transform="kron_lu", **dict(FAST, steps=4)),
                                         run=calibrate.RunConfig(num_rows=160, num_validation=64, num_test=64,
                                                                 shard=shard))
        out[str(shard)] = {{n: [np.asarray(x).tolist() for x in jax.tree.leaves(r.params)] for n, r in res.items()}}
    print("RESULT" + json.dumps(out))
""")


def test_sharded_equals_unsharded_on_4_host_devices():
    """The layer axis sharded over 4 (forced host) devices gives the single-device result (to rounding: 4 steps, as
    in test_vmapped_equals_per_layer)."""
    # the device count added to the inherited XLA_FLAGS (on the CPU the suite's -O0, see conftest), not replacing them
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT.format(repo=REPO)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][0]
    out = json.loads(line[len("RESULT"):])
    for name in out["True"]:
        for x, y in zip(out["True"][name], out["False"][name]):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=name)


class _Interrupt(Exception):
    pass


def _interrupt_after_the_first_batch(layer_set, recipe, store: str) -> None:
    """``quantize_layer_set`` into ``store``, stopped (as if killed) once its first batch is stored."""
    def crash(names):
        raise _Interrupt(names)

    with pytest.raises(_Interrupt):
        calibrate.quantize_layer_set(layer_set, recipe, store=store, on_batch_done=crash)


def test_recipe_resumes_after_an_interruption(tmp_path):
    ls = _layer_set(shapes=((48, 64), (48, 64), (32, 96)))
    recipe = calibrate.get_recipe("kroquant", run=RUN, calibration=calibrate.CalibrationConfig(
        transform=None, max_layers_per_program=1, **dict(FAST, steps=5)))
    full, full_rep = calibrate.quantize_layer_set(ls, recipe)

    store = str(tmp_path / "store")
    _interrupt_after_the_first_batch(ls, recipe, store)
    done = []
    resumed, rep = calibrate.quantize_layer_set(ls, recipe, store=store, on_batch_done=done.extend)
    assert sum(r["resumed"] for r in rep.values()) == 1  # the layer finished before the crash was not redone
    assert len(done) == 2 and not set(done) & {n for n, r in rep.items() if r["resumed"]}
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    for n in ls:
        d = ls[n][0].shape[1]
        y1 = qlinear.qlinear_forward(full[n], x[:, :d] if d == 64 else np.tile(x, (1, 2))[:, :d])
        y2 = qlinear.qlinear_forward(resumed[n], x[:, :d] if d == 64 else np.tile(x, (1, 2))[:, :d])
        np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
        assert rep[n]["heldout_error"] == pytest.approx(full_rep[n]["heldout_error"], rel=1e-6)


def test_a_resumed_run_runs_the_rest_in_the_programs_of_an_uninterrupted_one(tmp_path):
    """Five layers of one shape at three per program: batches of 3 and 2, both padded to 3. Interrupted after the
    first, the rerun must pad the last two to 3 again (not 2): a learned transform's last bits depend on the size of
    the program it was calibrated in, so the store then equals an uninterrupted run's bit for bit."""
    rng = np.random.default_rng(0)
    ls = {f"l{i}": (rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32),
                    rng.standard_normal((48, 64)).astype(np.float32) * (1 + 5 * (rng.random(64) > 0.9)))
          for i in range(5)}  # layers whose transform, calibrated in a program of 2, differs from one of 3
    recipe = calibrate.get_recipe("kroquant", run=calibrate.RunConfig(num_rows=24, num_validation=12, num_test=12),
                                  calibration=calibrate.CalibrationConfig(transform=None, max_layers_per_program=3,
                                                                          steps=5))
    full, _ = calibrate.quantize_layer_set(ls, recipe)

    store = str(tmp_path / "store")
    _interrupt_after_the_first_batch(ls, recipe, store)
    resumed, rep = calibrate.quantize_layer_set(ls, recipe, store=store)
    assert sum(r["resumed"] for r in rep.values()) == 3
    for n in ls:
        for a, b in zip(jax.tree.leaves(full[n].transform_params), jax.tree.leaves(resumed[n].transform_params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=n)
        np.testing.assert_array_equal(np.asarray(full[n].weight.codes), np.asarray(resumed[n].weight.codes), n)
    # a layer stored with another row split than today's rule gives the same settings (a store of the fallback rule
    # before 2026-12-08) is refused, naming the split, not resumed
    from kroquant_jax import provenance

    qstore = qlinear.QLinearStore(store)
    layer, extra = qstore.load("l0")
    extra = {k: v for k, v in extra.items() if k not in ("name", "fingerprint")}
    fingerprint = provenance.layer_fingerprint(*ls["l0"], recipe)
    qstore.save("l0", layer, {**extra, "rows": {"calibration": 28, "validation": 10, "test": 10}},
                fingerprint=fingerprint)
    with pytest.raises(provenance.StaleResultError,
                       match=r"'l0'.*row split .*'calibration': 28.* -> .*'calibration': 24"):
        calibrate.quantize_layer_set(ls, recipe, store=store)


def _quantize_two_batches(recipe):
    """Three layers of one shape through ``recipe`` at two per batch (so the last batch, one layer, is padded to the
    first one's size) and at three per batch (one batch). Returns the names of the programs the first run compiled
    and both runs' reports."""
    ls = _layer_set(shapes=((40, 64),) * 3)
    recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, max_layers_per_program=2))
    from kroquant_jax.timing import recorded_compilations

    batches = []
    with recorded_compilations() as compiled:
        _, rep = calibrate.quantize_layer_set(ls, recipe, on_batch_done=batches.append)
    assert [len(b) for b in batches] == [2, 1]
    one_batch = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration,
                                                                           max_layers_per_program=3))
    _, rep1 = calibrate.quantize_layer_set(ls, one_batch)
    assert rep.keys() == rep1.keys() == ls.keys()
    return compiled, rep, rep1


def test_quantize_layer_set_compiles_each_program_once_per_shape():
    """The last batch (one layer) is padded to the first one's size, so the calibration and LoRaQ programs compile
    once, and every layer gets what a single batch gives it."""
    recipe = calibrate.get_recipe("kroquant+loraq", run=RUN,
                                  calibration=calibrate.CalibrationConfig(transform=None, **dict(FAST, steps=7)),
                                  loraq=lowrank.LoRaQConfig(rank=32, steps=4, rotation_steps=2))
    compiled, rep, rep1 = _quantize_two_batches(recipe)
    assert compiled.count("jit(_program)") == 1 and compiled.count("jit(loraq_program)") == 1, compiled
    for n in rep:
        assert rep[n]["chosen"] == rep1[n]["chosen"], n
        np.testing.assert_allclose(rep[n]["heldout_error"], rep1[n]["heldout_error"], rtol=1e-4, err_msg=n)


def test_smoothquant_recipes_compile_each_program_once_per_shape():
    """SVDQuant (SmoothQuant search, then the searched diagonal transform, then the 16-bit SVD branch): the last
    batch's SmoothQuant search is padded like its other programs, so every program compiles once, and every layer
    gets what a single batch gives it."""
    recipe = calibrate.get_recipe(
        "svdquant", run=RUN, calibration=calibrate.CalibrationConfig(transform=None, **FAST), smooth_svd_rank=8,
        smoothquant=smoothquant.SmoothQuantConfig(alphas=(0.0, 0.5, 1.0), betas=(0.0, 0.5, 1.0), svd_method="exact"),
        svdquant=lowrank.SVDQuantConfig(rank=8, svd_method="exact"))
    compiled, rep, rep1 = _quantize_two_batches(recipe)
    for program in ("jit(_search_stacked)", "jit(_program)", "jit(_svdquant_stacked)"):
        assert compiled.count(program) == 1, (program, compiled)
    for n in rep:
        assert (rep[n]["alpha"], rep[n]["beta"]) == (rep1[n]["alpha"], rep1[n]["beta"]), n
        np.testing.assert_allclose(rep[n]["heldout_error"], rep1[n]["heldout_error"], rtol=1e-5, err_msg=n)


def test_batches_of_one_shape_are_balanced():
    """5 layers at (at most) 4 per batch give batches of 3 and 2 (the second padded to 3), not 4 and 1."""
    ls = _layer_set(shapes=((32, 32),) * 5, n=120)
    recipe = calibrate.get_recipe("rtn", run=calibrate.RunConfig(num_rows=64, num_validation=32, num_test=24),
                                  calibration=calibrate.CalibrationConfig(transform=None, max_layers_per_program=4,
                                                                          **FAST))
    batches = []
    calibrate.quantize_layer_set(ls, recipe, on_batch_done=batches.append)
    assert [len(b) for b in batches] == [3, 2]


def test_pad_to_does_not_change_results():
    ls, cfg, stacked = _stacked_run()
    padded = calibrate.calibrate_layers(ls, cfg, run=RUN, pad_to=5)
    _assert_same_params(stacked, padded, rtol=1e-5, atol=1e-6)
    for n in ls:
        assert padded[n].test_errors.keys() == stacked[n].test_errors.keys()
        np.testing.assert_allclose(padded[n].test_error, stacked[n].test_error, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(transforms.REGISTRY))
def test_every_calibration_matmul_asks_for_highest_precision(name):
    """With the default ObjectiveConfig (precision "highest"), every matmul of the calibration program (the transform's
    blocks and inverse blocks, the loss, its gradient, Adam, the held-out evaluation) asks for Precision.HIGHEST,
    in the jaxpr and in the lowered program: f32 matmuls at the default precision may run as TF32 on NVIDIA GPUs."""
    from jaxpr_checks import assert_every_dot_highest  # tests/jaxpr_checks.py (here: the subprocesses import this file)

    par = transforms.get(name)
    params0 = jax.tree.map(lambda x: np.stack([np.asarray(x)] * 2), par.init(64))
    a, w = np.ones((2, 40, 64), np.float32), np.ones((2, 32, 64), np.float32)

    def program(p, a_cal, a_val, a_test, ww):
        return calibrate._program(p, a_cal, a_val, a_test, ww, parameterization=par,
                                  cfg=calibrate.CalibrationConfig(steps=3 if par.trainable else 0, select_every=2))

    assert calibrate.CalibrationConfig().objective.precision == "highest"
    assert_every_dot_highest(program, params0, a, a, a, w)
    p0 = par.init(64)  # what the recipes and QuantizedLinear build from the chosen parameters
    assert_every_dot_highest(lambda p: (transforms.apply_to_activations(a[0], par.blocks(p)),
                                        transforms.apply_to_weights(w[0], par.inverse_blocks(p))), p0, min_dots=2)


def test_enable_compile_cache_is_explicit(tmp_path):
    """The library leaves JAX's persistent cache alone; enable_compile_cache turns it on (a fresh process, so no other
    test sees the setting) and a second process loads the calibration program from it with the same results."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {REPO!r})
        import jax
        import numpy as np
        from kroquant_jax import calibrate
        hits = []
        jax.monitoring.register_event_listener(
            lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
        rng = np.random.default_rng(0)
        ls = {{"l": ((rng.standard_normal((32, 64)) * 0.05).astype(np.float32), None,
                    rng.standard_normal((200, 64)).astype(np.float32))}}
        run = calibrate.RunConfig(num_rows=120, num_validation=40, num_test=40)
        before = untouched = jax.config.jax_compilation_cache_dir
        if sys.argv[2] == "first":  # the library leaves the setting alone (checked once: the second run loads)
            calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(steps=3), run=run)
            untouched = jax.config.jax_compilation_cache_dir
        calibrate.enable_compile_cache(sys.argv[1], min_compile_seconds=0)
        res = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(steps=4), run=run)
        print(json.dumps({{"before": before, "untouched": untouched, "hits": len(hits),
                          "error": res["l"].test_error}}))
        """)
    cache = str(tmp_path / "cache")
    runs = []
    for which in ("first", "second"):
        proc = subprocess.run([sys.executable, "-c", script, cache, which], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["before"] is None and runs[0]["untouched"] is None
    assert any(f.startswith("jit__program") for f in os.listdir(cache))
    assert runs[0]["hits"] == 0 and runs[1]["hits"] >= 1
    assert runs[1]["error"] == runs[0]["error"]


def test_best_iterate_is_the_lowest_scored_validation_error():
    """``select_every=5`` scores the start and every 5th iterate (and the last one, step 12) on the validation rows
    and keeps the best: with a constant learning rate those iterates are the last iterates of 5-, 10- and 12-step
    runs, so the kept one's validation error is the minimum of theirs and of the init's. The masked tail of the last
    chunk (steps 13-15) changes nothing."""
    ls = _layer_set(shapes=((48, 64),))
    (name,) = ls
    plain = dict(transform="kron_lu", learning_rate=0.05, lr_schedule="constant")
    last = {s: calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(steps=s, select_every=0, safeguard=False,
                                                                          **plain), run=RUN)[name]
            for s in (5, 10, 12)}
    best = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(steps=12, select_every=5, safeguard=False,
                                                                      **plain), run=RUN)[name]
    scored = [last[5].validation_errors["init0"]] + [last[s].validation_errors["trained0"] for s in (5, 10, 12)]
    assert best.losses.shape == (1, 12)
    # The chunked scan (select_every=5) and the whole one compile to different programs: the same steps, but their f32
    # rounding may differ from the second chunk on, and the STE's rounding decisions amplify it (it does on some CPUs).
    # So: the first chunk exactly, the rest to 2%.
    np.testing.assert_allclose(best.losses[0, :5], last[12].losses[0, :5], rtol=1e-6)
    np.testing.assert_allclose(best.losses[0], last[12].losses[0], rtol=2e-2)
    np.testing.assert_allclose(best.validation_errors["trained0"], min(scored), rtol=2e-2)
    assert best.validation_errors["trained0"] <= scored[0]  # never above the scored start
    k = int(np.argmin(scored))
    if k <= 1:  # the start or the first chunk's end: computed alike in both programs
        want = transforms.get("kron_lu").init(64) if k == 0 else last[5].params
        for x, y in zip(jax.tree.leaves(best.params), jax.tree.leaves(want)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_best_iterate_never_ends_above_its_start_and_cosine_changes_the_run():
    """With the best iterate kept, the trained candidate is never worse on validation rows than the init (the start
    is scored too), even at a learning rate that makes the last iterate worse; the cosine schedule is wired in (a
    run differs from the constant one)."""
    ls = _layer_set(shapes=((48, 64),), n=600)
    (name,) = ls
    run = calibrate.RunConfig(num_rows=8, num_validation=256, num_test=256)
    kw = dict(steps=20, learning_rate=0.5, safeguard=False)
    last = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(select_every=0, **kw), run=run)[name]
    best = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(select_every=5, **kw), run=run)[name]
    assert last.validation_errors["trained0"] > last.validation_errors["init0"]
    assert best.validation_errors["trained0"] <= best.validation_errors["init0"]
    const = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(select_every=0, lr_schedule="constant", **kw),
                                       run=run)[name]
    assert not np.allclose(const.losses, last.losses)
    np.testing.assert_array_equal(const.losses[0, :1], last.losses[0, :1])  # same start, same first step size


def test_recipe_stages_fit_the_format_the_layer_is_stored_in():
    """A stage whose format differs from the stored one is refused; an NVFP4 recipe stores its LoRaQ branch in NVFP4
    (the format LoRaQ fitted it for) and reports the error of the layer as stored."""
    from kroquant_jax.formats import NVFP4

    nvfp4 = calibrate.CalibrationConfig(transform=None, objective=objectives.ObjectiveConfig(fmt=NVFP4()))
    with pytest.raises(ValueError, match="Recipe.loraq.fmt=mxfp4 differs from calibration.objective.fmt=nvfp4"):
        calibrate.Recipe(transform="hadamard32", train=False, lowrank="loraq", calibration=nvfp4)
    with pytest.raises(ValueError, match="Recipe.smoothquant.fmt=mxfp4 differs"):
        calibrate.Recipe(transform="diagonal", train=False, smooth_init=True, calibration=nvfp4)
    calibrate.Recipe(transform="hadamard32", train=False, calibration=nvfp4)  # no stage of another format: accepted
    recipe = calibrate.Recipe(transform="hadamard32", train=False, lowrank="loraq", calibration=nvfp4,
                              loraq=lowrank.LoRaQConfig(rank=16, steps=20, rotation_steps=10, fmt=NVFP4()), run=RUN)
    layers = _layer_set(shapes=((48, 64),))
    quantized, reports = calibrate.quantize_layer_set(layers, recipe)
    (name, q), = quantized.items()
    assert q.lowrank_left.fmt.name == q.lowrank_right.fmt.name == q.weight.fmt.name == "nvfp4"
    params = transforms.HADAMARD32.init(64)
    w_t = np.asarray(transforms.apply_to_weights(layers[name][0], transforms.HADAMARD32.inverse_blocks(params)))
    stored = np.linalg.norm(np.asarray(qlinear.effective_weight(q)) - w_t) / np.linalg.norm(w_t)
    assert reports[name]["weight_error"] == pytest.approx(stored, rel=1e-4)


def test_recipe_transform_conflict_raises_and_unset_is_filled_in():
    with pytest.raises(ValueError, match="'identity' conflicts with calibration.transform='kron_lu'"):
        calibrate.Recipe(transform="identity", calibration=calibrate.CalibrationConfig(transform="kron_lu"))
    r = calibrate.Recipe(transform="hadamard32", calibration=calibrate.CalibrationConfig(transform=None, steps=3))
    assert r.calibration.transform == "hadamard32" and r.calibration.steps == 3
    assert calibrate.Recipe(transform="identity").calibration.transform == "identity"
    assert calibrate.get_recipe("rtn", calibration=calibrate.CalibrationConfig(transform=None)).calibration.transform \
        == "identity"
    with pytest.raises(ValueError, match="transform is None"):
        calibrate.calibrate_layers(_layer_set(shapes=((16, 32),)), calibrate.CalibrationConfig(transform=None))


def test_paper_literal_settings_are_the_old_engine():
    """PAPER_LITERAL: identity STE in the regularizers (zero regularizer gradient), constant lr, last iterate; on the
    same rows its trained transform is a plain optax Adam loop on L (the engine before the new defaults), to within
    half a step."""
    import optax

    cfg = calibrate.PAPER_LITERAL
    assert (cfg.lr_schedule, cfg.select_every, cfg.objective.regularizer_grad) == ("constant", 0, "ste")
    ls = _layer_set(shapes=((48, 64),))
    (name,) = ls
    res = calibrate.calibrate_layers(ls, dataclasses.replace(cfg, steps=6, safeguard=False), run=RUN)[name]
    rows = calibrate.layer_rows(name, layerset.validate_layer(name, ls[name]), RUN)
    par = transforms.get("kron_lu")
    a, w = jax.numpy.asarray(rows.calibration), jax.numpy.asarray(ls[name][0])
    p0 = par.init(64)
    ref = objectives.reference_output(a, w, cfg.objective)
    lam = objectives.auto_lambdas(objectives.loss_terms(p0, par, a, w, ref, cfg.objective))
    opt = optax.adam(cfg.learning_rate)
    p, state = p0, opt.init(p0)

    @jax.jit
    def step(p, state):
        g = jax.grad(lambda q: objectives.total_loss(q, par, a, w, lam, ref, cfg.objective))(p)
        upd, state = opt.update(g, state, p)
        return optax.apply_updates(p, upd), state

    for _ in range(6):
        p, state = step(p, state)
    # Same algorithm, two programs: the engine's vmapped scan and this loop are compiled differently, so their f32
    # roundings differ, and Adam turns a near-zero gradient's noise into a step of up to lr (the STE quantizer's
    # rounding flips add more). Bit equality is not the claim; each element within half a step is: a missing or extra
    # step, another learning rate or schedule, or a selected earlier iterate moves some element by about lr or more.
    for x, y, x0 in zip(jax.tree.leaves(res.params), jax.tree.leaves(p), jax.tree.leaves(p0)):
        np.testing.assert_allclose(x, np.asarray(y), rtol=0, atol=cfg.learning_rate / 2)
        assert np.abs(np.asarray(y) - np.asarray(x0)).max() > 5 * cfg.learning_rate, "6 steps must move the factors"


def test_quantizing_more_layers_of_the_same_shapes_compiles_nothing():
    """quantize_layer_set compiles its programs once per layer shape, recipe and row split: other layers of the same
    shapes (other names, other values) then compile no program at all. Catches the recompilations that make a run's
    time grow with its layer count (a jit wrapper built per call around a closure, a data-dependent static argument,
    a Python scalar baked into a program). Shapes of its own, so the first run compiles even after other tests."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    settings = {"calib_steps": 2, "calib_rows": 72, "calib_validation": 24, "calib_test": 24}
    recipes = [calibrate.recipe_from_args(m, settings) for m in ("rtn", "hadamard32", "kroquant")]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for recipe in recipes:
            calibrate.quantize_layer_set(_layer_set(shapes=((24, 96), (56, 96)), n=160, seed=1), recipe)
        first = len(compiles)
        for recipe in recipes:
            others = {f"other.{n}": v for n, v in _layer_set(shapes=((24, 96), (56, 96)), n=160, seed=2).items()}
            calibrate.quantize_layer_set(others, recipe)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert first > 0 and len(compiles) == first


def test_smoothed_kroquant_starts_include_smoothquant_itself():
    """Recipe.starts: with the 'smoothquant' start, smoothed KroQuant's candidates hold SmoothQuant's own transform
    (the same test error as the smoothquant recipe, from the same search), so the kept transform is never worse than
    SmoothQuant on the validation rows; starts=None keeps the engine's earlier two starts; bad starts raise."""
    ls = _layer_set(shapes=((48, 64),), n=400)
    run = calibrate.RunConfig(num_rows=160, num_validation=96, num_test=96)
    cal = calibrate.CalibrationConfig(transform=None, steps=5)
    sq = calibrate.get_recipe("smoothquant", run=run)
    three = calibrate.get_recipe("smoothed_kroquant", run=run, calibration=cal,
                                 starts=("hadamard", "smoothquant_hadamard", "smoothquant"))
    two = dataclasses.replace(three, starts=None)
    _, sq_rep = calibrate.quantize_layer_set(ls, sq)
    _, rep3 = calibrate.quantize_layer_set(ls, three)
    _, rep2 = calibrate.quantize_layer_set(ls, two)
    for name in ls:
        assert set(rep3[name]["candidates"]) == {f"{s}{k}" for s in ("init", "trained") for k in range(3)}
        assert set(rep2[name]["candidates"]) == {f"{s}{k}" for s in ("init", "trained") for k in range(2)}
        np.testing.assert_allclose(rep3[name]["candidates_test"]["init2"], sq_rep[name]["transform_test_error"],
                                   rtol=1e-5)
        np.testing.assert_allclose(rep3[name]["candidates"]["init2"], sq_rep[name]["transform_validation_error"],
                                   rtol=1e-5)
        assert rep3[name]["transform_validation_error"] <= sq_rep[name]["transform_validation_error"] * (1 + 1e-6)
        for k in ("init0", "init1"):  # the shared starts are the same computation either way
            np.testing.assert_allclose(rep3[name]["candidates"][k], rep2[name]["candidates"][k], rtol=1e-6)
    assert calibrate.get_recipe("smoothed_kroquant").starts == ("hadamard", "smoothquant_hadamard", "smoothquant")
    with pytest.raises(ValueError, match="needs transform 'smoothed_kron' with smooth_init"):
        calibrate.get_recipe("kroquant", starts=("hadamard",))
    with pytest.raises(ValueError, match="must name distinct starts"):
        calibrate.get_recipe("smoothed_kroquant", starts=("smoothquant", "rotated"))
    with pytest.raises(ValueError, match="must name distinct starts"):
        calibrate.get_recipe("smoothed_kroquant", starts=())


def test_select_with_branch_keeps_the_start_best_with_its_branch():
    """Recipe.select_with_branch: one LoRaQ branch per candidate transform (every start as started and trained),
    scored on the validation rows as the whole layer; the kept candidate is the best of those scores and the stored
    layer is that very candidate (its branch reused, not fitted again: the layer's validation error is its score). A
    recipe without the LoRaQ branch is refused."""
    ls = _layer_set(shapes=((48, 64),), n=400)  # the layer, rows and calibration of the starts test above
    (name,) = ls
    w, _, _ = ls[name]
    run = calibrate.RunConfig(num_rows=160, num_validation=96, num_test=96)
    loraq = lowrank.LoRaQConfig(rank=32, steps=20, rotation_steps=4)
    base = calibrate.get_recipe("smoothed_kroquant+loraq", run=run, loraq=loraq,
                                calibration=calibrate.CalibrationConfig(transform=None, steps=5))
    both = dataclasses.replace(base, starts=("hadamard", "smoothquant"), select_with_branch=True)
    q, rep = calibrate.quantize_layer_set(ls, both)
    r = rep[name]
    scores = r["branch_candidates"]
    assert set(scores) == {"init0", "init1", "trained0", "trained1"}
    assert r["chosen"] == min(scores, key=lambda lab: (scores[lab], lab))
    a_val = calibrate.layer_rows(name, layerset.LayerData(*ls[name]), run).validation
    y = np.asarray(qlinear.qlinear_forward(q[name], a_val)) - ls[name][1]
    ref = a_val.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(y - ref) / np.linalg.norm(ref), scores[r["chosen"]], rtol=1e-4)
    assert calibrate.get_recipe("smoothed_kroquant+gptq+loraq").select_with_branch is True
    assert calibrate.get_recipe("kroquant+loraq").select_with_branch is None
    with pytest.raises(ValueError, match="select_with_branch needs lowrank='loraq'"):
        calibrate.get_recipe("smoothed_kroquant", select_with_branch=True)


def test_layers_short_of_rows_are_reported_with_their_split(tmp_path, capsys):
    """A layer with fewer rows than the run asks for takes the fallback split (a fifth validates, a fifth tests); its
    report says so, the store keeps it, and the verbs' ``quantize_with_store`` names the layer on stderr."""
    from scripts.common_args import quantize_with_store

    full, short = _layer_set(shapes=((48, 64),), n=300), _layer_set(shapes=((48, 64),), n=40, seed=1)
    ls = {"block0.attn": full["block0.attn"], "block1.attn2": short["block0.attn"]}
    recipe = calibrate.get_recipe("rtn", run=RUN)
    store = str(tmp_path / "store")
    _, rep = quantize_with_store(ls, recipe, store, False, "--out", label="rtn")
    assert rep["block0.attn"]["rows"] == {"calibration": 160, "validation": 64, "test": 64}
    assert rep["block1.attn2"]["rows"] == {"calibration": 24, "validation": 8, "test": 8}
    assert calibrate.fallback_split_layers(rep, RUN) == {"block1.attn2": rep["block1.attn2"]["rows"]}
    err = capsys.readouterr().err
    assert "rtn: 1 of 2 layers have fewer activation rows than the 160 + 64 + 64" in err
    assert "block1.attn2 (8 test rows)" in err and "block0.attn" not in err
    _, again = calibrate.quantize_layer_set(ls, recipe, store=store)  # resumed from the store: the counts too
    assert all(r["resumed"] for r in again.values())
    assert calibrate.fallback_split_layers(again, RUN) == {"block1.attn2": rep["block1.attn2"]["rows"]}

"""`kroquant calibrate` (scripts/calibrate_layers.py) end to end on the tiny synthetic layer set."""

import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_calibrate_cli_writes_table_json_and_plot(tmp_path):
    from scripts import calibrate_layers

    out = tmp_path / "cal"
    errors = calibrate_layers.main(["--synthetic", "tiny", "--fast", "--methods", "rtn", "hadamard32",
                                    "--out", str(out)])
    assert sorted(os.listdir(out)) == ["calibrate_run.json", "plot.png", "results.json", "table.md"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["errors"] == {m: {n: float(e) for n, e in errs.items()} for m, errs in errors.items()}
    names = sorted(errors["rtn"])
    assert len(names) == 3 and sorted(errors["hadamard32"]) == names
    for method in ("rtn", "hadamard32"):
        values = np.array(list(errors[method].values()))
        assert np.all(np.isfinite(values)) and np.all((values > 0.01) & (values < 1.0)), (method, values)
    # On DiT-like layers with outlier channels the Hadamard rotation lowers the mean W4A4 error.
    assert np.mean(list(errors["hadamard32"].values())) < np.mean(list(errors["rtn"].values()))
    table = (out / "table.md").read_text()
    assert all(name in table for name in names) and "**mean**" in table
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_cli_compile_cache_option(tmp_path):
    """--compile-cache DIR turns on JAX's persistent cache for the run (a subprocess: the setting is process-wide)."""
    cache, out = tmp_path / "jax-cache", tmp_path / "cal"
    proc = subprocess.run([sys.executable, "-m", "scripts.calibrate_layers", "--synthetic", "tiny", "--fast",
                           "--methods", "rtn", "--out", str(out), "--compile-cache", str(cache)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "results.json").exists()
    assert any(name.startswith("jit__program") for name in os.listdir(cache)), os.listdir(cache)


def _parsed(*flags):
    import argparse

    from kroquant_jax import calibrate

    parser = argparse.ArgumentParser()
    calibrate.add_recipe_arguments(parser)
    return parser.parse_args(list(flags))


def test_recipe_from_args_without_flags_is_the_named_recipe():
    from kroquant_jax import calibrate

    for name in list(calibrate.RECIPES) + ["kroquant+loraq", "smoothed_kroquant+loraq"]:
        assert calibrate.recipe_from_args(name, _parsed()) == calibrate.get_recipe(name), name
    assert calibrate.recipe_from_args("kroquant", {}) == calibrate.get_recipe("kroquant")


def test_recipe_from_args_sets_every_stage(capsys):
    import pytest

    from kroquant_jax import calibrate

    args = _parsed("--calib-steps", "7", "--calib-rows", "99", "--calib-validation", "33", "--calib-test", "22",
                   "--rank", "0.125", "--loraq-steps", "5", "--rotation-steps", "3", "--svd-refine", "4",
                   "--sq-grid", "3", "--precision", "high", "--regularizer-grad", "ste", "--lr-schedule", "constant",
                   "--select-every", "0", "--max-layers-per-program", "8", "--smooth-svd-rank", "0",
                   "--smoothed-starts", "smoothquant", "hadamard", "--select-with-branch", "on")
    r = calibrate.recipe_from_args("smoothed_kroquant+loraq", args, seed=3, progress=True)
    assert (r.calibration.steps, r.calibration.lr_schedule, r.calibration.select_every,
            r.calibration.max_layers_per_program) == (7, "constant", 0, 8)
    assert (r.calibration.objective.precision, r.calibration.objective.regularizer_grad) == ("high", "ste")
    assert r.calibration.transform == "smoothed_kron"
    assert r.run == calibrate.RunConfig(num_rows=99, num_validation=33, num_test=22, seed=3, progress=True)
    assert (r.loraq.rank, r.loraq.steps, r.loraq.rotation_steps) == (0.125, 5, 3)
    assert r.smoothquant.alphas == r.smoothquant.betas == (0.0, 0.5, 1.0) and r.smooth_svd_rank == 0
    assert r.starts == ("smoothquant", "hadamard") and r.select_with_branch is True
    svd = calibrate.recipe_from_args("svdquant", args)
    assert (svd.svdquant.rank, svd.svdquant.refine_steps) == (0.125, 4)
    assert svd.loraq == calibrate.LoRaQConfig()  # a stage the recipe does not run keeps its defaults
    assert svd.starts is None and svd.select_with_branch is None
    # A rank after '@' wins over --rank, for every low-rank recipe; the old spellings still parse.
    assert calibrate.recipe_from_args("kroquant+loraq@64", args).loraq.rank == 64
    assert calibrate.recipe_from_args("svdquant@16", args).svdquant.rank == 16
    old = _parsed("--lora-rank", "64", "--calib-heldout", "40")
    assert old.rank == 64 and old.calib_validation == 40
    with pytest.raises(ValueError, match="'kroquant@64'.*low-rank branch"):
        calibrate.recipe_from_args("kroquant@64", args)
    with pytest.raises(ValueError, match="'rtn\\+loraq@1.5'.*in \\(0, 1\\]"):
        calibrate.recipe_from_args("rtn+loraq@1.5", args)
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        calibrate.recipe_from_args("nope", args)
    with pytest.raises(ValueError, match="unknown settings \\['calib_step'\\]"):
        calibrate.recipe_from_args("kroquant", {"calib_step": 3})
    with pytest.raises(SystemExit):
        _parsed("--rank", "0")
    assert "argument --rank/--lora-rank: '0': a rank must be >= 1" in capsys.readouterr().err


def test_calibrate_cli_rejects_an_unknown_method_before_any_work(tmp_path, capsys):
    import pytest

    from scripts import calibrate_layers

    with pytest.raises(SystemExit):
        calibrate_layers.main(["--synthetic", "tiny", "--methods", "rtn", "kroquant@32", "--out", str(tmp_path)])
    assert "low-rank branch" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_fast_keeps_the_first_layer_of_each_shape_and_says_so(tmp_path, capsys):
    from kroquant_jax import layerset, synthetic
    from scripts import calibrate_layers

    shapes = {"a.to_q": (64, 64), "a.to_k": (64, 64), "a.ff": (128, 64), "b.to_q": (64, 64), "b.ff": (128, 64)}
    path = tmp_path / "layers.safetensors"
    layerset.save_layer_set(str(path), synthetic.synthetic_layer_set(shapes, n=400, seed=1))
    errors = calibrate_layers.main(["--layers", str(path), "--fast", "--methods", "rtn", "--calib-rows", "100",
                                    "--out", str(tmp_path / "cal")])
    assert list(errors) == ["rtn"] and list(errors["rtn"]) == ["a.ff", "a.to_k"]  # the file stores names sorted
    assert "--fast: 2 layer(s), the first of each weight shape, methods rtn; steps 20, rows 100+32+64 (a smoke " \
           "test, not a measurement)" in capsys.readouterr().err
    args = json.loads((tmp_path / "cal" / "results.json").read_text())["meta"]["args"]
    assert (args["calib_rows"], args["calib_test"], args["rank"], args["methods"]) == (100, 64, 32, ["rtn"])
    assert calibrate_layers.FAST_METHODS == ("rtn", "hadamard32", "kroquant")


def test_fast_runs_every_stage_of_its_methods(tmp_path):
    """--fast is smaller, not hollow: every FAST method runs end to end on the kept layer (rtn and hadamard32
    evaluated, kroquant's transform trained for 20 steps on 128 rows and chosen against its Hadamard start), and the
    table, results.json and plot are written."""
    from kroquant_jax import layerset, synthetic
    from scripts import calibrate_layers

    path = tmp_path / "layers.safetensors"
    layerset.save_layer_set(str(path), synthetic.synthetic_layer_set({"a.q": (64, 64), "b.q": (64, 64)}, n=300,
                                                                     seed=2))
    out = tmp_path / "cal"
    errors = calibrate_layers.main(["--layers", str(path), "--fast", "--out", str(out)])
    assert list(errors) == list(calibrate_layers.FAST_METHODS) and all(list(e) == ["a.q"] for e in errors.values())
    saved = json.loads((out / "results.json").read_text())
    reports = {m: saved["reports"][m]["a.q"] for m in errors}
    assert {m: sorted(r["candidates"]) for m, r in reports.items()} == {
        "rtn": ["init0"], "hadamard32": ["init0"], "kroquant": ["init0", "trained0"]}
    assert reports["kroquant"]["chosen"] in ("init0", "trained0")
    assert all(np.isfinite(r["heldout_error"]) and 0 < r["heldout_error"] < 1 for r in reports.values())
    assert set(saved["seconds"]) == set(errors)
    table = (out / "table.md").read_text()
    assert "steps 20 (cosine lr, best of every 10), rows 128+32+64)" in table and "| a.q |" in table
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stage_flags_for_methods_without_that_stage_are_refused(capsys):
    """A stage flag (--gptq-*, --loraq-steps, --rank, --sq-grid, ...) that none of the methods reads would be ignored
    silently: named instead, by the library check and as a one-line argparse error of ``kroquant calibrate``
    (before any layer is loaded); --fast's own settings do not count as given."""
    import pytest

    from kroquant_jax import calibrate
    from scripts import calibrate_layers

    args = _parsed("--gptq-damp", "0.1", "--loraq-steps", "5", "--rank", "16", "--calib-steps", "3")
    plain = {m: calibrate.recipe_from_args(m, args) for m in ("rtn", "kroquant")}
    messages = calibrate.unused_stage_arguments(plain, args)
    assert messages == ["--gptq-damp applies to a '+gptq' recipe, and none of the methods (rtn, kroquant) has that stage",
                        "--loraq-steps applies to a '+loraq' recipe, and none of the methods (rtn, kroquant) has that "
                        "stage",
                        "--rank applies to a recipe with a low-rank branch, and none of the methods (rtn, kroquant) "
                        "has that stage"]
    used = {m: calibrate.recipe_from_args(m, args) for m in ("rtn", "kroquant+gptq+loraq")}
    assert calibrate.unused_stage_arguments(used, args) == []
    starts = _parsed("--smoothed-starts", "smoothquant")
    assert calibrate.unused_stage_arguments({"smoothquant": calibrate.recipe_from_args("smoothquant", starts)},
                                            starts) == [
        "--smoothed-starts applies to a smoothed_kroquant recipe, and none of the methods (smoothquant) has that stage"]
    with pytest.raises(SystemExit) as err:
        calibrate_layers.main(["--layers", "no-such-file.npz", "--methods", "rtn", "--gptq-order", "gptq_first"])
    assert err.value.code == 2
    assert "--gptq-order applies to a '+gptq' recipe, and none of the methods (rtn)" in capsys.readouterr().err
    # --fast fills in --loraq-steps / --rank / --sq-grid for its methods (rtn hadamard32 kroquant): not the user's
    assert calibrate.unused_stage_arguments(
        {m: calibrate.recipe_from_args(m, {}) for m in calibrate_layers.FAST_METHODS}, _parsed()) == []


def test_evaluate_and_demo_say_which_stage_flags_the_methods_do_not_use(tmp_path, capsys, monkeypatch):
    """`kroquant evaluate` / `kroquant demo` say (a one-line note, before the capture) which stage flags none of
    --methods uses, rather than refusing them: runs to be merged share one command line and differ in --methods.
    The demo's own preset stage settings (--rank, --loraq-steps, ...) are not the user's and are not named."""
    import pytest

    from scripts import demo, eval_testbed

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):  # the capture: the notes are printed before it
        raise Stop

    monkeypatch.setattr(eval_testbed, "capture_flow_layer_set", stop)
    with pytest.raises(Stop):
        eval_testbed.main(["--out", str(tmp_path / "e"), "--methods", "rtn", "--gptq-damp", "0.1"])
    assert capsys.readouterr().err.splitlines() == [
        "kroquant evaluate: note: --gptq-damp applies to a '+gptq' recipe, and none of the methods (rtn) has that "
        "stage; it changes nothing in this run"]
    with pytest.raises(Stop):
        demo.main(["--out", str(tmp_path / "d"), "--methods", "rtn", "kroquant", "--sq-grid", "3"])
    assert capsys.readouterr().err.splitlines() == [
        "kroquant demo: note: --sq-grid applies to a recipe with the SmoothQuant search, and none of the methods "
        "(rtn, kroquant) has that stage; it changes nothing in this run"]


def test_capture_rows_default_to_what_the_row_split_asks_for():
    """`kroquant evaluate` and `quantize-checkpoint` keep, by default, as many captured rows per layer as the split
    asks for (calibration + validation + test), so no layer takes split_rows' fallback at the defaults."""
    from kroquant_jax import calibrate
    from scripts import eval_testbed, quantize_checkpoint

    wanted = calibrate.RunConfig().num_rows + calibrate.RunConfig().num_validation + calibrate.RunConfig().num_test
    assert eval_testbed.parse_args(["--out", "x"]).rows_per_layer == wanted
    assert eval_testbed.parse_args(["--out", "x", "--calib-rows", "100", "--calib-test", "10"]).rows_per_layer == \
        100 + calibrate.RunConfig().num_validation + 10
    assert eval_testbed.parse_args(["--out", "x", "--rows-per-layer", "64"]).rows_per_layer == 64
    base = ["--checkpoint", "c", "--out", "o", "--synthetic-prompts", "2"]
    assert quantize_checkpoint._parse(base).rows_per_layer == wanted
    assert quantize_checkpoint._parse([*base, "--rows-per-layer", "24"]).rows_per_layer == 24

"""The README's main job (`kroquant demo`), run end to end at a tiny size: shipped checkpoint -> capture ->
calibrate (RTN and KroQuant + LoRaQ) -> generate the caption groups with 16-bit and W4A4 models -> table, grid,
report; and the caption-group selection it rests on (``models.testbed.evaluation.select_caption_groups``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kroquant_jax.layerset import as_layer_set, load_layer_set
from models.testbed import data as testbed_data
from models.testbed import evaluation
from scripts import demo

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "checkpoints" / "emoji_pixart" / "testbed_prompts.npz"
#: One tiny demo: 2 methods, 4 linears, 2 Euler steps, one caption or two of each group (the demo's three).
#: The capture keeps 61-64 distinct rows of each of the 4 layers (of 64 drawn: block 0's self-attention sees the same
#: rows with and without the caption); 32 + 12 + 12 = 56 fit them all, so every layer gets the same row split and each
#: calibration program compiles once per method (16 + 16 sent the layers short of 64 rows to the fallback split: three
#: shapes, each program compiled three times, about 30 s of the fixture's 100).
TINY = ["--methods", "rtn", "kroquant+loraq", "--calib-captions", "2", "--eval-train-captions", "1",
        "--variant-captions", "2", "--novel-captions", "1", "--steps", "2", "--rows-per-layer", "64", "--calib-rows",
        "32", "--calib-validation", "12", "--calib-test", "12", "--calib-steps", "2", "--loraq-steps", "2",
        "--rotation-steps", "2", "--layers", "4", "--batch-size", "2"]
SPLIT_ROWS = sum(int(TINY[TINY.index(flag) + 1]) for flag in ("--calib-rows", "--calib-validation", "--calib-test"))


def run_cli(verb_args: list[str], out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "scripts.cli", *verb_args, *TINY, *extra, "--compile-cache",
                           str(cache), "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    """One tiny ``kroquant demo`` run (a subprocess: ``--compile-cache`` is process-wide JAX state), shared by the
    tests: ``(folder, printed stdout, report, cache folder, cache entries after the run)``."""
    root = tmp_path_factory.mktemp("demo")
    cache = root / "jax-cache"
    proc = run_cli(["demo"], root / "demo", cache)
    report = json.loads((root / "demo" / "report.json").read_text())
    rows = {name: layer.activations.shape[0] for name, layer in
            as_layer_set(load_layer_set(str(root / "demo" / "layer_set.safetensors"))).items()}
    assert min(rows.values()) >= SPLIT_ROWS, f"{rows}: layers short of {SPLIT_ROWS} rows take another split (TINY)"
    return root / "demo", proc.stdout, report, cache, sorted(os.listdir(cache))


def test_tiny_demo_run_writes_table_grid_and_report(tiny_demo):
    out, printed, report, _, _ = tiny_demo
    assert "| rtn |" in printed and "| kroquant+loraq |" in printed
    assert set(report["results"]) == {"rtn", "kroquant+loraq"}
    for method, r in report["results"].items():
        for gid, m in r["groups"].items():
            assert np.isfinite(m["psnr_db"]) and 0.0 < m["ssim"] <= 1.0, (method, gid)
        assert len(r["per_layer_error"]) == 4 and all(0.0 < e < 1.0 for e in r["per_layer_error"].values())
    # LoRaQ's low-rank branch must reduce the per-layer output error of plain round-to-nearest
    assert report["results"]["kroquant+loraq"]["layer_error_mean"] < report["results"]["rtn"]["layer_error_mean"]
    # the grid: a title band and one row per generated caption, columns dataset, 16-bit and the two methods
    grid = np.asarray(Image.open(out / "grid.png"))
    assert grid.ndim == 3 and grid.shape[0] > 4 * 64 and grid.std() > 1.0
    with np.load(out / "images.npz") as images:
        assert list(images["titles"]) == ["dataset", "16-bit", "rtn", "kroquant+loraq"]
        assert images["column0"].shape == (4, 32, 32, 3)
    assert "| method |" in (out / "table.md").read_text()
    assert report["wall_s"] > 0 and report["jax"] and report["date_utc"].startswith("20")


def test_demo_caption_groups_are_disjoint_from_calibration_and_labelled(tiny_demo):
    """The demo generates training captions calibration did not use, held-out variants of trained concepts and novel
    concepts; the report says which caption is in which group, the table and the printout label every group, and the
    16-bit model draws the drawable groups closer to their dataset glyphs than the novel concepts."""
    out, printed, report, _, _ = tiny_demo
    dataset = testbed_data.load_dataset(PROMPTS)
    groups = report["caption_groups"]
    assert list(groups) == ["train", "variant", "novel"]
    calib = set(np.flatnonzero(~dataset.heldout)[:2].tolist())
    assert [dataset.find(c) for c in report["calibration_captions"]] == sorted(calib)
    seen = set(calib)
    for gid, group in groups.items():
        records = group["records"]
        assert group["label"] == evaluation.CAPTION_GROUPS[gid].label
        assert group["captions"] == [str(dataset.captions[i]) for i in records]
        assert not seen & set(records), f"group {gid} shares records with calibration or another group"
        seen |= set(records)
    assert not dataset.heldout[groups["train"]["records"]].any()
    variant, novel = groups["variant"]["records"], groups["novel"]["records"]
    assert dataset.heldout[variant].all() and dataset.trained_concept[variant].all()
    assert dataset.heldout[novel].all() and not dataset.trained_concept[novel].any()
    table = (out / "table.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| method | low-rank branch |"))
    for gid, group in groups.items():
        label = evaluation.CAPTION_GROUPS[gid].label
        assert f"{label} ({len(group['records'])})" in header and label in printed
        assert f"| kroquant+loraq | {label} |" in table
        for method in report["results"]:
            assert gid in report["results"][method]["groups"]
    assert "| 16-bit vs dataset glyph |" in table
    reference = report["reference"]
    assert reference["variant"]["psnr_db"] > reference["novel"]["psnr_db"]


def test_demo_and_evaluate_take_compile_cache(tiny_demo, tmp_path):
    """``kroquant demo --compile-cache DIR`` fills DIR with the run's compiled programs (the calibration program among
    them); ``kroquant evaluate`` with the same settings and DIR, in a second process, loads every program from it
    (writes no new entry) and gets the same results (RTN only there: its capture, calibration and sampling
    programs)."""
    _, _, first, cache, entries = tiny_demo
    assert any(name.startswith("jit__program-") for name in entries), entries
    run_cli(["evaluate"] + demo.DEMO_DEFAULTS, tmp_path / "evaluate", cache, "--methods", "rtn")
    second = json.loads((tmp_path / "evaluate" / "report.json").read_text())
    assert sorted(os.listdir(cache)) == entries, sorted(set(os.listdir(cache)) - set(entries))
    assert first["args"]["compile_cache"] == second["args"]["compile_cache"] == str(cache)
    assert first["caption_groups"] == second["caption_groups"]
    assert list(second["results"]) == ["rtn"]
    assert second["results"]["rtn"]["per_layer_error"] == first["results"]["rtn"]["per_layer_error"]
    assert second["results"]["rtn"]["groups"] == first["results"]["rtn"]["groups"], "the same images"


def test_select_caption_groups_on_the_shipped_prompts():
    """The shipped prompt file tells the 195 held-out records apart (116 variants of trained concepts, 79 novel
    concepts, as docs/testbed.md measured on the full dataset); each group takes its first records in record order
    and never a calibration record; bad requests fail naming the group."""
    dataset = testbed_data.load_dataset(PROMPTS)
    kinds = evaluation.heldout_groups(dataset)
    assert [len(kinds[k]) for k in evaluation.GROUPS] == [116, 79]
    training = np.flatnonzero(~dataset.heldout)
    calib = training[:8]
    groups = evaluation.select_caption_groups(dataset, calib, {"novel": 2, "train": 4, "variant": 3, "heldout": 0})
    assert list(groups) == ["train", "variant", "novel"]
    np.testing.assert_array_equal(groups["train"], training[8:12])
    np.testing.assert_array_equal(groups["variant"], kinds[evaluation.GROUPS[0]][:3])
    np.testing.assert_array_equal(groups["novel"], kinds[evaluation.GROUPS[1]][:2])
    assert "writing hand" in dataset.captions[groups["variant"]] and "gear" not in dataset.captions[groups["variant"]]
    # calibration records that are not the first training records are skipped, not generated
    skipped = evaluation.select_caption_groups(dataset, training[[0, 2]], {"train": 2})["train"]
    np.testing.assert_array_equal(skipped, training[[1, 3]])
    slices = evaluation.group_slices(groups)
    assert [(s.start, s.stop) for s in slices.values()] == [(0, 4), (4, 7), (7, 9)]
    with pytest.raises(ValueError, match="'heldout' and 'variant'|'variant' and 'heldout'"):
        evaluation.select_caption_groups(dataset, calib, {"variant": 1, "heldout": 16})
    with pytest.raises(ValueError, match="'train'.*65 captions asked for, the dataset has 56"):
        evaluation.select_caption_groups(dataset, calib, {"train": 65})
    with pytest.raises(ValueError, match="unknown caption groups \\['drawable'\\]"):
        evaluation.select_caption_groups(dataset, calib, {"drawable": 1})
    with pytest.raises(ValueError, match="no captions to generate"):
        evaluation.select_caption_groups(dataset, calib, {"train": 0})
    import dataclasses

    with pytest.raises(ValueError, match="no 'trained_concept' array.*kroquant build-emoji-dataset"):
        evaluation.select_caption_groups(dataclasses.replace(dataset, trained_concept=None), calib, {"novel": 1})


def test_headline_figures_of_a_report():
    """A run's report becomes headline figures: PSNR, its standard error and SSIM per group and method (16-bit vs the
    dataset as ``16bit``), the layer errors and the wall time, all with the stated machine."""
    metrics = {"psnr_db": 20.0, "psnr_sem_db": 0.5, "ssim": 0.8}
    single = {"psnr_db": 12.0, "psnr_sem_db": float("nan"), "ssim": 0.3}
    report = {"jax": "0.10.2", "date_utc": "2026-12-01T23:00", "wall_s": 500.0,
              "reference": {"train": metrics, "novel": single},
              "results": {"kroquant+loraq": {"groups": {"train": metrics, "novel": single},
                                             "layer_error_mean": 0.1, "layer_error_max": 0.2}}}
    figures = evaluation.headline_figures(report, "demo", device="cpu (2 cores)", command="kroquant demo",
                                          source="benchmarks/results/demo.json")
    assert figures["demo_psnr_db_train_kroquant_loraq"].value == 20.0
    assert figures["demo_psnr_sem_db_train_16bit"].value == 0.5
    assert "demo_psnr_sem_db_novel_16bit" not in figures, "a one-caption group has no standard error"
    assert figures["demo_layer_error_max_kroquant_loraq"].value == 0.2 and "demo_layer_error_mean_16bit" not in figures
    assert figures["demo_wall_s"].value == 500.0 and figures["demo_wall_s"].device == "cpu (2 cores)"
    seeds = {**metrics, "psnr_seed_std_db": 0.3, "psnr_seed_min_db": 19.6, "psnr_seed_max_db": 20.3}
    several = evaluation.headline_figures({**report, "reference": {"train": seeds},
                                           "results": {"svdquant": {"groups": {"train": seeds},
                                                                    "layer_error_mean": 0.1, "layer_error_max": 0.2}}},
                                          "e", device="gpu", command="kroquant evaluate", source="benchmarks/results/e.json")
    assert [several[f"e_psnr_seed_{s}_db_train_svdquant"].value for s in ("std", "min", "max")] == [0.3, 19.6, 20.3]
    assert "demo_psnr_seed_min_db_train_kroquant_loraq" not in figures, "one seed: no spread over seeds"
    with pytest.raises(ValueError, match="no 'wall_s'"):
        evaluation.headline_figures({k: v for k, v in report.items() if k != "wall_s"}, "demo", device="cpu",
                                    command="kroquant demo", source="benchmarks/results/demo.json")


def test_record_demo_writes_the_figures_the_readme_table_needs(tiny_demo, tmp_path):
    """``benchmarks/record_demo.py`` (a subprocess) copies the report, replaces every ``demo_*`` figure of the
    headline file and copies the grid; the README's demo table finds every figure of the rows the run has."""
    import string

    from kroquant_jax import headline

    out, _, report, _, _ = tiny_demo
    figures_file = tmp_path / "headline.json"
    old = headline.Figure(value=1.0, unit="dB", higher_is_better=True, device="cpu", jax="0", date_utc="2026-01-01",
                          command="x", source="benchmarks/results/x.json")
    headline.update(figures_file, {"demo_psnr_db_rtn": old, "gpu_figure": old})
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "record_demo.py"), str(out), "--device",
                           "cpu (test)", "--results", str(tmp_path), "--headline", str(figures_file), "--grid-to",
                           str(tmp_path / "grid.png")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = headline.load(figures_file)
    assert "demo_psnr_db_rtn" not in figures and "gpu_figure" in figures, "stale demo keys go, others stay"
    copy = tmp_path / f"demo_report_{report['date_utc'][:10]}.json"
    assert json.loads(copy.read_text())["caption_groups"] == report["caption_groups"]
    assert figures["demo_wall_s"].device == "cpu (test)"
    assert figures["demo_psnr_db_novel_kroquant_loraq"].source == f"benchmarks/results/{copy.name}"
    assert (tmp_path / "grid.png").read_bytes() == (out / "grid.png").read_bytes()
    single = [gid for gid, group in report["caption_groups"].items() if len(group["records"]) == 1]
    for row in headline.TABLES["demo"]["rows"]:
        keys = [name for cell in row for _, name, _, _ in string.Formatter().parse(cell) if name]
        if all(k.endswith(("_16bit", "_rtn")) for k in keys):  # the methods the tiny run has
            # a one-caption group has no standard error; the demo's own groups have several captions
            no_sem = [k for k in keys if any(k.startswith(f"demo_psnr_sem_db_{gid}_") for gid in single)]
            assert [k for k in keys if k not in figures] == no_sem and no_sem, row[0]

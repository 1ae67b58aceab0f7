"""The README's main job (`kroquant demo`), run end to end at a tiny size: shipped checkpoint -> capture ->
calibrate (RTN and KroQuant + LoRaQ) -> generate with 16-bit and W4A4 models -> table, grid, report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from scripts import demo

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_tiny_demo_run_writes_table_grid_and_report(tmp_path, capsys):
    out = tmp_path / "demo"
    tiny = ["--out", str(out), "--methods", "rtn", "kroquant+loraq", "--calib-captions", "1", "--eval-captions", "2",
            "--steps", "2", "--rows-per-layer", "64", "--calib-rows", "32", "--calib-heldout", "32",
            "--calib-steps", "2", "--loraq-steps", "2", "--layers", "4", "--batch-size", "2"]
    assert demo.main(tiny) == 0
    printed = capsys.readouterr().out
    assert "| rtn |" in printed and "| kroquant+loraq |" in printed
    report = json.loads((out / "report.json").read_text())
    assert set(report["results"]) == {"rtn", "kroquant+loraq"}
    for method, r in report["results"].items():
        assert np.isfinite(r["psnr_db"]) and 0.0 < r["ssim"] <= 1.0, method
        assert len(r["per_layer_error"]) == 4 and all(0.0 < e < 1.0 for e in r["per_layer_error"].values())
    # LoRaQ's low-rank branch must reduce the per-layer output error of plain round-to-nearest
    assert report["results"]["kroquant+loraq"]["layer_error_mean"] < report["results"]["rtn"]["layer_error_mean"]
    grid = np.asarray(Image.open(out / "grid.png"))
    assert grid.ndim == 3 and grid.shape[0] > 64 and grid.std() > 1.0
    assert "| method |" in (out / "table.md").read_text()


def test_demo_and_evaluate_take_compile_cache(tmp_path):
    """``kroquant demo --compile-cache DIR`` fills DIR with the run's compiled programs (the calibration program among
    them); ``kroquant evaluate`` with the same settings and DIR, in a second process, loads every program from it
    (writes no new entry) and gets the same results. Subprocesses: the cache is process-wide JAX state."""
    cache = tmp_path / "jax-cache"
    tiny = ["--methods", "rtn", "--calib-captions", "1", "--eval-captions", "1", "--steps", "1", "--rows-per-layer",
            "64", "--calib-rows", "32", "--calib-heldout", "32", "--layers", "1", "--batch-size", "1",
            "--compile-cache", str(cache)]
    entries, reports = [], []
    for i, verb_args in enumerate((["demo"], ["evaluate"] + demo.DEMO_DEFAULTS)):
        out = tmp_path / f"run{i}"
        proc = subprocess.run([sys.executable, "-m", "scripts.cli", *verb_args, *tiny, "--out", str(out)], cwd=REPO,
                              capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        entries.append(sorted(os.listdir(cache)))
        reports.append(json.loads((out / "report.json").read_text()))
    assert any(name.startswith("jit__program-") for name in entries[0]), entries[0]
    assert entries[1] == entries[0], sorted(set(entries[1]) - set(entries[0]))
    assert reports[0]["args"]["compile_cache"] == reports[1]["args"]["compile_cache"] == str(cache)
    assert reports[1]["results"]["rtn"]["per_layer_error"] == reports[0]["results"]["rtn"]["per_layer_error"]

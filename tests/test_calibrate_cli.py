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
    assert sorted(os.listdir(out)) == ["plot.png", "results.json", "table.md"]
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

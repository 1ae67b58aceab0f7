"""Smoke run of benchmarks/calibration_compile_probe.py on its tiny preset, as a subprocess (tests never import a
benchmark module): every variant runs in its own process and the record compares their outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_probe_records_each_variant_and_compares_outputs(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "calibration_compile_probe.py"), "--preset", "tiny",
                          "--out-dir", str(tmp_path), "--variants", "xla_default", "autotune0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "probe.json").read_text())
    base, other = record["variants"]["xla_default"], record["variants"]["autotune0"]
    assert base["options"] == {} and other["options"] == {"xla_gpu_autotune_level": 0}
    for rec in (base, other):
        for program in ("kroquant", "loraq"):
            times = rec["programs"][program]
            assert all(times[k] > 0 for k in ("lower_s", "compile_s", "run_first_s", "run_warm_s")), times
    # the CPU ignores xla_gpu_* options: the outputs are the same bits
    diff = other["diff_vs_xla_default"]
    assert set(diff) >= {"kroquant_errors", "loraq_error_final"}
    assert all(d["max_abs_diff"] == 0.0 and d["max_abs"] > 0 for d in diff.values()), diff
    best = record["best"]
    assert best["baseline"] == "xla_default" and best["variant"] in ("xla_default", "autotune0")
    assert best["xla_flags"] == {"xla_default": "", "autotune0": "--xla_gpu_autotune_level=0"}[best["variant"]]
    assert "autotune0" in run.stdout and "best: " in run.stdout  # the table

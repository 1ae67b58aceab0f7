"""``benchmarks/transform_quantize_fp8_bench.py`` on the CPU (interpret mode, one small shape): every tiling is
checked bit for bit against the default before it is timed, and a tiling that cannot be built is recorded with its
error while the others run."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(tmp_path, *argv):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "transform_quantize_fp8_bench.py"), *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_tilings_checked_then_timed(tmp_path):
    out = tmp_path / "tq_fp8.json"
    run = _run(tmp_path, "--interpret", "--shapes", "64x256", "--n-iter", "2", "--out", str(out), "--tilings",
               "br32_bd64:block_rows=32,block_cols=64", "odd_rows:block_rows=48")
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["m"], row["d"]) == (64, 256) and row["io_bytes"] == 64 * 256 * 3 + 4 * 64
    good = row["tilings"]["br32_bd64"]
    assert good["status"] == "ok" and good["bit_exact_vs_default"] and good["us"] > 0
    assert "block_rows=32" in good["block_sizes"] and "block_cols=64" in good["block_sizes"]
    assert row["tilings"]["default"]["bit_exact_vs_default"]
    assert "power of two" in row["tilings"]["odd_rows"]["status"]
    assert row["best"] in ("default", "br32_bd64")
    assert "| 64x256 | br32_bd64 |" in run.stdout


def test_bad_arguments_are_one_line_errors(tmp_path):
    run = _run(tmp_path, "--shapes", "64x250", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "multiple of 32" in run.stderr and "Traceback" not in run.stderr
    run = _run(tmp_path, "--tilings", "a:block_rowz=32", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "block_rowz" in run.stderr and "Traceback" not in run.stderr

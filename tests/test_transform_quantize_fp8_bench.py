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
    run = _run(tmp_path, "--interpret", "--shapes", "64x256", "--n-iter", "1", "--out", str(out), "--tilings",
               "br32_bd64:block_rows=32,block_cols=64", "odd_rows:block_rows=48", "--reencode-tilings",
               "br8_bc64:block_rows=8,block_cols=64,num_warps=2", "bad:block_cols=8",
               "--one-launch-tilings", "br32:block_rows=32", "--kinds", "k2,k1")
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
    # The one-launch form with K2 and K1 transforms: the two-launch default's bytes (checked), then timed.
    for kind in ("k2", "k1"):
        entry = row["one_launch"][kind]["br32"]
        assert entry["status"] == "ok" and entry["bit_exact_vs_default"] and entry["us"] > 0, entry
        assert "block_rows=32" in entry["block_sizes"] and row["one_launch"][kind]["default"]["bit_exact_vs_default"]
    assert "| 64x256 | k1 br32 |" in run.stdout
    # The re-encode: XLA's fusion and the Pallas kernel, each checked against XLA's bytes before it is timed.
    re = row["reencode"]
    assert re["io_bytes"] == 64 * 128 + 64 * 8 + 64 * 256 + 4 * 64
    assert re["variants"]["xla"]["status"] == "ok" and re["variants"]["xla"]["bit_exact_vs_xla"]
    assert re["variants"]["xla_convert"]["status"] == "ok" and re["variants"]["xla_convert"]["bit_exact_vs_xla"]
    small = re["variants"]["pallas_br8_bc64"]
    assert small["status"] == "ok" and small["bit_exact_vs_xla"] and small["us"] > 0
    assert "block_cols=8 must be a power of two >= 16" in re["variants"]["pallas_bad"]["status"]
    assert re["best"] in ("xla", "xla_convert", "pallas_br8_bc64")
    assert "| 64x256 | pallas_br8_bc64 |" in run.stdout


def test_bad_arguments_are_one_line_errors(tmp_path):
    run = _run(tmp_path, "--shapes", "64x250", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "multiple of 32" in run.stderr and "Traceback" not in run.stderr
    run = _run(tmp_path, "--tilings", "a:block_rowz=32", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "block_rowz" in run.stderr and "Traceback" not in run.stderr
    run = _run(tmp_path, "--kinds", "k3", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "--kinds 'k3'" in run.stderr and "Traceback" not in run.stderr
    run = _run(tmp_path, "--reencode-tilings", "a:block_rows=8,tile=3", "--out", str(tmp_path / "x.json"))
    assert run.returncode == 2 and "'tile'" in run.stderr and "Traceback" not in run.stderr

"""``benchmarks/testbed_stack.py`` on the CPU (a subprocess; the served layers run as their references): the shipped
testbed model cut to its first block (``--blocks 1``: the wiring is the same in each block), three of its systems at
batch 2, the per-image derivation and the wiring check."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "testbed_stack.py"), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def test_the_stack_runs_end_to_end_per_image_against_the_teacher(tmp_path):
    out = tmp_path / "stack.json"
    run = _run("--systems", "teacher_20x2,bf16_4x1,dmd2_w4a4_4x1", "--batches", "2", "--repeats", "1",
               "--blocks", "1", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads(out.read_text())
    names = ["teacher_20x2", "bf16_4x1", "dmd2_w4a4_4x1"]
    assert saved["errors"] == {} and saved["finite"] == {"2": dict.fromkeys(names, True)}
    assert saved["blocks"] == 1 and saved["model_blocks"] == 10 and "ONLY 1 OF THE REAL 10" in saved["what"]
    assert saved["w4a4_linears"] == 10 and saved["tokens_per_image"] == 256  # 1 block x 10 linears, 16 x 16
    assert saved["forward_passes_per_image"] == {"teacher_20x2": 40, "bf16_4x1": 4, "dmd2_w4a4_4x1": 4}
    calls = {n: saved["timings_ms"]["2"][n]["median_ms"] for n in names}
    assert saved["ms_per_image"]["2"] == pytest.approx({n: ms / 2 for n, ms in calls.items()})
    assert saved["speedup_per_image"]["2"] == pytest.approx({n: calls["teacher_20x2"] / ms for n, ms in calls.items()})
    # the served W4A4 layers are wired in: the 4-step pixels differ from the 16-bit 4-step ones by a quantization error
    assert 1e-3 < saved["checks"]["dmd2_w4a4_4x1 vs bf16_4x1 pixels rel err, batch 2"] < 0.5
    assert "dmd2_w4a4_4x1" in run.stdout and "blocks=1 of 10" in run.stdout


def test_bad_arguments_are_one_line_errors(tmp_path):
    for argv, message in ((["--batches", "1,0"], "every batch must be >= 1"),
                          (["--systems", "teacher_20x2,sdxl"], "unknown system"),
                          (["--strategy", "cublas"], "--strategy 'cublas'"),
                          (["--blocks", "11"], "--blocks 11: the checkpoint has 10 blocks")):
        run = _run(*argv, "--out", str(tmp_path / "x.json"))
        assert run.returncode == 2 and message in run.stderr, run.stderr[-500:]
        assert not (tmp_path / "x.json").exists()

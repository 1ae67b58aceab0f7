"""benchmarks/served_layer_error.py on a tiny PixArt and its quantized checkpoint folder (CPU): the float64 reference
is what it says (the jnp reference strategy matches it to f32 rounding, a bf16-output strategy sits at the bf16
floor), and bad input is refused before any capture."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models import families

REPO = Path(__file__).resolve().parents[1]


def _run(args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "served_layer_error.py"), *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_reference_is_exact_and_bf16_output_sits_at_the_floor(tiny_quantized_pixart, tmp_path):
    """One run, the dequant strategy on two implementations over the same captured rows: its jnp reference
    (``reference``) matches the float64 product to f32 rounding; the compiled path's kernels in interpret mode (the
    quantizer kernel, XLA's bf16 GEMM with bf16 output) sit at the bf16 floor."""
    teacher, quantized, prompts, config = tiny_quantized_pixart
    out = tmp_path / "ref.json"
    run = _run(["--checkpoint", quantized, "--teacher", teacher, "--prompts", prompts, "--rows", 48, "--strategies",
                "dequant", "--impl", "reference,interpret", "--out", out])
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["capture"] == {"steps": 2, "guidance": 3.0, "solver": "flow_euler", "rows_per_layer": 48, "seed": 0}
    assert saved["impl"] == ["interpret", "reference"] and set(saved["strategies"]) == {"dequant/reference",
                                                                                        "dequant/interpret"}
    layers = set(saved["bf16_floor"]["per_layer"])
    assert len(layers) == saved["layers"] == len(saved["rows"]) > 4 and all(0 < n <= 48 for n in saved["rows"].values())
    row = saved["strategies"]["dequant/reference"]
    assert row["finite"] and set(row["per_layer"]) == layers
    # the jnp reference computes the same product in f32: f32 rounding, far below bf16's
    assert row["max"] < 1e-5 and row["max_over_bf16_floor"] < 0.01
    assert 1e-4 < saved["bf16_floor"]["median"] < 1e-2  # bf16 rounds to 8 significant bits
    assert row["median"] == pytest.approx(np.median(list(row["per_layer"].values())))
    assert row["worst_layer"] == max(row["per_layer"], key=row["per_layer"].get)
    table = out.with_suffix(".md").read_text()
    assert table.count("| `dequant/reference`") == 1 and table.count("| `dequant/interpret`") == 1
    # the compiled path's kernels in interpret mode: the quantizer kernel, XLA's bf16 GEMM with bf16 output
    row = saved["strategies"]["dequant/interpret"]
    assert row["finite"] and set(row["per_layer"]) == layers
    assert 0.3 < row["median_over_bf16_floor"] < 3 and row["max_over_bf16_floor"] < 10


def test_refuses_bad_input_before_the_capture(tiny_quantized_pixart, tmp_path):
    teacher, quantized, prompts, config = tiny_quantized_pixart
    other = families.PIXART.build(dataclasses.replace(config, num_layers=2), seed=4)
    families.PIXART.to_diffusers(other, tmp_path / "other")
    common = ["--checkpoint", quantized, "--prompts", prompts, "--out", tmp_path / "x.json"]
    for args, words in ((["--teacher", tmp_path / "other"], ["not the model of", "num_layers"]),
                        (["--teacher", teacher, "--strategies", "dequant,fp9"],
                         ["--strategies: unknown strategy(s) ['fp9']"]),
                        (["--teacher", tmp_path / "missing"], ["--teacher", "no such file"])):
        run = _run([*common, *args])
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert all(w in run.stderr for w in words), run.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()

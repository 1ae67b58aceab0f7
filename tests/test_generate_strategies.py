"""benchmarks/generate_strategies.py on a tiny PixArt and its quantized checkpoint folder (CPU, the served strategy
through its jnp reference): every system samples the same noise, the numbers it prints are the comparisons it names,
and a teacher of another model or an unknown strategy is refused before any sampling."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models import families, image_metrics

REPO = Path(__file__).resolve().parents[1]


def _run(args, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "generate_strategies.py"), *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_strategies_against_the_teacher_and_simulate(tiny_quantized_pixart, tmp_path):
    teacher, quantized, prompts, config = tiny_quantized_pixart
    out = tmp_path / "cmp.json"
    run = _run(["--checkpoint", quantized, "--teacher", teacher, "--prompts", prompts, "--strategies",
                "simulate,dequant,fp8", "--impl", "reference", "--seeds", 0, 5, "--space", "pixels", "--save-latents",
                "--out", out],
               tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["samples"] == 4 and saved["prompts"] == 2 and saved["seeds"] == [0, 5]
    assert saved["sampler"]["num_steps"] == 2 and saved["sampler"]["solver"] == "flow_euler"
    rows = saved["strategies"]
    assert set(rows) == {"simulate", "dequant", "fp8"} and all(r["finite"] for r in rows.values())
    # the second served strategy's PSNRs paired with the first's, sample by sample
    paired = rows["fp8"]["paired_vs"]
    assert paired["baseline"] == "dequant" and "paired_vs" not in rows["dequant"]
    for versus in ("vs_teacher", "vs_simulate"):
        diff = np.subtract(rows["fp8"][versus]["psnr_per_sample_db"], rows["dequant"][versus]["psnr_per_sample_db"])
        assert paired[versus]["psnr_db"] == pytest.approx(diff.mean())
        assert paired[versus]["psnr_sem_db"] == pytest.approx(diff.std(ddof=1) / 2)
    assert "vs_simulate" not in rows["simulate"]
    for row in rows.values():  # quantized: not the teacher, and not garbage
        assert 5 < row["vs_teacher"]["psnr_db"] < 80 and 0 < row["vs_teacher"]["rel_l2"] < 1
        assert len(row["vs_teacher"]["psnr_per_sample_db"]) == 4
        per = row["vs_teacher"]["psnr_per_sample_db"]
        assert row["vs_teacher"]["psnr_db"] == pytest.approx(np.mean(per))
    # the served path differs from the simulated one by its bf16 activations only: nearer simulate than the teacher
    assert rows["dequant"]["vs_simulate"]["psnr_db"] > rows["dequant"]["vs_teacher"]["psnr_db"]
    assert sum(line.startswith("| `") for line in out.with_suffix(".md").read_text().splitlines()) == 3
    # the printed PSNR is the testbed's pixel PSNR (models.image_metrics) of the saved samples
    with np.load(out.with_suffix(".npz")) as saved_latents:
        samples = {k: saved_latents[k] for k in saved_latents.files}
    assert set(samples) == {"teacher", "simulate", "dequant", "fp8"} and samples["teacher"].shape == (4, 3, 8, 8)

    def pixels(x):  # (n, 3, H, W) in [-1, 1] -> (n, H, W, 3) in [0, 1]
        return np.clip((np.moveaxis(x, 1, -1) + 1) / 2, 0, 1)

    for strategy, row in rows.items():
        np.testing.assert_allclose(row["vs_teacher"]["psnr_per_sample_db"],
                                   image_metrics.psnr(pixels(samples[strategy]), pixels(samples["teacher"])),
                                   rtol=1e-6)


def test_refuses_another_teacher_and_unknown_strategies(tiny_quantized_pixart, tmp_path):
    teacher, quantized, prompts, config = tiny_quantized_pixart
    other = families.PIXART.build(dataclasses.replace(config, num_layers=2), seed=3)
    families.PIXART.to_diffusers(other, tmp_path / "other")
    common = ["--checkpoint", quantized, "--prompts", prompts, "--out", tmp_path / "x.json"]
    run = _run([*common, "--teacher", tmp_path / "other"], tmp_path)
    assert run.returncode != 0 and "not the model of" in run.stderr and "num_layers" in run.stderr
    assert "Traceback" not in run.stderr
    run = _run([*common, "--teacher", teacher, "--strategies", "simulate,fp9"], tmp_path)
    assert run.returncode != 0 and "--strategies: unknown strategy(s) ['fp9']" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "x.json").exists()

"""`kroquant encode-prompts`: a local pipeline's text encoder -> the prompt file of quantize-checkpoint / generate."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from scripts import cli

REPO = Path(__file__).resolve().parents[1]


def test_encode_prompts_writes_the_prompt_file(tmp_path):
    from models import diffusers_io
    from tiny_pipelines import tiny_pixart_pipeline  # tests/tiny_pipelines.py

    tiny_pixart_pipeline(tmp_path / "pipe")
    (tmp_path / "prompts.txt").write_text("a red cat\n\nblue dog\n")
    out = tmp_path / "prompts.npz"
    proc = subprocess.run([sys.executable, "-m", "scripts.cli", "encode-prompts", "--pipeline", str(tmp_path / "pipe"),
                           "--prompts-file", str(tmp_path / "prompts.txt"), "--max-sequence-length", "8", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"pixart: 2 prompt(s) encoded -> {out} (context (2, 8, 16), mask (2, 8)" in proc.stderr
    direct = diffusers_io.encode_prompts(str(tmp_path / "pipe"), ["a red cat", "blue dog"], "pixart",
                                         max_sequence_length=8)
    with np.load(out) as written:
        assert sorted(written.files) == sorted(direct)
        for key in direct:
            np.testing.assert_array_equal(written[key], direct[key])


def test_encode_prompts_bad_input(tmp_path, capsys):
    assert cli.main(["encode-prompts", "--pipeline", str(tmp_path), "--prompt", "x", "--out", "o.npz"]) == 1
    assert capsys.readouterr().err == (f"kroquant encode-prompts: error: --pipeline {tmp_path}: no model_index.json "
                                       f"(expected a diffusers pipeline folder)\n")
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    assert cli.main(["encode-prompts", "--pipeline", str(tmp_path), "--prompt", "x", "--out", "o.npz"]) == 1
    assert "_class_name 'StableDiffusionPipeline' is not one of ['FluxPipeline'," in capsys.readouterr().err

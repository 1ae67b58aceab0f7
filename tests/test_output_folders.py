"""A verb's output folder is keyed by what produced its files (``provenance.claim_output_folder``): a run with other
inputs refuses a folder holding another run's files, or with ``--overwrite`` clears them first, so no earlier file
is lost silently or left beside the new ones."""

import json

import numpy as np
import pytest

from kroquant_jax import provenance
from scripts import cli

OUTPUTS = ("latents.npz", "images/*.png")


def test_claim_output_folder_rules(tmp_path):
    out = tmp_path / "out"
    key = {"prompts_sha256": "a" * 64, "steps": 2, "latent_hw": (8, 8)}
    provenance.claim_output_folder(out, "run.json", key, OUTPUTS)  # fresh: created and claimed
    assert json.loads((out / "run.json").read_text()) == {**key, "latent_hw": [8, 8]}
    (out / "images").mkdir()
    for name in ("latents.npz", "images/0000.png", "images/0001.png", "notes.txt"):
        (out / name).write_text(name)
    provenance.claim_output_folder(out, "run.json", key, OUTPUTS)  # the same run again: nothing deleted
    assert (out / "images/0001.png").exists()
    other = {**key, "steps": 4, "seed": 1}
    with pytest.raises(provenance.OutputFolderError) as err:
        provenance.claim_output_folder(out, "run.json", other, OUTPUTS, flag="--out")
    assert str(err.value) == (f"--out {out}: holds the outputs of a run with other inputs (seed: '<unset>' -> 1; "
                              "steps: 2 -> 4); use another --out or pass --overwrite")
    assert (out / "latents.npz").read_text() == "latents.npz"  # refused: untouched
    provenance.claim_output_folder(out, "run.json", other, OUTPUTS, overwrite=True)
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["notes.txt", "run.json"]  # only its outputs
    assert json.loads((out / "run.json").read_text())["steps"] == 4
    # outputs without a record: another (unknown) run's
    (out / "run.json").unlink()
    (out / "latents.npz").write_text("old")
    with pytest.raises(provenance.OutputFolderError, match=r"holds 1 output file\(s\) of an unknown run \(no run.json"):
        provenance.claim_output_folder(out, "run.json", key, OUTPUTS)
    # a record of another key without any of its files (a run that failed before writing) is replaced
    (out / "latents.npz").unlink()
    provenance.claim_output_folder(out, "run.json", other, OUTPUTS)
    provenance.claim_output_folder(out, "run.json", key, OUTPUTS)
    assert json.loads((out / "run.json").read_text())["steps"] == 2


def _error_line(capsys, verb):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"kroquant {verb}: error: "), err
    return line[len(f"kroquant {verb}: error: "):]


def test_generate_refuses_another_runs_out_and_overwrite_clears_it(tiny_quantized_pixart, tmp_path, capsys):
    _, quantized, prompts, _ = tiny_quantized_pixart
    out = tmp_path / "samples"
    base = ["generate", "--checkpoint", str(quantized), "--prompts", str(prompts), "--out", str(out), "--quiet"]
    assert cli.main(base) == 0
    first = np.load(out / "latents.npz")["latents"]
    assert cli.main(base) == 0  # the same run again replaces its own files
    np.testing.assert_array_equal(np.load(out / "latents.npz")["latents"], first)
    (out / "images").mkdir()
    stale = out / "images" / "w4a4_0007.png"  # an earlier run's image, e.g. of more prompts
    stale.write_bytes(b"png")
    assert cli.main([*base, "--steps", "1"]) == 1
    message = _error_line(capsys, "generate")
    assert message.startswith(f"--out {out}: holds the outputs of a run with other inputs (steps: None -> 1)")
    assert message.endswith("use another --out or pass --overwrite")
    np.testing.assert_array_equal(np.load(out / "latents.npz")["latents"], first)  # nothing replaced
    assert cli.main([*base, "--steps", "1", "--overwrite"]) == 0
    assert not stale.exists()
    assert json.loads((out / "generate_run.json").read_text())["steps"] == 1
    assert not np.array_equal(np.load(out / "latents.npz")["latents"], first)


def test_calibrate_refuses_another_runs_out(tmp_path, capsys):
    out = tmp_path / "calib"
    base = ["calibrate", "--synthetic", "tiny", "--fast", "--methods", "rtn", "--out", str(out)]
    assert cli.main(base) == 0
    results = (out / "results.json").read_text()
    assert cli.main([*base, "--seed", "1"]) == 1
    message = _error_line(capsys, "calibrate")
    assert message.startswith(f"--out {out}: holds the outputs of a run with other inputs (")
    assert "seed: 0 -> 1" in message
    assert (out / "results.json").read_text() == results
    assert cli.main([*base, "--seed", "1", "--overwrite"]) == 0
    assert json.loads((out / "calibrate_run.json").read_text())["seed"] == 1
    assert (out / "results.json").read_text() != results

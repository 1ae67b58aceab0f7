"""`kroquant quantize-checkpoint` on tiny random checkpoints: stale results are refused (naming the layer and what
changed), --overwrite recomputes, a matching rerun resumes and says so; everything checkable is checked before the
capture; linears whose width is not a multiple of 32 stay 16-bit or are zero-padded (--unaligned pad), and are
listed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

from models import families, pixart, sana
from models.quantized_checkpoint import load_quantized_checkpoint
from scripts import cli, quantize_checkpoint

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
PIXART = pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                             num_layers=1, cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=8,
                             use_additional_conditions=False)
TINY = ["--synthetic-prompts", "2", "--synthetic-tokens", "4", "--steps", "2", "--latent-hw", "8", "8",
        "--rows-per-layer", "24", "--recipe", "rtn", "--calib-rows", "16", "--calib-heldout", "8", "--eval-prompts",
        "1", "--quiet"]
LAYERS = 10  # quantizable linears of the one-block PixArt


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two checkpoints of the same shapes (``a``, ``b``) and a finished run of ``a`` (``out_a``)."""
    root = tmp_path_factory.mktemp("qc")
    families.PIXART.to_diffusers(families.PIXART.build(PIXART, seed=4), root / "a")
    families.PIXART.to_diffusers(families.PIXART.build(PIXART, seed=5), root / "b")
    report = quantize_checkpoint.main(["--checkpoint", str(root / "a"), "--out", str(root / "out_a"), *TINY])
    assert report["layers"] == LAYERS and report["layers_resumed"] == 0
    return root


def _copy(runs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(runs / "out_a", out)
    return out


def _store_state(out):
    return {p.name: p.stat().st_mtime_ns for p in (out / "qlayers-rtn").iterdir()}


def test_report_records_the_sampler_actually_used(runs):
    report = json.loads((runs / "out_a" / "report-rtn.json").read_text())
    assert report["solver"] == "dpm_solver_pp_2m" and report["shift"] is None and report["left_16bit"] == {}
    assert json.loads((runs / "out_a" / "layer_set.json").read_text())["steps"] == 2


def test_matching_rerun_reuses_and_says_so(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    report = quantize_checkpoint.main(["--checkpoint", str(runs / "a"), "--out", str(out), *TINY])
    err = capsys.readouterr().err
    assert report["layers_resumed"] == LAYERS
    assert f"resumed {LAYERS} of {LAYERS} layers from {out / 'qlayers-rtn'}" in err
    assert "reused the layer set captured with the same settings" in err


@pytest.mark.parametrize("change, expected", [
    (["--checkpoint", "b"], "was computed from other inputs (weight; 9 more stored layer(s) differ too)"),
    (["--calib-rows", "12"], "(recipe setting run.num_rows: 16 -> 12; 9 more stored layer(s) differ too)"),
    (["--steps", "3"], "(capture setting steps: 2 -> 3)"),
    (["--synthetic-prompts", "3"], "(capture prompts)"),
    (["--text-rows-from-all-prompts"], "(capture setting text_rows_from_all_prompts: None -> True)"),
])
def test_rerun_with_other_inputs_is_refused_before_the_capture(runs, tmp_path, capsys, change, expected):
    out = _copy(runs, tmp_path)
    argv = ["--checkpoint", str(runs / "a"), "--out", str(out), *TINY, *change]
    if change[0] == "--checkpoint":
        argv = ["--checkpoint", str(runs / "b"), "--out", str(out), *TINY]
    before = _store_state(out), (out / "layer_set.safetensors").stat().st_mtime_ns
    # the CLI's entry point in this process (the status `python -m scripts.cli` exits with; the real subprocess is
    # test_generate_runs_the_quantized_folder_alone's)
    assert cli.main(["quantize-checkpoint", *argv]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kroquant quantize-checkpoint: error: {out / 'qlayers-rtn'}: stored layer ")
    assert expected in lines[0] and lines[0].endswith("rerun with --overwrite to recompute, or choose another --out")
    assert (_store_state(out), (out / "layer_set.safetensors").stat().st_mtime_ns) == before  # nothing recomputed


def test_each_recipe_store_is_checked_against_its_own_capture(runs, tmp_path, capsys):
    """Two recipes in one --out with other capture settings: the second recaptures (its store is empty), and the
    first one's store is still judged by the capture it was calibrated on (its own record), not by the folder's
    latest layer_set.json: a rerun with its settings resumes, a rerun with the second's settings is refused."""
    out = _copy(runs, tmp_path)
    (out / "qlayers-rtn" / quantize_checkpoint.STORE_CAPTURE_RECORD).unlink()  # a store made before the record
    recipe_at = TINY.index("--recipe") + 1
    other = [*TINY[:recipe_at], "hadamard32", *TINY[recipe_at + 1:], "--steps", "3"]
    quantize_checkpoint.main(["--checkpoint", str(runs / "a"), "--out", str(out), *other])
    assert json.loads((out / "layer_set.json").read_text())["steps"] == 3
    assert json.loads((out / "qlayers-hadamard32" / "capture.json").read_text())["steps"] == 3
    capsys.readouterr()
    # the rtn store has no record of its own and the folder's is the hadamard32 run's: refused early (legacy rule)
    assert cli.main(["quantize-checkpoint", "--checkpoint", str(runs / "a"), "--out", str(out), *TINY]) == 1
    assert "(capture setting steps: 3 -> 2)" in capsys.readouterr().err
    # with its own record (what every run writes now) the rtn store resumes after a capture with its settings
    quantize_checkpoint.main(["--checkpoint", str(runs / "a"), "--out", str(out), *TINY, "--overwrite"])
    quantize_checkpoint.main(["--checkpoint", str(runs / "a"), "--out", str(out), *other])
    assert json.loads((out / "layer_set.json").read_text())["steps"] == 3
    report = quantize_checkpoint.main(["--checkpoint", str(runs / "a"), "--out", str(out), *TINY])
    assert report["layers_resumed"] == LAYERS
    capsys.readouterr()
    code = cli.main(["quantize-checkpoint", "--checkpoint", str(runs / "a"), "--out", str(out), *TINY, "--steps", "4"])
    assert code == 1 and "qlayers-rtn: stored layer" in capsys.readouterr().err


def test_overwrite_recomputes(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    report = quantize_checkpoint.main(["--checkpoint", str(runs / "b"), "--out", str(out), *TINY, "--overwrite"])
    assert report["layers_resumed"] == 0 and "resumed" not in capsys.readouterr().err
    again = quantize_checkpoint.main(["--checkpoint", str(runs / "b"), "--out", str(out), *TINY])
    assert again["layers_resumed"] == LAYERS
    assert again["heldout_error"] == report["heldout_error"]


def test_layer_set_of_another_checkpoint_is_refused(runs, tmp_path, capsys):
    code = cli.main(["quantize-checkpoint", "--checkpoint", str(runs / "b"), "--out", str(tmp_path / "o"), *TINY,
                     "--layer-set", str(runs / "out_a" / "layer_set.safetensors")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert f"layer_set.safetensors: layer 'transformer_blocks.0.attn1.to_k' has other weights: not captured from " \
           f"--checkpoint {runs / 'b'} (another checkpoint or --dtype?); capture again without --layer-set" in err


def _error(argv, capsys) -> str:
    assert cli.main(["quantize-checkpoint", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip().removeprefix("kroquant quantize-checkpoint: error: ")


def test_bad_input_is_refused_before_any_work(runs, tmp_path, capsys):
    a, out = str(runs / "a"), str(tmp_path / "o")
    assert _error(["--checkpoint", a, "--out", out, *TINY, "--recipe", "nope"], capsys).startswith(
        "--recipe: unknown recipe 'nope'; available: ['hadamard32', 'kroquant', 'rtn',")
    # a pipeline root instead of its transformer folder
    pipeline = tmp_path / "pipe"
    shutil.copytree(runs / "a", pipeline / "transformer")
    (pipeline / "model_index.json").write_text("{}")
    assert _error(["--checkpoint", str(pipeline), "--out", out, *TINY], capsys) == (
        f"--checkpoint {pipeline} is a diffusers pipeline folder; pass its transformer folder: "
        f"--checkpoint {pipeline / 'transformer'}")
    broken = tmp_path / "broken"
    shutil.copytree(runs / "a", broken)
    (broken / "config.json").write_text('{"_class_name": "PixArtTransformer2DModel",')
    assert _error(["--checkpoint", str(broken), "--out", out, *TINY], capsys).startswith(
        f"{broken / 'config.json'}: not valid JSON (")
    (broken / "config.json").write_text('{"_class_name": "UNet2DModel"}')
    assert _error(["--checkpoint", str(broken), "--out", out, *TINY], capsys).startswith(
        f"{broken / 'config.json'}: _class_name 'UNet2DModel' is not a supported model family (supported: ")
    (tmp_path / "file").write_text("")
    assert _error(["--checkpoint", a, "--out", str(tmp_path / "file"), *TINY], capsys) == (
        f"--out {tmp_path / 'file'}: exists and is not a folder")
    # LoRaQ's default rank 128 does not fit the 32-wide layers
    assert _error(["--checkpoint", a, "--out", out, *TINY, "--recipe", "rtn+loraq"], capsys).startswith(
        "--recipe rtn+loraq: layer 'transformer_blocks.0.attn1.to_k': rank=128 exceeds min(o, d) of the weight "
        "(32, 32)")
    assert _error(["--checkpoint", a, "--out", out, *TINY[4:], "--embeddings", str(tmp_path / "none.npz")],
                  capsys) == f"--embeddings {tmp_path / 'none.npz'}: no such file or folder"
    assert not (tmp_path / "o" / "layer_set.safetensors").exists()  # nothing was captured


def test_unaligned_linears_stay_16bit_and_are_listed(tmp_path):
    cfg = sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                          num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
                          caption_channels=8, mlp_ratio=2.5, sample_size=8)  # GLUMBConv hidden 80: d = 80
    families.SANA.to_diffusers(families.SANA.build(cfg, seed=0), tmp_path / "sana")
    report = quantize_checkpoint.main(["--checkpoint", str(tmp_path / "sana"), "--out", str(tmp_path / "o"), *TINY])
    assert report["left_16bit"] == {
        "transformer_blocks.0.ff.conv_point": "input width 80 is not a multiple of the block 32"}
    assert "transformer_blocks.0.ff.conv_point" not in report["heldout_error"] and report["layers"] >= 1
    assert report["solver"] == "flow_euler" and report["shift"] == 3.0 and report["padded"] == {}

    padded = quantize_checkpoint.main(["--checkpoint", str(tmp_path / "sana"), "--out", str(tmp_path / "p"), *TINY,
                                       "--unaligned", "pad"])
    assert padded["left_16bit"] == {} and padded["layers"] == report["layers"] + 1
    assert padded["padded"] == {"transformer_blocks.0.ff.conv_point": "input width 80 zero-padded to 96"}
    assert padded["heldout_error"]["transformer_blocks.0.ff.conv_point"] < 1.0
    assert padded["mean_latent_psnr_db"] > 0
    loaded = load_quantized_checkpoint(tmp_path / "p" / "quantized-rtn")
    config = loaded.qlayers["transformer_blocks.0.ff.conv_point"].config
    assert (config.in_features, config.input_pad) == (96, 16)


def test_generate_runs_the_quantized_folder_alone(runs, tmp_path):
    """quantize-checkpoint's folder, moved away from its source checkpoint, generates (`kroquant generate`, a
    subprocess) the same W4A4 latents as quantize-checkpoint's own evaluation of the same prompt and seed."""
    import numpy as np

    rng = np.random.default_rng(3)
    prompts = tmp_path / "prompts.npz"
    np.savez(prompts, context=rng.standard_normal((2, 4, 8)), mask=np.ones((2, 4)),
             uncond_context=np.zeros((1, 4, 8)), uncond_mask=np.ones((1, 4)))
    source = tmp_path / "source"
    shutil.copytree(runs / "a", source)
    out = tmp_path / "out"
    quantize_checkpoint.main(["--checkpoint", str(source), "--out", str(out), "--embeddings", str(prompts),
                              *TINY[4:]])
    shutil.rmtree(source)  # the quantized folder stands alone
    folder = tmp_path / "moved"
    shutil.move(out / "quantized-rtn", folder)
    proc = subprocess.run([sys.executable, "-m", "scripts.cli", "generate", "--checkpoint", str(folder), "--prompts",
                           str(prompts), "--out", str(tmp_path / "g"), "--quiet"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("2 prompt(s) generated with the W4A4 model (rtn, 10 quantized layers, simulate; dpm_solver_pp_2m, "
            "2 steps)") in proc.stderr
    with np.load(tmp_path / "g" / "latents.npz") as generated, np.load(out / "samples-rtn.npz") as evaluated:
        assert generated["latents"].shape == (2, 4, 8, 8)
        assert generated["seeds"][1] == evaluated["seeds"][0]
        np.testing.assert_array_equal(generated["latents"][1], evaluated["latents_w4a4"][0])


def _text_embeddings(path, prompts=6, tokens=4, channels=8, seed=0):
    rng = np.random.default_rng(seed)
    mask = (np.arange(tokens)[None] < rng.integers(1, tokens + 1, prompts)[:, None]).astype(np.float32)
    np.savez(path, context=rng.standard_normal((prompts, tokens, channels)).astype(np.float32), mask=mask,
             uncond_context=np.zeros((1, tokens, channels), np.float32), uncond_mask=np.ones((1, tokens), np.float32))
    return int(mask.sum()) + 1  # distinct real rows: every real token, and the all-zero unconditional caption's


def test_text_rows_from_all_prompts_capture_and_its_store_key(runs, tmp_path, capsys):
    from kroquant_jax.layerset import load_layer_set

    text = tmp_path / "text.npz"
    distinct = _text_embeddings(text)
    out = tmp_path / "out"
    argv = ["--checkpoint", str(runs / "a"), "--out", str(out), *TINY, "--rows-per-layer", "64"]
    quantize_checkpoint.main(argv + ["--text-rows-from-all-prompts", "--text-embeddings", str(text)])
    settings = json.loads((out / "layer_set.json").read_text())
    assert settings["text_rows_from_all_prompts"] is True and set(settings["text_prompts"]) == {
        "context", "mask", "uncond_context", "uncond_mask"}
    layer_set = load_layer_set(str(out / "layer_set.safetensors"))
    plain = load_layer_set(str(runs / "out_a" / "layer_set.safetensors"))
    assert layer_set["transformer_blocks.0.attn2.to_k"].activations.shape == (distinct, 32)
    assert layer_set["transformer_blocks.0.attn2.to_v"].activations.shape == (distinct, 32)
    assert plain["transformer_blocks.0.attn2.to_k"].activations.shape[0] < distinct
    # vice versa: a store made with the option is refused without it (and with other text embeddings)
    assert cli.main(["quantize-checkpoint", *argv]) == 1
    assert "(capture text_prompts; capture setting text_rows_from_all_prompts: True -> None)" in \
        capsys.readouterr().err
    _text_embeddings(text, seed=1)
    assert cli.main(["quantize-checkpoint", *argv, "--text-rows-from-all-prompts", "--text-embeddings",
                     str(text)]) == 1
    assert "(capture text_prompts)" in capsys.readouterr().err


def test_text_rows_bad_input_is_refused_before_any_work(runs, tmp_path, capsys):
    a, out = str(runs / "a"), str(tmp_path / "o")
    text = tmp_path / "text.npz"
    _text_embeddings(text)
    assert _error(["--checkpoint", a, "--out", out, *TINY, "--text-embeddings", str(text)], capsys) == (
        "--text-embeddings is read only with --text-rows-from-all-prompts")
    assert _error(["--checkpoint", a, "--out", out, *TINY, "--text-rows-from-all-prompts", "--layer-set",
                   str(runs / "out_a" / "layer_set.safetensors")], capsys) == (
        "--text-rows-from-all-prompts is a capture option, and --layer-set captures nothing")
    with np.load(text) as data:
        arrays = dict(data)
    np.savez(text, **{**arrays, "mask": arrays["mask"][:, :3]})
    assert _error(["--checkpoint", a, "--out", out, *TINY, "--text-rows-from-all-prompts", "--text-embeddings",
                   str(text)], capsys) == (
        f"--text-embeddings {text}['mask']: shape (6, 3) does not match 'context''s (prompts, tokens) = (6, 4)")
    assert not (tmp_path / "o" / "layer_set.safetensors").exists()  # nothing was captured

"""Bad input to the `kroquant` verbs ends in one line naming the flag or file at fault, before the expensive part:
unreadable .npz / .safetensors / JSON files, prompt arrays the sampler would misread, non-finite or non-positive
sampler flags, an output path that cannot be written."""

import json
import shutil

import numpy as np
import pytest

from scripts import cli


def _error(capsys, verb: str) -> str:
    """The one stderr line of a failed verb, without its ``kroquant <verb>: error: `` prefix."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    prefix = f"kroquant {verb}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix):].strip()


def _generate(checkpoint, prompts, out) -> int:
    return cli.main(["generate", "--checkpoint", str(checkpoint), "--prompts", str(prompts), "--out", str(out),
                     "--quiet"])


def test_unreadable_npz_and_safetensors_files_are_named(tmp_path, capsys):
    """A truncated .npz (numpy's BadZipFile) or .safetensors (the reader's SafetensorError) was an "internal error"
    that named no file; each reader now names it: layer sets, testbed datasets, prompt files."""
    good = tmp_path / "good.npz"
    np.savez(good, **{"a/weight": np.zeros((8, 32), np.float32)})
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(good.read_bytes()[:100])
    cut_st = tmp_path / "cut.safetensors"
    cut_st.write_bytes(b"\x40" + b"\x00" * 20)
    for argv, verb, path in ((["calibrate", "--layers", str(truncated), "--methods", "rtn"], "calibrate", truncated),
                             (["calibrate", "--layers", str(cut_st), "--methods", "rtn"], "calibrate", cut_st),
                             (["dmd2", "reference", "--data", str(truncated)], "dmd2", truncated)):
        assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 1
        message = _error(capsys, verb)
        assert message.startswith(f"{path}: not a readable ."), message


@pytest.mark.parametrize("case, expected", [
    ("truncated", "not a readable .npz file (truncated or corrupt"),
    ("nan", "'context' holds NaN or Inf values"),
    ("mask_tokens", "'mask' has shape (2, 5), not the (prompts, tokens) of 'context', (2, 4)"),
    ("mask_prompts", "'mask' has shape (3, 4), not the (prompts, tokens) of 'context', (2, 4)"),
])
def test_generate_refuses_a_bad_prompt_file_naming_its_flag(case, expected, tiny_quantized_pixart, tmp_path, capsys):
    """Before: a truncated file was an internal BadZipFile, NaN features gave NaN latents with status 0, a mask of
    another token count an internal TypeError, one of more prompts was used silently; errors said --embeddings
    (quantize-checkpoint's flag) instead of generate's --prompts."""
    _, quantized, prompts, _ = tiny_quantized_pixart
    with np.load(prompts) as data:
        arrays = {k: data[k] for k in data.files}
    if case == "nan":
        arrays["context"][0, 1, 2] = np.nan
    elif case == "mask_tokens":
        arrays["context_mask"] = np.ones((2, 5), np.float32)
    elif case == "mask_prompts":
        arrays["context_mask"] = np.ones((3, 4), np.float32)
    path = tmp_path / "prompts.npz"
    np.savez(path, **arrays)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    assert _generate(quantized, path, tmp_path / "out") == 1
    assert _error(capsys, "generate").startswith(f"--prompts {path}: {expected}")
    assert not (tmp_path / "out" / "latents.npz").exists()


@pytest.mark.parametrize("verb, argv, flag, message", [
    ("generate", ["--guidance", "nan"], "--guidance", "must be a finite number, got nan"),
    ("generate", ["--shift", "0"], "--shift", "must be > 0, got 0"),
    ("quantize-checkpoint", ["--guidance", "inf"], "--guidance", "must be a finite number, got inf"),
    ("quantize-checkpoint", ["--shift", "-1"], "--shift", "must be > 0, got -1"),
])
def test_sampler_flags_must_be_finite_and_the_shift_positive(verb, argv, flag, message, tmp_path, capsys):
    """A NaN / Inf guidance or a shift <= 0 (flow_sigmas divides by 1 + (shift - 1) s) sampled NaN latents and
    exited 0; now argparse refuses the flag."""
    common = {"generate": ["--checkpoint", "c", "--prompts", "p.npz"],
              "quantize-checkpoint": ["--checkpoint", "c", "--synthetic-prompts", "1"]}[verb]
    assert cli.main([verb, *common, "--out", str(tmp_path / "o"), *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"kroquant {verb}: error: argument {flag}: {message}"


def test_generate_checks_out_before_sampling(tiny_quantized_pixart, tmp_path, capsys):
    """An --out that is a file failed the write after the sampling, with an errno message naming no flag."""
    _, quantized, prompts, _ = tiny_quantized_pixart
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    assert _generate(quantized, prompts, taken) == 1
    assert _error(capsys, "generate") == f"--out {taken}: exists and is not a folder"
    assert taken.read_text() == "not a folder"


def test_encode_prompts_checks_out_and_prompts_file_before_loading_the_pipeline(tmp_path, capsys):
    """--out a folder failed only at the write, after the text encoder ran; an unreadable --prompts-file gave a
    decoder message naming neither flag nor file. Both are refused before the pipeline is loaded (none here)."""
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "PixArtSigmaPipeline"}))
    (tmp_path / "folder").mkdir()
    assert cli.main(["encode-prompts", "--pipeline", str(pipeline), "--prompt", "a cat", "--out",
                     str(tmp_path / "folder")]) == 1
    assert _error(capsys, "encode-prompts") == f"--out {tmp_path / 'folder'}: is a folder, not a file name"
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"\xb0\xff\x00")
    assert cli.main(["encode-prompts", "--pipeline", str(pipeline), "--prompts-file", str(binary), "--out",
                     str(tmp_path / "p.npz")]) == 1
    assert _error(capsys, "encode-prompts").startswith(f"--prompts-file {binary}: not a readable UTF-8 text file")


def test_generate_names_a_corrupt_json_file_of_the_checkpoint(tiny_quantized_pixart, tmp_path, capsys):
    """A truncated quantization_config.json or config.json gave json's bare "Expecting value: line ..." message."""
    _, quantized, prompts, _ = tiny_quantized_pixart
    for name in ("quantization_config.json", "config.json"):
        folder = tmp_path / name
        shutil.copytree(quantized, folder)
        text = (folder / name).read_text()
        (folder / name).write_text(text[:len(text) // 2])
        assert _generate(folder, prompts, tmp_path / "out") == 1
        assert _error(capsys, "generate").startswith(f"{folder / name}: corrupt JSON (")


@pytest.mark.parametrize("verb", ["evaluate", "qad"])
def test_testbed_verbs_name_a_missing_checkpoint_folder(verb, tmp_path, capsys):
    """A missing --checkpoint was reported as its missing testbed_prompts.npz, with a `python -m` hint."""
    missing = tmp_path / "nosuch"
    argv = [verb, "--checkpoint", str(missing), "--out", str(tmp_path / "out")]
    if verb == "qad":
        argv += ["--data", str(tmp_path / "data.npz"), "--variants", "qad_16bit"]
    assert cli.main(argv) == 1
    assert _error(capsys, verb) == f"--checkpoint {missing}: no such file or folder"


@pytest.mark.parametrize("flags,message", [
    (["--dm-sigma-range", "0.9", "0.1"], "--dm-sigma-range: need 0 < dm_sigma_min (0.9) < dm_sigma_max (0.1)"),
    (["--guidance-sigma-range", "0.5", "0.2"], "--guidance-sigma-range: self.guidance_sigma_range=(0.5, 0.2) must "
                                               "satisfy 0 <= low <= high <= 1"),
    (["--generator-lr", "0"], "--generator-lr / --fake-lr: learning rates must be > 0"),
])
def test_dmd2_settings_are_refused_by_flag_before_anything_loads(flags, message, tmp_path, capsys):
    """DMD2Config's checks ran only after the teacher and the dataset had loaded, and named its fields."""
    argv = ["dmd2", "train", "--teacher", str(tmp_path / "no_teacher"), "--data", str(tmp_path / "no_data.npz"),
            "--run", str(tmp_path / "run"), *flags]
    assert cli.main(argv) == 1
    assert _error(capsys, "dmd2").startswith(message)


def test_generate_names_a_latent_size_the_model_cannot_patch(tiny_quantized_pixart, tmp_path, capsys):
    """--latent-hw 7 7 on a PixArt model (patch 2) failed inside the sampler's trace, naming PatchEmbed's arrays."""
    _, quantized, prompts, _ = tiny_quantized_pixart
    argv = ["generate", "--checkpoint", str(quantized), "--prompts", str(prompts), "--out", str(tmp_path / "out"),
            "--latent-hw", "7", "8", "--quiet"]
    assert cli.main(argv) == 1
    assert _error(capsys, "generate") == "--latent-hw 7 8: latent size (7, 8): a pixart model needs positive " \
                                         "multiples of 2"


def test_every_family_checks_its_latent_multiple():
    from models import families

    expected = {"pixart": 2, "sana": 1, "flux": 2, "ideogram4": 1}
    for name, family in families.REGISTRY.items():
        cfg = next(iter(family.presets.values()))
        assert family.latent_multiple(cfg) == expected[name], name
        family.check_latent_hw(cfg, (64, 64))
    with pytest.raises(ValueError, match=r"latent size \(64, 63\): a flux model needs positive multiples of 2"):
        families.FLUX.check_latent_hw(families.FLUX.presets["FLUX.1-schnell"], (64, 63))

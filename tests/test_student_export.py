"""A trained W4A4 student (QAD's, DMD2's W4A4 generator) as a quantized checkpoint folder: written by
``models.qad.export_student_checkpoint`` / ``kroquant dmd2 export``, read by ``load_quantized_checkpoint`` and
``kroquant generate`` (simulate and the served ``dequant`` strategy's CPU reference), and a DMD2 generator started
from it (``--init-checkpoint``, ``models.dmd2.load_init_checkpoint``) on a tiny random PixArt."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kroquant_jax import formats
from models import dmd2, families, qad
from models.layers import LinearHooks, linears
from models.quantized_checkpoint import load_quantized_checkpoint, save_quantized_checkpoint
from models.testbed import model as testbed

# one block, 32-wide, the testbed's 32x32 latents and 384-dim captions (the shipped prompt file's)
TINY = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2, attention_head_dim=16,
                           cross_attention_dim=32)
PROMPTS = Path(__file__).resolve().parent.parent / "checkpoints" / "emoji_pixart" / "testbed_prompts.npz"
QUANT = qad.QADConfig(fmt="mxfp4", ste="identity", steps=20, chunk=10, save_every=10)
GAN_LAYER = "transformer_blocks.0.ff.net.0.proj"


def ptq_layers(model, seed):
    """LoRaQ-like calibrated layers of every quantizable linear: a random diagonal transform, a packed MXFP4
    rank-32 branch of half the weight's leading singular directions (``QuantizedLinear``s, as a PTQ store holds
    them)."""
    from kroquant_jax.qlinear import build_qlinear

    rng = np.random.default_rng(seed)
    out = {}
    for name, linear in linears(model, quantizable_only=True).items():
        w = np.asarray(linear.kernel[...], np.float32).T  # (o, d)
        o, d = w.shape
        u, s, vt = np.linalg.svd(w, full_matrices=False)
        branch = (0.5 * u[:, :32] * s[:32], vt[:32])  # (o, 32), (32, d)
        params = {"log_gamma": jnp.asarray(0.3 * rng.standard_normal(d), jnp.float32)}
        out[name] = build_qlinear(w, np.asarray(linear.bias[...]), transform="diagonal", transform_params=params,
                                  lowrank=branch, lowrank_quantized=True)
    return out


def trained_student(model, seed):
    """A QAD student as training leaves it: PTQ-initialised, then its 16-bit rest and its layers moved away from
    the teacher's (so an export that dropped the trained rest or layers would not match)."""
    layers, blocks, packed = qad.student_from_qlinears(model, ptq_layers(model, seed))
    _, state = nnx.split(model)
    rng = np.random.default_rng(1000 + seed)  # numpy: jax.random would compile a sampler per parameter shape
    rest = jax.tree.map(lambda p: p + jnp.asarray(0.05 * rng.standard_normal(p.shape), p.dtype), state)
    layers = {n: {**l, "weight": l["weight"] * 1.1, "bias": l["bias"] + 0.1} for n, l in layers.items()}
    return {"model": rest, "layers": jax.tree.map(jnp.asarray, layers)}, blocks, packed


def inputs(b=2):
    context = jax.random.normal(jax.random.key(7), (b, 6, TINY.caption_channels))
    mask = jnp.array([[1.0] * 5 + [0.0]] * b)
    x = jax.random.normal(jax.random.key(8), (b, TINY.in_channels, TINY.sample_size, TINY.sample_size))
    return x, jnp.array([0.9, 0.35]), context, mask


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny teacher (saved as a diffusers folder) and a trained QAD student exported from it."""
    root = tmp_path_factory.mktemp("export")
    teacher = families.PIXART.build(TINY, jnp.float32, seed=0)
    families.PIXART.to_diffusers(teacher, root / "teacher")
    graphdef, teacher_state = nnx.split(teacher)
    trainable, blocks, packed = trained_student(teacher, seed=1)
    qlayers = qad.export_student_checkpoint(root / "qad_ptq", graphdef, trainable, blocks, QUANT, packed,
                                            recipe_name="qad_ptq", recipe=QUANT, extra={"step": 20, "steps": 2})
    return {"root": root, "teacher": teacher, "graphdef": graphdef, "teacher_state": teacher_state,
            "trainable": trainable, "blocks": blocks, "packed": packed, "qlayers": qlayers,
            "folder": root / "qad_ptq"}


def student_velocity(world, x, sigma, context, mask):
    return jax.jit(lambda tr: qad.student_velocity(world["graphdef"], tr, world["blocks"], QUANT, world["packed"], x,
                                                   sigma * testbed.TIMESTEP_SCALE, context, mask))(world["trainable"])


def checkpoint_velocity(loaded, overrides, x, sigma, context, mask):
    graphdef, state = nnx.split(loaded.model)

    @jax.jit
    def run(state, overrides):
        return nnx.merge(graphdef, state)(x, context, sigma * testbed.TIMESTEP_SCALE, encoder_attention_mask=mask,
                                          hooks=LinearHooks(overrides))

    return run(state, overrides)


def test_exported_student_is_a_quantized_checkpoint_whose_forward_is_the_students(world):
    """load_quantized_checkpoint reads it; the folder holds the trained 16-bit rest (not the teacher's) and every
    quantizable linear packed; its simulate forward is the student's fake-quant velocity (float32 rounding only:
    rtol 1e-4 of the output scale) and the served dequant strategy (bf16 activations, jnp reference) is within 3%."""
    from pallas_kernels import served

    loaded = load_quantized_checkpoint(world["folder"])
    assert set(loaded.qlayers) == set(linears(world["teacher"], quantizable_only=True))
    config = loaded.config
    assert config["recipe"] == "qad_ptq" and config["settings"]["fmt"] == "mxfp4" and config["settings"]["lr"] == 5e-5
    assert config["extra"]["guidance"] == 1.0 and config["extra"]["solver"] == "flow_euler"
    assert config["extra"]["step"] == 20 and config["extra"]["student"]["lowrank_quantized"] is True
    assert config["left_16bit"] == {}
    trained = np.asarray(world["trainable"]["model"]["proj_out"]["kernel"][...])
    np.testing.assert_array_equal(np.asarray(loaded.model.proj_out.kernel[...]), trained)
    assert not np.array_equal(trained, np.asarray(world["teacher"].proj_out.kernel[...]))
    name = "transformer_blocks.0.attn1.to_q"
    np.testing.assert_array_equal(np.asarray(loaded.qlayers[name].weight.codes),
                                  np.asarray(world["qlayers"][name].weight.codes))

    x, sigma, context, mask = inputs()
    ours = np.asarray(student_velocity(world, x, sigma, context, mask))
    simulate = np.asarray(checkpoint_velocity(loaded, loaded.overrides(), x, sigma, context, mask))
    scale = float(np.abs(ours).max())
    np.testing.assert_allclose(simulate, ours, rtol=1e-4, atol=1e-4 * scale)
    sixteen = np.asarray(jax.jit(lambda state: nnx.merge(world["graphdef"], state)(  # jitted: one program, not eager
        x, context, sigma * testbed.TIMESTEP_SCALE, encoder_attention_mask=mask))(world["teacher_state"]))
    assert np.abs(ours - sixteen).max() > 1e-2 * scale  # the quantizers (and the trained rest) are on
    dequant = np.asarray(checkpoint_velocity(loaded, loaded.served_overrides(served.ServeOptions(strategy="dequant")),
                                             x, sigma, context, mask))
    assert np.isfinite(dequant).all() and not np.array_equal(dequant, simulate)
    assert np.linalg.norm(dequant - simulate) / np.linalg.norm(simulate) < 0.03


def test_kroquant_generate_serves_the_export_at_guidance_one(world, tmp_path):
    """`kroquant generate` runs the exported folder with its recorded sampler (flow Euler, 2 steps, guidance 1:
    one branch) on simulate and dequant; the two agree within 5%."""
    from scripts import generate

    prompts = tmp_path / "p.npz"
    _, _, context, mask = inputs(1)
    np.savez(prompts, context=np.asarray(context), mask=np.asarray(mask), uncond_context=np.zeros_like(context),
             uncond_mask=np.asarray(mask))
    common = ["--checkpoint", str(world["folder"]), "--prompts", str(prompts), "--quiet"]
    sim = generate.main([*common, "--out", str(tmp_path / "sim")])
    deq = generate.main([*common, "--out", str(tmp_path / "deq"), "--strategy", "dequant"])
    assert (sim["solver"], sim["steps"], deq["strategy"]) == ("flow_euler", 2, "dequant")
    with np.load(tmp_path / "sim" / "latents.npz") as a, np.load(tmp_path / "deq" / "latents.npz") as b:
        s, d = a["latents"], b["latents"]
    assert np.isfinite(d).all() and np.linalg.norm(d - s) / np.linalg.norm(s) < 0.05


def test_dmd2_generator_from_the_export_starts_at_the_qad_students_forward(world, tmp_path):
    """load_init_checkpoint: the generator's 16-bit rest is the folder's, its W~ the dequantized codes (MXFP4
    re-quantization returns them), so its initial W4A4 forward is the QAD student's (1e-5 of the scale); the key
    hashes the folder's files (a moved copy keys alike, another export differently)."""
    store = dmd2.load_init_checkpoint(world["folder"], world["teacher"])
    assert store.kind == "init_checkpoint" and store.w4a4.quant.fmt == "mxfp4" and store.w4a4.lowrank_quantized
    np.testing.assert_array_equal(np.asarray(store.generator["model"]["proj_out"]["kernel"][...]),
                                  np.asarray(world["trainable"]["model"]["proj_out"]["kernel"][...]))
    name = "transformer_blocks.0.ff.net.2"
    w = world["trainable"]["layers"][name]["weight"]
    np.testing.assert_array_equal(np.asarray(store.generator["layers"][name]["weight"]),
                                  np.asarray(formats.dequantize(formats.quantize(w, QUANT.quant_format))))
    x, sigma, context, mask = inputs()
    flow = dmd2.pixart_flow_model(world["graphdef"], jnp.zeros((6, TINY.caption_channels)), jnp.ones((6,)),
                                  w4a4=store.w4a4)
    # committed to its device as a restored checkpoint's arrays are: the end-to-end test's forward of its restored
    # generator is then this program (one compilation)
    generator = jax.device_put(store.generator, jax.devices()[0])
    ours = np.asarray(jax.jit(flow.apply)(generator, x, sigma, {"context": context, "mask": mask}))
    theirs = np.asarray(student_velocity(world, x, sigma, context, mask))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * float(np.abs(theirs).max()))

    key = dmd2.generator_key(store)
    assert key["generator"] == {"init_checkpoint": "qad_ptq", "sha256": store.sha256}
    moved = dmd2.load_init_checkpoint(shutil.copytree(world["folder"], tmp_path / "moved" / "qad_ptq"),
                                      world["teacher"])
    assert moved.sha256 == store.sha256
    trainable, blocks, packed = trained_student(world["teacher"], seed=2)
    qad.export_student_checkpoint(tmp_path / "other", world["graphdef"], trainable, blocks, QUANT, packed,
                                  recipe_name="qad_ptq", recipe=QUANT)
    other = dmd2.load_init_checkpoint(tmp_path / "other", world["teacher"])
    assert other.sha256 != store.sha256
    run = tmp_path / "run"
    dmd2.check_run_key(run, key, write=True)
    dmd2.check_run_key(run, dmd2.generator_key(moved), write=False)
    with pytest.raises(dmd2.RunKeyMismatch, match=r"initialised from --init-checkpoint .*qad_ptq .*this call's from "
                                                  r"--init-checkpoint .*other"):
        dmd2.check_run_key(run, dmd2.generator_key(other), write=False)


def test_a_wrong_init_checkpoint_is_refused_in_one_line_naming_the_file_layer_and_key(world, tmp_path):
    from safetensors.numpy import load_file, save_file

    from kroquant_jax.qlinear import QLinearStore

    teacher, folder = world["teacher"], world["folder"]

    def copy(name):
        return shutil.copytree(folder, tmp_path / name)

    with pytest.raises(ValueError, match="--init-checkpoint .*nowhere: no such folder"):
        dmd2.load_init_checkpoint(tmp_path / "nowhere", teacher)
    (copy("no_arrays") / "quantized.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no_arrays: no quantized.safetensors \(not a quantized checkpoint"):
        dmd2.load_init_checkpoint(tmp_path / "no_arrays", teacher)
    store = QLinearStore(str(tmp_path / "a_store"))  # a PTQ store given to the wrong flag
    store.save("transformer_blocks.0.attn1.to_q", world["qlayers"]["transformer_blocks.0.attn1.to_q"])
    with pytest.raises(ValueError, match="no config.json .*a QLinearStore folder of layer files is a --ptq-store"):
        dmd2.load_init_checkpoint(tmp_path / "a_store", teacher)
    wider = families.PIXART.build(dataclasses.replace(TINY, attention_head_dim=32, cross_attention_dim=64), jnp.float32,
                                  seed=0)
    with pytest.raises(ValueError, match=r"config.json: attention_head_dim is 16, the teacher's is 32"):
        dmd2.load_init_checkpoint(folder, wider)
    # a layer's bias truncated in quantized.safetensors
    bad = copy("bad_shape")
    arrays = load_file(str(bad / "quantized.safetensors"))
    target = "transformer_blocks.0.ff.net.2"
    arrays[f"{target}/bias"] = arrays[f"{target}/bias"][:5]
    save_file(arrays, str(bad / "quantized.safetensors"))
    with pytest.raises(ValueError, match=rf"quantized.safetensors \(layer {target}\): key 'bias' has shape \(5,\), "
                                         r"expected \(32,\)"):
        dmd2.load_init_checkpoint(bad, teacher)
    # a quantizable linear left 16-bit, and one layer in another format
    model = nnx.merge(world["graphdef"], world["trainable"]["model"])
    partial = {k: v for k, v in world["qlayers"].items() if k != "transformer_blocks.0.attn2.to_v"}
    save_quantized_checkpoint(tmp_path / "partial", model, partial, recipe_name="x", recipe=QUANT)
    with pytest.raises(ValueError, match=r"no quantized layer for 1 quantizable linear\(s\) of the teacher, e\.g\. "
                                         r"\['transformer_blocks\.0\.attn2\.to_v'\]"):
        dmd2.load_init_checkpoint(tmp_path / "partial", teacher)
    one = {target: world["trainable"]["layers"][target]}
    nv = qad.export_qlinears(one, world["blocks"], dataclasses.replace(QUANT, fmt="nvfp4"), world["packed"])
    save_quantized_checkpoint(tmp_path / "mixed", model, {**world["qlayers"], **nv}, recipe_name="x", recipe=QUANT)
    with pytest.raises(ValueError, match=rf"layers in several formats \(.* is mxfp4, {target} is nvfp4\)"):
        dmd2.load_init_checkpoint(tmp_path / "mixed", teacher)


def test_dmd2_train_from_a_qad_export_then_dmd2_export_end_to_end(world, tmp_path):
    """`kroquant dmd2 train --init-checkpoint` (one cycle) from the QAD export, then `kroquant dmd2 export`: the
    written folder's simulate forward is the trained generator's W4A4 forward; refused in one line: an existing
    --out (without --overwrite), a 16-bit run, resuming or exporting with another initial folder."""
    from scripts import dmd2 as script

    teacher_dir, run = world["root"] / "teacher", tmp_path / "run"
    train = ["train", "--data", str(PROMPTS), "--teacher", str(teacher_dir), "--run", str(run), "--num-steps", "1",
             "--gan-feature-layer", GAN_LAYER, "--batch-size", "2", "--ratio", "1", "--cycles", "1",
             "--cycles-per-call", "1", "--no-progress", "--compute-dtype", "float32"]
    assert script.main([*train, "--init-checkpoint", str(world["folder"])]) == 0
    assert json.loads((run / "dmd2_run.json").read_text())["generator"]["init_checkpoint"] == "qad_ptq"
    trainable, blocks, packed = trained_student(world["teacher"], seed=3)
    other = tmp_path / "other_student"
    qad.export_student_checkpoint(other, world["graphdef"], trainable, blocks, QUANT, packed, recipe_name="qad_ptq",
                                  recipe=QUANT)
    with pytest.raises(dmd2.RunKeyMismatch, match="initialised from --init-checkpoint .*qad_ptq .*this call's from "
                                                  "--init-checkpoint .*other_student"):
        script.main([*train, "--init-checkpoint", str(other), "--cycles", "2"])

    out = tmp_path / "exported"
    assert script.main(["export", "--run", str(run), "--out", str(out)]) == 0
    loaded = load_quantized_checkpoint(out)
    assert loaded.config["recipe"] == "dmd2" and loaded.config["extra"]["cycle"] == 1
    assert loaded.config["extra"]["init"]["init_checkpoint"] == "qad_ptq" and loaded.config["extra"]["steps"] == 1
    assert loaded.config["settings"]["num_steps"] == 1 and loaded.config["settings"]["fake_updates_per_generator"] == 1
    store = dmd2.load_init_checkpoint(world["folder"], world["teacher"])
    generator, cycle = dmd2.restore_generator(run, store.generator, dmd2.generator_key(store))
    name = "transformer_blocks.0.attn1.to_q"
    assert cycle == 1 and not np.array_equal(np.asarray(generator["layers"][name]["weight"]),
                                             np.asarray(store.generator["layers"][name]["weight"]))
    x, sigma, context, mask = inputs()
    flow = dmd2.pixart_flow_model(world["graphdef"], jnp.zeros((6, TINY.caption_channels)), jnp.ones((6,)),
                                  w4a4=store.w4a4)
    trained = np.asarray(jax.jit(flow.apply)(generator, x, sigma, {"context": context, "mask": mask}))
    exported = np.asarray(checkpoint_velocity(loaded, loaded.overrides(), x, sigma, context, mask))
    np.testing.assert_allclose(exported, trained, rtol=1e-4, atol=1e-4 * float(np.abs(trained).max()))

    with pytest.raises(ValueError, match=r"--out .*exported: exists and is not empty; pass --overwrite"):
        script.main(["export", "--run", str(run), "--out", str(out)])
    with pytest.raises(dmd2.RunKeyMismatch, match="this call's from --init-checkpoint .*other_student"):
        script.main(["export", "--run", str(run), "--out", str(tmp_path / "refused"), "--init-checkpoint",
                     str(other)])
    with pytest.raises(ValueError, match=r"--ptq-store .*: the run .* was initialised from --init-checkpoint"):
        script.main(["export", "--run", str(run), "--out", str(tmp_path / "refused"), "--ptq-store", str(other)])
    sixteen = tmp_path / "sixteen"  # a 16-bit run's key and a checkpoint
    (sixteen / "checkpoints" / "1").mkdir(parents=True)
    (sixteen / "dmd2_run.json").write_text(json.dumps(dmd2.TEACHER_KEY))
    with pytest.raises(ValueError, match=r"--run .*sixteen: its generator is 16-bit \(trained without --ptq-store"):
        script.main(["export", "--run", str(sixteen), "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()


def test_qad_export_dir_is_validated_before_any_work(tmp_path):
    """`kroquant qad --export-dir DIR`: an existing non-empty DIR/<variant> is refused before the teacher is loaded
    and before --out is created (unless --overwrite-export)."""
    from scripts import qad as qad_script

    (tmp_path / "export" / "qad_16bit").mkdir(parents=True)
    (tmp_path / "export" / "qad_16bit" / "config.json").write_text("{}")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"--export-dir .*qad_16bit: exists and is not empty; pass "
                                         r"--overwrite-export"):
        qad_script.main(["--data", str(tmp_path / "none.npz"), "--out", str(out), "--variants", "qad_16bit",
                         "--export-dir", str(tmp_path / "export")])
    assert not out.exists()

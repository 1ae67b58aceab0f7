"""The resume keys of the long jobs: a rerun whose settings or inputs differ from those that produced a run folder's
results is refused in one line naming the folder, the setting and its old -> new value, instead of resuming (or
reusing) the results of the other run. Each test builds its run folder without compiling a training step
(``--time-budget 0`` writes the key and the initial state), so they stay cheap."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kroquant_jax import provenance
from models import dmd2, families, qad
from models.layers import linears
from models.testbed import data as testbed_data
from models.testbed import model as testbed

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "checkpoints" / "emoji_pixart" / "testbed_prompts.npz"
TINY = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2, attention_head_dim=16,
                           cross_attention_dim=32)


def _dataset(path: Path, seed: int = 0) -> Path:
    """A 6-record emoji dataset (4 training, 2 held-out), 32 px, 384-wide captions."""
    rng = np.random.default_rng(seed)
    n, tokens = 6, 5
    mask = np.zeros((n, tokens), np.uint8)
    mask[:, :3] = 1
    testbed_data.write_dataset(testbed_data.EmojiDataset(
        images=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
        context=(rng.standard_normal((n, tokens, 384)) * mask[..., None]).astype(np.float16),
        context_mask=mask, null_context=np.zeros((tokens, 384), np.float16),
        null_mask=np.array([1, 1, 0, 0, 0], np.uint8),
        captions=np.array([f"caption {i}" for i in range(n)]), sequences=np.array([f"{i:X}" for i in range(n)]),
        heldout=np.array([False] * 4 + [True] * 2), image_size=32, max_tokens=tokens), path)
    return path


def _rest_param(model) -> nnx.Param:
    """A parameter outside the quantizable linears (a norm, an embedding, a 16-bit linear)."""
    quantized = set(linears(model, quantizable_only=True))
    for path, node in nnx.iter_graph(model):
        names = [str(p) for p in path]
        if isinstance(node, nnx.Param) and ".".join(names[:-1]) not in quantized:
            return node
    raise AssertionError("no parameter outside the quantizable linears")


# --------------------------------------------------------------------------------------------------------------------
# train-testbed: <run>/train_run.json
# --------------------------------------------------------------------------------------------------------------------


def test_train_testbed_refuses_a_run_trained_with_other_settings_or_data(tmp_path):
    from scripts import train_testbed

    data = _dataset(tmp_path / "a.npz")
    run = tmp_path / "run"
    common = ["--data", str(data), "--run", str(run), "--batch-size", "2", "--num-layers", "1", "--no-progress",
              "--compute-dtype", "float32", "--time-budget", "0"]
    assert train_testbed.main(common) == 0
    assert (run / "train_state.npz").exists() and (run / "train_run.json").exists()
    assert train_testbed.main(common + ["--steps", "40", "--chunk", "7"]) == 0  # training further resumes
    state = (run / "train_state.npz").read_bytes()
    with pytest.raises(provenance.RunFolderError) as refused:
        train_testbed.main(common + ["--lr", "0.01"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--run {run}: made with other settings (lr: 0.0003 -> 0.01)")
    with pytest.raises(provenance.RunFolderError, match=r"\(model.num_layers: 1 -> 2\)"):
        train_testbed.main(common + ["--num-layers", "2"])
    with pytest.raises(provenance.RunFolderError, match=r"data.context: .* -> .*data.images: .* -> "):
        train_testbed.main([*common[:1], str(_dataset(tmp_path / "b.npz", seed=1)), *common[2:]])
    assert (run / "train_state.npz").read_bytes() == state  # nothing touched
    # a state trained before runs were keyed cannot be verified
    (run / "train_run.json").unlink()
    with pytest.raises(provenance.RunFolderError, match=r"no train_run.json\), so the dataset and settings .* cannot "
                                                        r"be verified; use another --run"):
        train_testbed.main(common)


# --------------------------------------------------------------------------------------------------------------------
# dmd2 train / evaluate: <run>/dmd2_run.json, "training"
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    for name, seed in (("teacher", 0), ("other", 1)):
        families.PIXART.to_diffusers(families.PIXART.build(TINY, jnp.float32, seed=seed), root / name)
    return root


def _dmd2_train(teacher: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(PROMPTS), "--teacher", str(teacher), "--num-steps", "1", "--gan-feature-layer",
            "transformer_blocks.0.ff.net.0.proj", "--batch-size", "2", "--ratio", "2", "--no-progress",
            "--compute-dtype", "float32", "--run", str(run), "--time-budget", "0", *extra]


def test_dmd2_train_refuses_a_run_with_other_settings_teacher_or_seed(teachers, tmp_path):
    from scripts import dmd2 as script

    run = tmp_path / "run"
    assert script.main(_dmd2_train(teachers / "teacher", run)) == 0
    stored = json.loads((run / "dmd2_run.json").read_text())
    assert stored["generator"] == "teacher" and stored["training"]["config"]["generator_lr"] == 1e-5
    assert script.main(_dmd2_train(teachers / "teacher", run, "--cycles", "20", "--cycles-per-call", "5")) == 0
    with pytest.raises(dmd2.RunKeyMismatch) as refused:
        script.main(_dmd2_train(teachers / "teacher", run, "--generator-lr", "2e-5", "--ratio", "3"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{run}: trained with other settings (")
    assert "config.fake_updates_per_generator: 2 -> 3; config.generator_lr: 1e-05 -> 2e-05)" in message
    with pytest.raises(dmd2.RunKeyMismatch, match=r"\(config.guidance: 3.0 -> 1.5\)"):
        script.main(_dmd2_train(teachers / "teacher", run, "--guidance", "1.5"))
    with pytest.raises(dmd2.RunKeyMismatch, match=r"\(teacher: '[0-9a-f]+\.\.\. -> '[0-9a-f]+\.\.\.\)"):
        script.main(_dmd2_train(teachers / "other", run))
    with pytest.raises(dmd2.RunKeyMismatch, match=r"\(seed: 0 -> 1\)"):
        script.main(_dmd2_train(teachers / "teacher", run, "--seed", "1"))
    # evaluating the run with another teacher is refused before anything is restored or written
    evaluate = ["evaluate", "--data", str(PROMPTS), "--teacher", str(teachers / "other"), "--num-steps", "1",
                "--gan-feature-layer", "transformer_blocks.0.ff.net.0.proj", "--run", str(run), "--reference",
                str(tmp_path / "absent.npz"), "--out", str(tmp_path / "eval")]
    with pytest.raises(dmd2.RunKeyMismatch, match=r"trained with other settings \(teacher: "):
        script.main(evaluate)
    assert not (tmp_path / "eval").exists()


def test_dmd2_checkpoints_without_keyed_settings_are_refused_for_training(tmp_path):
    run = tmp_path / "legacy"
    (run / "checkpoints" / "5").mkdir(parents=True)
    (run / "dmd2_run.json").write_text(json.dumps({"generator": "teacher"}))
    key = {"generator": "teacher", "training": {"seed": 0}}
    with pytest.raises(dmd2.RunKeyMismatch, match="predate the keyed training settings .* cannot be verified"):
        dmd2.check_run_key(run, key, write=True)
    dmd2.check_run_key(run, {"generator": "teacher", "training": {"teacher": "x"}}, write=False)  # evaluation
    fresh = tmp_path / "fresh"  # a key without checkpoints (a run stopped before its first save) is upgraded
    fresh.mkdir()
    (fresh / "dmd2_run.json").write_text(json.dumps({"generator": "teacher"}))
    dmd2.check_run_key(fresh, key, write=True)
    assert json.loads((fresh / "dmd2_run.json").read_text()) == key


# --------------------------------------------------------------------------------------------------------------------
# qad: runs/<variant>/qad_run.json
# --------------------------------------------------------------------------------------------------------------------


def test_qad_refusal_names_each_setting_old_and_new(tmp_path):
    config = qad.QADConfig(steps=20, chunk=10, save_every=10)
    qad.check_run_folder(tmp_path, config, {"init": "16bit", "data": "aaa"})
    qad.check_run_folder(tmp_path, config, {"init": "16bit", "data": "aaa"})  # the same key: resumed
    (tmp_path / "checkpoints").mkdir()  # results of that key
    with pytest.raises(ValueError) as refused:
        qad.check_run_folder(tmp_path, dataclasses.replace(config, lr=1e-4), {"init": "16bit", "data": "bbb"})
    assert str(refused.value) == (f"--out {tmp_path}: made with other settings (config.lr: 5e-05 -> 0.0001; data: "
                                  "'aaa' -> 'bbb'); use another --out or the same settings")
    # a folder without results (a run stopped before its first save) takes the new key
    (tmp_path / "checkpoints").rmdir()
    qad.check_run_folder(tmp_path, dataclasses.replace(config, lr=1e-4), {"init": "16bit", "data": "bbb"})
    assert json.loads((tmp_path / "qad_run.json").read_text())["config"]["lr"] == 1e-4


def test_qad_run_may_train_further_and_an_older_record_resumes(tmp_path):
    """The step count, the steps per compiled chunk and the save interval schedule the work, so they are not keyed
    (as docs/reliability.md says of every training verb): a rerun with more steps resumes. A record written while
    they (and the teacher folder's name) were keyed is rewritten without them: the same run resumes, another is
    refused naming only the settings that decide results."""
    config = qad.QADConfig(steps=20, chunk=10, save_every=10)
    extra = {"init": "16bit", "data": "aaa", "teacher": "t"}
    qad.check_run_folder(tmp_path / "run", config, extra)
    (tmp_path / "run" / "checkpoints").mkdir()
    qad.check_run_folder(tmp_path / "run", dataclasses.replace(config, steps=40, chunk=5, save_every=20), extra)
    assert "steps" not in json.loads((tmp_path / "run" / "qad_run.json").read_text())["config"]

    def older_record(folder, config):
        (folder / "checkpoints").mkdir(parents=True)
        record = {**qad.run_key(config, extra), "config": config.to_json(), "checkpoint": "emoji_pixart"}
        (folder / "qad_run.json").write_text(json.dumps(record))

    older_record(tmp_path / "old", config)
    qad.check_run_folder(tmp_path / "old", dataclasses.replace(config, steps=60), extra)
    assert json.loads((tmp_path / "old" / "qad_run.json").read_text()) == json.loads(json.dumps(
        qad.run_key(config, extra)))
    older_record(tmp_path / "old_lr", config)
    with pytest.raises(ValueError, match=r"made with other settings \(config.lr: 5e-05 -> 0.0001\); use another"):
        qad.check_run_folder(tmp_path / "old_lr", dataclasses.replace(config, lr=1e-4), extra)


def test_qad_record_from_before_the_naive_field_resumes_as_what_it_ran(tmp_path):
    """A naive run used to be keyed ``ste="none"`` (the identity STE on the activations); its record is rewritten as
    ``ste="identity", naive=True``, so that run resumes, a naive run with the clipped rule is refused (it trains
    other numerics), and an older non-naive record gains ``naive: false``."""
    extra = {"init": "16bit", "data": "aaa", "teacher": "t"}

    def older_record(folder, ste):
        (folder / "checkpoints").mkdir(parents=True)
        key = qad.run_key(qad.QADConfig(), extra)
        config = {k: v for k, v in key["config"].items() if k != "naive"}
        (folder / "qad_run.json").write_text(json.dumps({**key, "config": {**config, "ste": ste}}))

    older_record(tmp_path / "naive", "none")
    qad.check_run_folder(tmp_path / "naive", qad.QADConfig(naive=True), extra)
    stored = json.loads((tmp_path / "naive" / "qad_run.json").read_text())["config"]
    assert (stored["ste"], stored["naive"]) == ("identity", True)
    older_record(tmp_path / "naive_clipped", "none")
    with pytest.raises(ValueError, match=r"config.ste: 'identity' -> 'clipped'"):
        qad.check_run_folder(tmp_path / "naive_clipped", qad.QADConfig(naive=True, ste="clipped"), extra)
    older_record(tmp_path / "clipped", "clipped")
    qad.check_run_folder(tmp_path / "clipped", qad.QADConfig(ste="clipped"), extra)
    assert json.loads((tmp_path / "clipped" / "qad_run.json").read_text())["config"]["naive"] is False


# --------------------------------------------------------------------------------------------------------------------
# quantize-checkpoint / evaluate: the capture's key covers the model outside the quantized linears
# --------------------------------------------------------------------------------------------------------------------


def test_params_digest_covers_the_rest_of_the_model_only():
    from models.layers import params_digest

    model = families.PIXART.build(TINY, jnp.float32, seed=0)
    names = list(linears(model, quantizable_only=True))
    before = params_digest(model, names, config=TINY)
    first = linears(model)[names[0]]
    first.kernel[...] = first.kernel[...] + 1.0  # a quantized weight: the layer set's own comparison covers it
    assert params_digest(model, names, config=TINY) == before
    assert params_digest(model, (), config=TINY) != params_digest(model, names, config=TINY)
    rest = _rest_param(model)
    rest[...] = rest[...] + 1.0
    assert params_digest(model, names, config=TINY) != before
    assert params_digest(model, names, config=dataclasses.replace(TINY, norm_eps=1e-5)) != \
        params_digest(model, names, config=TINY)


def test_quantize_checkpoint_refuses_stored_layers_captured_from_another_rest_of_the_model(tmp_path, capsys):
    from models import pixart
    from scripts import cli, quantize_checkpoint

    cfg = pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                              num_layers=1, cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=8,
                              use_additional_conditions=False)
    model = families.PIXART.build(cfg, seed=4)
    families.PIXART.to_diffusers(model, tmp_path / "a")
    rest = _rest_param(model)  # the same quantized linears, another norm / embedding
    rest[...] = rest[...] * 0.5 + 0.25
    families.PIXART.to_diffusers(model, tmp_path / "b")
    tiny = ["--synthetic-prompts", "2", "--synthetic-tokens", "4", "--steps", "1", "--latent-hw", "8", "8",
            "--rows-per-layer", "24", "--recipe", "rtn", "--calib-rows", "16", "--calib-heldout", "8",
            "--eval-prompts", "1", "--quiet", "--out", str(tmp_path / "out")]
    quantize_checkpoint.main(["--checkpoint", str(tmp_path / "a"), *tiny])
    capsys.readouterr()
    layer_set = (tmp_path / "out" / "layer_set.safetensors").stat().st_mtime_ns
    assert cli.main(["quantize-checkpoint", "--checkpoint", str(tmp_path / "b"), *tiny]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "capture model: the checkpoint's parameters outside the quantized linears, or its " \
                               "config, differ" in lines[0], lines
    assert (tmp_path / "out" / "layer_set.safetensors").stat().st_mtime_ns == layer_set
    # that layer set given to a run of the other checkpoint: its record beside it names the model it came from
    other = ["--checkpoint", str(tmp_path / "b"), *tiny[:-1], str(tmp_path / "out_b")]
    layer_set_file = str(tmp_path / "out" / "layer_set.safetensors")
    assert cli.main(["quantize-checkpoint", *other, "--layer-set", layer_set_file]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "captured from a model whose parameters outside the quantized linears" in lines[0], lines


def test_evaluate_capture_key_covers_the_prompt_content_batch_size_and_model(tmp_path):
    from scripts import eval_testbed

    args = eval_testbed.parse_args(["--out", "x"])
    model = families.PIXART.build(TINY, jnp.float32, seed=0)
    names = list(linears(model, quantizable_only=True))
    a = testbed_data.load_dataset(_dataset(tmp_path / "a.npz"))
    b = testbed_data.load_dataset(_dataset(tmp_path / "b.npz", seed=1))  # the same path could hold either
    calib = np.flatnonzero(~a.heldout)
    digest = eval_testbed.capture_inputs_digest(a, calib, model, TINY, names)
    assert digest == eval_testbed.capture_inputs_digest(a, calib, model, TINY, names)
    assert digest != eval_testbed.capture_inputs_digest(b, calib, model, TINY, names)
    rest = _rest_param(model)
    rest[...] = rest[...] + 1.0
    assert digest != eval_testbed.capture_inputs_digest(a, calib, model, TINY, names)
    keys = {eval_testbed.capture_key(args, "p.npz", calib, names, inputs=digest),
            eval_testbed.capture_key(eval_testbed.parse_args(["--out", "x", "--batch-size", "2"]), "p.npz", calib,
                                     names, inputs=digest),
            eval_testbed.capture_key(args, "p.npz", calib, names, inputs="another")}
    assert len(keys) == 3

"""The emoji testbed DiT: the shipped diffusers checkpoint, its JAX port parity, flow matching, training script."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import families, pixart
from models.testbed import data as testbed_data
from models.testbed import evaluation
from models.testbed import model as testbed
from models.testbed.metrics import FULL_BACKEND_OPTIMIZATION

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / "checkpoints" / "emoji_pixart"
PROMPTS = CHECKPOINT / "testbed_prompts.npz"


@pytest.fixture(scope="module")
def prompts() -> testbed_data.EmojiDataset:
    return testbed_data.load_dataset(PROMPTS)


@pytest.fixture(scope="module")
def jax_model():
    return families.PIXART.from_diffusers(CHECKPOINT, "float32")


def first_blocks(blocks: int) -> tuple[dict, dict[str, np.ndarray]]:
    """The shipped checkpoint's diffusers config and state cut to its first ``blocks`` transformer blocks (the other
    blocks' weights dropped, ``num_layers`` = ``blocks``): for the tests whose claim is the same at any depth (the
    capture's rows, a sampler against another, the evaluation command's wiring), at a fraction of the compile and
    sampling time (as ``--blocks 1`` does in tests/test_testbed_stack.py)."""
    from models import convert

    config, state = convert.read_diffusers_dir(CHECKPOINT)
    kept = {k: v for k, v in state.items() if not k.startswith("transformer_blocks.") or int(k.split(".")[1]) < blocks}
    return {**config, "num_layers": blocks}, kept


def write_first_blocks(folder: Path, blocks: int) -> Path:
    """:func:`first_blocks` written as a diffusers folder ``folder`` with the shipped prompt file beside it (where the
    scripts look for it by default); returns ``folder``."""
    import shutil

    from models import convert

    convert.write_diffusers_dir(folder, *first_blocks(blocks))
    shutil.copy(PROMPTS, folder / PROMPTS.name)
    return folder


@pytest.fixture(scope="module")
def two_block_model():
    """The shipped model's first two blocks, float32 (its blocks 0 and 1 with their real weights)."""
    config, state = first_blocks(2)
    return families.PIXART.from_diffusers_state(state, pixart.PixArtConfig.from_diffusers_config(config), "float32")


# --------------------------------------------------------------------------------------------------------------------
# The shipped checkpoint
# --------------------------------------------------------------------------------------------------------------------


def test_shipped_checkpoint_files_and_config():
    weights = CHECKPOINT / "diffusion_pytorch_model.safetensors"
    assert weights.stat().st_size <= 25 * 2**20
    config = json.loads((CHECKPOINT / "config.json").read_text())
    assert config["_class_name"] == "PixArtTransformer2DModel"
    assert pixart.PixArtConfig.from_diffusers_config(config) == testbed.TESTBED_PIXART_CONFIG


def test_diffusers_loads_checkpoint_and_matches_jax_port(jax_model, prompts):
    import torch
    from diffusers import PixArtTransformer2DModel

    reference_model = PixArtTransformer2DModel.from_pretrained(CHECKPOINT, torch_dtype=torch.float32).eval()
    _, model = jax_model
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 3, 32, 32)).astype(np.float32)  # (b, 3, s, s)
    context = prompts.context[:3].astype(np.float32)  # (b, t, 384)
    mask = prompts.context_mask[:3].astype(np.float32)  # (b, t)
    timestep = np.array([999.0, 500.0, 12.5], np.float32)  # (b,)
    with torch.no_grad():
        reference = reference_model(torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(context),
                                    timestep=torch.from_numpy(timestep),
                                    encoder_attention_mask=torch.from_numpy(mask),
                                    added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                                    return_dict=False)[0].numpy()
    graphdef, state = nnx.split(model)
    # jitted with the weights an argument (eager, every primitive compiles on its own; closed over, the checkpoint
    # would be folded into the program as constants)
    forward = jax.jit(lambda state, *a, **k: nnx.merge(graphdef, state)(*a, **k))
    ours = np.asarray(forward(state, jnp.asarray(x), jnp.asarray(context), jnp.asarray(timestep),
                              encoder_attention_mask=jnp.asarray(mask)))
    assert ours.shape == reference.shape == (3, 3, 32, 32)
    relative = np.linalg.norm(ours - reference) / np.linalg.norm(reference)
    assert relative < 1e-5, relative
    # The mask matters: dropping it changes the output (so the comparison above exercised it).
    unmasked = np.asarray(forward(state, jnp.asarray(x), jnp.asarray(context), jnp.asarray(timestep)))
    assert np.linalg.norm(unmasked - reference) / np.linalg.norm(reference) > 1e-3


def test_shipped_model_samples_its_captions(jax_model, prompts):
    """Training captions come out as their emoji; a held-out caption still gives an emoji-like image on white."""
    _, model = jax_model
    train = prompts.split(heldout=False)
    held = prompts.split(heldout=True)
    train_indices = [train.find(caption) for caption in ("watermelon", "palm tree", "flag: China")]
    held_index = held.find("writing hand")
    context = np.concatenate([train.context[train_indices], held.context[[held_index]]]).astype(np.float32)
    mask = np.concatenate([train.context_mask[train_indices], held.context_mask[[held_index]]])
    noise = jax.random.normal(jax.random.key(0), (4, 3, 32, 32), jnp.float32)
    graphdef, state = nnx.split(model)
    # the weights an argument: closed over, XLA would fold the whole checkpoint into the program as constants; 80
    # forward passes make the program run-time bound: XLA's full backend optimisation (its default), not the suite's -O0
    sample = jax.jit(lambda s, n, c, m: testbed.euler_sample(
        testbed.pixart_velocity_fn(nnx.merge(graphdef, s)), n, c, m, jnp.asarray(prompts.null_context, jnp.float32),
        jnp.asarray(prompts.null_mask), num_steps=10, guidance=3.0), compiler_options=FULL_BACKEND_OPTIMIZATION)
    images = testbed.pixels_to_images(sample(state, noise, jnp.asarray(context), jnp.asarray(mask)))  # (4, 32, 32, 3)
    targets = np.concatenate([train.images[train_indices], held.images[[held_index]]]).astype(np.float32) / 255
    samples = images.astype(np.float32) / 255
    errors = ((samples[:, None] - targets[None]) ** 2).mean(axis=(2, 3, 4))  # (sample, target)
    for row in range(3):
        assert errors[row].argmin() == row, errors
        assert errors[row, row] < 0.04, errors  # measured 0.005-0.027; other targets 0.06-0.23
    # Held-out caption: white corners, coloured content, nearer its own target than the training targets.
    corners = samples[3, [0, 0, -1, -1], [0, -1, 0, -1]]  # (4, 3)
    assert corners.min() > 0.9
    assert samples[3].std() > 0.15
    assert errors[3].argmin() == 3, errors


def test_project_flow_euler_sampler_reproduces_the_testbed_sampler(two_block_model, prompts):
    """models.sampling.flow_euler + pixart_denoiser (what capture / W4A4 evaluation use) = testbed.euler_sample (on the
    shipped model's first two blocks: the samplers' equivalence does not depend on the depth)."""
    from flax import nnx

    from models import sampling

    model = two_block_model
    graphdef, state = nnx.split(model)
    noise = jax.random.normal(jax.random.key(5), (1, 3, 32, 32), jnp.float32)
    context = jnp.asarray(prompts.context[:1], jnp.float32)  # (1, t, 384)
    mask = jnp.asarray(prompts.context_mask[:1])  # (1, t)
    null_context = jnp.asarray(prompts.null_context, jnp.float32)  # (t, 384)
    null_mask = jnp.asarray(prompts.null_mask)  # (t,)
    ours = testbed.euler_sample(testbed.pixart_velocity_fn(model), noise, context, mask, null_context, null_mask,
                                num_steps=3, guidance=3.0)
    params = {"model": state, "context": context, "mask": mask, "uncond_context": null_context[None],
              "uncond_mask": null_mask[None]}
    theirs, _ = sampling.flow_euler(sampling.pixart_denoiser(graphdef, 3.0, 3), params, noise,
                                    sampling.flow_sigmas(3))
    np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), atol=2e-4)


# --------------------------------------------------------------------------------------------------------------------
# Objective and sampler
# --------------------------------------------------------------------------------------------------------------------


def test_euler_sampler_is_exact_on_a_straight_flow():
    """With the exact velocity of a single target x0, v = (x - x0) / sigma, Euler lands on x0 from any noise."""
    target = jax.random.uniform(jax.random.key(1), (2, 3, 8, 8), minval=-1, maxval=1)
    noise = jax.random.normal(jax.random.key(2), (2, 3, 8, 8))
    context, mask = jnp.zeros((2, 4, 5)), jnp.ones((2, 4), jnp.uint8)

    def velocity(x, timestep, context, mask):
        sigma = timestep[:, None, None, None] / testbed.TIMESTEP_SCALE
        return (x - jnp.concatenate([target] * (x.shape[0] // 2))) / sigma

    for guidance in (1.0, 4.0):
        out = testbed.euler_sample(velocity, noise, context, mask, jnp.zeros((4, 5)), jnp.ones((4,), jnp.uint8),
                                   num_steps=7, guidance=guidance)
        np.testing.assert_allclose(np.asarray(out), np.asarray(target), atol=1e-5)


def test_guidance_combines_conditional_and_unconditional_velocity():
    noise = jnp.ones((1, 3, 2, 2))
    context = jnp.ones((1, 2, 4))  # conditional branch sees ones, unconditional zeros

    def velocity(x, timestep, context, mask):
        return jnp.broadcast_to(jnp.where(context.sum((1, 2)) > 0, 2.0, 0.5)[:, None, None, None], x.shape)

    out = testbed.euler_sample(velocity, noise, context, jnp.ones((1, 2)), jnp.zeros((2, 4)), jnp.ones((2,)),
                               num_steps=1, guidance=3.0)
    # one step from sigma 1 to 0: x - v_cfg, v_cfg = 0.5 + 3 (2 - 0.5) = 5
    np.testing.assert_allclose(np.asarray(out), -4.0)


def test_flow_matching_loss_is_zero_for_the_true_velocity_and_positive_otherwise():
    pixels = jax.random.uniform(jax.random.key(3), (4, 3, 8, 8), minval=-1, maxval=1)
    config = testbed.FlowMatchingConfig(caption_dropout=0.0)
    key = jax.random.key(4)
    key_sigma, key_noise, _ = jax.random.split(key, 3)
    sigma = testbed.sample_sigmas(key_sigma, 4, config)
    noise = jax.random.normal(key_noise, pixels.shape, jnp.float32)
    oracle = lambda x, t, c, m: noise - pixels  # noqa: E731
    args = (pixels, jnp.zeros((4, 2, 3)), jnp.ones((4, 2)), key, config, jnp.zeros((2, 3)), jnp.ones((2,)))
    assert float(testbed.flow_matching_loss(oracle, *args)) < 1e-12
    assert float(testbed.flow_matching_loss(lambda x, t, c, m: jnp.zeros_like(x), *args)) > 0.5
    assert 0.0 < float(sigma.min()) and float(sigma.max()) < 1.0


def test_caption_dropout_replaces_whole_captions():
    context, mask = jnp.ones((64, 3, 2)), jnp.ones((64, 3), jnp.uint8)
    null_context, null_mask = jnp.full((3, 2), 7.0), jnp.array([1, 1, 0], jnp.uint8)
    kept = testbed.drop_captions(jax.random.key(0), context, mask, null_context, null_mask, 0.0)
    np.testing.assert_array_equal(np.asarray(kept[0]), np.asarray(context))
    dropped_context, dropped_mask = testbed.drop_captions(jax.random.key(0), context, mask, null_context, null_mask,
                                                          0.5)
    is_null = np.asarray(dropped_context[:, 0, 0] == 7.0)  # (64,)
    assert 10 < is_null.sum() < 54
    np.testing.assert_array_equal(np.asarray(dropped_mask)[is_null], np.tile([1, 1, 0], (is_null.sum(), 1)))
    assert (np.asarray(dropped_context)[~is_null] == 1.0).all()


def test_pixel_conversion_roundtrip_and_errors():
    images = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    pixels = testbed.images_to_pixels(jnp.asarray(images))
    assert pixels.shape == (2, 3, 4, 4) and float(pixels.min()) >= -1 and float(pixels.max()) <= 1
    np.testing.assert_array_equal(testbed.pixels_to_images(pixels), images)
    with pytest.raises(ValueError, match="batch, height, width, 3"):
        testbed.images_to_pixels(jnp.zeros((2, 3, 4, 4)))


def test_training_init_zeroes_outputs_and_rejects_unknown_parameters():
    params = {"proj_out.kernel": np.ones((4, 12)), "transformer_blocks.0.attn2.to_out.0.kernel": np.ones((4, 4)),
              "transformer_blocks.0.attn1.to_q.kernel": np.ones((4, 4)), "transformer_blocks.0.attn1.to_q.bias":
              np.ones(4), "scale_shift_table": np.full((2, 4), 3.0)}
    out = testbed.init_for_training(params, seed=0)
    assert not out["proj_out.kernel"].any() and not out["transformer_blocks.0.attn2.to_out.0.kernel"].any()
    assert not out["transformer_blocks.0.attn1.to_q.bias"].any()
    assert np.abs(out["transformer_blocks.0.attn1.to_q.kernel"]).max() <= np.sqrt(6 / 8)
    assert (out["scale_shift_table"] == 3.0).all()
    with pytest.raises(KeyError, match="mystery"):
        testbed.init_for_training({"mystery": np.ones(3)}, seed=0)


# --------------------------------------------------------------------------------------------------------------------
# The package's training and evaluation helpers
# --------------------------------------------------------------------------------------------------------------------


def test_train_state_round_trip_and_mismatch(tmp_path):
    from models.testbed import training

    state = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "step": jnp.asarray(7, jnp.int32)}
    path = tmp_path / "state.npz"
    training.save_train_state(path, state)
    back = training.load_train_state(path, jax.tree.map(jnp.zeros_like, state))
    np.testing.assert_array_equal(np.asarray(back["params"]["w"]), np.asarray(state["params"]["w"]))
    assert int(back["step"]) == 7 and back["step"].dtype == jnp.int32
    with pytest.raises(ValueError, match=r"\['params'\]\['w'\] has shape \(2, 3\)"):
        training.load_train_state(path, {"params": {"w": jnp.zeros((3, 2))}, "step": jnp.asarray(0, jnp.int32)})
    with pytest.raises(KeyError, match="missing"):
        training.load_train_state(path, {"params": {"v": jnp.zeros((2, 3))}, "step": jnp.asarray(0, jnp.int32)})
    optimizer = training.make_optimizer(lr=1e-2, warmup=2, weight_decay=0.0)
    params = {"w": jnp.ones(3)}
    opt_state = optimizer.init(params)
    updates, _ = optimizer.update({"w": jnp.ones(3)}, opt_state, params)
    assert float(jnp.abs(updates["w"]).max()) == 0.0  # warm-up starts at learning rate 0


def test_layer_errors_summary_groups_by_layer_type():
    summary = evaluation.layer_errors_summary({"transformer_blocks.0.attn1.to_q": 0.1,
                                               "transformer_blocks.1.attn1.to_q": 0.3,
                                               "transformer_blocks.0.ff.net.2": 0.5})
    assert summary["layer_error_by_type"] == pytest.approx({"attn1.to_q": 0.2, "ff.net.2": 0.5})
    assert summary["layer_error_mean"] == pytest.approx(0.3) and summary["layer_error_max"] == 0.5
    assert len(summary["per_layer_error"]) == 3


def test_checkpoint_capture_records_only_real_caption_tokens(two_block_model, prompts):
    """Cross-attention keys/values of the shipped model (its first two blocks, which hold the recorded layers): no
    padding row, each real caption token once."""
    jax_model = two_block_model
    indices = np.flatnonzero(~prompts.heldout)[:2]
    names = ["transformer_blocks.0.attn2.to_k", "transformer_blocks.0.ff.net.2"]
    layer_set = evaluation.capture_flow_layer_set(jax_model, prompts, indices, names, steps=2, guidance=3.0,
                                                  rows_per_layer=512, seed=0, batch_size=2)
    rows = layer_set["transformer_blocks.0.attn2.to_k"][2]
    context = jax_model.caption_projection(jnp.asarray(prompts.context[indices], jnp.float32))  # (2, t, 256)
    null = jax_model.caption_projection(jnp.asarray(prompts.null_context, jnp.float32)[None])[0]  # (t, 256)
    mask = prompts.context_mask[indices].astype(bool)
    real = np.concatenate([np.asarray(context)[mask], np.asarray(null)[prompts.null_mask.astype(bool)]])
    padding = np.asarray(context)[~mask]
    assert len(padding) and rows.shape[0] <= len(np.unique(real, axis=0))
    for row in rows:  # every recorded row is a real token's row (jit vs eager: a few ulps)
        assert np.isclose(real, row, rtol=1e-4, atol=1e-5).all(axis=1).any()
        assert not np.isclose(padding, row, rtol=1e-4, atol=1e-5).all(axis=1).any()
    assert layer_set["transformer_blocks.0.ff.net.2"][2].shape[0] == 512


def test_checkpoint_text_rows_are_every_training_caption_token(two_block_model, prompts):
    """--text-rows-from-all-prompts on the shipped model (its first two blocks, which hold the recorded layers): the
    cross-attention keys / values get the caption projection of every real token of every distinct training caption +
    the empty caption; the other layers are unchanged."""
    jax_model = two_block_model
    indices = np.flatnonzero(~prompts.heldout)[:2]
    names = ["transformer_blocks.0.attn2.to_k", "transformer_blocks.1.attn2.to_v", "transformer_blocks.0.ff.net.2"]
    text = evaluation.training_caption_text(prompts)
    assert text["context"].shape[0] == len(np.unique(prompts.captions[~prompts.heldout]))
    options = dict(steps=2, guidance=3.0, rows_per_layer=100_000, seed=0, batch_size=2)
    plain = evaluation.capture_flow_layer_set(jax_model, prompts, indices, names, **options)
    layer_set = evaluation.capture_flow_layer_set(jax_model, prompts, indices, names, **options, text_prompts=text)
    projected = np.asarray(jax_model.caption_projection(jnp.asarray(text["context"])))  # (P, t, 256)
    null = np.asarray(jax_model.caption_projection(jnp.asarray(text["uncond_context"])))[0]  # (t, 256)
    real = np.unique(np.concatenate([projected[text["mask"] > 0], null[text["uncond_mask"][0] > 0]]), axis=0)
    for name in names[:2]:
        rows = layer_set[name][2]
        assert rows.shape == real.shape and rows.shape[0] > 10 * plain[name][2].shape[0]
        np.testing.assert_allclose(np.unique(rows, axis=0), real, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(layer_set[names[2]][2], plain[names[2]][2])


def test_eval_text_rows_flags_change_the_capture_key(tmp_path, capsys):
    from scripts import eval_testbed

    args = eval_testbed.parse_args(["--out", "x"])
    assert not args.text_rows_from_all_prompts and args.text_prompts is None
    with pytest.raises(SystemExit):
        eval_testbed.parse_args(["--out", "x", "--text-prompts", "data.npz"])
    assert "--text-prompts is read only with --text-rows-from-all-prompts" in capsys.readouterr().err
    on = eval_testbed.parse_args(["--out", "x", "--text-rows-from-all-prompts", "--text-prompts", "data.npz"])
    assert on.text_rows_from_all_prompts and on.text_prompts == "data.npz"
    text = {"context": np.ones((2, 3, 4)), "mask": np.ones((2, 3))}
    keys = [eval_testbed.capture_key(args, "p.npz", [0, 1], ["a"]),
            eval_testbed.capture_key(args, "p.npz", [0, 1], ["a"], text),
            eval_testbed.capture_key(args, "p.npz", [0, 1], ["a"], {**text, "mask": np.zeros((2, 3))})]
    assert len(set(keys)) == 3 and keys[1].startswith(keys[0])  # without the option: the key of earlier runs
    stores = {eval_testbed.store_folder(tmp_path, "kroquant", None, key) for key in keys}
    assert len(stores) == 3  # a method's store made without the option is never resumed with it, nor vice versa


# --------------------------------------------------------------------------------------------------------------------
# The training script: a few CPU steps, resume, export loadable by diffusers
# --------------------------------------------------------------------------------------------------------------------


def synthetic_dataset(path: Path) -> None:
    rng = np.random.default_rng(0)
    n, tokens = 6, 5
    mask = np.zeros((n, tokens), np.uint8)
    mask[:, :3] = 1
    dataset = testbed_data.EmojiDataset(
        images=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
        context=(rng.standard_normal((n, tokens, 384)) * mask[..., None]).astype(np.float16),
        context_mask=mask, null_context=np.zeros((tokens, 384), np.float16),
        null_mask=np.array([1, 1, 0, 0, 0], np.uint8),
        captions=np.array([f"caption {i}" for i in range(n)]), sequences=np.array([f"{i:X}" for i in range(n)]),
        heldout=np.array([False] * 4 + [True] * 2), image_size=32, max_tokens=tokens)
    testbed_data.write_dataset(dataset, path)


def test_train_chunk_takes_the_training_set_as_an_argument(tmp_path):
    """make_train_chunk's jitted program gets the training set as arguments, not as constants folded into it."""
    import dataclasses

    from jaxpr_checks import jit_constants  # tests/jaxpr_checks.py
    from models.testbed import training

    synthetic_dataset(tmp_path / "tiny.npz")
    dataset = testbed_data.load_dataset(tmp_path / "tiny.npz")
    data = {"images": jnp.asarray(dataset.images), "context": jnp.asarray(dataset.context),
            "context_mask": jnp.asarray(dataset.context_mask), "null_context": jnp.asarray(dataset.null_context),
            "null_mask": jnp.asarray(dataset.null_mask)}
    cfg = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                              attention_head_dim=16, cross_attention_dim=32)
    graphdef, params = nnx.split(training.build_model(cfg, 0))
    optimizer = training.make_optimizer(1e-4, 1, 0.0)
    state = {"params": params, "ema": params, "opt_state": optimizer.init(params), "step": jnp.asarray(0, jnp.int32),
             "key": jax.random.key(0)}
    chunk = training.make_train_chunk(graphdef, optimizer, testbed.FlowMatchingConfig(), data, 2, 1, 0.99,
                                      jnp.float32)
    constants = jit_constants(chunk, state)
    folded = [name for name, array in data.items()
              if any(np.shape(c) == array.shape and np.array_equal(np.asarray(c), array) for c in constants)]
    assert folded == []


def test_train_script_runs_resumes_and_exports(tmp_path):
    from scripts import train_testbed

    data = tmp_path / "tiny.npz"
    synthetic_dataset(data)
    common = ["--data", str(data), "--run", str(tmp_path / "run"), "--batch-size", "2", "--chunk", "1",
              "--num-layers", "1", "--no-progress", "--compute-dtype", "float32", "--warmup", "1"]
    assert train_testbed.main(common + ["--steps", "2"]) == 0
    first = np.load(tmp_path / "run" / "train_state.npz")
    assert int(first["['step']"]) == 2
    assert train_testbed.main(common + ["--steps", "3", "--export", str(tmp_path / "export")]) == 0
    events = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    starts = [event["step"] for event in events if event["event"] == "start"]
    assert starts == [0, 2], "the second run must resume at step 2"
    second = np.load(tmp_path / "run" / "train_state.npz")
    assert int(second["['step']"]) == 3
    changed = [key for key in first.files if "params" in key and not np.array_equal(first[key], second[key])]
    assert changed, "the resumed step must update the parameters"
    config, model = families.PIXART.from_diffusers(tmp_path / "export", "float32")
    assert config.num_layers == 1 and config.caption_channels == 384
    import torch
    from diffusers import PixArtTransformer2DModel

    exported = PixArtTransformer2DModel.from_pretrained(tmp_path / "export", torch_dtype=torch.float32)
    assert exported.config.num_layers == 1


def test_sample_captions_compiles_once_for_every_seed(prompts):
    """train-testbed's sample grids: one seed's call of sample_captions compiles the sampler, the next seed's calls
    compile nothing (the same program, the weights an argument of it)."""
    import dataclasses

    from kroquant_jax.timing import recorded_compilations
    from models.testbed import training

    cfg = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                              attention_head_dim=16, cross_attention_dim=32)
    graphdef, params = nnx.split(families.PIXART.build(cfg, jnp.float32, seed=0))
    indices = np.arange(2)
    first = training.sample_captions(graphdef, params, prompts, indices, 0, 2, 3.0)
    with recorded_compilations() as compiled:
        second = training.sample_captions(graphdef, params, prompts, indices, 1, 2, 3.0)
    assert compiled == []
    assert first.shape == second.shape == (2, 32, 32, 3) and not np.array_equal(first, second)


# --------------------------------------------------------------------------------------------------------------------
# The end-to-end W4A4 evaluation command (tiny setting)
# --------------------------------------------------------------------------------------------------------------------


#: The tiny evaluation's settings, after ``--out FOLDER --checkpoint <first_block>``: 1 calibration caption, 2 held-out
#: captions, 2 Euler steps, the first 3 linears.
TINY_EVAL = ["--calib-captions", "1", "--eval-captions", "2", "--steps", "2", "--batch-size", "1", "--rows-per-layer",
             "128", "--calib-rows", "64", "--calib-validation", "32", "--calib-test", "32", "--layers", "3",
             "--loraq-steps", "2", "--rotation-steps", "2"]
#: The shared RTN run's methods and rank (rank 64: the settings of the tiny run's rerun, so that the two merge).
RTN_EVAL = ["--methods", "rtn", "--rank", "64"]


@pytest.fixture(scope="module")
def first_block(tmp_path_factory) -> Path:
    """The shipped checkpoint cut to its first transformer block (:func:`write_first_blocks`): the model of the tiny
    evaluation and generalisation runs. The evaluation's wiring (capture, calibration, generation, outputs,
    resumption, merging) is the same at any depth, and the 3 linears it quantizes are block 0's with their real
    weights."""
    return write_first_blocks(tmp_path_factory.mktemp("first_block"), 1)


def tiny_eval_args(out: Path, checkpoint: Path) -> list[str]:
    """``--out out --checkpoint checkpoint`` and :data:`TINY_EVAL`."""
    return ["--out", str(out), "--checkpoint", str(checkpoint), *TINY_EVAL]


@pytest.fixture(scope="module")
def rtn_eval(tmp_path_factory, first_block) -> Path:
    """One tiny ``kroquant evaluate`` of RTN alone (``TINY_EVAL + RTN_EVAL`` on ``first_block``, one generation seed),
    shared by the tests as a finished run of the same settings: read it, or copy it before changing it."""
    from scripts import eval_testbed

    out = tmp_path_factory.mktemp("rtn_eval") / "eval"
    assert eval_testbed.main([*tiny_eval_args(out, first_block), *RTN_EVAL]) == 0
    return out


def test_eval_script_tiny_run_writes_table_report_and_grid(tmp_path, rtn_eval, first_block):
    """``kroquant evaluate`` (tiny, on the shipped checkpoint's first block): report, table, grid and stores of three
    methods; a rerun with another rank calibrates anew; runs of the same settings merge, others are refused."""
    import shutil

    from scripts import eval_testbed

    out = tmp_path / "eval"
    tiny = tiny_eval_args(out, first_block)
    # 1 training + 1 held-out caption: as many images as the shared run's 2 held-out captions, so that the 16-bit and
    # RTN sampling programs are those of rtn_eval (one compiled program per model, settings and batch)
    assert eval_testbed.main(tiny + ["--methods", "rtn", "rtn+loraq", "rtn+loraq@64", "--rank", "0.125",
                                     "--eval-train-captions", "1", "--eval-captions", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    results = report["results"]
    result = results["rtn"]
    assert len(result["per_layer_error"]) == 3
    assert 0.0 < result["layer_error_mean"] <= result["layer_error_max"] < 1.0
    held = result["groups"]["heldout"]
    assert 10.0 < held["psnr_db"] < 99.0, "3 W4A4 linears change the images, but not beyond recognition"
    assert 0.0 < held["ssim"] <= 1.0 and len(held["psnr_per_image_db"]) == 1
    assert set(result["layer_error_by_type"]) == {"attn1.to_k", "attn1.to_out.0", "attn1.to_q"}
    # --rank 0.125 of the 256-wide layers is rank 32; "@64" overrides it for one method
    assert results["rtn"]["low_rank_branch"] == "none"
    assert results["rtn+loraq"]["low_rank_branch"] == "LoRaQ r=32 (MXFP4)"
    assert results["rtn+loraq@64"]["low_rank_branch"] == "LoRaQ r=64 (MXFP4)"
    errors = [results[m]["layer_error_mean"] for m in ("rtn", "rtn+loraq", "rtn+loraq@64")]
    assert errors[0] > errors[1] > errors[2], f"a larger LoRaQ branch must lower the layer error: {errors}"
    assert [len(report["caption_groups"][g]["records"]) for g in ("train", "heldout")] == [1, 1]
    assert 0.0 < result["groups"]["train"]["ssim"] <= 1.0
    table = (out / "table.md").read_text()
    assert "| rtn | none |" in table and "training, not calibration (1)" in table
    assert (out / "grid.png").stat().st_size > 1000
    stores = sorted(p.name.rsplit("-", 1)[0] for p in (out / "qlayers").iterdir())
    assert stores == ["rtn", "rtn_loraq", "rtn_loraq_r64"], "the calibrated layers are stored (resumable)"

    # A rerun with another rank must not resume the rank-32 layers: it calibrates anew, like the "@64" method did.
    assert eval_testbed.main(tiny + ["--methods", "rtn+loraq", "--rank", "64"]) == 0
    rerun = json.loads((out / "report.json").read_text())["results"]["rtn+loraq"]
    assert rerun["low_rank_branch"] == "LoRaQ r=64 (MXFP4)"
    for name, error in rerun["per_layer_error"].items():
        assert error == pytest.approx(results["rtn+loraq@64"]["per_layer_error"][name], rel=1e-5), name
    assert len(list((out / "qlayers").iterdir())) == 4

    # Runs of the same settings over other methods (parallel processes) merge into one report, table and grid.
    other = rtn_eval
    merged = tmp_path / "merged"
    assert eval_testbed.main(["--out", str(merged), "--merge", str(out), str(other)]) == 0
    report = json.loads((merged / "report.json").read_text())
    assert list(report["results"]) == ["rtn+loraq", "rtn"]
    assert report["results"]["rtn"]["per_layer_error"] == results["rtn"]["per_layer_error"]
    with np.load(merged / "images.npz") as data:
        assert list(data["titles"]) == ["dataset", "16-bit", "rtn+loraq", "rtn"]
        assert data["column0"].shape == (2, 32, 32, 3)
    assert "| rtn+loraq |" in (merged / "table.md").read_text() and (merged / "grid.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="methods \\['rtn'\\] are in"):
        evaluation.merge_outputs([other, other], tmp_path / "clash")
    other = shutil.copytree(rtn_eval, tmp_path / "other")  # the shared run stays as it is
    changed = json.loads((other / "report.json").read_text())
    changed["settings"] = changed["settings"].replace("--rank 64", "--rank 32")
    (other / "report.json").write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="another 'settings'"):
        evaluation.merge_outputs([out, other], tmp_path / "bad")


def test_psnr_text_leaves_out_an_undefined_standard_error():
    one_caption = evaluation.seed_image_metrics(np.zeros((2, 1, 12, 12, 3), np.uint8),
                                                 np.ones((2, 1, 12, 12, 3), np.uint8))
    assert np.isnan(one_caption["psnr_sem_db"])
    assert evaluation.psnr_text(one_caption) == f"{one_caption['psnr_db']:.2f}"
    assert evaluation.psnr_text({"psnr_db": 21.957, "psnr_sem_db": 0.481}) == "21.96 ± 0.48"


def test_seed_image_metrics_match_a_manual_computation():
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, (2, 3, 12, 12, 3), dtype=np.uint8)  # (seeds, captions, s, s, 3)
    got = np.clip(ref.astype(np.int64) + rng.integers(-40, 41, ref.shape), 0, 255).astype(np.uint8)
    m = evaluation.seed_image_metrics(got, ref)
    psnr = np.array([[10 * np.log10(1 / np.mean((got[j, k] / 255 - ref[j, k] / 255) ** 2)) for k in range(3)]
                     for j in range(2)])  # (seeds, captions)
    assert m["psnr_db"] == pytest.approx(psnr.mean())
    assert m["psnr_db_per_seed"] == pytest.approx(list(psnr.mean(axis=1)))
    assert m["psnr_per_caption_db"] == pytest.approx(list(psnr.mean(axis=0)), abs=1e-3)
    assert m["psnr_sem_db"] == pytest.approx(psnr.mean(axis=0).std(ddof=1) / np.sqrt(3)), "over captions, not images"
    assert (m["psnr_seed_min_db"], m["psnr_seed_max_db"]) == pytest.approx((psnr.mean(1).min(), psnr.mean(1).max()))
    assert m["psnr_seed_std_db"] == pytest.approx(psnr.mean(axis=1).std(ddof=1))
    assert m["psnr_per_image_db"] == pytest.approx(list(psnr.ravel()), abs=1e-3), "seed-major"
    flat = evaluation.image_metrics_of(got.reshape(6, 12, 12, 3), ref.reshape(6, 12, 12, 3))
    assert (m["ssim"], m["chroma_ratio"]) == pytest.approx((flat["ssim"], flat["chroma_ratio"])), "over all images"
    assert evaluation.seed_image_metrics(got[:1], ref[:1]) == evaluation.image_metrics_of(got[0], ref[0])
    by_group = evaluation.group_metrics(got.reshape(6, 12, 12, 3), ref.reshape(6, 12, 12, 3), {"a": [0], "b": [1, 2]}, 2)
    assert by_group["b"] == evaluation.seed_image_metrics(got[:, 1:], ref[:, 1:])
    with pytest.raises(ValueError, match="4 seeds"):
        evaluation.group_metrics(got.reshape(6, 12, 12, 3), ref.reshape(6, 12, 12, 3), {"a": [0]}, 4)


def test_eval_seeds_flag_defaults_to_seed_and_refuses_repeats(capsys):
    from scripts import eval_testbed

    assert eval_testbed.parse_args(["--out", "x", "--seed", "5"]).seeds == [5]
    assert eval_testbed.parse_args(["--out", "x", "--seed", "5", "--seeds", "0", "1"]).seeds == [0, 1]
    with pytest.raises(SystemExit):
        eval_testbed.parse_args(["--out", "x", "--seeds", "1", "2", "1"])
    assert "--seeds: each generation seed once, got [1, 2, 1] (repeated: [1])" in capsys.readouterr().err


def test_eval_script_seeds_rerun_reuses_calibration_and_reports_the_seed_spread(tmp_path, capfd, rtn_eval,
                                                                                   first_block):
    """A rerun of a tiny ``kroquant evaluate`` folder with other ``--seeds`` reuses its capture and calibrated layers,
    generates again, and reports the per-seed PSNR and its spread; it does not merge with a run of other seeds."""
    import shutil

    from scripts import eval_testbed

    # the shared RTN run (the default: one generation seed, --seed's) is the first run; the rerun goes to a copy of it
    first, out = rtn_eval, shutil.copytree(rtn_eval, tmp_path / "eval")
    tiny = [*tiny_eval_args(out, first_block), *RTN_EVAL]
    report = json.loads((out / "report.json").read_text())
    held = report["results"]["rtn"]["groups"]["heldout"]
    assert report["seeds"] == [0] and report["noise_seeds"] == [1000] and report["results"]["rtn"]["resumed_layers"] == 0
    assert set(held) == {"psnr_db", "psnr_sem_db", "ssim", "chroma_ratio", "saturation_ratio", "psnr_per_image_db"}
    _, images = evaluation.load_outputs(out)
    assert images["rtn"].shape == (2, 32, 32, 3) and held == evaluation.image_metrics_of(images["rtn"], images["16-bit"])
    assert "seed range" not in (out / "table.md").read_text()
    stores = {p: p.stat().st_mtime_ns for p in [out / "layer_set.safetensors", *(out / "qlayers").rglob("*")]}
    capfd.readouterr()

    # Other generation seeds: the capture and the calibrated layers are reused (untouched), only generation reruns.
    assert eval_testbed.main(tiny + ["--seeds", "0", "3"]) == 0
    err = capfd.readouterr().err
    assert "reused the capture" in err and "rtn: resumed 3 of 3 layers" in err
    assert {p: p.stat().st_mtime_ns for p in stores} == stores
    assert sorted(p.name for p in (out / "qlayers").iterdir()) == sorted(p.name for p in (first / "qlayers").iterdir())
    report = json.loads((out / "report.json").read_text())
    assert report["seeds"] == [0, 3] and report["results"]["rtn"]["resumed_layers"] == 3
    _, seeded = evaluation.load_outputs(out)
    assert seeded["rtn"].shape == (4, 32, 32, 3) and seeded["dataset"].shape == (2, 32, 32, 3)
    for title in ("16-bit", "rtn"):
        np.testing.assert_array_equal(seeded[title][:2], images[title], err_msg=f"{title}: seed 0 as before")
        assert not np.array_equal(seeded[title][2:], images[title]), f"{title}: seed 3 draws other noise"
    held = report["results"]["rtn"]["groups"]["heldout"]
    per_seed = [evaluation.image_metrics_of(seeded["rtn"][j:j + 2], seeded["16-bit"][j:j + 2])["psnr_db"]
                for j in (0, 2)]
    assert held["psnr_db_per_seed"] == pytest.approx(per_seed)
    assert held["psnr_db_per_seed"][0] == pytest.approx(json.loads((first / "report.json").read_text())[
        "results"]["rtn"]["groups"]["heldout"]["psnr_db"])
    assert (held["psnr_seed_min_db"], held["psnr_seed_max_db"]) == pytest.approx((min(per_seed), max(per_seed)))
    table = (out / "table.md").read_text()
    assert "held-out: seed range" in table and "| seed 0 | seed 3 |" in table and "(reused)" in table

    with pytest.raises(ValueError, match="--seeds 0 3.*--seeds 0"):
        eval_testbed.main(["--out", str(tmp_path / "merged"), "--merge", str(first), str(out)])


def test_prompt_subset_keeps_every_heldout_record_and_the_drawn_training_ones(prompts):
    sub = testbed_data.prompt_subset(prompts, 5, seed=1)
    assert sub.num_examples == int(prompts.heldout.sum()) + 5 and int((~sub.heldout).sum()) == 5
    index = np.array([prompts.find(c) for c in sub.captions])
    assert list(index) == sorted(index)
    for key in ("images", "context", "context_mask", "captions", "sequences", "heldout"):
        np.testing.assert_array_equal(getattr(sub, key), getattr(prompts, key)[index], err_msg=key)
    assert sub.null_context is prompts.null_context and sub.image_size == prompts.image_size
    with pytest.raises(ValueError, match="exceeds"):
        testbed_data.prompt_subset(prompts, prompts.num_examples + 1)


def test_eval_method_specs_and_helpers(capsys):
    """The recipe flags are kroquant_jax.calibrate.add_recipe_arguments' (tested in tests/test_calibrate_cli.py)."""
    from kroquant_jax import calibrate
    from scripts import eval_testbed

    args = eval_testbed.parse_args(["--out", "x", "--rank", "0.125"])
    assert args.rank == 0.125 and eval_testbed.parse_args(["--out", "x"]).rank is None
    assert calibrate.recipe_from_args("kroquant+loraq", args).loraq.rank == 0.125
    assert calibrate.recipe_from_args("kroquant+loraq@128", args).loraq.rank == 128
    with pytest.raises(SystemExit):
        eval_testbed.parse_args(["--out", "x", "--rank", "0"])
    assert "argument --rank/--lora-rank: '0': a rank must be >= 1" in capsys.readouterr().err
    assert evaluation.layer_type("transformer_blocks.7.attn2.to_out.0") == "attn2.to_out.0"
    a, b = (eval_testbed.store_folder(Path("o"), "rtn+loraq", calibrate.recipe_from_args(m, args), "key")
            for m in ("rtn+loraq", "rtn+loraq@64"))
    assert a.parent == b.parent == Path("o/qlayers") and a != b and a.name.startswith("rtn_loraq-")
    # a setting that only schedules the work (--max-layers-per-program) names the same store; a default run's name
    # is the one it had before such settings were left out
    recipe = calibrate.recipe_from_args("kroquant", args)
    scheduled = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration,
                                                                            max_layers_per_program=8))
    assert scheduled != recipe
    assert (eval_testbed.store_folder(Path("o"), "kroquant", scheduled, "key")
            == eval_testbed.store_folder(Path("o"), "kroquant", recipe, "key"))
    legacy = hashlib.sha1(f"key|{recipe!r}".encode()).hexdigest()[:12]
    assert eval_testbed.store_folder(Path("o"), "kroquant", recipe, "key").name == f"kroquant-{legacy}"


def test_eval_preset_becomes_the_defaults_and_out_stays_required(capsys):
    """``kroquant demo``'s mechanism: a preset command line gives the defaults; --out is required unless it gives it."""
    from scripts import eval_testbed

    preset = ["--out", "runs/p", "--steps", "3", "--rank", "0.125"]
    args = eval_testbed.parse_args([], preset=preset)
    assert (args.out, args.steps, args.rank, args.guidance) == ("runs/p", 3, 0.125, 3.0)
    args = eval_testbed.parse_args(["--steps", "5", "--out", "o"], preset=preset)
    assert (args.out, args.steps, args.rank) == ("o", 5, 0.125)
    for argv, preset in (([], ()), (["--steps", "3"], ()), ([], ["--steps", "3"])):
        with pytest.raises(SystemExit):
            eval_testbed.parse_args(argv, preset=preset)
        assert "required: --out" in capsys.readouterr().err


def test_generalisation_script_groups_heldout_records_and_finds_nearest(tmp_path, first_block):
    """The held-out records split into siblings of trained concepts and novel concepts; the nearest-image outcome;
    ``scripts/testbed_generalisation.py`` (run on the shipped checkpoint's first block: its report and grid do not
    depend on the depth) reports one outcome per generated record and writes the grid."""
    from scripts import testbed_generalisation as tg

    data = testbed_data.load_dataset(str(CHECKPOINT / "testbed_prompts.npz"))
    groups = evaluation.heldout_groups(data)
    bases = [testbed_data.base_sequence(testbed_data.text_to_sequence(s)) for s in data.sequences]
    trained = {b for b, held in zip(bases, data.heldout) if not held}
    assert sorted(np.concatenate(list(groups.values()))) == list(np.flatnonzero(data.heldout))
    # the split follows the full dataset's training records (the record's trained_concept flag): 116 / 79 held-out
    # records; a base shared with one of this file's own 64 training records is always a sibling, never novel
    assert (len(groups["sibling in training"]), len(groups["novel concept"])) == (116, 79)
    assert all(data.trained_concept[i] for i in groups["sibling in training"])
    assert not any(data.trained_concept[i] or bases[i] in trained for i in groups["novel concept"])
    pool = data.images.astype(np.float32) / 255
    target = int(groups["novel concept"][0])
    assert evaluation.nearest_outcome(data.images[target], target, data, pool, bases)[0] == "own glyph"
    assert evaluation.nearest_outcome(data.images[target], target, data, pool, bases)[2] == 0.0

    out = tmp_path / "gen"
    assert tg.main(["--data", str(CHECKPOINT / "testbed_prompts.npz"), "--checkpoint", str(first_block), "--out",
                    str(out), "--per-group", "1", "--steps", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    for kind in evaluation.GROUPS:
        assert report["groups"][kind]["records"] == 1
        assert sum(report["groups"][kind][o] for o in evaluation.OUTCOMES) == 1
    assert (out / "grid.png").stat().st_size > 1000

"""Activation capture (layer sets) and W4A4 assembly through linear overrides, on tiny models."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import capture, families, flux, pixart, quantize_model, sampling, sana
from models.layers import LinearHooks, linears

PIXART = pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                             num_layers=2, cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=8,
                             use_additional_conditions=False)

SANA = sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                       num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
                       caption_channels=8, mlp_ratio=2.0, sample_size=8)


def _pixart_prompts(count, seed=0, batch=1, tokens=5):
    rng = np.random.default_rng(seed)
    return [{"context": jnp.asarray(rng.standard_normal((batch, tokens, 8)), jnp.float32),
             "mask": jnp.ones((batch, tokens)), "uncond_context": jnp.zeros((batch, tokens, 8)),
             "uncond_mask": jnp.ones((batch, tokens))} for _ in range(count)]


class _ListRecorder:
    def __init__(self):
        self.seen = {}

    def wants(self, path):
        return True

    def record(self, path, x, token_mask=None):
        self.seen[path] = (x, token_mask)


def test_pixart_layer_set_rows_are_real_layer_inputs(tmp_path):
    model = families.PIXART.build(PIXART, seed=1)
    config = capture.CaptureConfig(num_steps=3, guidance_scale=4.5, latent_hw=(8, 8), rows_per_layer=40, seed=0)
    layer_set = capture.capture_layer_set("pixart", model, _pixart_prompts(2), config)
    quantizable = linears(model, quantizable_only=True)
    assert set(layer_set) == set(quantizable) and len(layer_set) == 2 * 10
    for name, (weight, bias, rows) in layer_set.items():
        layer = quantizable[name]
        np.testing.assert_array_equal(weight, np.asarray(layer.kernel[...]).T)
        assert bias is not None and bias.shape == (layer.out_features,)
        assert rows.shape[1] == layer.in_features and np.isfinite(rows).all()
        assert len(np.unique(rows, axis=0)) == rows.shape[0], name  # repeats are dropped
        if ".attn2.to_k" in name or ".attn2.to_v" in name:
            # the caption rows repeat at every step: at most 5 distinct per prompt + the all-zero unconditional
            # caption's 1 (each step draws 7 of a call's 10 rows, so a row may be missed)
            assert 7 <= rows.shape[0] <= 11, name
        elif ".ff." in name:
            # 2 batches x 3 steps x ceil(40 / 6) = 7 rows -> 42, trimmed to 40
            assert rows.shape[0] == 40, name
        else:  # block-0 self-attention inputs are equal in both CFG halves (the same noise), and block 0's
            # unconditional cross-attention output is one row (all-zero caption): repeats dropped
            assert 20 <= rows.shape[0] <= 40, name

    # rows of the first step equal true inputs: rerun the first denoiser call with a recorder that keeps everything
    recorder = _ListRecorder()
    prompts = _pixart_prompts(1)[0]
    noise = jax.random.normal(jax.random.split(jax.random.fold_in(jax.random.key(0), 0))[0], (1, 4, 8, 8))
    t = float(sampling.dpm_solver_schedule(3).timesteps[0])
    model(jnp.concatenate([noise, noise]), jnp.concatenate([prompts["uncond_context"], prompts["context"]]),
          jnp.full((2,), t), jnp.ones((2, 5)), hooks=LinearHooks(recorder=recorder))
    full = np.asarray(recorder.seen["transformer_blocks.1.ff.net.2"][0]).reshape(-1, 128)
    captured = layer_set["transformer_blocks.1.ff.net.2"][2]
    matches = sum(bool(np.isclose(full, row, rtol=1e-4, atol=1e-5).all(axis=1).any()) for row in captured)
    assert matches >= 5  # the first-step rows of the first batch (at least 7 drawn, minus trimming)

    from kroquant_jax.layerset import load_layer_set, save_layer_set
    path = str(tmp_path / "layers.safetensors")
    save_layer_set(path, layer_set)
    loaded = load_layer_set(path)
    assert sorted(loaded) == sorted(layer_set)
    np.testing.assert_array_equal(loaded["transformer_blocks.0.attn2.to_k"].activations,
                                  layer_set["transformer_blocks.0.attn2.to_k"][2])


def _padded_prompts(count, channels=8, tokens=5, real=3, uncond_real=1, seed=0):
    """Captions with padding: ``real`` of ``tokens`` kept (``uncond_real`` for the unconditional caption); the padded
    positions hold a sentinel value, so a recorded padding row would stand out."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(tokens) < real).astype(np.float32)[None]  # (1, t)
    uncond_mask = (np.arange(tokens) < uncond_real).astype(np.float32)[None]  # (1, t)
    prompts = []
    for _ in range(count):
        context = np.where(mask[..., None] > 0, rng.standard_normal((1, tokens, channels)), 5.0)  # (1, t, c)
        uncond = np.where(uncond_mask[..., None] > 0, 0.0, 5.0) * np.ones((1, tokens, channels))  # (1, t, c)
        prompts.append({"context": jnp.asarray(context, jnp.float32), "mask": jnp.asarray(mask),
                        "uncond_context": jnp.asarray(uncond, jnp.float32), "uncond_mask": jnp.asarray(uncond_mask)})
    return prompts


def _real_context_rows(model, prompts, name, channels):
    """The distinct rows of real tokens that reach ``name`` (a cross-attention key/value input) over the prompts:
    one eager forward per prompt with a recorder that keeps everything (the caption does not depend on the step)."""
    rows = []
    for prompt in prompts:
        recorder = _ListRecorder()
        model(jnp.zeros((2, channels, 8, 8)), jnp.concatenate([prompt["uncond_context"], prompt["context"]]),
              jnp.full((2,), 500.0), jnp.concatenate([prompt["uncond_mask"], prompt["mask"]]),
              hooks=LinearHooks(recorder=recorder))
        x, token_mask = recorder.seen[name]
        assert token_mask is not None and token_mask.shape == x.shape[:-1]
        rows.append(np.asarray(x)[np.asarray(token_mask)])
    return np.unique(np.concatenate(rows), axis=0)


@pytest.mark.parametrize("family", ["pixart", "sana"])
def test_capture_drops_masked_tokens_and_repeated_rows(family):
    if family == "pixart":
        model = families.PIXART.build(PIXART, seed=5)
    else:
        model = families.SANA.build(SANA, seed=5)
    prompts = _padded_prompts(2)
    names = ("transformer_blocks.0.attn2.to_k", "transformer_blocks.0.attn2.to_v", "caption_projection.linear_1")
    config = capture.CaptureConfig(num_steps=3, latent_hw=(8, 8), rows_per_layer=60, layers=names, seed=1,
                                   solver="flow_euler" if family == "pixart" else None)
    layer_set = capture.capture_layer_set(family, model, prompts, config)
    real = _real_context_rows(model, prompts, "transformer_blocks.0.attn2.to_k", 4)
    # 3 real tokens per prompt + 1 of the unconditional caption (the same for both prompts): 7 distinct rows
    assert real.shape[0] == 7
    for name in names[:2]:
        rows = layer_set[name][2]
        # every step draws ceil(60 / 6) = 10 of the 10 rows of a call, 4 of them real, the same 4 at every step
        np.testing.assert_allclose(np.unique(rows, axis=0), real, rtol=1e-5, atol=1e-6)  # eager vs jit: ulps
        assert rows.shape[0] == 7, name
    projection_rows = layer_set["caption_projection.linear_1"][2]
    assert projection_rows.shape[0] == 7 and not np.isclose(projection_rows, 5.0).all(axis=1).any()


def test_flux_capture_keeps_every_text_token_and_drops_repeats():
    flux_cfg = flux.FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=4,
                               axes_dims_rope=(4, 4, 8))
    rng = np.random.default_rng(0)
    prompts = [{"context": jnp.asarray(rng.standard_normal((1, 3, 8)), jnp.float32), "pooled": jnp.ones((1, 4))}]
    config = capture.CaptureConfig(num_steps=3, latent_hw=(8, 8), rows_per_layer=300,
                                   layers=("context_embedder", "transformer_blocks.0.attn.add_k_proj"))
    layer_set = capture.capture_layer_set("flux", families.FLUX.build(flux_cfg), prompts, config)
    # the context embedder reads the same 3 text tokens at every step: kept once each
    np.testing.assert_array_equal(np.unique(layer_set["context_embedder"][2], axis=0),
                                  np.unique(np.asarray(prompts[0]["context"][0]), axis=0))
    # the modulated context stream changes with the timestep: 3 tokens x 3 steps, all distinct
    assert layer_set["transformer_blocks.0.attn.add_k_proj"][2].shape == (9, 32)


def test_row_sampler_skips_ideogram4_padding_and_rejects_bad_masks():
    from models import ideogram4, ideogram4_sampling

    cfg = ideogram4.tiny_config()
    model = ideogram4.Ideogram4Transformer(cfg, rngs=nnx.Rngs(0))
    layout = ideogram4_sampling.prepare_ids([2, 4], 2, 2, 6)  # prompt 0: 4 padding slots, prompt 1: 2
    batch, length = layout.indicator.shape
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((batch, length, cfg.in_channels)), jnp.float32)
    features = jnp.asarray(rng.standard_normal((batch, length, cfg.llm_features_dim)), jnp.float32)
    names = ["layers.0.attention.to_q", "layers.1.feed_forward.w2"]
    sampler = capture.RowSampler(names, rows=batch * length, key=jax.random.key(0))
    full = _ListRecorder()
    for recorder in (sampler, full):
        model(hidden, jnp.full((batch,), 0.5), features, jnp.asarray(layout.position_ids),
              jnp.asarray(layout.segment_ids), jnp.asarray(layout.indicator), hooks=LinearHooks(recorder=recorder))
    real = layout.segment_ids.reshape(-1) != ideogram4.SEQUENCE_PADDING_INDICATOR  # (B L,)
    assert real.sum() == batch * length - 6
    for name in names:
        rows, valid = (np.asarray(a) for a in sampler.result()[name])
        x, token_mask = full.seen[name]
        np.testing.assert_array_equal(np.asarray(token_mask).reshape(-1), real)
        inputs = np.asarray(x).reshape(batch * length, -1)
        assert valid.sum() == real.sum() and valid[:real.sum()].all()  # the real rows come first
        np.testing.assert_array_equal(np.unique(rows[valid], axis=0), np.unique(inputs[real], axis=0))
    with pytest.raises(ValueError, match="token mask of shape"):
        capture.RowSampler(["a"], 2, jax.random.key(0)).record("a", jnp.ones((2, 3, 4)), jnp.ones((2, 4), bool))


def test_unmasked_draw_is_the_permutation_draw():
    x = jnp.arange(40.0).reshape(2, 10, 2)
    plain, masked = (capture.RowSampler(["a"], 7, jax.random.key(3)) for _ in range(2))
    plain.record("a", x)
    masked.record("a", x, jnp.ones((2, 10), bool))
    expected = x.reshape(-1, 2)[jax.random.choice(jax.random.fold_in(jax.random.key(3), 0), 20, (7,), replace=False)]
    for sampler in (plain, masked):
        rows, valid = sampler.result()["a"]
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(expected))
        assert bool(valid.all())
    np.testing.assert_array_equal(capture.distinct_rows(np.array([[1.0, 2], [3, 4], [1, 2], [5, 6], [3, 4]])),
                                  np.array([[1.0, 2], [3, 4], [5, 6]]))
    # several layers of two row counts, drawn inside one jit: layer k's rows are still its own key's permutation
    # (the sampler draws the permutations of all layers of one row count at once)
    names = ["l0", "l1", "l2", "l3"]
    inputs = {"l0": x, "l1": x + 100, "l2": jnp.arange(30.0).reshape(15, 2), "l3": x - 100}

    def draw(key):
        sampler = capture.RowSampler(names, 5, key)
        for name in ("l2", "l0", "l3", "l1"):  # not in index order
            sampler.record(name, inputs[name])
        return {n: r for n, (r, _) in sampler.result().items()}

    drawn = jax.jit(draw)(jax.random.key(5))
    for k, name in enumerate(names):
        flat = inputs[name].reshape(-1, 2)
        order = jax.random.permutation(jax.random.fold_in(jax.random.key(5), k), flat.shape[0])
        np.testing.assert_array_equal(np.asarray(drawn[name]), np.asarray(flat[order[:5]]), err_msg=name)


def test_capture_selected_layers_sana_and_flux():
    sana_cfg = SANA
    config = capture.CaptureConfig(num_steps=2, latent_hw=(8, 8), rows_per_layer=16,
                                   layers=("transformer_blocks.0.ff.conv_inverted",
                                           "transformer_blocks.0.ff.conv_point"))
    layer_set = capture.capture_layer_set("sana", families.SANA.build(sana_cfg), _pixart_prompts(1), config)
    weight, bias, rows = layer_set["transformer_blocks.0.ff.conv_point"]
    assert weight.shape == (32, 64) and bias is None and rows.shape == (16, 64)

    flux_cfg = flux.FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=4,
                               axes_dims_rope=(4, 4, 8))
    prompts = [{"context": jnp.ones((1, 3, 8)), "pooled": jnp.ones((1, 4))}]
    config = capture.CaptureConfig(num_steps=2, latent_hw=(8, 8), rows_per_layer=8,
                                   layers=("single_transformer_blocks.0.proj_out",
                                           "transformer_blocks.0.attn.to_add_out"))
    layer_set = capture.capture_layer_set("flux", families.FLUX.build(flux_cfg), prompts, config)
    assert layer_set["single_transformer_blocks.0.proj_out"][2].shape == (8, 32 + 128)
    assert layer_set["transformer_blocks.0.attn.to_add_out"][0].shape == (32, 32)

    with pytest.raises(ValueError, match="no Linear at"):
        capture.capture_layer_set("flux", families.FLUX.build(flux_cfg), prompts,
                                  capture.CaptureConfig(num_steps=1, latent_hw=(8, 8), layers=("proj_in",)))


def test_overrides_replace_exactly_the_named_linears():
    model = families.PIXART.build(PIXART, seed=2)
    x, context, t = jnp.ones((1, 4, 8, 8)), jnp.ones((1, 5, 8)), jnp.array([300.0])
    reference = model(x, context, t)
    layers = linears(model, quantizable_only=True)
    exact = {name: jax.tree_util.Partial(lambda k, b, v: v @ k + b, layer.kernel[...], layer.bias[...])
             for name, layer in layers.items()}
    quantize_model.check_overrides(model, exact)
    np.testing.assert_allclose(np.asarray(quantize_model.run_with_overrides(model, exact, x, context, t)),
                               np.asarray(reference), rtol=1e-5, atol=1e-5)
    zero_ff = {"transformer_blocks.0.ff.net.2": lambda v: jnp.zeros(v.shape[:-1] + (32,), v.dtype)}
    changed = quantize_model.run_with_overrides(model, zero_ff, x, context, t)
    assert float(jnp.abs(changed - reference).max()) > 1e-4
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.ff\.net\.2: override returns \(2, 7\)"):
        quantize_model.check_overrides(model, {"transformer_blocks.0.ff.net.2": lambda v: v[..., :7]})
    with pytest.raises(ValueError, match="no such Linear"):
        quantize_model.check_overrides(model, {"transformer_blocks.9.ff.net.2": lambda v: v})
    with pytest.raises(ValueError, match="override of transformer_blocks.0.attn1.to_q"):
        quantize_model.run_with_overrides(model, {"transformer_blocks.0.attn1.to_q": lambda v: v[..., :3]},
                                          x, context, t)


def test_fake_quant_w4a4_sampling_same_graph_same_seed():
    model = families.PIXART.build(PIXART, seed=3)
    graphdef, state = nnx.split(model)
    sample = jax.jit(sampling.make_sampler("pixart", graphdef, PIXART, num_steps=3, guidance_scale=4.5,
                                           latent_hw=(8, 8)))
    prompts = _pixart_prompts(1)[0]
    key = jax.random.key(7)
    full, _ = sample({"model": state, **prompts}, key)
    overrides = quantize_model.fake_quant_overrides(model)
    quantize_model.check_overrides(model, overrides)
    w4a4, _ = sample({"model": state, **prompts, "overrides": overrides}, key)
    again, _ = sample({"model": state, **prompts, "overrides": overrides}, key)
    np.testing.assert_array_equal(np.asarray(w4a4), np.asarray(again))
    difference = float(jnp.abs(w4a4 - full).max())
    assert 1e-4 < difference < float(jnp.abs(full).max())


@pytest.mark.slow
def test_quantize_checkpoint_script_end_to_end(tmp_path):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    from kroquant_jax.layerset import load_layer_set
    from models.quantized_checkpoint import load_quantized_checkpoint
    from scripts import quantize_checkpoint

    families.PIXART.to_diffusers(families.PIXART.build(PIXART, seed=4), tmp_path / "ckpt")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                                  norm_num_groups=8, layers_per_block=1)
    vae.save_pretrained(tmp_path / "vae")
    out = tmp_path / "out"
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--out", str(out), "--synthetic-prompts", "2",
            "--synthetic-tokens", "4", "--steps", "2", "--latent-hw", "8", "8", "--rows-per-layer", "24",
            "--recipe", "hadamard32", "--calib-rows", "16", "--calib-heldout", "8",
            "--eval-prompts", "1", "--vae", str(tmp_path / "vae")]
    report = quantize_checkpoint.main(argv)
    assert report["family"] == "pixart" and report["layers"] == 20
    psnr = report["per_prompt"][0]["latent_psnr_db"]
    assert np.isfinite(psnr) and 0 < psnr < 200  # W4A4 differs from 16-bit, but not wildly
    assert set(report["heldout_error"]) == set(linears(families.PIXART.build(PIXART), quantizable_only=True))
    layer_set = load_layer_set(str(out / "layer_set.safetensors"))
    assert layer_set["transformer_blocks.1.ff.net.2"].activations.shape == (24, 128)
    assert sorted(load_quantized_checkpoint(out / "quantized-hadamard32").qlayers) == sorted(layer_set)
    with np.load(out / "samples-hadamard32.npz") as samples:
        assert samples["latents_16bit"].shape == samples["latents_w4a4"].shape == (1, 4, 8, 8)
    assert sorted(p.name for p in (out / "images-hadamard32").iterdir()) == ["16bit_0000.png", "w4a4_0000.png"]
    assert json.loads((out / "report-hadamard32.json").read_text())["layers"] == 20
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_diffusers_io_encodes_prompts_with_a_local_pipeline(tmp_path):
    torch = pytest.importorskip("torch")
    from models import diffusers_io
    from tiny_pipelines import tiny_pixart_pipeline  # tests/tiny_pipelines.py

    tokenizer, encoder = tiny_pixart_pipeline(tmp_path)
    out = diffusers_io.encode_prompts(str(tmp_path), ["a red cat", "blue dog"], "pixart", max_sequence_length=8)
    assert out["context"].shape == (2, 8, 16) and out["uncond_context"].shape == (1, 8, 16)
    tokens = tokenizer(["a red cat", ""], padding="max_length", max_length=8, return_tensors="pt")
    with torch.no_grad():
        direct = encoder(tokens.input_ids, attention_mask=tokens.attention_mask)[0].numpy()
    np.testing.assert_array_equal(out["mask"][0], tokens.attention_mask[0].numpy())
    np.testing.assert_allclose(out["context"][0], direct[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["uncond_context"][0], direct[1], rtol=1e-5, atol=1e-6)
    assert out["uncond_mask"].sum() == tokens.attention_mask[1].sum()
    with pytest.raises(ValueError, match="unknown family"):
        diffusers_io.encode_prompts(str(tmp_path), ["a"], "sd3")


# --------------------------------------------------------------------------------------------------------------------
# Text-only layers from many prompts (CaptureConfig.text_rows_from_all_prompts)
# --------------------------------------------------------------------------------------------------------------------

def _many_prompts(count, channels=8, tokens=5, seed=3):
    """``count`` captions with 1-4 real tokens each (the padded positions hold the sentinel 5.0) and a 2-token
    unconditional caption, as ``text_prompts``."""
    rng = np.random.default_rng(seed)
    real = rng.integers(1, tokens, count)  # (P,)
    mask = (np.arange(tokens)[None] < real[:, None]).astype(np.float32)  # (P, t)
    context = np.where(mask[..., None] > 0, rng.standard_normal((count, tokens, channels)), 5.0)  # (P, t, c)
    uncond_mask = (np.arange(tokens) < 2).astype(np.float32)[None]  # (1, t)
    uncond = np.where(uncond_mask[..., None] > 0, rng.standard_normal((1, tokens, channels)), 5.0)  # (1, t, c)
    return {"context": context.astype(np.float32), "mask": mask, "uncond_context": uncond.astype(np.float32),
            "uncond_mask": uncond_mask}


def _direct_text_rows(model, prompts, uncond=True):
    """The distinct rows of ``model.caption_context`` of every real token, eagerly, and those of the padding."""
    real, padding = [], []
    for key in ("context", "uncond_context") if uncond else ("context",):
        out = np.asarray(model.caption_context(jnp.asarray(prompts[key])))  # (P, t, d)
        keep = prompts[key.replace("context", "mask")] > 0
        real.append(out[keep])
        padding.append(out[~keep])
    return np.unique(np.concatenate(real), axis=0), np.concatenate(padding)


def _same_row_set(got, expected):
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.unique(got, axis=0), expected, rtol=1e-5, atol=1e-6)  # jit vs eager: ulps


@pytest.mark.parametrize("family", ["pixart", "sana"])
def test_text_rows_are_the_caption_context_of_every_real_token_and_the_rest_is_unchanged(family):
    build, cfg = (families.PIXART, PIXART) if family == "pixart" else (families.SANA, SANA)
    model = build.build(cfg, seed=7)
    sampled = _padded_prompts(1)
    text = _many_prompts(11)
    config = capture.CaptureConfig(num_steps=2, latent_hw=(8, 8), rows_per_layer=200, seed=2,
                                   solver="flow_euler" if family == "pixart" else None)
    plain = capture.capture_layer_set(family, model, sampled, config)
    with_text = capture.capture_layer_set(
        family, model, sampled, dataclasses.replace(config, text_rows_from_all_prompts=True, text_batch_size=4), text)
    declared = build.text_only.layers(model)
    kv = [n for n in plain if ".attn2.to_k" in n or ".attn2.to_v" in n]
    assert set(declared) == set(kv) and len(kv) == 2 * cfg.num_layers
    expected, padding = _direct_text_rows(model, text)
    assert expected.shape[0] == text["mask"].sum() + 2  # every real token is a distinct row
    for name, (weight, bias, rows) in with_text.items():
        assert weight is plain[name][0] or np.array_equal(weight, plain[name][0])
        if name in declared:
            _same_row_set(rows, expected)
            assert len(np.unique(rows, axis=0)) == rows.shape[0]
            # no padding token's row: the sentinel inputs give rows far from every real one
            assert not np.isclose(padding[:, None], rows[None], rtol=1e-4, atol=1e-5).all(-1).any()
            assert rows.shape[0] > plain[name][2].shape[0]  # the sampled capture saw one caption's 3 + 1 tokens
        else:  # every other layer: exactly the rows of the capture without the option
            np.testing.assert_array_equal(rows, plain[name][2], err_msg=name)

    # without text_prompts: the prompts of the sampled batches (+ their unconditional caption, with CFG)
    default = capture.capture_layer_set(family, model, sampled,
                                        dataclasses.replace(config, text_rows_from_all_prompts=True))
    sampled_text = {k: np.asarray(v) for k, v in sampled[0].items()}
    _same_row_set(default[kv[0]][2], _direct_text_rows(model, sampled_text)[0])
    # CFG off: the unconditional caption is not sampled, so it gives no rows either
    no_cfg = capture.text_only_rows(family, model, text, max_rows=500, seed=0, uses_cfg=False)
    _same_row_set(no_cfg[0], _direct_text_rows(model, text, uncond=False)[0])


def test_text_rows_subset_is_seeded_and_does_not_depend_on_the_batching():
    model = families.PIXART.build(PIXART, seed=8)
    text = _many_prompts(9)
    full, distinct = capture.text_only_rows("pixart", model, text, max_rows=1000, seed=0, uses_cfg=True)
    assert distinct == full.shape[0] == text["mask"].sum() + 2
    subsets = {}
    for seed, batch in ((0, 2), (0, 9), (1, 4)):
        rows, count = capture.text_only_rows("pixart", model, text, max_rows=6, seed=seed, uses_cfg=True,
                                             batch_size=batch)
        assert rows.shape == (6, 32) and count == distinct
        assert all(np.isclose(full, row, rtol=1e-5, atol=1e-6).all(axis=1).any() for row in rows)
        subsets[seed, batch] = np.unique(rows, axis=0)
    np.testing.assert_allclose(subsets[0, 2], subsets[0, 9], rtol=1e-5, atol=1e-6)  # same seed, other batches
    assert subsets[0, 2].shape != subsets[1, 4].shape or not np.allclose(subsets[0, 2], subsets[1, 4])
    # repeated captions and the unconditional caption broadcast to every prompt add no row
    doubled = {"context": np.concatenate([text["context"]] * 2), "mask": np.concatenate([text["mask"]] * 2),
               "uncond_context": np.repeat(text["uncond_context"], 5, 0),
               "uncond_mask": np.repeat(text["uncond_mask"], 5, 0)}
    again, count = capture.text_only_rows("pixart", model, doubled, max_rows=1000, seed=0, uses_cfg=True)
    assert count == distinct
    _same_row_set(again, np.unique(full, axis=0))


def test_text_rows_bad_input_raises_before_sampling():
    model = families.PIXART.build(PIXART, seed=9)
    sampled = _padded_prompts(1)
    text = _many_prompts(3)
    on = capture.CaptureConfig(num_steps=1, latent_hw=(8, 8), text_rows_from_all_prompts=True)

    def fails(prompts, match, config=on, family="pixart", capture_model=model):
        with pytest.raises(ValueError, match=match):
            capture.capture_layer_set(family, capture_model, sampled, config, prompts)

    fails(text, r"text_prompts are only read with CaptureConfig\(text_rows_from_all_prompts=True\)",
          config=dataclasses.replace(on, text_rows_from_all_prompts=False))
    fails({**text, "mask": text["mask"][:, :4]}, r"text_prompts\['mask'\]: shape \(3, 4\) does not match "
          r"'context''s \(prompts, tokens\) = \(3, 5\)")
    fails({**text, "mask": text["mask"] * 2}, r"text_prompts\['mask'\]: holds values other than 0 and 1")
    fails({**text, "context": text["context"][..., :6]}, r"text_prompts\['context'\]: shape \(3, 5, 6\), the "
          r"model's text-only layers need \(prompts >= 1, tokens, 8\)")
    fails({**text, "context": np.where(text["mask"][..., None] > 0, np.nan, text["context"])},
          r"text_prompts\['context'\]: holds non-finite values")
    fails({k: v for k, v in text.items() if not k.startswith("uncond")},
          r"lacks 'uncond_context' \(CFG samples the unconditional caption too\)")
    fails({**text, "context_mask": text["mask"]}, r"unknown keys \['context_mask'\]")
    fails({**text, "mask": 0 * text["mask"], "uncond_mask": 0 * text["uncond_mask"]}, "every token is masked")
    fails(text, r"none of the 1 recorded layers reads the text alone \(the pixart family's: "
          r"\['transformer_blocks.0.attn2.to_k', 'transformer_blocks.0.attn2.to_v'\]",
          config=dataclasses.replace(on, layers=("transformer_blocks.0.attn1.to_q",)))
    flux_cfg = flux.FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=4,
                               axes_dims_rope=(4, 4, 8))
    with pytest.raises(ValueError, match="the flux family has no linear whose input depends on the text alone"):
        capture.capture_layer_set("flux", families.FLUX.build(flux_cfg),
                                  [{"context": jnp.ones((1, 3, 8)), "pooled": jnp.ones((1, 4))}], on)
    assert families.FLUX.text_only is None and families.IDEOGRAM4.text_only is None

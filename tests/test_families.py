"""The model-family registry: detection from config.json, one interface for every family, quantize-checkpoint on
Ideogram 4 through it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import convert, families, flux, ideogram4, pixart, sana

TINY = {
    "pixart": pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                  num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2,
                                  caption_channels=8, use_additional_conditions=False),
    "sana": sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                            num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
                            caption_channels=8, mlp_ratio=2.0, sample_size=8),
    "flux": flux.FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=1, joint_attention_dim=8, pooled_projection_dim=4,
                            axes_dims_rope=(4, 4, 8)),
    "ideogram4": ideogram4.tiny_config(),
}


def test_registry_covers_the_four_families_and_detects_them():
    assert sorted(families.REGISTRY) == ["flux", "ideogram4", "pixart", "sana"]
    for name, family in families.REGISTRY.items():
        assert families.get(name) is family
        cfg = TINY[name]
        config = cfg.to_diffusers_config()
        assert families.detect(config) is family and config["_class_name"] == family.class_name
        assert family.config_from_diffusers(config) == cfg
        for preset in family.presets.values():  # presets round-trip through config.json
            assert family.config_from_diffusers(preset.to_diffusers_config()) == preset
    with pytest.raises(ValueError, match=r"ckpt/config.json: _class_name 'UNet2DConditionModel' is not a supported"):
        families.detect({"_class_name": "UNet2DConditionModel"}, source="ckpt/config.json")
    with pytest.raises(ValueError, match="unknown model family 'sd3'"):
        families.get("sd3")


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_family_round_trips_through_one_interface(tmp_path, name):
    family = families.get(name)
    model = family.build(TINY[name], seed=3)
    sites = family.linear_sites(model)
    assert sites and all(s in family.linear_sites(model, quantizable_only=False) for s in sites)
    family.to_diffusers(model, tmp_path / "ckpt", max_shard_bytes=4096)
    found, config = families.detect_dir(tmp_path / "ckpt")
    assert found is family and config["_class_name"] == family.class_name
    loaded_family, cfg, loaded = families.load_diffusers(tmp_path / "ckpt")
    assert loaded_family is family and cfg == TINY[name]
    original, back = convert.flat_state_dict(model), convert.flat_state_dict(loaded)
    assert original.keys() == back.keys()
    for key in original:
        np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(original[key]))
    _, half = family.from_diffusers(tmp_path / "ckpt", dtype="bfloat16")
    assert {np.asarray(v).dtype for v in convert.flat_state_dict(half).values()} == {np.dtype(jnp.bfloat16)}
    other = next(f for f in families.REGISTRY.values() if f is not family)
    with pytest.raises(ValueError, match=f"a {family.class_name} checkpoint, not {other.class_name}"):
        other.from_diffusers(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["pixart", "sana", "flux"])
def test_attention_impl_is_a_jax_side_config_field(tmp_path, name):
    """``attention_impl`` is a JAX-side choice: left out of config.json, refused inside one, settable by
    ``config_overrides``, checked by value, and ``"cudnn"`` off a GPU is a clear error at the first forward."""
    import dataclasses

    family, cfg = families.get(name), TINY[name]
    assert "attention_impl" not in cfg.to_diffusers_config() and cfg.attention_impl == "xla"
    with pytest.raises(ValueError, match="attention_impl='cudnn' \\(unknown key\\)"):
        family.config_from_diffusers({**cfg.to_diffusers_config(), "attention_impl": "cudnn"})
    with pytest.raises(ValueError, match="attention_impl='flash' must be one of \\('xla', 'cudnn'\\)"):
        dataclasses.replace(cfg, attention_impl="flash")
    family.to_diffusers(family.build(cfg, seed=3), tmp_path / "ckpt")
    loaded_cfg, model = family.from_diffusers(tmp_path / "ckpt", "bfloat16", {"attention_impl": "cudnn"})
    assert loaded_cfg == dataclasses.replace(cfg, attention_impl="cudnn")
    assert {getattr(m, "attention_impl", None) for _, m in nnx.iter_graph(model)} >= {"cudnn"}
    if jax.default_backend() != "gpu":
        import argparse

        from scripts.quantize_checkpoint import prompt_arrays, prompt_batches

        synthetic = argparse.Namespace(embeddings=None, synthetic_prompts=1, synthetic_tokens=3, seed=0,
                                       max_prompts=None)
        batch = prompt_batches(prompt_arrays(synthetic, family, loaded_cfg), [0], 1, jnp.bfloat16)[0]
        graphdef, state = nnx.split(model)
        sample = family.make_sampler(graphdef, loaded_cfg, num_steps=1, guidance_scale=1.0, latent_hw=(8, 8))
        with pytest.raises(ValueError, match="attention_impl='cudnn' needs an NVIDIA GPU"):
            jax.eval_shape(sample, {"model": state, **batch}, jax.random.key(0))


@pytest.mark.parametrize("name", ["flux", "ideogram4"])
def test_device_init_draws_the_host_init_distributions(name):
    """``build(on_device=True)``: the same shapes and dtypes as the host init, each parameter from the same rule
    (uniform ±1/sqrt(fan_in) kernels, zero biases, unit norm weights, normal / sqrt(dim) tables), other values."""
    family, cfg = families.get(name), TINY[name]
    host = convert.flat_state_dict(family.build(cfg, seed=3))
    device = convert.flat_state_dict(family.build(cfg, seed=3, on_device=True))
    assert host.keys() == device.keys()
    for key, h in host.items():
        h, d = np.asarray(h, np.float64), np.asarray(device[key], np.float64)
        assert h.shape == d.shape and np.asarray(host[key]).dtype == np.asarray(device[key]).dtype, key
        if key.endswith("kernel"):
            bound = 1 / np.sqrt(np.prod(h.shape[:-1]))
            assert np.abs(d).max() <= bound and (h.size < 64 or np.abs(d).max() > 0.8 * bound), key
            assert not np.array_equal(h, d), key
        elif np.all(h == h.flat[0]):  # biases and norm weights: constants
            np.testing.assert_array_equal(d, h, err_msg=key)
        else:  # scale_shift_table, embeddings: normal / sqrt(dim)
            assert 0.5 < d.std() * np.sqrt(h.shape[-1]) < 1.5 and not np.array_equal(h, d), key
    again = convert.flat_state_dict(family.build(cfg, seed=3, on_device=True))
    assert all(np.array_equal(np.asarray(again[k]), np.asarray(device[k])) for k in device)


def test_bad_checkpoints_raise_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "FooModel"}))
    with pytest.raises(ValueError, match=r"config.json: _class_name 'FooModel'"):
        families.load_diffusers(tmp_path)
    with pytest.raises(convert.CheckpointError, match="no config.json"):
        families.detect_dir(tmp_path / "missing")
    family = families.PIXART
    family.to_diffusers(family.build(TINY["pixart"]), tmp_path / "ok")
    state = convert.read_safetensors(tmp_path / "ok" / convert.WEIGHTS_NAME)
    state = {k: v for k, v in state.items() if k != "proj_out.bias"}
    with pytest.raises(convert.ConversionError, match="proj_out.bias"):
        family.from_diffusers_state(state, TINY["pixart"])


def test_ideogram4_scan_layout_through_the_family(tmp_path):
    family = families.IDEOGRAM4
    model = family.build(TINY["ideogram4"], seed=1)
    family.to_diffusers(model, tmp_path / "ckpt")
    _, scanned = family.from_diffusers(tmp_path / "ckpt", config_overrides={"scan_layers": True})
    assert scanned.config.scan_layers
    exported = family.to_diffusers_state(scanned)
    for key, value in family.to_diffusers_state(model).items():
        np.testing.assert_array_equal(exported[key], value)


def test_ideogram4_sampler_runs_the_conditional_branch_with_hooks():
    from models import capture

    family = families.IDEOGRAM4
    cfg = TINY["ideogram4"]
    model = family.build(cfg, seed=2)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    params = {"model": state, "context": jnp.asarray(rng.standard_normal((2, 3, cfg.llm_features_dim)), jnp.float32),
              "mask": jnp.asarray([[0, 1, 1], [1, 1, 1]], jnp.float32)}
    sample = jax.jit(family.make_sampler(graphdef, cfg, num_steps=2, guidance_scale=1.0, latent_hw=(2, 2)))
    latents, aux = sample(params, jax.random.key(0))
    assert latents.shape == (2, 4, cfg.in_channels) and aux == {} and np.isfinite(np.asarray(latents)).all()
    with pytest.raises(ValueError, match="guidance_scale must be 1.0"):
        family.make_sampler(graphdef, cfg, num_steps=2, guidance_scale=4.5, latent_hw=(2, 2))
    # capture: the left padding of prompt 0 is never recorded
    config = capture.CaptureConfig(num_steps=2, guidance_scale=1.0, latent_hw=(2, 2), rows_per_layer=100,
                                   layers=("layers.0.attention.to_q",))
    layer_set = capture.capture_layer_set("ideogram4", model, [{k: v for k, v in params.items() if k != "model"}],
                                          config)
    rows = layer_set["layers.0.attention.to_q"][2]
    assert rows.shape == (2 * (2 + 4 + 3 + 4), cfg.hidden_size)  # 2 steps x the real tokens of both rows, distinct


@pytest.mark.slow
def test_quantize_checkpoint_on_a_diffusers_ideogram4(tmp_path):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    from scripts import quantize_checkpoint

    torch.manual_seed(0)
    config = {k: v for k, v in TINY["ideogram4"].to_diffusers_config().items() if not k.startswith("_")}
    diffusers.Ideogram4Transformer2DModel(**config).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out"
    report = quantize_checkpoint.main([
        "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out), "--synthetic-prompts", "3",
        "--synthetic-tokens", "4", "--steps", "2", "--guidance", "1", "--latent-hw", "2", "2",
        "--rows-per-layer", "32", "--recipe", "rtn", "--calib-rows", "16", "--calib-heldout", "4",
        "--eval-prompts", "1"])
    model = families.IDEOGRAM4.build(TINY["ideogram4"])
    assert report["family"] == "ideogram4" and report["layers"] == len(families.IDEOGRAM4.linear_sites(model)) == 14
    assert np.isfinite(report["mean_latent_psnr_db"])
    with np.load(out / "samples-rtn.npz") as samples:
        assert samples["latents_16bit"].shape == (1, 4, TINY["ideogram4"].in_channels)

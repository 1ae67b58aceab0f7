"""FLUX.1 port: parity with diffusers' FluxTransformer2DModel, conversion round trip, preset size, packing."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from models import convert, families, flux  # noqa: E402
from models.layers import linears  # noqa: E402


def _jit_forward(model, *args):
    """One compiled forward pass (eager dispatch compiles every op separately: slower for a single call)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args)



def _random_flux(seed: int, **config):
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(**config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    return model


CONFIGS = {
    # schnell-like (no guidance), odd head count, uneven RoPE axes.
    "schnell_like_odd_heads": dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                                   attention_head_dim=12, num_attention_heads=3, joint_attention_dim=10,
                                   pooled_projection_dim=6, guidance_embeds=False, axes_dims_rope=(2, 4, 6)),
    # dev-like: guidance embedding, explicit out_channels.
    "dev_like_guidance": dict(patch_size=1, in_channels=8, out_channels=4, num_layers=1, num_single_layers=1,
                              attention_head_dim=8, num_attention_heads=2, joint_attention_dim=6,
                              pooled_projection_dim=5, guidance_embeds=True, axes_dims_rope=(2, 2, 4)),
}


@pytest.mark.parametrize("name,sharded", [("schnell_like_odd_heads", False), ("schnell_like_odd_heads", True),
                                          ("dev_like_guidance", False)])
def test_forward_matches_diffusers(tmp_path, name, sharded):
    config = CONFIGS[name]
    reference = _random_flux(1, **config)
    reference.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "10GB")
    assert (tmp_path / convert.WEIGHTS_INDEX_NAME).is_file() == sharded
    cfg, model = families.FLUX.from_diffusers(tmp_path)
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, cfg.in_channels // 4, 6, 8)).astype(np.float32)
    tokens = np.array(flux.pack_latents(jnp.asarray(latents)))
    img_ids = flux.image_ids(6, 8)
    txt_ids = np.zeros((5, 3), np.float32)
    context = rng.standard_normal((2, 5, cfg.joint_attention_dim)).astype(np.float32)
    pooled = rng.standard_normal((2, cfg.pooled_projection_dim)).astype(np.float32)
    timestep = np.array([1.0, 0.25], np.float32)
    guidance = np.array([3.5, 3.5], np.float32) if cfg.guidance_embeds else None
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens), torch.from_numpy(context), torch.from_numpy(pooled),
                             torch.from_numpy(timestep), torch.from_numpy(img_ids), torch.from_numpy(txt_ids),
                             None if guidance is None else torch.from_numpy(guidance)).sample.numpy()
    got = np.asarray(_jit_forward(model, jnp.asarray(tokens), jnp.asarray(context), jnp.asarray(pooled), jnp.asarray(timestep),
                           jnp.asarray(img_ids), jnp.asarray(txt_ids),
                           None if guidance is None else jnp.asarray(guidance)))
    assert got.shape == expected.shape
    err = float(np.abs(expected - got).max() / np.abs(expected).max())
    assert err < 1e-4, err


def test_pack_unpack_match_the_pipeline():
    from diffusers import FluxPipeline
    latents = np.random.default_rng(1).standard_normal((2, 4, 6, 10)).astype(np.float32)
    packed = FluxPipeline._pack_latents(torch.from_numpy(latents), 2, 4, 6, 10).numpy()
    np.testing.assert_array_equal(np.asarray(flux.pack_latents(jnp.asarray(latents))), packed)
    np.testing.assert_array_equal(np.asarray(flux.unpack_latents(jnp.asarray(packed), 6, 10)), latents)
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32).numpy()
    np.testing.assert_array_equal(flux.image_ids(6, 10), ids)


def test_export_round_trip_and_quantizable_names(tmp_path):
    reference = _random_flux(2, **CONFIGS["dev_like_guidance"])
    reference.save_pretrained(tmp_path / "src")
    _, model = families.FLUX.from_diffusers(tmp_path / "src")
    families.FLUX.to_diffusers(model, tmp_path / "out")
    _, original = convert.read_diffusers_dir(tmp_path / "src")
    _, exported = convert.read_diffusers_dir(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    assert all(np.array_equal(original[k], exported[k]) for k in original)
    quantizable = set(linears(model, quantizable_only=True))
    # double: q k v, add_q k v, to_out.0, to_add_out, ff x2, ff_context x2; single: q k v, proj_mlp, proj_out
    assert len(quantizable) == 12 + 5
    assert "transformer_blocks.0.norm1.linear" not in quantizable
    assert "single_transformer_blocks.0.proj_out" in quantizable and "proj_out" not in quantizable


def test_preset_parameter_count_matches_diffusers():
    cfg = flux.FLUX1_SCHNELL
    shapes = convert.abstract_shapes(lambda: families.FLUX.construct(cfg))
    ours = sum(math.prod(s) for s in shapes.values())
    config = {k: v for k, v in cfg.to_diffusers_config().items() if not k.startswith("_")}
    with torch.device("meta"):
        theirs = sum(p.numel() for p in diffusers.FluxTransformer2DModel(**config).parameters())
    assert ours == theirs
    assert 11.8e9 < ours < 12.0e9  # FLUX.1 is a 12B model


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="axes_dims_rope"):
        flux.FluxConfig(axes_dims_rope=(16, 56, 50))

"""PixArt-Σ port: parity with diffusers' PixArtTransformer2DModel, conversion round trips, preset size."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from models import convert, families, pixart  # noqa: E402
from models.layers import linears  # noqa: E402


def _jit_forward(model, *args):
    """One compiled forward pass (eager dispatch compiles every op separately: slower for a single call)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args)



def _random_pixart(seed: int, **config):
    torch.manual_seed(seed)
    model = diffusers.PixArtTransformer2DModel(**config).eval()
    with torch.no_grad():
        for param in model.parameters():  # diffusers zero-inits some layers: make every weight matter
            param.normal_(0.0, 0.2)
    return model


def _rel_err(ref: np.ndarray, out: np.ndarray) -> float:
    return float(np.abs(ref - out).max() / np.abs(ref).max())


CONFIGS = {
    # PixArt-Σ-like: caption projection, additional (resolution/aspect) conditions, odd head count.
    "sigma_like_odd_heads": dict(num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=8,
                                 num_layers=2, cross_attention_dim=24, sample_size=8, patch_size=2,
                                 caption_channels=12, use_additional_conditions=True, interpolation_scale=1),
    # Emoji-testbed-like: pixel space, patch 2, caption 384-ish width, no additional conditions, affine norms.
    "pixel_space_no_conditions": dict(num_attention_heads=2, attention_head_dim=16, in_channels=3, out_channels=None,
                                      num_layers=2, cross_attention_dim=32, sample_size=16, patch_size=2,
                                      caption_channels=40, use_additional_conditions=False,
                                      norm_elementwise_affine=True),
    # No cross-attention, no caption projection, exact GELU, interpolation scale 2.
    "no_cross_attention": dict(num_attention_heads=5, attention_head_dim=4, in_channels=4, out_channels=4,
                               num_layers=1, cross_attention_dim=None, sample_size=8, patch_size=1,
                               caption_channels=None, activation_fn="gelu", interpolation_scale=2,
                               use_additional_conditions=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("sharded", [False, True])
def test_forward_matches_diffusers(tmp_path, name, sharded):
    config = CONFIGS[name]
    reference = _random_pixart(1, **config)
    reference.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "10GB")
    assert (tmp_path / convert.WEIGHTS_INDEX_NAME).is_file() == sharded
    cfg, model = families.PIXART.from_diffusers(tmp_path)

    rng = np.random.default_rng(0)
    batch, tokens = 2, 5
    height, width = (8, 12) if name != "pixel_space_no_conditions" else (16, 16)
    x = rng.standard_normal((batch, cfg.in_channels, height, width)).astype(np.float32)
    context_width = config["caption_channels"] or config["cross_attention_dim"] or 8
    context = rng.standard_normal((batch, tokens, context_width)).astype(np.float32)
    timestep = np.array([3.0, 871.0], np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int64)
    resolution = np.array([[64.0, 96.0], [128.0, 128.0]], np.float32)
    aspect = np.array([[1.5], [1.0]], np.float32)
    added = {"resolution": torch.from_numpy(resolution), "aspect_ratio": torch.from_numpy(aspect)} \
        if cfg.uses_additional_conditions else None
    with torch.no_grad():
        expected = reference(torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(context),
                             timestep=torch.from_numpy(timestep), encoder_attention_mask=torch.from_numpy(mask),
                             added_cond_kwargs=added).sample.numpy()
    got = np.asarray(_jit_forward(model, jnp.asarray(x), jnp.asarray(context), jnp.asarray(timestep), jnp.asarray(mask),
                           jnp.asarray(resolution), jnp.asarray(aspect)))
    assert got.shape == expected.shape
    assert _rel_err(expected, got) < 1e-4, _rel_err(expected, got)


def test_export_round_trip_is_exact_and_loads_in_diffusers(tmp_path):
    config = CONFIGS["sigma_like_odd_heads"]
    reference = _random_pixart(2, **config)
    reference.save_pretrained(tmp_path / "src")
    _, model = families.PIXART.from_diffusers(tmp_path / "src")
    families.PIXART.to_diffusers(model, tmp_path / "out", max_shard_bytes=4096)
    _, original = convert.read_diffusers_dir(tmp_path / "src")
    _, exported = convert.read_diffusers_dir(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for key in original:
        assert original[key].dtype == exported[key].dtype, key
        assert np.array_equal(original[key], exported[key]), key
    reloaded = diffusers.PixArtTransformer2DModel.from_pretrained(tmp_path / "out").eval()
    for (name_a, a), (name_b, b) in zip(reference.state_dict().items(), reloaded.state_dict().items()):
        assert name_a == name_b and torch.equal(a, b), name_a


def test_bf16_conversion_and_export(tmp_path):
    reference = _random_pixart(3, **CONFIGS["pixel_space_no_conditions"])
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    _, model = families.PIXART.from_diffusers(tmp_path / "src", dtype="bfloat16")
    assert model.transformer_blocks[0].attn1.to_q.kernel[...].dtype == jnp.bfloat16
    families.PIXART.to_diffusers(model, tmp_path / "out")
    _, original = convert.read_diffusers_dir(tmp_path / "src")
    _, exported = convert.read_diffusers_dir(tmp_path / "out")
    for key in original:
        assert exported[key].dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(original[key].view(np.uint16), exported[key].view(np.uint16)), key
    x = jnp.ones((1, 3, 16, 16), jnp.bfloat16)
    out = model(x, jnp.ones((1, 4, 40)), jnp.array([5.0]))
    assert out.dtype == jnp.bfloat16 and out.shape == (1, 3, 16, 16) and bool(jnp.isfinite(out).all())


def test_linear_paths_are_diffusers_prefixes(tmp_path):
    reference = _random_pixart(4, **CONFIGS["sigma_like_odd_heads"])
    model = families.PIXART.build(pixart.PixArtConfig.from_diffusers_config(dict(reference.config)))
    torch_linears = {n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(linears(model)) == torch_linears
    quantizable = set(linears(model, quantizable_only=True))
    assert quantizable == {n for n in torch_linears if n.startswith("transformer_blocks.")}
    assert "transformer_blocks.1.attn2.to_out.0" in quantizable and "proj_out" not in quantizable


def test_preset_parameter_count_matches_diffusers():
    cfg = pixart.PIXART_SIGMA_XL_2_1024_MS
    shapes = convert.abstract_shapes(lambda: families.PIXART.construct(cfg))
    ours = sum(math.prod(s) for s in shapes.values())
    config = {k: v for k, v in cfg.to_diffusers_config().items() if not k.startswith("_")}
    with torch.device("meta"):
        theirs = sum(p.numel() for p in diffusers.PixArtTransformer2DModel(**config).parameters())
    assert ours == theirs
    assert 600e6 < ours < 620e6  # PixArt-Σ-XL is a 0.6B model


def test_config_rejects_unported_settings():
    with pytest.raises(ValueError, match="double_self_attention"):
        pixart.PixArtConfig.from_diffusers_config({"double_self_attention": True})
    with pytest.raises(ValueError, match="bogus_key"):
        pixart.PixArtConfig.from_diffusers_config({"bogus_key": 1})
    with pytest.raises(NotImplementedError, match="norm_type"):
        pixart.PixArtConfig(norm_type="ada_norm_zero")


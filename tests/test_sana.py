"""SANA port: parity with diffusers' SanaTransformer2DModel, conversion round trip, preset size."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from models import convert, families, sana  # noqa: E402
from models.layers import linears  # noqa: E402


def _jit_forward(model, *args):
    """One compiled forward pass (eager dispatch compiles every op separately: slower for a single call)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args)



def _random_sana(seed: int, **config):
    torch.manual_seed(seed)
    model = diffusers.SanaTransformer2DModel(**config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


CONFIGS = {
    # Sana_1600M-like: no positions, patch 1, odd self-attention head count, mask on the caption.
    "sana_like_odd_heads": dict(in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=8,
                                num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=12,
                                cross_attention_dim=24, caption_channels=10, mlp_ratio=2.5, sample_size=8,
                                patch_size=1),
    # Guidance embedding, QK RMSNorm across heads, sincos positions, patch 2, affine norm2, attention bias.
    "guidance_qknorm_positions": dict(in_channels=3, out_channels=None, num_attention_heads=2, attention_head_dim=8,
                                      num_layers=1, num_cross_attention_heads=4, cross_attention_head_dim=4,
                                      cross_attention_dim=16, caption_channels=6, mlp_ratio=1.5, sample_size=8,
                                      patch_size=2, interpolation_scale=1.0, guidance_embeds=True,
                                      qk_norm="rms_norm_across_heads", norm_elementwise_affine=True,
                                      attention_bias=True),
}


@pytest.mark.parametrize("name,sharded", [("sana_like_odd_heads", False), ("sana_like_odd_heads", True),
                                          ("guidance_qknorm_positions", False)])
def test_forward_matches_diffusers(tmp_path, name, sharded):
    config = CONFIGS[name]
    reference = _random_sana(1, **config)
    reference.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "10GB")
    assert (tmp_path / convert.WEIGHTS_INDEX_NAME).is_file() == sharded
    cfg, model = families.SANA.from_diffusers(tmp_path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, cfg.in_channels, 8, 12)).astype(np.float32)
    context = rng.standard_normal((2, 5, cfg.caption_channels)).astype(np.float32)
    timestep = np.array([999.0, 20.5], np.float32)
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.int64)
    guidance = np.array([4.5, 1.0], np.float32) if cfg.guidance_embeds else None
    with torch.no_grad():
        expected = reference(torch.from_numpy(x), torch.from_numpy(context), torch.from_numpy(timestep),
                             guidance=None if guidance is None else torch.from_numpy(guidance),
                             encoder_attention_mask=torch.from_numpy(mask)).sample.numpy()
    got = np.asarray(_jit_forward(model, jnp.asarray(x), jnp.asarray(context), jnp.asarray(timestep), jnp.asarray(mask),
                           None if guidance is None else jnp.asarray(guidance)))
    assert got.shape == expected.shape
    err = float(np.abs(expected - got).max() / np.abs(expected).max())
    assert err < 1e-4, err


def test_export_round_trip_and_quantizable_names(tmp_path):
    reference = _random_sana(2, **CONFIGS["guidance_qknorm_positions"])
    reference.save_pretrained(tmp_path / "src")
    _, model = families.SANA.from_diffusers(tmp_path / "src")
    families.SANA.to_diffusers(model, tmp_path / "out")
    _, original = convert.read_diffusers_dir(tmp_path / "src")
    _, exported = convert.read_diffusers_dir(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for key in original:
        assert np.array_equal(original[key], exported[key]), key
    reloaded = diffusers.SanaTransformer2DModel.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), reloaded.state_dict().values()))
    quantizable = set(linears(model, quantizable_only=True))
    assert {"transformer_blocks.0.ff.conv_inverted", "transformer_blocks.0.ff.conv_point"} <= quantizable
    assert "transformer_blocks.0.attn1.to_out.0" in quantizable and "proj_out" not in quantizable
    assert len(quantizable) == 10


def test_preset_parameter_count_matches_diffusers():
    cfg = sana.SANA_1600M_1024PX
    shapes = convert.abstract_shapes(lambda: families.SANA.construct(cfg))
    ours = sum(math.prod(s) for s in shapes.values())
    config = {k: v for k, v in cfg.to_diffusers_config().items() if not k.startswith("_")}
    with torch.device("meta"):
        theirs = sum(p.numel() for p in diffusers.SanaTransformer2DModel(**config).parameters())
    assert ours == theirs
    assert 1.5e9 < ours < 1.7e9


def test_bad_config_is_rejected():
    with pytest.raises(NotImplementedError, match="qk_norm"):
        sana.SanaConfig(qk_norm="layer_norm")
    with pytest.raises(ValueError, match="dropout"):
        sana.SanaConfig.from_diffusers_config({"dropout": 0.1})

"""cuDNN flash attention (``attention_impl="cudnn"``) in the PixArt-Σ, SANA and FLUX.1 ports gives the forward of the
fp32-logits XLA attention up to bf16 rounding, on the GPU (CPU CI checks the config plumbing and the refusal)."""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import families, flux, pixart, sana
from models.layers import dot_product_attention
from scripts.quantize_checkpoint import prompt_arrays, prompt_batches

pytestmark = pytest.mark.gpu

CONFIGS = {
    # PixArt-Σ's real head width (72) with its cross-attention mask; SANA's cross-attention; FLUX.1's joint attention
    "pixart": dataclasses.replace(pixart.PIXART_SIGMA_XL_2_1024_MS, num_layers=2, sample_size=16),
    "sana": sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                            num_cross_attention_heads=2, cross_attention_head_dim=64, cross_attention_dim=64,
                            caption_channels=64, mlp_ratio=2.0, sample_size=16),
    "flux": dataclasses.replace(flux.FLUX1_SCHNELL, num_layers=1, num_single_layers=1),
}


@pytest.mark.parametrize("shape", [(1, 4096, 16, 72, 300), (2, 333, 4, 128, 77)])
def test_cudnn_attention_matches_xla_with_a_mask_bias(shape):
    b, s, h, dh, t = shape
    q, k, v = (jax.random.normal(key, (b, n, h, dh), jnp.bfloat16)
               for key, n in zip(jax.random.split(jax.random.key(0), 3), (s, t, t)))
    keep = (jnp.arange(t) < t - 5).astype(jnp.float32)[None].repeat(b, 0)  # the last 5 tokens masked
    bias = ((1.0 - keep) * -10000.0)[:, None, None, :]  # (b, 1, 1, t)
    ref = jax.jit(lambda *a: dot_product_attention(*a, "xla"))(q, k, v, bias).astype(jnp.float32)
    out = jax.jit(lambda *a: dot_product_attention(*a, "cudnn"))(q, k, v, bias).astype(jnp.float32)
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert err < 1e-2, err


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_family_forward_with_cudnn_attention_matches_xla(name):
    family, cfg = families.get(name), CONFIGS[name]
    synthetic = argparse.Namespace(embeddings=None, synthetic_prompts=1, synthetic_tokens=77, seed=0,
                                   max_prompts=None)
    outs = {}
    for impl in ("xla", "cudnn"):
        impl_cfg = dataclasses.replace(cfg, attention_impl=impl)
        graphdef, state = nnx.split(family.build(impl_cfg, dtype=jnp.bfloat16, seed=0))
        batch = prompt_batches(prompt_arrays(synthetic, family, impl_cfg), [0], 1, jnp.bfloat16)[0]
        hw = (cfg.sample_size, cfg.sample_size) if hasattr(cfg, "sample_size") else (32, 32)
        sample = jax.jit(family.make_sampler(graphdef, impl_cfg, num_steps=1, guidance_scale=1.0, latent_hw=hw))
        outs[impl] = np.asarray(sample({"model": state, **batch}, jax.random.key(0))[0], np.float32)
    assert np.isfinite(outs["cudnn"]).all()
    err = np.linalg.norm(outs["cudnn"] - outs["xla"]) / np.linalg.norm(outs["xla"])
    assert err < 2e-2, err

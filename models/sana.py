"""SANA: a Flax NNX port of diffusers' ``SanaTransformer2DModel``.

Structure (module names = diffusers keys): ``patch_embed`` (patch conv, sincos positions only when
``interpolation_scale`` is set), ``time_embed`` (AdaLayerNormSingle, or the timestep+guidance embedding when
``guidance_embeds``), ``caption_projection`` + ``caption_norm`` (RMSNorm), ``transformer_blocks.{i}``:
``norm1`` -> ``attn1`` (ReLU linear attention, O(n) in tokens), ``attn2`` (softmax cross-attention on the raw
residual), ``norm2`` -> ``ff`` (GLUMBConv: 1x1 conv ``conv_inverted`` -> SiLU -> depthwise 3x3 ``conv_depth`` ->
gated SiLU -> 1x1 conv ``conv_point``), AdaLN-single modulation; ``scale_shift_table``, ``norm_out``, ``proj_out``.

The 1x1 convolutions are :class:`~models.layers.Linear` layers on channels-last tokens (kernel (d, o)), so they are
quantized like any linear. Quantizable: attn1/attn2 q, k, v, out and ff.conv_inverted, ff.conv_point in every block.
The depthwise 3x3 conv, embeddings, caption projection and proj_out stay 16-bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models import convert
from models.convert import linear_rules, param_rules, rule
from models.layers import (Attention, ConvWeights, LayerNorm, Linear, LinearHooks, PatchEmbed, RMSNorm,
                           TextProjection, TimestepEmbedding, block_attention_sites, check_attention_impl,
                           check_fused_sites, layer_norm, mask_to_bias, name_linears, timestep_embedding, unpatchify,
                           with_token_mask)
from models.pixart import AdaLayerNormSingle

__all__ = ["SANA_1600M_1024PX", "SanaConfig", "SanaTransformer2DModel", "KEY_TABLE", "from_diffusers",
           "to_diffusers"]

CLASS_NAME = "SanaTransformer2DModel"


@dataclasses.dataclass(frozen=True)
class SanaConfig(convert.DiTConfig):
    """The fields of diffusers' SanaTransformer2DModel config.json (defaults = Sana_1600M_1024px).

    ``guidance_embeds_scale`` is kept for the config round trip (diffusers' forward pass does not use it either);
    ``timestep_scale`` is not used by the forward pass but by the sampler, which multiplies the model's timestep
    (1000 sigma) by it as diffusers' ``SanaPipeline`` does (:func:`models.sampling.make_sampler`).
    """

    diffusers_class: ClassVar[str] = CLASS_NAME
    ignored_keys: ClassVar[Mapping[str, Any]] = {"dropout": 0.0}

    in_channels: int = 32
    out_channels: int | None = 32
    num_attention_heads: int = 70
    attention_head_dim: int = 32
    num_layers: int = 20
    num_cross_attention_heads: int | None = 20
    cross_attention_head_dim: int | None = 112
    cross_attention_dim: int | None = 2240
    caption_channels: int = 2304
    mlp_ratio: float = 2.5
    attention_bias: bool = False
    sample_size: int = 32
    patch_size: int = 1
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    interpolation_scale: float | None = None
    guidance_embeds: bool = False
    guidance_embeds_scale: float = 0.1
    qk_norm: str | None = None
    #: JAX-side (not in config.json): ``models.layers.ATTENTION_IMPLEMENTATIONS`` (the cross-attention; the
    #: self-attention is SANA's linear attention).
    attention_impl: str = convert.jax_side_field("xla")
    timestep_scale: float = 1.0

    def __post_init__(self):
        check_attention_impl(self.attention_impl, "SanaConfig")
        if self.cross_attention_dim is None:
            raise NotImplementedError("SanaConfig: cross_attention_dim=None is not supported (diffusers' block "
                                      "then has no norm2 and cannot run either)")
        if self.qk_norm not in (None, "rms_norm_across_heads"):
            raise NotImplementedError(f"SanaConfig: {self.qk_norm=} is not ported")



#: Efficient-Large-Model/Sana_1600M_1024px_diffusers, transformer/config.json.
SANA_1600M_1024PX = SanaConfig(
    in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
    num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304,
    mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1, norm_elementwise_affine=False, norm_eps=1e-6,
    interpolation_scale=None)


class LinearAttention(Attention):
    """diffusers Attention with SanaLinearAttnProcessor2_0: ReLU feature maps, ``out = relu(q) (relu(k)^T v) /
    (relu(q) sum relu(k) + 1e-15)`` in fp32, per head."""

    def __call__(self, x: jax.Array, context: jax.Array | None = None, bias: jax.Array | None = None,
                 hooks: LinearHooks | None = None) -> jax.Array:
        """x (b, n, dim) -> (b, n, dim) (``bias`` is ignored, as in diffusers)."""
        q, k, v = self.project_qkv(x, x, hooks)  # (b, n, h, dh) each
        q = jax.nn.relu(q).astype(jnp.float32)  # (b, n, h, dh)
        k = jax.nn.relu(k).astype(jnp.float32)  # (b, n, h, dh)
        kv = jnp.einsum("bnhd,bnhe->bhde", k, v.astype(jnp.float32))  # (b, h, dh, dh)
        numerator = jnp.einsum("bnhd,bhde->bnhe", q, kv)  # (b, n, h, dh)
        denominator = jnp.einsum("bnhd,bhd->bnh", q, k.sum(axis=1))  # (b, n, h)
        out = numerator / (denominator[..., None] + 1e-15)  # (b, n, h, dh)
        out = out.reshape(out.shape[:2] + (-1,)).astype(x.dtype)  # (b, n, inner)
        out = self.to_out[0](out, hooks)  # (b, n, dim)
        if out.dtype == jnp.float16:
            out = jnp.clip(out, -65504, 65504)
        return out


class GLUMBConv(nnx.Module):
    """diffusers GLUMBConv (norm_type None, no residual) on channels-last tokens of a (gh, gw) grid."""

    def __init__(self, dim: int, mlp_ratio: float, *, dtype: Any, rngs: nnx.Rngs):
        hidden = int(mlp_ratio * dim)
        self.hidden = hidden
        self.conv_inverted = Linear(dim, 2 * hidden, quantizable=True, dtype=dtype, rngs=rngs)
        self.conv_depth = ConvWeights(3, 3, 1, 2 * hidden, bias=True, dtype=dtype, rngs=rngs)
        self.conv_point = Linear(hidden, dim, bias=False, quantizable=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, grid_h: int, grid_w: int, hooks: LinearHooks | None) -> jax.Array:
        """x (b, gh*gw, dim) -> (b, gh*gw, dim)."""
        b = x.shape[0]
        h = jax.nn.silu(self.conv_inverted(x, hooks))  # (b, n, 2 hidden)
        h = h.reshape(b, grid_h, grid_w, 2 * self.hidden)  # (b, gh, gw, 2 hidden)
        kernel = self.conv_depth.kernel[...]
        h = jax.lax.conv_general_dilated(h.astype(kernel.dtype), kernel, window_strides=(1, 1),
                                         padding=((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         feature_group_count=2 * self.hidden)  # (b, gh, gw, 2 hidden)
        h = h + self.conv_depth.bias[...]  # (b, gh, gw, 2 hidden)
        h, gate = jnp.split(h.reshape(b, grid_h * grid_w, 2 * self.hidden), 2, axis=-1)  # (b, n, hidden) x2
        return self.conv_point(h * jax.nn.silu(gate), hooks)  # (b, n, dim)


class SanaBlock(nnx.Module):
    """diffusers SanaTransformerBlock."""

    def __init__(self, cfg: SanaConfig, *, dtype: Any, rngs: nnx.Rngs):
        dim = cfg.inner_dim
        self.norm1 = LayerNorm(dim, cfg.norm_eps, False, dtype=dtype)
        self.attn1 = LinearAttention(dim, cfg.num_attention_heads, cfg.attention_head_dim, bias=cfg.attention_bias,
                                     qk_norm=cfg.qk_norm, dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(dim, cfg.norm_eps, cfg.norm_elementwise_affine, dtype=dtype)
        self.attn2 = Attention(dim, cfg.num_cross_attention_heads, cfg.cross_attention_head_dim,
                               cfg.cross_attention_dim, bias=True, qk_norm=cfg.qk_norm,
                               attention_impl=cfg.attention_impl, dtype=dtype, rngs=rngs)
        self.ff = GLUMBConv(dim, cfg.mlp_ratio, dtype=dtype, rngs=rngs)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (6, dim), dtype) / dim ** 0.5)

    def __call__(self, x: jax.Array, context: jax.Array, context_bias: jax.Array | None, timestep6: jax.Array,
                 grid_h: int, grid_w: int, hooks: LinearHooks | None, context_mask: jax.Array | None = None
                 ) -> jax.Array:
        """x (b, n, dim), context (b, t, dim), context_bias (b, 1, 1, t), timestep6 (b, 6 dim), context_mask (b, t)
        -> (b, n, dim)."""
        b, _, dim = x.shape
        mod = self.scale_shift_table[...][None] + timestep6.reshape(b, 6, dim)  # (b, 6, dim)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(mod, 6, axis=1)  # (b, 1, dim)
        h = (self.norm1(x) * (1 + scale_msa) + shift_msa).astype(x.dtype)  # (b, n, dim)
        x = x + gate_msa * self.attn1(h, hooks=hooks)  # (b, n, dim)
        x = x + self.attn2(x, context, context_bias, hooks=hooks, context_mask=context_mask)  # (b, n, dim)
        h = self.norm2(x) * (1 + scale_mlp) + shift_mlp  # (b, n, dim)
        return x + gate_mlp * self.ff(h, grid_h, grid_w, hooks)  # (b, n, dim)


class TimestepGuidanceEmbedding(nnx.Module):
    """diffusers SanaCombinedTimestepGuidanceEmbeddings: ``(linear(silu(e)) (b, 6 dim), e (b, dim))``."""

    def __init__(self, dim: int, *, dtype: Any, rngs: nnx.Rngs):
        self.timestep_embedder = TimestepEmbedding(256, dim, dtype=dtype, rngs=rngs)
        self.guidance_embedder = TimestepEmbedding(256, dim, dtype=dtype, rngs=rngs)
        self.linear = Linear(dim, 6 * dim, dtype=dtype, rngs=rngs)

    def __call__(self, timestep: jax.Array, guidance: jax.Array, dtype: Any, hooks: LinearHooks | None):
        emb = self.timestep_embedder(timestep_embedding(timestep).astype(dtype), hooks)  # (b, dim)
        emb = emb + self.guidance_embedder(timestep_embedding(guidance).astype(dtype), hooks)  # (b, dim)
        return self.linear(jax.nn.silu(emb), hooks), emb  # (b, 6 dim), (b, dim)


class SanaTransformer2DModel(nnx.Module):
    """SANA denoiser: latents (b, in_channels, H, W) -> velocity (b, out_channels, H, W)."""

    def __init__(self, cfg: SanaConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        dim = cfg.inner_dim
        self.patch_embed = PatchEmbed(cfg.sample_size, cfg.patch_size, cfg.in_channels, dim,
                                      cfg.interpolation_scale, dtype=dtype, rngs=rngs)
        self.time_embed = TimestepGuidanceEmbedding(dim, dtype=dtype, rngs=rngs) if cfg.guidance_embeds \
            else AdaLayerNormSingle(dim, False, dtype=dtype, rngs=rngs)
        self.caption_projection = TextProjection(cfg.caption_channels, dim, dtype=dtype, rngs=rngs)
        self.caption_norm = RMSNorm(dim, 1e-5, dtype=dtype)
        self.transformer_blocks = nnx.List([SanaBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (2, dim), dtype) / dim ** 0.5)
        self.proj_out = Linear(dim, cfg.patch_size ** 2 * cfg.resolved_out_channels, dtype=dtype, rngs=rngs)
        name_linears(self)

    def fused_sites(self) -> tuple[dict, dict, dict[str, tuple[str, ...]]]:
        """The sites where :class:`models.layers.FusedLinearHooks` may replace linears
        (:func:`models.layers.block_attention_sites`: ``attn1`` q | k | v, ``attn2`` k | v of every block)."""
        return block_attention_sites(self.transformer_blocks)

    def caption_context(self, encoder_hidden_states: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        """The context every block's cross-attention reads: ``caption_norm(caption_projection(e))`` of
        encoder_hidden_states (b, t, caption_channels) -> (b, t, dim).

        Token by token (row ``[i, k]`` depends on ``encoder_hidden_states[i, k]`` alone: an MLP and an RMSNorm over the
        features) and independent of the image and the timestep: the input of every ``attn2.to_k`` / ``attn2.to_v``
        (``models.families.TextOnlyInputs``; their q/k norm comes after the projection).
        """
        context = self.caption_projection(encoder_hidden_states.astype(self.proj_out.kernel.dtype), hooks)  # (b, t, d)
        return self.caption_norm(context)  # (b, t, dim)

    def __call__(self, hidden_states: jax.Array, encoder_hidden_states: jax.Array, timestep: jax.Array,
                 encoder_attention_mask: jax.Array | None = None, guidance: jax.Array | None = None,
                 hooks: LinearHooks | None = None) -> jax.Array:
        """hidden_states (b, c, H, W), encoder_hidden_states (b, t, caption_channels), timestep (b,) in [0, 1000],
        encoder_attention_mask (b, t) 1 = keep, guidance (b,) (guidance_embeds models) -> (b, out, H, W)."""
        check_fused_sites(hooks, *self.fused_sites())
        cfg = self.cfg
        b, _, height, width = hidden_states.shape
        p = cfg.patch_size
        dtype = self.proj_out.kernel.dtype
        timestep = jnp.broadcast_to(jnp.asarray(timestep), (b,))  # (b,)
        x = self.patch_embed(hidden_states.astype(dtype))  # (b, n, dim)
        if cfg.guidance_embeds:
            if guidance is None:
                raise ValueError("this SANA model has guidance embeddings: pass guidance (b,)")
            timestep6, embedded = self.time_embed(timestep, jnp.broadcast_to(guidance, (b,)), dtype, hooks)
        else:
            timestep6, embedded = self.time_embed(timestep, None, None, dtype, hooks)  # (b, 6 dim), (b, dim)
        context = self.caption_context(encoder_hidden_states,
                                       with_token_mask(hooks, encoder_attention_mask))  # (b, t, dim)
        context_bias = mask_to_bias(encoder_attention_mask)  # (b, 1, 1, t) or None
        for block in self.transformer_blocks:
            x = block(x, context, context_bias, timestep6, height // p, width // p, hooks,
                      encoder_attention_mask)  # (b, n, dim)
        shift, scale = jnp.split(self.scale_shift_table[...][None] + embedded[:, None], 2, axis=1)  # (b, 1, dim)
        x = layer_norm(x, 1e-6) * (1 + scale) + shift  # (b, n, dim)
        x = self.proj_out(x, hooks)  # (b, n, p p out)
        return unpatchify(x, height, width, p, cfg.resolved_out_channels)  # (b, out, H, W)


def _block_rules() -> list:
    prefix = "transformer_blocks.{i}"
    rules = param_rules(f"{prefix}.scale_shift_table", f"{prefix}.norm2.weight", f"{prefix}.norm2.bias")
    for attn in ("attn1", "attn2"):
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            rules += linear_rules(f"{prefix}.{attn}.{proj}")
        rules += param_rules(f"{prefix}.{attn}.norm_q.weight", f"{prefix}.{attn}.norm_k.weight")
    rules += linear_rules(f"{prefix}.ff.conv_inverted", transform="conv1x1")
    rules += linear_rules(f"{prefix}.ff.conv_point", bias=False, transform="conv1x1")
    rules += [rule(f"{prefix}.ff.conv_depth.weight", f"{prefix}.ff.conv_depth.kernel", "conv"),
              rule(f"{prefix}.ff.conv_depth.bias", f"{prefix}.ff.conv_depth.bias")]
    return rules


#: diffusers key -> NNX path table of SanaTransformer2DModel.
KEY_TABLE = convert.KeyTable([
    rule("patch_embed.proj.weight", "patch_embed.proj.kernel", "conv"),
    rule("patch_embed.proj.bias", "patch_embed.proj.bias"),
    rule("patch_embed.pos_embed", None),
    *[r for name in ("time_embed.emb.timestep_embedder", "time_embed.timestep_embedder",
                     "time_embed.guidance_embedder")
      for layer in ("linear_1", "linear_2") for r in linear_rules(f"{name}.{layer}")],
    *linear_rules("time_embed.linear"),
    *linear_rules("caption_projection.linear_1"),
    *linear_rules("caption_projection.linear_2"),
    *param_rules("caption_norm.weight", "scale_shift_table"),
    *_block_rules(),
    *linear_rules("proj_out"),
], name="SanaTransformer2DModel")

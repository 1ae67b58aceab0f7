"""FLUX.1: a Flax NNX port of diffusers' ``FluxTransformer2DModel``.

Structure (module names = diffusers keys): ``x_embedder`` / ``context_embedder`` (linears), ``time_text_embed``
(timestep [+ guidance] embedding + pooled-text projection), 3-axis RoPE (no parameters),
``transformer_blocks.{i}`` (double stream: ``norm1`` / ``norm1_context`` AdaLayerNormZero, joint ``attn`` with
``to_q/k/v`` + ``add_q/k/v_proj``, per-head ``norm_q/k`` + ``norm_added_q/k`` RMSNorms, ``to_out.0`` /
``to_add_out``, GELU-tanh ``ff`` / ``ff_context``), ``single_transformer_blocks.{i}`` (single stream:
AdaLayerNormZeroSingle ``norm``, parallel ``attn`` (q, k, v only) and ``proj_mlp``, fused ``proj_out``),
``norm_out`` (AdaLayerNormContinuous), ``proj_out``.

Quantizable linears: every Linear in the two kinds of blocks except the AdaLN modulation linears
(``norm1.linear``, ``norm1_context.linear``, ``norm.linear``: norms stay 16-bit, as the paper keeps them).

Inputs are packed latents (see :func:`pack_latents`): (b, (H/2)(W/2), 4c) tokens, with position ids from
:func:`image_ids`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import convert
from models.convert import linear_rules, param_rules
from models.layers import (FeedForward, Linear, LinearHooks, RMSNorm, TextProjection, TimestepEmbedding,
                           apply_rope, check_attention_impl, dot_product_attention, layer_norm, name_linears,
                           rope_frequencies, timestep_embedding)

__all__ = ["FLUX1_SCHNELL", "FluxConfig", "FluxTransformer2DModel", "KEY_TABLE", "image_ids",
           "pack_latents", "unpack_latents"]

CLASS_NAME = "FluxTransformer2DModel"


@dataclasses.dataclass(frozen=True)
class FluxConfig(convert.DiTConfig):
    """The fields of diffusers' FluxTransformer2DModel config.json (defaults = FLUX.1-schnell)."""

    diffusers_class: ClassVar[str] = CLASS_NAME

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    #: JAX-side (not in config.json): ``models.layers.ATTENTION_IMPLEMENTATIONS``.
    attention_impl: str = convert.jax_side_field("xla")

    def __post_init__(self):
        check_attention_impl(self.attention_impl, "FluxConfig")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"FluxConfig: sum({self.axes_dims_rope=}) must equal {self.attention_head_dim=}")



#: black-forest-labs/FLUX.1-schnell, transformer/config.json.
FLUX1_SCHNELL = FluxConfig(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                           attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                           pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=(16, 56, 56))


class AdaLNModulation(nnx.Module):
    """The ``linear`` of diffusers' AdaLayerNormZero (n=6) / ZeroSingle (n=3) / Continuous (n=2): silu(temb) ->
    n chunks of (b, dim)."""

    def __init__(self, dim: int, chunks: int, *, dtype: Any, rngs: nnx.Rngs):
        self.chunks = chunks
        self.linear = Linear(dim, chunks * dim, dtype=dtype, rngs=rngs)

    def __call__(self, temb: jax.Array, hooks: LinearHooks | None) -> list[jax.Array]:
        return jnp.split(self.linear(jax.nn.silu(temb), hooks), self.chunks, axis=-1)  # n x (b, dim)


class FluxAttention(nnx.Module):
    """diffusers FluxAttention (+ FluxAttnProcessor): per-head RMSNorm on q/k, RoPE, optional context stream."""

    def __init__(self, dim: int, heads: int, head_dim: int, context: bool, pre_only: bool, *, dtype: Any,
                 rngs: nnx.Rngs, attention_impl: str = "xla"):
        inner = heads * head_dim
        self.heads = heads
        self.head_dim = head_dim
        self.attention_impl = attention_impl
        self.norm_q = RMSNorm(head_dim, 1e-6, dtype=dtype)
        self.norm_k = RMSNorm(head_dim, 1e-6, dtype=dtype)
        self.to_q = Linear(dim, inner, quantizable=True, dtype=dtype, rngs=rngs)
        self.to_k = Linear(dim, inner, quantizable=True, dtype=dtype, rngs=rngs)
        self.to_v = Linear(dim, inner, quantizable=True, dtype=dtype, rngs=rngs)
        self.to_out = None if pre_only else nnx.List([Linear(inner, dim, quantizable=True, dtype=dtype, rngs=rngs)])
        if context:
            self.norm_added_q = RMSNorm(head_dim, 1e-6, dtype=dtype)
            self.norm_added_k = RMSNorm(head_dim, 1e-6, dtype=dtype)
            self.add_q_proj = Linear(dim, inner, quantizable=True, dtype=dtype, rngs=rngs)
            self.add_k_proj = Linear(dim, inner, quantizable=True, dtype=dtype, rngs=rngs)
            self.add_v_proj = Linear(dim, inner, quantizable=True, dtype=dtype, rngs=rngs)
            self.to_add_out = Linear(inner, dim, quantizable=True, dtype=dtype, rngs=rngs)
        else:
            self.norm_added_q = self.norm_added_k = self.add_q_proj = self.add_k_proj = None
            self.add_v_proj = self.to_add_out = None

    def _heads(self, x: jax.Array) -> jax.Array:
        return x.reshape(x.shape[:2] + (self.heads, self.head_dim))  # (b, s, h, dh)

    def __call__(self, x: jax.Array, context: jax.Array | None, rope: tuple[jax.Array, jax.Array],
                 hooks: LinearHooks | None):
        """x (b, n, dim), context (b, t, dim) or None, rope cos/sin ((t +) n, dh) ->
        (out (b, n, ·), context_out (b, t, dim) or None)."""
        q = self.norm_q(self._heads(self.to_q(x, hooks)))  # (b, n, h, dh)
        k = self.norm_k(self._heads(self.to_k(x, hooks)))  # (b, n, h, dh)
        v = self._heads(self.to_v(x, hooks))  # (b, n, h, dh)
        if context is not None:
            cq = self.norm_added_q(self._heads(self.add_q_proj(context, hooks)))  # (b, t, h, dh)
            ck = self.norm_added_k(self._heads(self.add_k_proj(context, hooks)))  # (b, t, h, dh)
            cv = self._heads(self.add_v_proj(context, hooks))  # (b, t, h, dh)
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((cq, q), (ck, k), (cv, v)))  # (b, t+n, h, dh)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (b, s, h, dh)
        out = dot_product_attention(q, k, v, implementation=self.attention_impl)  # (b, s, h, dh)
        out = out.reshape(out.shape[:2] + (-1,))  # (b, s, inner)
        if context is None:
            return out, None
        t = context.shape[1]
        return self.to_out[0](out[:, t:], hooks), self.to_add_out(out[:, :t], hooks)  # (b, n, dim), (b, t, dim)


class FluxTransformerBlock(nnx.Module):
    """diffusers FluxTransformerBlock (double stream)."""

    def __init__(self, cfg: FluxConfig, *, dtype: Any, rngs: nnx.Rngs):
        dim = cfg.inner_dim
        self.norm1 = AdaLNModulation(dim, 6, dtype=dtype, rngs=rngs)
        self.norm1_context = AdaLNModulation(dim, 6, dtype=dtype, rngs=rngs)
        self.attn = FluxAttention(dim, cfg.num_attention_heads, cfg.attention_head_dim, True, False, dtype=dtype,
                                  rngs=rngs, attention_impl=cfg.attention_impl)
        self.ff = FeedForward(dim, 4 * dim, dtype=dtype, rngs=rngs)
        self.ff_context = FeedForward(dim, 4 * dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, context: jax.Array, temb: jax.Array, rope, hooks: LinearHooks | None):
        """x (b, n, dim), context (b, t, dim), temb (b, dim) -> (context (b, t, dim), x (b, n, dim))."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            m[:, None] for m in self.norm1(temb, hooks))  # (b, 1, dim)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
            m[:, None] for m in self.norm1_context(temb, hooks))  # (b, 1, dim)
        h = layer_norm(x, 1e-6) * (1 + scale_msa) + shift_msa  # (b, n, dim)
        c = layer_norm(context, 1e-6) * (1 + c_scale_msa) + c_shift_msa  # (b, t, dim)
        attn, context_attn = self.attn(h, c, rope, hooks)  # (b, n, dim), (b, t, dim)
        x = x + gate_msa * attn  # (b, n, dim)
        h = layer_norm(x, 1e-6) * (1 + scale_mlp) + shift_mlp  # (b, n, dim)
        x = x + gate_mlp * self.ff(h, hooks)  # (b, n, dim)
        context = context + c_gate_msa * context_attn  # (b, t, dim)
        c = layer_norm(context, 1e-6) * (1 + c_scale_mlp) + c_shift_mlp  # (b, t, dim)
        context = context + c_gate_mlp * self.ff_context(c, hooks)  # (b, t, dim)
        if context.dtype == jnp.float16:
            context = jnp.clip(context, -65504, 65504)
        return context, x


class FluxSingleTransformerBlock(nnx.Module):
    """diffusers FluxSingleTransformerBlock (single stream over [text; image] tokens)."""

    def __init__(self, cfg: FluxConfig, *, dtype: Any, rngs: nnx.Rngs):
        dim = cfg.inner_dim
        mlp = 4 * dim
        self.norm = AdaLNModulation(dim, 3, dtype=dtype, rngs=rngs)
        self.proj_mlp = Linear(dim, mlp, quantizable=True, dtype=dtype, rngs=rngs)
        self.proj_out = Linear(dim + mlp, dim, quantizable=True, dtype=dtype, rngs=rngs)
        self.attn = FluxAttention(dim, cfg.num_attention_heads, cfg.attention_head_dim, False, True, dtype=dtype,
                                  rngs=rngs, attention_impl=cfg.attention_impl)

    def __call__(self, x: jax.Array, temb: jax.Array, rope, hooks: LinearHooks | None) -> jax.Array:
        """x (b, t+n, dim), temb (b, dim) -> (b, t+n, dim)."""
        shift, scale, gate = (m[:, None] for m in self.norm(temb, hooks))  # (b, 1, dim)
        h = layer_norm(x, 1e-6) * (1 + scale) + shift  # (b, s, dim)
        mlp = jax.nn.gelu(self.proj_mlp(h, hooks), approximate=True)  # (b, s, 4 dim)
        attn, _ = self.attn(h, None, rope, hooks)  # (b, s, dim)
        x = x + gate * self.proj_out(jnp.concatenate([attn, mlp], axis=-1), hooks)  # (b, s, dim)
        if x.dtype == jnp.float16:
            x = jnp.clip(x, -65504, 65504)
        return x


class TimeTextEmbedding(nnx.Module):
    """diffusers CombinedTimestep[Guidance]TextProjEmbeddings: timestep (+ guidance) + pooled text -> (b, dim)."""

    def __init__(self, dim: int, pooled_dim: int, guidance: bool, *, dtype: Any, rngs: nnx.Rngs):
        self.timestep_embedder = TimestepEmbedding(256, dim, dtype=dtype, rngs=rngs)
        self.guidance_embedder = TimestepEmbedding(256, dim, dtype=dtype, rngs=rngs) if guidance else None
        self.text_embedder = TextProjection(pooled_dim, dim, act="silu", dtype=dtype, rngs=rngs)

    def __call__(self, timestep: jax.Array, guidance: jax.Array | None, pooled: jax.Array,
                 hooks: LinearHooks | None) -> jax.Array:
        dtype = pooled.dtype
        emb = self.timestep_embedder(timestep_embedding(timestep).astype(dtype), hooks)  # (b, dim)
        if self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(timestep_embedding(guidance).astype(dtype), hooks)  # (b, dim)
        return emb + self.text_embedder(pooled, hooks)  # (b, dim)


class FluxTransformer2DModel(nnx.Module):
    """FLUX.1 denoiser on packed latent tokens: (b, n, in_channels) -> velocity (b, n, p p out_channels)."""

    def __init__(self, cfg: FluxConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        dim = cfg.inner_dim
        self.time_text_embed = TimeTextEmbedding(dim, cfg.pooled_projection_dim, cfg.guidance_embeds, dtype=dtype,
                                                 rngs=rngs)
        self.context_embedder = Linear(cfg.joint_attention_dim, dim, dtype=dtype, rngs=rngs)
        self.x_embedder = Linear(cfg.in_channels, dim, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nnx.List([FluxTransformerBlock(cfg, dtype=dtype, rngs=rngs)
                                            for _ in range(cfg.num_layers)])
        self.single_transformer_blocks = nnx.List([FluxSingleTransformerBlock(cfg, dtype=dtype, rngs=rngs)
                                                   for _ in range(cfg.num_single_layers)])
        self.norm_out = AdaLNModulation(dim, 2, dtype=dtype, rngs=rngs)
        self.proj_out = Linear(dim, cfg.patch_size ** 2 * cfg.resolved_out_channels, dtype=dtype, rngs=rngs)
        name_linears(self)

    def __call__(self, hidden_states: jax.Array, encoder_hidden_states: jax.Array, pooled_projections: jax.Array,
                 timestep: jax.Array, img_ids: jax.Array, txt_ids: jax.Array, guidance: jax.Array | None = None,
                 hooks: LinearHooks | None = None) -> jax.Array:
        """hidden_states (b, n, in_channels), encoder_hidden_states (b, t, joint_attention_dim), pooled_projections
        (b, pooled_projection_dim), timestep (b,) in [0, 1] (sigma), img_ids (n, 3), txt_ids (t, 3), guidance (b,)
        (guidance-distilled models) -> (b, n, p p out_channels)."""
        cfg = self.cfg
        b = hidden_states.shape[0]
        dtype = self.proj_out.kernel.dtype
        if img_ids.ndim != 2 or txt_ids.ndim != 2:
            raise ValueError(f"img_ids {img_ids.shape} and txt_ids {txt_ids.shape} must be 2-D (tokens, 3)")
        if cfg.guidance_embeds and guidance is None:
            raise ValueError("this FLUX model has guidance embeddings (FLUX.1-dev): pass guidance (b,)")
        x = self.x_embedder(hidden_states.astype(dtype), hooks)  # (b, n, dim)
        timestep = jnp.broadcast_to(jnp.asarray(timestep, dtype), (b,)) * 1000  # (b,)
        if guidance is not None:
            guidance = jnp.broadcast_to(jnp.asarray(guidance, dtype), (b,)) * 1000  # (b,)
        temb = self.time_text_embed(timestep, guidance, pooled_projections.astype(dtype), hooks)  # (b, dim)
        context = self.context_embedder(encoder_hidden_states.astype(dtype), hooks)  # (b, t, dim)
        rope = rope_frequencies(jnp.concatenate([txt_ids, img_ids], axis=0), cfg.axes_dims_rope)  # 2 x (t+n, dh)
        for block in self.transformer_blocks:
            context, x = block(x, context, temb, rope, hooks)  # (b, t, dim), (b, n, dim)
        t = context.shape[1]
        joint = jnp.concatenate([context, x], axis=1)  # (b, t+n, dim)
        for block in self.single_transformer_blocks:
            joint = block(joint, temb, rope, hooks)  # (b, t+n, dim)
        x = joint[:, t:]  # (b, n, dim)
        scale, shift = (m[:, None] for m in self.norm_out(temb, hooks))  # (b, 1, dim)
        x = layer_norm(x, 1e-6) * (1 + scale) + shift  # (b, n, dim)
        return self.proj_out(x, hooks)  # (b, n, p p out)


def pack_latents(latents: jax.Array) -> jax.Array:
    """diffusers FluxPipeline._pack_latents: (b, c, H, W) -> (b, (H/2)(W/2), 4c)."""
    b, c, height, width = latents.shape
    if height % 2 or width % 2:
        raise ValueError(f"FLUX latents need even H and W, got {latents.shape}")
    x = latents.reshape(b, c, height // 2, 2, width // 2, 2)  # (b, c, h, 2, w, 2)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (height // 2) * (width // 2), c * 4)  # (b, h w, 4c)


def unpack_latents(tokens: jax.Array, height: int, width: int) -> jax.Array:
    """Inverse of :func:`pack_latents`: (b, (H/2)(W/2), 4c) -> (b, c, H, W)."""
    b, _, c4 = tokens.shape
    x = tokens.reshape(b, height // 2, width // 2, c4 // 4, 2, 2)  # (b, h, w, c, 2, 2)
    return x.transpose(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, height, width)  # (b, c, H, W)


def image_ids(height: int, width: int) -> np.ndarray:
    """FluxPipeline._prepare_latent_image_ids for latents of (H, W): ((H/2)(W/2), 3) = [0, row, col] float32."""
    ids = np.zeros((height // 2, width // 2, 3), np.float32)
    ids[..., 1] = np.arange(height // 2)[:, None]
    ids[..., 2] = np.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)


def _rules() -> list:
    double = "transformer_blocks.{i}"
    single = "single_transformer_blocks.{i}"
    rules = []
    for name in ("norm1.linear", "norm1_context.linear", "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                 "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj",
                 "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"):
        rules += linear_rules(f"{double}.{name}")
    rules += param_rules(*(f"{double}.attn.{n}.weight" for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")))
    for name in ("norm.linear", "proj_mlp", "proj_out", "attn.to_q", "attn.to_k", "attn.to_v"):
        rules += linear_rules(f"{single}.{name}")
    rules += param_rules(f"{single}.attn.norm_q.weight", f"{single}.attn.norm_k.weight")
    for name in ("timestep_embedder", "guidance_embedder", "text_embedder"):
        for layer in ("linear_1", "linear_2"):
            rules += linear_rules(f"time_text_embed.{name}.{layer}")
    for name in ("context_embedder", "x_embedder", "norm_out.linear", "proj_out"):
        rules += linear_rules(name)
    return rules


#: diffusers key -> NNX path table of FluxTransformer2DModel.
KEY_TABLE = convert.KeyTable(_rules(), name="FluxTransformer2DModel")

"""PixArt-Σ / PixArt-α: a Flax NNX port of diffusers' ``PixArtTransformer2DModel`` (norm_type ``ada_norm_single``).

Structure (module names = diffusers keys): ``pos_embed`` (patch conv + 2-D sincos positions), ``adaln_single``
(timestep [+ resolution/aspect-ratio] embedding -> 6*dim modulation), ``caption_projection`` (caption_channels ->
dim), ``transformer_blocks.{i}`` (``norm1`` -> ``attn1`` self-attention, ``attn2`` cross-attention on the raw
residual, ``norm2`` -> ``ff`` GELU-tanh MLP; AdaLN-single shift/scale/gate from ``scale_shift_table``), ``norm_out``,
``scale_shift_table``, ``proj_out``.

Quantizable linears (W4A4 in the paper): every Linear inside ``transformer_blocks`` (attn1/attn2 q, k, v, out and
ff.net.0.proj, ff.net.2). Embeddings, caption projection, adaln_single and proj_out stay 16-bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models import convert
from models.convert import linear_rules, param_rules, rule
from models.layers import (Attention, FeedForward, LayerNorm, Linear, LinearHooks, PatchEmbed, TextProjection,
                           TimestepEmbedding, block_attention_sites, check_attention_impl, check_fused_sites,
                           layer_norm, mask_to_bias, name_linears, run_blocks_scanned, timestep_embedding, unpatchify,
                           with_token_mask)

__all__ = ["PIXART_SIGMA_XL_2_1024_MS", "PixArtConfig", "PixArtTransformer2DModel", "KEY_TABLE", "from_diffusers",
           "to_diffusers"]

CLASS_NAME = "PixArtTransformer2DModel"


@dataclasses.dataclass(frozen=True)
class PixArtConfig(convert.DiTConfig):
    """The fields of diffusers' PixArtTransformer2DModel config.json that change the computation.

    ``interpolation_scale=None`` means ``max(sample_size // 64, 1)``; ``use_additional_conditions=None`` means
    ``sample_size == 128`` (diffusers' rules, resolved by :attr:`resolved_interpolation_scale` and
    :attr:`uses_additional_conditions`).
    """

    diffusers_class: ClassVar[str] = CLASS_NAME
    ignored_keys: ClassVar[Mapping[str, Any]] = {
        "dropout": 0.0, "norm_num_groups": None, "upcast_attention": None, "use_linear_projection": False,
        "num_vector_embeds": None, "double_self_attention": False, "only_cross_attention": False}

    num_attention_heads: int = 16
    attention_head_dim: int = 72
    in_channels: int = 4
    out_channels: int | None = 8
    num_layers: int = 28
    cross_attention_dim: int | None = 1152
    attention_bias: bool = True
    sample_size: int = 128
    patch_size: int = 2
    activation_fn: str = "gelu-approximate"
    num_embeds_ada_norm: int | None = 1000
    norm_type: str = "ada_norm_single"
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    interpolation_scale: float | None = None
    use_additional_conditions: bool | None = None
    caption_channels: int | None = None
    attention_type: str = "default"
    #: JAX-side (not in config.json): ``models.layers.ATTENTION_IMPLEMENTATIONS``.
    attention_impl: str = convert.jax_side_field("xla")

    def __post_init__(self):
        check_attention_impl(self.attention_impl, "PixArtConfig")
        if self.norm_type != "ada_norm_single":
            raise NotImplementedError(f"PixArtConfig: {self.norm_type=} is not ported (only 'ada_norm_single')")
        if self.activation_fn not in ("gelu-approximate", "gelu"):
            raise NotImplementedError(f"PixArtConfig: {self.activation_fn=} is not ported")
        if self.attention_type != "default":
            raise NotImplementedError(f"PixArtConfig: {self.attention_type=} is not ported")
        if self.uses_additional_conditions and self.inner_dim % 3:
            raise ValueError(f"PixArtConfig: additional conditions need inner_dim={self.inner_dim} divisible by 3")
        if self.caption_channels is not None and self.cross_attention_dim not in (None, self.inner_dim):
            raise ValueError(f"PixArtConfig: with a caption projection, {self.cross_attention_dim=} must equal "
                             f"inner_dim={self.inner_dim}")

    @property
    def resolved_interpolation_scale(self) -> float:
        return self.interpolation_scale if self.interpolation_scale is not None else max(self.sample_size // 64, 1)

    @property
    def uses_additional_conditions(self) -> bool:
        if self.use_additional_conditions is None:
            return self.sample_size == 128
        return self.use_additional_conditions



#: PixArt-alpha/PixArt-Sigma-XL-2-1024-MS, transformer/config.json.
PIXART_SIGMA_XL_2_1024_MS = PixArtConfig(
    num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
    cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2, activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
    interpolation_scale=2, use_additional_conditions=False, caption_channels=4096, attention_type="default")


class CombinedTimestepSizeEmbeddings(nnx.Module):
    """diffusers PixArtAlphaCombinedTimestepSizeEmbeddings: timestep (+ resolution, aspect ratio) -> (b, dim)."""

    def __init__(self, dim: int, additional_conditions: bool, *, dtype: Any, rngs: nnx.Rngs):
        self.additional_conditions = additional_conditions
        self.timestep_embedder = TimestepEmbedding(256, dim, dtype=dtype, rngs=rngs)
        if additional_conditions:
            self.resolution_embedder = TimestepEmbedding(256, dim // 3, dtype=dtype, rngs=rngs)
            self.aspect_ratio_embedder = TimestepEmbedding(256, dim // 3, dtype=dtype, rngs=rngs)
        else:
            self.resolution_embedder = self.aspect_ratio_embedder = None

    def __call__(self, timestep: jax.Array, resolution: jax.Array | None, aspect_ratio: jax.Array | None,
                 dtype: Any, hooks: LinearHooks | None) -> jax.Array:
        b = timestep.shape[0]
        emb = self.timestep_embedder(timestep_embedding(timestep).astype(dtype), hooks)  # (b, dim)
        if not self.additional_conditions:
            return emb
        if resolution is None or aspect_ratio is None:
            raise ValueError("PixArt with use_additional_conditions needs resolution (b, 2) and aspect_ratio (b, 1)")
        res = timestep_embedding(resolution.reshape(-1)).astype(dtype)  # (b 2, 256)
        res = self.resolution_embedder(res, hooks).reshape(b, -1)  # (b, 2 dim/3)
        ar = timestep_embedding(aspect_ratio.reshape(-1)).astype(dtype)  # (b, 256)
        ar = self.aspect_ratio_embedder(ar, hooks).reshape(b, -1)  # (b, dim/3)
        return emb + jnp.concatenate([res, ar], axis=1)  # (b, dim)


class AdaLayerNormSingle(nnx.Module):
    """diffusers AdaLayerNormSingle: ``(linear(silu(emb)) (b, 6 dim), emb (b, dim))``."""

    def __init__(self, dim: int, additional_conditions: bool, *, dtype: Any, rngs: nnx.Rngs):
        self.emb = CombinedTimestepSizeEmbeddings(dim, additional_conditions, dtype=dtype, rngs=rngs)
        self.linear = Linear(dim, 6 * dim, dtype=dtype, rngs=rngs)

    def __call__(self, timestep, resolution, aspect_ratio, dtype, hooks):
        embedded = self.emb(timestep, resolution, aspect_ratio, dtype, hooks)  # (b, dim)
        return self.linear(jax.nn.silu(embedded), hooks), embedded  # (b, 6 dim), (b, dim)


class PixArtBlock(nnx.Module):
    """diffusers BasicTransformerBlock with norm_type ada_norm_single (self-attn, cross-attn, GELU MLP)."""

    def __init__(self, cfg: PixArtConfig, *, dtype: Any, rngs: nnx.Rngs):
        dim = cfg.inner_dim
        self.norm1 = LayerNorm(dim, cfg.norm_eps, cfg.norm_elementwise_affine, dtype=dtype)
        self.attn1 = Attention(dim, cfg.num_attention_heads, cfg.attention_head_dim, bias=cfg.attention_bias,
                               attention_impl=cfg.attention_impl, dtype=dtype, rngs=rngs)
        if cfg.cross_attention_dim is not None:
            self.attn2 = Attention(dim, cfg.num_attention_heads, cfg.attention_head_dim, cfg.cross_attention_dim,
                                   bias=cfg.attention_bias, attention_impl=cfg.attention_impl, dtype=dtype,
                                   rngs=rngs)
        else:
            self.attn2 = None
        self.norm2 = LayerNorm(dim, cfg.norm_eps, cfg.norm_elementwise_affine, dtype=dtype)
        self.ff = FeedForward(dim, 4 * dim, approximate=cfg.activation_fn == "gelu-approximate", dtype=dtype,
                              rngs=rngs)
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (6, dim), dtype) / dim ** 0.5)

    def __call__(self, x: jax.Array, context: jax.Array | None, context_bias: jax.Array | None,
                 timestep6: jax.Array, hooks: LinearHooks | None, context_mask: jax.Array | None = None
                 ) -> jax.Array:
        """x (b, n, dim), context (b, t, c), context_bias (b, 1, 1, t), timestep6 (b, 6 dim), context_mask (b, t)
        -> (b, n, dim)."""
        b, _, dim = x.shape
        mod = self.scale_shift_table[...][None] + timestep6.reshape(b, 6, dim)  # (b, 6, dim)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(mod, 6, axis=1)  # (b, 1, dim)
        h = self.norm1(x) * (1 + scale_msa) + shift_msa  # (b, n, dim)
        x = x + gate_msa * self.attn1(h, hooks=hooks)  # (b, n, dim)
        if self.attn2 is not None:
            x = x + self.attn2(x, context, context_bias, hooks=hooks, context_mask=context_mask)  # (b, n, dim)
        h = self.norm2(x) * (1 + scale_mlp) + shift_mlp  # (b, n, dim)
        return x + gate_mlp * self.ff(h, hooks)  # (b, n, dim)


class PixArtTransformer2DModel(nnx.Module):
    """PixArt-α/Σ denoiser: latents (b, in_channels, H, W) -> (b, out_channels, H, W).

    Args:
        cfg: the model config.
        dtype: parameter and compute dtype (norms, softmax and embeddings of positions run in fp32).
    """

    def __init__(self, cfg: PixArtConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        dim = cfg.inner_dim
        self.pos_embed = PatchEmbed(cfg.sample_size, cfg.patch_size, cfg.in_channels, dim,
                                    cfg.resolved_interpolation_scale, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nnx.List([PixArtBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.scale_shift_table = nnx.Param(jax.random.normal(rngs.params(), (2, dim), dtype) / dim ** 0.5)
        self.proj_out = Linear(dim, cfg.patch_size ** 2 * cfg.resolved_out_channels, dtype=dtype, rngs=rngs)
        self.adaln_single = AdaLayerNormSingle(dim, cfg.uses_additional_conditions, dtype=dtype, rngs=rngs)
        self.caption_projection = TextProjection(cfg.caption_channels, dim, dtype=dtype, rngs=rngs) \
            if cfg.caption_channels is not None else None
        for block in self.transformer_blocks:
            for layer in (block.attn1, block.attn2, block.ff):
                if layer is not None:
                    for node in nnx.iter_graph(layer):
                        if isinstance(node[1], Linear):
                            node[1].quantizable = True
        name_linears(self)

    def fused_sites(self) -> tuple[dict, dict, dict[str, tuple[str, ...]]]:
        """The sites where :class:`models.layers.FusedLinearHooks` may replace linears
        (:func:`models.layers.block_attention_sites`: ``attn1`` q | k | v, ``attn2`` k | v of every block)."""
        return block_attention_sites(self.transformer_blocks)

    def caption_context(self, encoder_hidden_states: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        """The context every block's cross-attention reads: encoder_hidden_states (b, t, caption_channels) -> (b, t,
        cross_attention_dim), the caption projection when the model has one, else the embeddings as they are.

        Token by token (row ``[i, k]`` depends on ``encoder_hidden_states[i, k]`` alone) and independent of the image
        and the timestep: the input of every ``attn2.to_k`` / ``attn2.to_v`` (``models.families.TextOnlyInputs``).
        """
        context = encoder_hidden_states.astype(self.proj_out.kernel.dtype)  # (b, t, c)
        if self.caption_projection is None:
            return context
        return self.caption_projection(context, hooks)  # (b, t, dim)

    def __call__(self, hidden_states: jax.Array, encoder_hidden_states: jax.Array, timestep: jax.Array,
                 encoder_attention_mask: jax.Array | None = None, resolution: jax.Array | None = None,
                 aspect_ratio: jax.Array | None = None, hooks: LinearHooks | None = None,
                 scan_blocks: bool = False) -> jax.Array:
        """hidden_states (b, c, H, W), encoder_hidden_states (b, t, caption_channels), timestep (b,) in [0, 1000),
        encoder_attention_mask (b, t) 1 = keep, resolution (b, 2), aspect_ratio (b, 1) -> (b, out_channels, H, W).

        ``scan_blocks``: run the transformer blocks as one ``lax.scan`` (:func:`models.layers.run_blocks_scanned`:
        one compiled block; overrides of block linears must then be ``jax.tree_util.Partial`` s, and the hooks may
        not record)."""
        check_fused_sites(hooks, *self.fused_sites())
        cfg = self.cfg
        b, _, height, width = hidden_states.shape
        dtype = self.proj_out.kernel.dtype
        timestep = jnp.broadcast_to(jnp.asarray(timestep), (b,))  # (b,)
        x = self.pos_embed(hidden_states.astype(dtype))  # (b, n, dim)
        timestep6, embedded = self.adaln_single(timestep, resolution, aspect_ratio, dtype, hooks)  # (b, 6d), (b, d)
        context = self.caption_context(encoder_hidden_states,
                                       with_token_mask(hooks, encoder_attention_mask))  # (b, t, dim)
        context_bias = mask_to_bias(encoder_attention_mask)  # (b, 1, 1, t) or None
        if scan_blocks:
            def run_block(block, x, block_hooks):
                return block(x, context, context_bias, timestep6, block_hooks, encoder_attention_mask)

            x = run_blocks_scanned(list(self.transformer_blocks), x, hooks, run_block)  # (b, n, dim)
        else:
            for block in self.transformer_blocks:
                x = block(x, context, context_bias, timestep6, hooks, encoder_attention_mask)  # (b, n, dim)
        shift, scale = jnp.split(self.scale_shift_table[...][None] + embedded[:, None], 2, axis=1)  # (b, 1, dim)
        x = layer_norm(x, 1e-6) * (1 + scale) + shift  # (b, n, dim)
        x = self.proj_out(x, hooks)  # (b, n, p p out)
        return unpatchify(x, height, width, cfg.patch_size, cfg.resolved_out_channels)  # (b, out, H, W)


def _block_rules() -> list:
    prefix = "transformer_blocks.{i}"
    rules = param_rules(f"{prefix}.scale_shift_table", f"{prefix}.norm1.weight", f"{prefix}.norm1.bias",
                        f"{prefix}.norm2.weight", f"{prefix}.norm2.bias")
    for attn in ("attn1", "attn2"):
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            rules += linear_rules(f"{prefix}.{attn}.{proj}")
    rules += linear_rules(f"{prefix}.ff.net.0.proj") + linear_rules(f"{prefix}.ff.net.2")
    return rules


#: diffusers key -> NNX path table of PixArtTransformer2DModel.
KEY_TABLE = convert.KeyTable([
    rule("pos_embed.proj.weight", "pos_embed.proj.kernel", "conv"),
    rule("pos_embed.proj.bias", "pos_embed.proj.bias"),
    rule("pos_embed.pos_embed", None),  # a recomputed buffer (persistent only with pos_embed_max_size)
    *_block_rules(),
    *param_rules("scale_shift_table"),
    *linear_rules("proj_out"),
    *linear_rules("adaln_single.linear"),
    *[r for name in ("timestep_embedder", "resolution_embedder", "aspect_ratio_embedder")
      for layer in ("linear_1", "linear_2") for r in linear_rules(f"adaln_single.emb.{name}.{layer}")],
    *linear_rules("caption_projection.linear_1"),
    *linear_rules("caption_projection.linear_2"),
], name="PixArtTransformer2DModel")

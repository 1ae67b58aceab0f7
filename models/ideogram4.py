"""Ideogram 4 transformer in Flax NNX: a port of diffusers' ``Ideogram4Transformer2DModel`` (diffusers 0.42).

The model reads ONE packed sequence per sample, ``[left padding][text tokens][image tokens]`` (or any other layout
described by ``indicator`` / ``segment_ids`` / ``position_ids``):

* image tokens (``indicator == OUTPUT_IMAGE_INDICATOR``) carry patchified latents ``(in_channels,)``;
* text tokens (``indicator == LLM_TOKEN_INDICATOR``) carry LLM features ``(llm_features_dim,)``, RMS-normalised and
  projected to the hidden width;
* a block-diagonal attention mask built from ``segment_ids`` keeps each segment (a sample, or the padding) to itself;
* multi-axis rotary embeddings (MRoPE, interleaved t/h/w frequencies) use ``position_ids (B, L, 3)``; image
  positions start at ``IMAGE_POSITION_OFFSET = 65536`` and are always computed in float32 (bf16 cannot hold
  consecutive integers there).

Each of the ``num_layers`` blocks: AdaLN scales/gates from the timestep (``tanh`` gates, ``1 + scale``), self-attention
with q/k RMSNorm per head, a SwiGLU feed-forward ``w2(silu(w1 x) * w3 x)``, and "sandwich" RMSNorms before and after
each branch. The linears are the shared ``models.layers.Linear`` (kernel ``(d_in, d_out)``; the block linears
``to_q/to_k/to_v/to_out.0/w1/w2/w3`` are marked quantizable) and every forward takes optional ``LinearHooks`` (quantized
overrides, activation capture; fused q/k projection + norm and w1|w3 + SwiGLU sites for the GPU epilogue kernels
through ``models.layers.FusedLinearHooks``). Module names follow diffusers, so a linear's dotted path is its
diffusers key prefix (``layers.3.attention.to_q`` <- ``layers.3.attention.to_q.weight``); :data:`KEY_TABLE` is the
declarative mapping used by :mod:`models.convert`.

Two layouts of the blocks:

* ``scan_layers=False`` (default): ``layers`` is a list of blocks, paths ``layers.{i}.…`` exactly as diffusers.
* ``scan_layers=True``: ``layers`` is ONE block whose parameters carry a leading ``num_layers`` axis, and the
  forward pass runs ``jax.lax.scan`` over it (one block compiled instead of 34: much faster compiles, the same
  numbers). :func:`stack_layer_params` / :func:`unstack_layer_params` convert flat states between the two.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import convert
from models.layers import (FusedLinearHooks, Linear, LinearHooks, check_attention_impl, check_fused_sites, name_linears,
                           with_token_mask)

# Per-token role indicators of the packed sequence (diffusers' constants).
SEQUENCE_PADDING_INDICATOR = -1
OUTPUT_IMAGE_INDICATOR = 2
LLM_TOKEN_INDICATOR = 3
# Image grid coordinates start here so that they never collide with text token positions.
IMAGE_POSITION_OFFSET = 65536

CLASS_NAME = "Ideogram4Transformer2DModel"


@dataclasses.dataclass(frozen=True)
class Ideogram4Config:
    """Architecture of ``Ideogram4Transformer2DModel``; the defaults are diffusers' defaults, i.e. the real model.

    The first ten fields are diffusers' ``config.json`` fields; the rest are JAX-side choices.

    Attributes:
        dtype: dtype of the activations between layers (``jnp.bfloat16`` for serving, ``jnp.float32`` for parity).
        param_dtype: dtype the parameters are created in; the linears (``models.layers.Linear``) compute in it.
        attention_impl: ``"xla"`` (any device) or ``"cudnn"`` (cuDNN flash attention; GPU, bf16/fp16 only).
        scan_layers: stack the blocks and run them with ``lax.scan`` (see the module docstring).
        remat: rematerialise each block in the backward pass (``jax.checkpoint`` per block): a gradient keeps only
            the blocks' inputs and recomputes the rest, instead of keeping every intermediate of every block.
    """

    in_channels: int = 128
    num_layers: int = 34
    attention_head_dim: int = 256
    num_attention_heads: int = 18
    intermediate_size: int = 12288
    adaln_dim: int = 512
    llm_features_dim: int = 53248
    rope_theta: int = 5_000_000
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    norm_eps: float = 1e-5
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attention_impl: str = "xla"
    scan_layers: bool = False
    remat: bool = False

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(int(s) for s in self.mrope_section))
        if len(self.mrope_section) != 3:
            raise ValueError(f"mrope_section={self.mrope_section} must have 3 entries (t, h, w)")
        if self.attention_head_dim % 2:
            raise ValueError(f"attention_head_dim={self.attention_head_dim} must be even (rotary pairs)")
        num_freqs = self.attention_head_dim // 2
        for axis in (1, 2):
            if 3 * self.mrope_section[axis] > num_freqs:
                raise ValueError(f"mrope_section[{axis}]={self.mrope_section[axis]}: 3 * section must be <= "
                                 f"attention_head_dim // 2 = {num_freqs} (interleaved MRoPE)")
        check_attention_impl(self.attention_impl, "Ideogram4Config")
        for name in ("in_channels", "num_layers", "num_attention_heads", "intermediate_size", "adaln_dim",
                     "llm_features_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")

    @property
    def hidden_size(self) -> int:
        return self.attention_head_dim * self.num_attention_heads

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any], **overrides: Any) -> Ideogram4Config:
        """Build from a diffusers ``config.json`` dict (keys starting with ``_`` are ignored; unknown keys raise)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        diffusers_fields = {f.name for f in dataclasses.fields(cls)[:10]}
        kwargs = {}
        for key, value in config.items():
            if key.startswith("_"):
                continue
            if key not in diffusers_fields:
                raise ValueError(f"unknown Ideogram4Transformer2DModel config key {key!r}={value!r}")
            kwargs[key] = tuple(value) if key == "mrope_section" else value
        unknown = set(overrides) - fields
        if unknown:
            raise ValueError(f"unknown Ideogram4Config override(s) {sorted(unknown)}")
        return cls(**{**kwargs, **overrides})

    def to_diffusers_config(self) -> dict[str, Any]:
        """The diffusers ``config.json`` dict of this architecture."""
        config = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[:10]}
        config["mrope_section"] = list(self.mrope_section)
        config["_class_name"] = CLASS_NAME
        return config


IDEOGRAM4 = Ideogram4Config()
"""The real model (diffusers defaults): 34 blocks, hidden 4608 = 18 x 256, 9.28 B parameters."""


def tiny_config(**overrides: Any) -> Ideogram4Config:
    """A CPU-sized config with the real model's structure (for tests and script validation)."""
    base = dict(in_channels=8, num_layers=2, attention_head_dim=32, num_attention_heads=2, intermediate_size=96,
                adaln_dim=16, llm_features_dim=24, rope_theta=10_000, mrope_section=(4, 3, 3))
    return Ideogram4Config(**{**base, **overrides})


# ----------------------------------------------------------------------------------------------------------------
# Ideogram-specific layers
# ----------------------------------------------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with diffusers' numerics: normalise in float32, cast to the weight's dtype when it
    is a 16-bit type, then multiply by the weight ``scale (features,)``."""

    def __init__(self, features: int, eps: float, *, param_dtype: Any = jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.scale[...]
        x32 = x.astype(jnp.float32)  # (..., features)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # (..., 1)
        normed = x32 * jax.lax.rsqrt(variance + self.eps)  # (..., features) float32
        if scale.dtype in (jnp.bfloat16, jnp.float16):
            normed = normed.astype(scale.dtype)
        return normed * scale  # (..., features)


def rotate_half(x: jax.Array) -> jax.Array:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last axis."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def mrope_inverse_frequencies(head_dim: int, theta: float) -> jax.Array:
    """``(head_dim // 2,)`` float32 inverse frequencies ``1 / theta ** (2k / head_dim)`` (diffusers' formula)."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim  # (head_dim/2,)
    return 1.0 / (jnp.float32(theta) ** exponents)  # (head_dim/2,)


def mrope_cos_sin(position_ids: jax.Array, head_dim: int, theta: float,
                  mrope_section: tuple[int, int, int]) -> tuple[jax.Array, jax.Array]:
    """Interleaved multi-axis rotary embedding tables.

    Frequency ``k`` uses the t position, except ``k = 1, 4, 7, ... < 3 * section[1]`` (h position) and
    ``k = 2, 5, 8, ... < 3 * section[2]`` (w position). Everything is float32: image positions are ~65536.

    Args:
        position_ids: ``(B, L, 3)`` integer (t, h, w) positions.
    Returns:
        ``(cos, sin)``, each ``(B, L, head_dim)`` float32.
    """
    if position_ids.ndim != 3 or position_ids.shape[-1] != 3:
        raise ValueError(f"position_ids must have shape (B, L, 3), got {position_ids.shape}")
    inv_freq = mrope_inverse_frequencies(head_dim, theta)  # (F,) with F = head_dim/2
    positions = position_ids.astype(jnp.float32)  # (B, L, 3)
    freqs = positions[..., :, None] * inv_freq  # (B, L, 3, F): angle of each axis at each frequency
    num_freqs = head_dim // 2
    freq_index = np.arange(num_freqs)
    axis_of_freq = np.zeros((num_freqs,), np.int32)  # t everywhere by default
    for axis in (1, 2):
        length = mrope_section[axis] * 3
        axis_of_freq[(freq_index % 3 == axis) & (freq_index < length)] = axis
    one_hot = jnp.asarray(np.eye(3, dtype=bool)[axis_of_freq].T)  # (3, F)
    angles = jnp.where(one_hot[0], freqs[..., 0, :], jnp.where(one_hot[1], freqs[..., 1, :], freqs[..., 2, :]))
    emb = jnp.concatenate([angles, angles], axis=-1)  # (B, L, head_dim)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x (B, L, H, D)`` rotated by ``cos, sin (B, L, D)`` (broadcast over heads)."""
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]  # (B, L, H, D)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """Block-diagonal attention mask: ``segment_ids (B, L)`` -> ``(B, 1, L, L)`` bool, True where
    query and key share a segment id (the padding, id -1, forms its own segment, as in diffusers)."""
    if segment_ids.ndim != 2:
        raise ValueError(f"segment_ids must have shape (B, L), got {segment_ids.shape}")
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # (B, 1, L, L)


def sinusoidal_embedding(t: jax.Array, dim: int, scale: float = 1e4) -> jax.Array:
    """``t (...)`` -> ``(..., dim)`` float32 ``[sin(t w_k), cos(t w_k)]`` with ``w_k = scale ** (-k / (half - 1))``."""
    t = t.astype(jnp.float32)
    half = dim // 2
    log_step = math.log(scale) / (half - 1)
    freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -log_step)  # (half,)
    angles = t[..., None] * freq  # (..., half)
    emb = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # (..., 2*half)
    if dim % 2:
        emb = jnp.pad(emb, [(0, 0)] * (emb.ndim - 1) + [(0, 1)])  # (..., dim)
    return emb


def _linear(cfg: Ideogram4Config, d_in: int, d_out: int, rngs: nnx.Rngs, bias: bool,
            quantizable: bool = False) -> Linear:
    return Linear(d_in, d_out, bias=bias, quantizable=quantizable, dtype=cfg.param_dtype, rngs=rngs)


def _project_norm(projection: Linear, norm: RMSNorm, x: jax.Array, hooks: LinearHooks | None) -> jax.Array:
    """``norm(projection(x))`` per head, ``(B, L, hidden)`` -> ``(B, L, H, D)``; a fused ``projection_norm`` hook
    (:class:`models.layers.FusedLinearHooks`) replaces both, given the norm's weight and eps."""
    batch, length, _ = x.shape
    heads = (batch, length, -1, norm.scale.shape[0])
    fused = getattr(hooks, "fused_projection_norm", None)
    y = None if fused is None else fused(projection, x, norm.scale[...], norm.eps)  # (B, L, hidden) or None
    if y is not None:
        return y.reshape(heads)
    return norm(projection(x, hooks).reshape(heads))  # (B, L, H, D)


def _fused_swiglu(hooks: LinearHooks, gate: Linear, up: Linear, x: jax.Array) -> jax.Array | None:
    """``SiLU(gate(x)) * up(x)`` from a fused ``swiglu`` hook, or None when the hooks have none for ``gate``."""
    fused = getattr(hooks, "fused_swiglu", None)
    return None if fused is None else fused(gate, up, x)


class Ideogram4Attention(nnx.Module):
    """Self-attention: split q/k/v (no bias), q/k RMSNorm per head, MRoPE, segment mask, output projection."""

    def __init__(self, cfg: Ideogram4Config, *, rngs: nnx.Rngs):
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.attention_head_dim
        self.attention_impl = cfg.attention_impl
        self.to_q = _linear(cfg, hidden, hidden, rngs, bias=False, quantizable=True)
        self.to_k = _linear(cfg, hidden, hidden, rngs, bias=False, quantizable=True)
        self.to_v = _linear(cfg, hidden, hidden, rngs, bias=False, quantizable=True)
        self.norm_q = RMSNorm(self.head_dim, 1e-5, param_dtype=cfg.param_dtype)
        self.norm_k = RMSNorm(self.head_dim, 1e-5, param_dtype=cfg.param_dtype)
        self.to_out = nnx.List([_linear(cfg, hidden, hidden, rngs, bias=False, quantizable=True)])

    def __call__(self, x: jax.Array, mask: jax.Array | None, cos: jax.Array, sin: jax.Array,
                 hooks: LinearHooks | None = None) -> jax.Array:
        """``x (B, L, hidden)``, ``mask (B, 1, L, L)`` bool or None (all attend), ``cos/sin (B, L, head_dim)``."""
        batch, length, _ = x.shape
        heads = (batch, length, self.num_heads, self.head_dim)
        fused = getattr(hooks, "fused_shared_input", None)
        qkv = None if fused is None else fused((self.to_q, self.to_k, self.to_v), x)  # 3 x (B, L, hidden) or None
        if qkv is not None:  # q | k | v as one fused linear; the norms run on its slices
            query, key = self.norm_q(qkv[0].reshape(heads)), self.norm_k(qkv[1].reshape(heads))  # (B, L, H, D)
            value = qkv[2].reshape(heads)  # (B, L, H, D)
        else:
            query = _project_norm(self.to_q, self.norm_q, x, hooks).reshape(heads)  # (B, L, H, D)
            key = _project_norm(self.to_k, self.norm_k, x, hooks).reshape(heads)  # (B, L, H, D)
            value = self.to_v(x, hooks).reshape(heads)  # (B, L, H, D)
        query = apply_rotary(query, cos, sin)  # (B, L, H, D)
        key = apply_rotary(key, cos, sin)  # (B, L, H, D)
        out = jax.nn.dot_product_attention(query, key, value, mask=mask,
                                           implementation=self.attention_impl)  # (B, L, H, D)
        return self.to_out[0](out.reshape(batch, length, -1), hooks)  # (B, L, hidden)


class Ideogram4MLP(nnx.Module):
    """SwiGLU feed-forward ``w2(silu(w1 x) * w3 x)`` (no biases)."""

    def __init__(self, cfg: Ideogram4Config, *, rngs: nnx.Rngs):
        self.w1 = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs, bias=False, quantizable=True)
        self.w2 = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, rngs, bias=False, quantizable=True)
        self.w3 = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs, bias=False, quantizable=True)

    def __call__(self, x: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        gated = None if hooks is None else _fused_swiglu(hooks, self.w1, self.w3, x)  # (B, L, intermediate)
        if gated is None:
            gated = jax.nn.silu(self.w1(x, hooks)) * self.w3(x, hooks)  # (B, L, intermediate)
        return self.w2(gated, hooks)  # (B, L, hidden)


class Ideogram4TransformerBlock(nnx.Module):
    """AdaLN block with sandwich RMSNorms: ``h += tanh(g_a) * norm2(attn(norm1(h) * (1 + s_a)))``, same for the FFN."""

    def __init__(self, cfg: Ideogram4Config, *, rngs: nnx.Rngs):
        hidden = cfg.hidden_size
        self.attention = Ideogram4Attention(cfg, rngs=rngs)
        self.feed_forward = Ideogram4MLP(cfg, rngs=rngs)
        self.attention_norm1 = RMSNorm(hidden, cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.ffn_norm1 = RMSNorm(hidden, cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.attention_norm2 = RMSNorm(hidden, cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.ffn_norm2 = RMSNorm(hidden, cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.adaln_modulation = _linear(cfg, cfg.adaln_dim, 4 * hidden, rngs, bias=True)

    def __call__(self, hidden_states: jax.Array, mask: jax.Array | None, cos: jax.Array, sin: jax.Array,
                 adaln_input: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        """``hidden_states (B, L, hidden)``; ``adaln_input (B, 1 or L, adaln_dim)``."""
        mod = self.adaln_modulation(adaln_input)  # (B, 1|L, 4*hidden)
        scale_msa, gate_msa, scale_mlp, gate_mlp = jnp.split(mod, 4, axis=-1)  # each (B, 1|L, hidden)
        gate_msa, gate_mlp = jnp.tanh(gate_msa), jnp.tanh(gate_mlp)
        scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
        attn_in = self.attention_norm1(hidden_states) * scale_msa  # (B, L, hidden)
        attn_out = self.attention(attn_in, mask, cos, sin, hooks)  # (B, L, hidden)
        hidden_states = hidden_states + gate_msa * self.attention_norm2(attn_out)  # (B, L, hidden)
        ffn_in = self.ffn_norm1(hidden_states) * scale_mlp  # (B, L, hidden)
        ffn_out = self.feed_forward(ffn_in, hooks)  # (B, L, hidden)
        return hidden_states + gate_mlp * self.ffn_norm2(ffn_out)  # (B, L, hidden)


class Ideogram4EmbedScalar(nnx.Module):
    """Timestep embedding: sinusoid of ``1e4 * (t - lo) / (hi - lo)``, then ``mlp_out(silu(mlp_in(.)))``."""

    def __init__(self, cfg: Ideogram4Config, input_range: tuple[float, float], *, rngs: nnx.Rngs):
        self.dim = cfg.hidden_size
        self.range_min, self.range_max = input_range
        if self.range_max <= self.range_min:
            raise ValueError(f"input_range={input_range}: the upper end must exceed the lower end")
        self.mlp_in = _linear(cfg, self.dim, self.dim, rngs, bias=True)
        self.mlp_out = _linear(cfg, self.dim, self.dim, rngs, bias=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x (...)`` in the model dtype -> ``(..., hidden)``."""
        scaled = 1e4 * (x.astype(jnp.float32) - self.range_min) / (self.range_max - self.range_min)  # (...)
        emb = sinusoidal_embedding(scaled, self.dim).astype(x.dtype)  # (..., hidden)
        return self.mlp_out(jax.nn.silu(self.mlp_in(emb)))  # (..., hidden)


class Ideogram4FinalLayer(nnx.Module):
    """``linear(LayerNorm(h) * (1 + adaln_modulation(silu(c))))``; LayerNorm without affine, eps 1e-6."""

    def __init__(self, cfg: Ideogram4Config, *, rngs: nnx.Rngs):
        self.linear = _linear(cfg, cfg.hidden_size, cfg.in_channels, rngs, bias=True)
        self.adaln_modulation = _linear(cfg, cfg.adaln_dim, cfg.hidden_size, rngs, bias=True)

    def __call__(self, hidden_states: jax.Array, conditioning: jax.Array) -> jax.Array:
        scale = 1.0 + self.adaln_modulation(jax.nn.silu(conditioning))  # (B, 1|L, hidden)
        x32 = hidden_states.astype(jnp.float32)  # (B, L, hidden)
        mean = jnp.mean(x32, axis=-1, keepdims=True)  # (B, L, 1)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)  # (B, L, 1)
        normed = ((x32 - mean) * jax.lax.rsqrt(var + 1e-6)).astype(hidden_states.dtype)  # (B, L, hidden)
        return self.linear(normed * scale)  # (B, L, in_channels)


def _stacked_blocks(cfg: Ideogram4Config, rngs: nnx.Rngs) -> Ideogram4TransformerBlock:
    """One block module whose every parameter has a leading ``num_layers`` axis (independent random init per layer)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Ideogram4TransformerBlock(cfg, rngs=nnx.Rngs(0))))
    keys = jax.random.split(rngs.params(), cfg.num_layers)  # (num_layers, key)

    def make_state(key: jax.Array) -> nnx.State:
        return nnx.state(Ideogram4TransformerBlock(cfg, rngs=nnx.Rngs(params=key)))

    return nnx.merge(graphdef, jax.vmap(make_state)(keys))


class Ideogram4Transformer(nnx.Module):
    """``Ideogram4Transformer2DModel`` (diffusers 0.42) in NNX. See the module docstring."""

    def __init__(self, cfg: Ideogram4Config, *, rngs: nnx.Rngs):
        self.config = cfg
        hidden = cfg.hidden_size
        self.input_proj = _linear(cfg, cfg.in_channels, hidden, rngs, bias=True)
        self.llm_cond_norm = RMSNorm(cfg.llm_features_dim, 1e-6, param_dtype=cfg.param_dtype)
        self.llm_cond_proj = _linear(cfg, cfg.llm_features_dim, hidden, rngs, bias=True)
        self.t_embedding = Ideogram4EmbedScalar(cfg, (0.0, 1.0), rngs=rngs)
        self.adaln_proj = _linear(cfg, hidden, cfg.adaln_dim, rngs, bias=True)
        self.embed_image_indicator = nnx.Embed(2, hidden, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        if cfg.scan_layers:
            self.layers = _stacked_blocks(cfg, rngs)
        else:
            self.layers = nnx.List([Ideogram4TransformerBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_layer = Ideogram4FinalLayer(cfg, rngs=rngs)
        name_linears(self)

    def fused_sites(self) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]],
                                   dict[str, tuple[str, ...]]]:
        """The sites where fused hooks may replace linears (:class:`models.layers.FusedLinearHooks`):
        ``({to_q / to_k path: (that path,)}, {w1 path: (w1 path, w3 path)}, {to_q path: (to_q, to_k, to_v paths)})``
        (q/k projection + per-head RMSNorm; gate + up projection + SwiGLU; q | k | v, which read the same input, as
        one linear, the q/k RMSNorm applied to its slices)."""
        blocks = [self.layers] if self.config.scan_layers else list(self.layers)
        norm_sites, swiglu_sites, shared_sites = {}, {}, {}
        for block in blocks:
            attention = block.attention
            for projection in (attention.to_q, attention.to_k):
                norm_sites[projection.path] = (projection.path,)
            shared_sites[attention.to_q.path] = (attention.to_q.path, attention.to_k.path, attention.to_v.path)
            mlp = block.feed_forward
            swiglu_sites[mlp.w1.path] = (mlp.w1.path, mlp.w3.path)
        return norm_sites, swiglu_sites, shared_sites

    def _check_hooks(self, hooks: LinearHooks | None) -> None:
        """Scanned blocks share their linear paths: they take only stacked hooks; fused entries must name sites."""
        if hooks is None:
            return
        stacked = isinstance(hooks, FusedLinearHooks) and hooks.stacked
        if self.config.scan_layers and not stacked:
            raise ValueError("hooks need the list layout (scan_layers=False): scanned blocks share their linear paths "
                             "(or pass FusedLinearHooks(..., stacked=True) with a leading layer axis on every entry)")
        if stacked and not self.config.scan_layers:
            raise ValueError("stacked hooks (FusedLinearHooks(stacked=True)) need scan_layers=True")
        if stacked:
            for table, entries in hooks.entries().items():
                for name, entry in entries.items():
                    if not name.startswith("layers."):
                        raise ValueError(f"stacked hooks may only name block linears (layers.*): {table} {name!r}")
                    for leaf in jax.tree_util.tree_leaves(entry):
                        if not jnp.ndim(leaf) or jnp.shape(leaf)[0] != self.config.num_layers:
                            raise ValueError(f"stacked {table} entry {name!r}: array of shape {jnp.shape(leaf)} has "
                                             f"no leading num_layers={self.config.num_layers} axis")
        check_fused_sites(hooks, *self.fused_sites())

    def embed_text(self, encoder_hidden_states: jax.Array | None, indicator: jax.Array) -> jax.Array:
        """Text conditioning added to the hidden stream: ``llm_cond_proj(norm(f * m)) * m``, ``m = [text token]``.

        It does not depend on the timestep or the latents, so a sampler computes it once per prompt (pass the result
        as ``text_embeddings``). ``encoder_hidden_states=None`` means all-zero features (the unconditional branch):
        then the result is exactly ``bias * m`` and the big projection is skipped.

        Args:
            encoder_hidden_states: ``(B, L, llm_features_dim)`` or None.
            indicator: ``(B, L)`` integer token roles.
        Returns:
            ``(B, L, hidden)`` in the compute dtype.
        """
        cfg = self.config
        llm_token_mask = (indicator == LLM_TOKEN_INDICATOR).astype(cfg.dtype)[..., None]  # (B, L, 1)
        if encoder_hidden_states is None:
            bias = self.llm_cond_proj.bias[...].astype(cfg.dtype)  # (hidden,) (the projection of zero features)
            return bias * llm_token_mask  # (B, L, hidden)
        if encoder_hidden_states.shape != (*indicator.shape, cfg.llm_features_dim):
            raise ValueError(f"encoder_hidden_states {encoder_hidden_states.shape} must be (B, L, "
                             f"llm_features_dim={cfg.llm_features_dim}) with (B, L) = indicator {indicator.shape}")
        features = encoder_hidden_states.astype(cfg.dtype) * llm_token_mask  # (B, L, F)
        return self.llm_cond_proj(self.llm_cond_norm(features)) * llm_token_mask  # (B, L, hidden)

    def __call__(self, hidden_states: jax.Array, timestep: jax.Array, encoder_hidden_states: jax.Array | None,
                 position_ids: jax.Array, segment_ids: jax.Array | None, indicator: jax.Array, *,
                 text_embeddings: jax.Array | None = None, hooks: LinearHooks | None = None) -> jax.Array:
        """Flow-matching velocity for every token of the packed sequence (only image tokens are meaningful).

        Args:
            hidden_states: ``(B, L, in_channels)`` patchified noisy latents (non-image positions are ignored).
            timestep: ``(B,)`` or ``(B, L)`` model time in [0, 1] (0 = noise, 1 = data), in the compute dtype as the
                pipeline passes it.
            encoder_hidden_states: ``(B, L, llm_features_dim)`` text features, or None for all-zero features.
            position_ids: ``(B, L, 3)`` integer (t, h, w) positions.
            segment_ids: ``(B, L)`` integer segment ids (tokens attend within their segment), or None when every token
                of a row is in one segment (no mask: the cheap path).
            indicator: ``(B, L)`` integer token roles (``LLM_TOKEN_INDICATOR``, ``OUTPUT_IMAGE_INDICATOR``, other).
            text_embeddings: ``(B, L, hidden)`` from :meth:`embed_text`; replaces ``encoder_hidden_states``.
            hooks: :class:`models.layers.LinearHooks` routing the block linears (quantized overrides, activation
                capture), list layout; or :class:`models.layers.FusedLinearHooks` (also fused q/k projection
                + RMSNorm, w1|w3 + SwiGLU and q | k | v sites, see :meth:`fused_sites`), with ``stacked=True`` for the scan
                layout (entries keyed ``layers.<sub path>``, arrays with a leading ``num_layers`` axis).
        Returns:
            ``(B, L, in_channels)`` in the compute dtype.
        """
        cfg = self.config
        batch, length, channels = hidden_states.shape
        if channels != cfg.in_channels:
            raise ValueError(f"hidden_states {hidden_states.shape}: last dim must be in_channels={cfg.in_channels}")
        if indicator.shape != (batch, length):
            raise ValueError(f"indicator {indicator.shape} must be (B, L) = {(batch, length)}")
        if position_ids.shape != (batch, length, 3):
            raise ValueError(f"position_ids {position_ids.shape} must be (B, L, 3) = {(batch, length, 3)}")
        if segment_ids is not None and segment_ids.shape != (batch, length):
            raise ValueError(f"segment_ids {segment_ids.shape} must be (B, L) = {(batch, length)}")
        self._check_hooks(hooks)
        if timestep.shape not in ((batch,), (batch, length)):
            raise ValueError(f"timestep {timestep.shape} must be (B,) = {(batch,)} or (B, L) = {(batch, length)}")

        image_mask = (indicator == OUTPUT_IMAGE_INDICATOR)  # (B, L) bool
        image_mask_f = image_mask.astype(cfg.dtype)[..., None]  # (B, L, 1)
        hidden = hidden_states.astype(cfg.dtype) * image_mask_f  # (B, L, C)
        hidden = self.input_proj(hidden) * image_mask_f  # (B, L, hidden)

        t_cond = self.t_embedding(timestep.astype(cfg.dtype))  # (B, hidden) or (B, L, hidden)
        if timestep.ndim == 1:
            t_cond = t_cond[:, None, :]  # (B, 1, hidden)
        adaln_input = jax.nn.silu(self.adaln_proj(t_cond))  # (B, 1|L, adaln_dim)

        if text_embeddings is None:
            text_embeddings = self.embed_text(encoder_hidden_states, indicator)  # (B, L, hidden)
        elif text_embeddings.shape != (batch, length, cfg.hidden_size):
            raise ValueError(f"text_embeddings {text_embeddings.shape} must be (B, L, hidden) = "
                             f"{(batch, length, cfg.hidden_size)}")
        hidden = hidden + text_embeddings.astype(cfg.dtype)  # (B, L, hidden)
        hidden = hidden + self.embed_image_indicator(image_mask.astype(jnp.int32))  # (B, L, hidden)

        cos, sin = mrope_cos_sin(position_ids, cfg.attention_head_dim, cfg.rope_theta, cfg.mrope_section)
        cos, sin = cos.astype(cfg.dtype), sin.astype(cfg.dtype)  # (B, L, head_dim) each
        mask = None if segment_ids is None else segment_mask(segment_ids)  # (B, 1, L, L) or None
        # The padding segment never reaches a real token: a recorder keeps only the rows of real tokens.
        hooks = with_token_mask(hooks, None if segment_ids is None else segment_ids != SEQUENCE_PADDING_INDICATOR)

        if cfg.scan_layers:
            block_graph, block_states = nnx.split(self.layers)
            # Stacked hooks (FusedLinearHooks(stacked=True)): each block gets its slice of the entries' arrays.
            entries = {} if hooks is None else hooks.entries()

            def run_block(carry: jax.Array, xs: tuple[nnx.State, dict]) -> tuple[jax.Array, None]:
                block_state, block_entries = xs
                block = nnx.merge(block_graph, block_state)
                block_hooks = None if hooks is None else type(hooks).from_entries(block_entries)
                return block(carry, mask, cos, sin, adaln_input, block_hooks), None  # (B, L, hidden)

            body = jax.checkpoint(run_block, prevent_cse=False) if cfg.remat else run_block
            hidden, _ = jax.lax.scan(body, hidden, (block_states, entries))  # (B, L, hidden)
        else:
            for block in self.layers:
                if cfg.remat:
                    graph, state = nnx.split(block)
                    hidden = jax.checkpoint(lambda h, s, g=graph: nnx.merge(g, s)(h, mask, cos, sin, adaln_input,
                                                                                  hooks))(hidden, state)
                else:
                    hidden = block(hidden, mask, cos, sin, adaln_input, hooks)  # (B, L, hidden)

        return self.final_layer(hidden, adaln_input)  # (B, L, in_channels)


# ----------------------------------------------------------------------------------------------------------------
# parameter counting and conversion
# ----------------------------------------------------------------------------------------------------------------


def count_params(cfg: Ideogram4Config) -> int:
    """Number of parameters of the model of ``cfg``, from shapes only (``nnx.eval_shape``: nothing is allocated)."""
    shapes = convert.abstract_shapes(lambda: new_model(cfg))
    return int(sum(math.prod(shape) for shape in shapes.values()))


def _norm_rule(prefix: str) -> convert.KeyRule:
    return convert.rule(f"{prefix}.weight", f"{prefix}.scale")


KEY_TABLE = convert.KeyTable(
    [
        *convert.linear_rules("input_proj"),
        _norm_rule("llm_cond_norm"),
        *convert.linear_rules("llm_cond_proj"),
        *convert.linear_rules("t_embedding.mlp_in"),
        *convert.linear_rules("t_embedding.mlp_out"),
        *convert.linear_rules("adaln_proj"),
        convert.rule("embed_image_indicator.weight", "embed_image_indicator.embedding"),
        *[r for name in ("to_q", "to_k", "to_v", "to_out.0")
          for r in convert.linear_rules(f"layers.{{i}}.attention.{name}", bias=False)],
        _norm_rule("layers.{i}.attention.norm_q"),
        _norm_rule("layers.{i}.attention.norm_k"),
        *[r for name in ("w1", "w2", "w3")
          for r in convert.linear_rules(f"layers.{{i}}.feed_forward.{name}", bias=False)],
        *[_norm_rule(f"layers.{{i}}.{name}")
          for name in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2")],
        *convert.linear_rules("layers.{i}.adaln_modulation"),
        *convert.linear_rules("final_layer.linear"),
        *convert.linear_rules("final_layer.adaln_modulation"),
    ],
    name="Ideogram4Transformer2DModel",
)
"""diffusers ``Ideogram4Transformer2DModel`` keys <-> list-layout (``scan_layers=False``) flax paths."""

_LAYER_PATH = re.compile(r"^layers\.(\d+)\.(.+)$")


def stack_layer_params(params: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """List-layout flat state (``layers.{i}.X``) -> scan-layout flat state (``layers.X`` with a leading layer axis).

    Raises:
        ValueError: naming the sub-path whose layers are missing or have different shapes.
    """
    per_path: dict[str, dict[int, Any]] = {}
    stacked: dict[str, Any] = {}
    for key, value in params.items():
        found = _LAYER_PATH.match(key)
        if found is None:
            stacked[key] = value
            continue
        per_path.setdefault(found.group(2), {})[int(found.group(1))] = value
    for sub_path, by_layer in per_path.items():
        if sorted(by_layer) != list(range(num_layers)):
            raise ValueError(f"layers.*.{sub_path}: have layers {sorted(by_layer)}, need 0..{num_layers - 1}")
        shapes = {tuple(v.shape) for v in by_layer.values()}
        if len(shapes) != 1:
            raise ValueError(f"layers.*.{sub_path}: layers have different shapes {sorted(shapes)}")
        stacked[f"layers.{sub_path}"] = np.stack([np.asarray(by_layer[i]) for i in range(num_layers)])
    return stacked


def unstack_layer_params(params: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Inverse of :func:`stack_layer_params`."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if not key.startswith("layers."):
            flat[key] = value
            continue
        if value.shape[0] != num_layers:
            raise ValueError(f"{key}: leading axis {value.shape[0]} must be num_layers={num_layers}")
        sub_path = key[len("layers."):]
        for layer in range(num_layers):
            flat[f"layers.{layer}.{sub_path}"] = np.asarray(value[layer])
    return flat


def new_model(cfg: Ideogram4Config, dtype: Any = None) -> Ideogram4Transformer:
    """The plain constructor (jax.random init); ``dtype`` (None: ``cfg.param_dtype``) sets the parameter dtype, the
    compute dtype stays ``cfg.dtype``. Run under ``nnx.eval_shape`` for shapes without memory. Loading and exporting
    diffusers checkpoints: ``models.families.IDEOGRAM4``."""
    if dtype is not None:
        cfg = dataclasses.replace(cfg, param_dtype=jnp.dtype(dtype))
    return Ideogram4Transformer(cfg, rngs=nnx.Rngs(0))


def _jax_fields(cfg: Ideogram4Config) -> dict[str, Any]:
    return {"dtype": jnp.dtype(cfg.dtype).name, "param_dtype": jnp.dtype(cfg.param_dtype).name,
            "attention_impl": cfg.attention_impl, "scan_layers": cfg.scan_layers}


def save(model: Ideogram4Transformer, directory: str) -> None:
    """Save ``model`` (parameters + config) with orbax, atomically."""
    params = {k: np.asarray(v) for k, v in convert.flat_state_dict(model).items()}
    config = {**model.config.to_diffusers_config(), "_jax": _jax_fields(model.config)}
    convert.save_flax_state(directory, params, config)


def load(directory: str, **config_overrides: Any) -> Ideogram4Transformer:
    """Load what :func:`save` wrote; ``config_overrides`` may change the JAX-side fields (layout, dtypes)."""
    config, params = convert.load_flax_state(directory)
    saved = config.pop("_jax", {})
    saved_scan = bool(saved.get("scan_layers", False))
    jax_fields = {"dtype": jnp.dtype(saved.get("dtype", "float32")),
                  "param_dtype": jnp.dtype(saved.get("param_dtype", "float32")),
                  "attention_impl": saved.get("attention_impl", "xla"), "scan_layers": saved_scan}
    cfg = Ideogram4Config.from_diffusers_config(config, **{**jax_fields, **config_overrides})
    if saved_scan and not cfg.scan_layers:
        params = unstack_layer_params(params, cfg.num_layers)
    elif cfg.scan_layers and not saved_scan:
        params = stack_layer_params(params, cfg.num_layers)
    params = {k: np.asarray(v).astype(jnp.dtype(cfg.param_dtype)) for k, v in params.items()}
    return convert.merge_flat_state(lambda: new_model(cfg), params)

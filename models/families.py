"""The model families behind one interface, and the registry that finds a checkpoint's family.

Each family lives in its own file (``models.pixart``, ``models.sana``, ``models.flux``, ``models.ideogram4``) with the
same pieces: a frozen config dataclass whose presets match real checkpoints (``from_diffusers_config`` /
``to_diffusers_config``), the Flax NNX model (module names = diffusers keys, so a linear's dotted path is its diffusers
key prefix) and its declarative ``KEY_TABLE`` (``models.convert``: named transforms; unknown, missing or mis-shaped
keys raise). A :class:`Family` joins them with the family's sampler, so that callers never branch on the family:

    family, config = families.detect_dir("ckpt/transformer")       # from config.json's _class_name
    cfg, model = family.from_diffusers("ckpt/transformer", dtype="bfloat16")
    family.linear_sites(model)                                      # the quantizable linears (W4A4)
    family.shared_inputs(model)                                     # their groups that read one input (q|k|v, ...)
    sample = jax.jit(family.make_sampler(graphdef, cfg, num_steps=20, guidance_scale=4.5, latent_hw=(128, 128)))
    family.to_diffusers(model, "out/transformer")                  # the exact inverse of the conversion

``REGISTRY`` maps a family name (``"pixart"``, ``"sana"``, ``"flux"``, ``"ideogram4"``) to its :class:`Family`;
:func:`detect` maps a diffusers ``_class_name``. Every family takes the same optional
:class:`models.layers.LinearHooks` in its forward pass (quantized overrides, capture recorders, fused sites).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from models import convert, flux, ideogram4, ideogram4_sampling, pixart, sampling, sana
from models.layers import InitKeys, device_init, host_init, linears

__all__ = ["CAPTION_KEYS_VALUES", "FLUX", "Family", "IDEOGRAM4", "PIXART", "REGISTRY", "SANA", "SharedInputGroups",
           "TextOnlyInputs", "detect", "detect_dir", "differing_fields", "family_of", "get", "load_diffusers",
           "load_pipeline_transformers"]

#: ``model -> groups``: the model's quantizable linears that read the identical input tensor, each group a tuple of
#: dotted paths in the order their outputs are stacked when the group runs as one linear (``Family.shared_inputs``).
SharedInputGroups = Callable[[nnx.Module], tuple[tuple[str, ...], ...]]


@dataclasses.dataclass(frozen=True)
class TextOnlyInputs:
    """The linears of a family whose input is a function of the text inputs alone.

    Such an input does not depend on the image or the denoising step (PixArt-Σ and SANA: every block's cross-attention
    ``attn2.to_k`` / ``attn2.to_v`` reads the projected caption), so sampling a few prompts records only the tokens of
    those prompts, however many steps run; ``models.capture`` can instead compute these rows directly from the text
    inputs of many more prompts (``CaptureConfig.text_rows_from_all_prompts``).

    Attributes:
        layers: ``model -> dotted paths`` of those linears, in graph order. The caption projection's own linears
            (16-bit, never quantized) are not listed: they are captured from the sampling runs like any other layer.
        inputs: ``(model, context (b, t, c)) -> (b, t, d)``, the input every one of ``layers`` reads, a pure function
            computed token by token (row ``[i, k]`` depends on ``context[i, k]`` alone). The text mask never enters
            it (the models use the mask only to bias the attention): it only says which rows are real tokens.
    """

    layers: Callable[[nnx.Module], tuple[str, ...]]
    inputs: Callable[[nnx.Module, jax.Array], jax.Array]


def _cross_attention_kv(model: nnx.Module) -> tuple[str, ...]:
    """The paths of every block's cross-attention key and value projections (PixArt-Σ, SANA)."""
    return tuple(linear.path for block in model.transformer_blocks if block.attn2 is not None
                 for linear in (block.attn2.to_k, block.attn2.to_v))


#: PixArt-Σ and SANA: the cross-attention keys / values read ``model.caption_context(context)`` (PixArt: the caption
#: projection; SANA: the caption projection and its RMSNorm).
CAPTION_KEYS_VALUES = TextOnlyInputs(layers=_cross_attention_kv,
                                     inputs=lambda model, context: model.caption_context(context))


def _no_shared_inputs(model: nnx.Module) -> tuple[tuple[str, ...], ...]:
    """A family without linears that read the same input."""
    return ()


def _self_and_cross_attention_groups(model: nnx.Module) -> tuple[tuple[str, ...], ...]:
    """PixArt-Σ and SANA, per block: ``attn1.to_q|to_k|to_v`` (each reads the modulated ``norm1`` output) and
    ``attn2.to_k|to_v`` (each reads the caption context, under the same caption mask). ``attn2.to_q`` reads the
    image tokens (the residual stream), so it is in no group."""
    groups = []
    for block in model.transformer_blocks:
        attn1 = block.attn1
        groups.append((attn1.to_q.path, attn1.to_k.path, attn1.to_v.path))
        if block.attn2 is not None:
            groups.append((block.attn2.to_k.path, block.attn2.to_v.path))
    return tuple(groups)


def _flux_groups(model: nnx.Module) -> tuple[tuple[str, ...], ...]:
    """FLUX.1: per double-stream block ``attn.to_q|to_k|to_v`` (the modulated image tokens) and
    ``attn.add_q_proj|add_k_proj|add_v_proj`` (the modulated text tokens); per single-stream block
    ``attn.to_q|to_k|to_v|proj_mlp`` (all four read the one modulated norm of the joint sequence; ``proj_out`` reads
    their concatenated results). The feed-forwards' up projections read their own norms: no group."""
    groups = []
    for block in model.transformer_blocks:
        attn = block.attn
        groups.append((attn.to_q.path, attn.to_k.path, attn.to_v.path))
        groups.append((attn.add_q_proj.path, attn.add_k_proj.path, attn.add_v_proj.path))
    for block in model.single_transformer_blocks:
        attn = block.attn
        groups.append((attn.to_q.path, attn.to_k.path, attn.to_v.path, block.proj_mlp.path))
    return tuple(groups)


def _ideogram4_groups(model: nnx.Module) -> tuple[tuple[str, ...], ...]:
    """Ideogram 4, per block: ``attention.to_q|to_k|to_v`` (the modulated ``attention_norm1`` output) and
    ``feed_forward.w1|w3`` (the modulated ``ffn_norm1`` output; served fused with the SwiGLU). Scanned blocks
    (``scan_layers``) share their paths: one group of each kind."""
    blocks = [model.layers] if model.config.scan_layers else list(model.layers)
    groups = []
    for block in blocks:
        attention, mlp = block.attention, block.feed_forward
        groups.append((attention.to_q.path, attention.to_k.path, attention.to_v.path))
        groups.append((mlp.w1.path, mlp.w3.path))
    return tuple(groups)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config type, model constructor, key table, presets and sampler.

    Attributes:
        name: the registry name (``"pixart"``, ...).
        class_name: diffusers' ``_class_name`` of the transformer.
        config_type: the frozen config dataclass (``from_diffusers_config(dict)``, ``to_diffusers_config()``).
        new_model: ``(cfg, dtype np.dtype | None) -> model``: the plain constructor (any init; run under
            ``nnx.eval_shape`` for shapes). ``dtype`` None means the family's default (float32, or the config's
            ``param_dtype`` for Ideogram 4).
        key_table: diffusers keys <-> flax paths of the list (diffusers) layout of the blocks.
        presets: ``{name: config}`` of real checkpoints.
        sampler: ``(graphdef, cfg, *, num_steps, guidance_scale, latent_hw, shift, solver, hooks_factory) ->
            sample(params, key) -> (latents, aux per step)`` (see ``models.sampling.make_sampler``).
        prompt_inputs: the text inputs the sampler's ``params`` need (e.g. ``("context", "mask", "uncond_context",
            "uncond_mask")``).
        prompt_widths: ``cfg -> {input: feature width}`` of the float text inputs (for synthetic prompts).
        config_attr: the attribute of a model holding its config.
        list_layout: ``cfg -> cfg`` of the layout the key table describes (Ideogram 4's scanned blocks are stored in
            the list layout); None = the config's own layout.
        stack: ``(flat params, cfg) -> flat params`` from the list layout to ``cfg``'s layout; ``unstack`` its inverse.
        text_only: the linears whose input is a function of the text alone (:class:`TextOnlyInputs`), or None when
            the family has none. FLUX.1 has none: its text stream's block linears (``add_q/k/v_proj``, ``to_add_out``,
            ``ff_context``) read the context modulated by the timestep embedding (AdaLN-Zero), and after the first
            block a context that the joint attention has mixed with the image tokens; only the 16-bit
            ``context_embedder`` reads the text alone. Ideogram 4 has none: its text tokens are embedded
            (``llm_cond_proj``, 16-bit) into the one packed sequence beside the image tokens, and every block linear
            reads that sequence after timestep-modulated norms and joint self-attention.
        shared_inputs: ``model -> groups`` of its quantizable linears that read the identical input tensor (each a
            tuple of dotted paths, in the order their outputs are stacked when the group is served as one linear:
            one activation transform, one quantizer call, one GEMM; ``kroquant_jax.shared_inputs`` calibrates a group
            as one layer named by its paths joined by ``|``). No linear is in two groups.
        latent_multiple: ``cfg -> int``: the sampler's ``latent_hw`` must be multiples of it (the patch size of
            PixArt / SANA, FLUX.1's 2 x 2 packing; Ideogram 4's ``latent_hw`` is its token grid already).
    """

    name: str
    class_name: str
    config_type: type
    new_model: Callable[[Any, np.dtype | None], nnx.Module]
    key_table: convert.KeyTable
    presets: Mapping[str, Any]
    sampler: Callable[..., Callable]
    prompt_inputs: tuple[str, ...]
    prompt_widths: Callable[[Any], dict[str, int]]
    config_attr: str = "cfg"
    list_layout: Callable[[Any], Any] | None = None
    stack: Callable[[dict, Any], dict] | None = None
    unstack: Callable[[dict, Any], dict] | None = None
    text_only: TextOnlyInputs | None = None
    shared_inputs: SharedInputGroups = _no_shared_inputs
    latent_multiple: Callable[[Any], int] = lambda cfg: 1

    # -- configs ----------------------------------------------------------------------------------------------------

    def config_from_diffusers(self, config: Mapping[str, Any]) -> Any:
        """The family's config from a diffusers ``config.json`` dict (unknown or unported settings raise)."""
        return self.config_type.from_diffusers_config(dict(config))

    def check_latent_hw(self, cfg: Any, latent_hw: tuple[int, int]) -> None:
        """Raises ``ValueError`` when ``latent_hw`` (H, W) is not a positive multiple of :attr:`latent_multiple` (the
        sampler would fail inside the trace, with a message about its own arrays)."""
        multiple = self.latent_multiple(cfg)
        if any(v <= 0 or v % multiple for v in latent_hw):
            raise ValueError(f"latent size {tuple(latent_hw)}: a {self.name} model needs positive multiples of "
                             f"{multiple}")

    def config_of(self, model: nnx.Module) -> Any:
        """The config a model was built with."""
        return getattr(model, self.config_attr)

    # -- models -----------------------------------------------------------------------------------------------------

    def construct(self, cfg: Any, dtype: Any = None) -> nnx.Module:
        """The plain constructor (eager, any init); use under ``nnx.eval_shape`` for shapes without memory."""
        return self.new_model(cfg, convert.resolve_dtype(dtype))

    def build(self, cfg: Any, dtype: Any = None, seed: int = 0, on_device: bool = False) -> nnx.Module:
        """A randomly initialised model (:func:`models.layers.host_init`; for tests and training). ``on_device``:
        the same distributions drawn on the device (:func:`models.layers.device_init`; other values; for large
        random-weight benchmarks)."""
        return (device_init if on_device else host_init)(lambda: self.construct(cfg, dtype), seed)

    def linear_sites(self, model: nnx.Module, quantizable_only: bool = True) -> list[str]:
        """Dotted paths of the model's linears (by default the quantizable ones: the W4A4 sites), in graph order."""
        return list(linears(model, quantizable_only=quantizable_only))

    def make_sampler(self, graphdef: nnx.GraphDef, cfg: Any, **options: Any) -> Callable:
        """The family's jitted-ready sampling run ``sample(params, key) -> (latents, aux per step)``; ``options`` as
        ``models.sampling.make_sampler`` (``num_steps``, ``guidance_scale``, ``latent_hw``, ``shift``, ``solver``,
        ``hooks_factory``)."""
        return self.sampler(graphdef, cfg, **options)

    # -- conversion -------------------------------------------------------------------------------------------------

    def from_diffusers_state(self, state: Mapping[str, np.ndarray], cfg: Any, dtype: Any = None) -> nnx.Module:
        """The model of ``cfg`` from a diffusers state dict ``{key: np.ndarray}`` (torch layout), parameters cast to
        ``dtype`` (None: the family's default).

        Raises:
            convert.ConversionError: listing every missing, unexpected and mis-shaped key at once.
        """
        stored_cfg = cfg if self.list_layout is None else self.list_layout(cfg)
        build_stored = functools.partial(self.construct, stored_cfg, dtype)
        shapes = convert.abstract_shapes(build_stored)
        params = self.key_table.to_flax(state, shapes, dtype=_param_dtype(build_stored))
        if stored_cfg != cfg:
            params = self.stack(params, cfg)
        return convert.merge_flat_state(functools.partial(self.construct, cfg, dtype), params)

    def from_diffusers(self, directory: str | os.PathLike, dtype: Any = None,
                       config_overrides: Mapping[str, Any] | None = None) -> tuple[Any, nnx.Module]:
        """``(cfg, model)`` of a diffusers transformer directory (config.json + safetensors, single or sharded).

        ``dtype``: the parameter dtype (None: the family's default). ``config_overrides`` replace fields of the
        config read from the file (e.g. Ideogram 4's JAX-side ``scan_layers``, ``attention_impl`` and its compute
        ``dtype``).

        Raises:
            convert.CheckpointError: unreadable files (named). ValueError: a config of another family (naming the
            file and its class) or unported settings. convert.ConversionError: every bad key at once.
        """
        config, state = convert.read_diffusers_dir(directory)
        found = detect(config, source=str(Path(directory) / convert.CONFIG_NAME))
        if found is not self:
            raise ValueError(f"{Path(directory) / convert.CONFIG_NAME}: a {found.class_name} checkpoint, not "
                             f"{self.class_name}")
        cfg = self.config_from_diffusers(config)
        if config_overrides:
            cfg = dataclasses.replace(cfg, **dict(config_overrides))
        return cfg, self.from_diffusers_state(state, cfg, dtype)

    def to_diffusers_state(self, model: nnx.Module, dtype: Any = None) -> dict[str, np.ndarray]:
        """The diffusers state dict of ``model`` (the exact inverse of :meth:`from_diffusers_state`)."""
        params = {k: np.asarray(v) for k, v in convert.flat_state_dict(model).items()}
        cfg = self.config_of(model)
        if self.list_layout is not None and self.list_layout(cfg) != cfg:
            params = self.unstack(params, cfg)
        return self.key_table.to_diffusers(params, dtype=dtype)

    def to_diffusers(self, model: nnx.Module, directory: str | os.PathLike, dtype: Any = None,
                     max_shard_bytes: int | None = None) -> None:
        """Write ``model`` as a diffusers directory (loadable by the diffusers class's ``from_pretrained``)."""
        convert.write_diffusers_dir(directory, self.config_of(model).to_diffusers_config(),
                                    self.to_diffusers_state(model, dtype), max_shard_bytes=max_shard_bytes)


def _param_dtype(build: Callable[[], nnx.Module]) -> np.dtype:
    """The dtype of the (first) kernel of the model ``build()`` would create (nothing is allocated)."""
    flat = convert.flat_state_dict(nnx.eval_shape(build))
    return np.dtype(next(value.dtype for path, value in flat.items() if path.endswith(".kernel")))


def _dit_model(model_type: type) -> Callable[[Any, np.dtype | None], nnx.Module]:
    """The constructor of a PixArt / SANA / FLUX model (dtype = parameters and compute, default float32)."""
    def new_model(cfg: Any, dtype: np.dtype | None) -> nnx.Module:
        return model_type(cfg, dtype=np.dtype(np.float32) if dtype is None else dtype, rngs=InitKeys(0))

    return new_model


def _caption_widths(cfg: Any) -> dict[str, int]:
    width = cfg.caption_channels if cfg.caption_channels is not None else cfg.cross_attention_dim
    return {"context": width, "uncond_context": width}


_CAPTION_INPUTS = ("context", "mask", "uncond_context", "uncond_mask")

def _dit_family(module: Any, config_type: type, model_type: type, presets: Mapping[str, Any],
                prompt_inputs: tuple[str, ...], prompt_widths: Callable[[Any], dict[str, int]],
                shared_inputs: SharedInputGroups, latent_multiple: Callable[[Any], int],
                text_only: TextOnlyInputs | None = None) -> Family:
    """A PixArt / SANA / FLUX family: its module's CLASS_NAME and KEY_TABLE, ``models.sampling.make_sampler``."""
    name = module.__name__.rsplit(".", 1)[-1]
    return Family(name=name, class_name=module.CLASS_NAME, config_type=config_type, new_model=_dit_model(model_type),
                  key_table=module.KEY_TABLE, presets=presets, sampler=functools.partial(sampling.make_sampler, name),
                  prompt_inputs=prompt_inputs, prompt_widths=prompt_widths, text_only=text_only,
                  shared_inputs=shared_inputs, latent_multiple=latent_multiple)


PIXART = _dit_family(pixart, pixart.PixArtConfig, pixart.PixArtTransformer2DModel,
                     {"PixArt-Sigma-XL-2-1024-MS": pixart.PIXART_SIGMA_XL_2_1024_MS}, _CAPTION_INPUTS, _caption_widths,
                     _self_and_cross_attention_groups, lambda cfg: cfg.patch_size, CAPTION_KEYS_VALUES)
SANA = _dit_family(sana, sana.SanaConfig, sana.SanaTransformer2DModel,
                   {"Sana_1600M_1024px": sana.SANA_1600M_1024PX}, _CAPTION_INPUTS, _caption_widths,
                   _self_and_cross_attention_groups, lambda cfg: cfg.patch_size, CAPTION_KEYS_VALUES)
FLUX = _dit_family(flux, flux.FluxConfig, flux.FluxTransformer2DModel, {"FLUX.1-schnell": flux.FLUX1_SCHNELL},
                   ("context", "pooled"),
                   lambda cfg: {"context": cfg.joint_attention_dim, "pooled": cfg.pooled_projection_dim}, _flux_groups,
                   lambda cfg: 2)  # pack_latents: 2 x 2 latent patches per token

IDEOGRAM4 = Family(
    name="ideogram4", class_name=ideogram4.CLASS_NAME, config_type=ideogram4.Ideogram4Config,
    new_model=ideogram4.new_model, key_table=ideogram4.KEY_TABLE, presets={"Ideogram-4": ideogram4.IDEOGRAM4},
    sampler=ideogram4_sampling.make_sampler, prompt_inputs=("context", "mask"),
    prompt_widths=lambda cfg: {"context": cfg.llm_features_dim}, config_attr="config",
    list_layout=lambda cfg: dataclasses.replace(cfg, scan_layers=False),
    stack=lambda params, cfg: ideogram4.stack_layer_params(params, cfg.num_layers),
    unstack=lambda params, cfg: ideogram4.unstack_layer_params(params, cfg.num_layers),
    shared_inputs=_ideogram4_groups)

#: ``{family name: Family}``.
REGISTRY: dict[str, Family] = {family.name: family for family in (PIXART, SANA, FLUX, IDEOGRAM4)}
_BY_CLASS = {family.class_name: family for family in REGISTRY.values()}


def family_of(model: nnx.Module) -> Family:
    """The registered family a model belongs to (by the type of the config it was built with)."""
    for family in REGISTRY.values():
        if isinstance(getattr(model, family.config_attr, None), family.config_type):
            return family
    raise ValueError(f"{type(model).__name__} is not a model of a registered family ({sorted(REGISTRY)})")


def get(name: str) -> Family:
    """The family registered as ``name``.

    Raises:
        ValueError: naming the unknown family and the known ones.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]


def detect(config: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family of a diffusers ``config.json`` dict, from its ``_class_name``.

    Raises:
        ValueError: naming ``source`` (the file) and the class when the class is missing or not a known family.
    """
    class_name = config.get("_class_name")
    if class_name not in _BY_CLASS:
        raise ValueError(f"{source}: _class_name {class_name!r} is not a supported model family "
                         f"(supported: {', '.join(sorted(_BY_CLASS))})")
    return _BY_CLASS[class_name]


def differing_fields(ours: Any, theirs: Any) -> list[str]:
    """The fields of two model configs of one dataclass type whose values differ, in field order (``[]``: the same
    model architecture), for errors that name them."""
    if type(ours) is not type(theirs):
        raise TypeError(f"differing_fields: {type(ours).__name__} and {type(theirs).__name__} are different configs")
    return [f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(theirs, f.name)]


def detect_dir(directory: str | os.PathLike) -> tuple[Family, dict[str, Any]]:
    """``(family, config dict)`` of a diffusers transformer directory (reads only its config.json)."""
    config = convert.read_diffusers_config(directory)
    return detect(config, source=str(Path(directory) / convert.CONFIG_NAME)), config


def check_same_model(directory: str | os.PathLike, other: str | os.PathLike) -> Family:
    """The family of two diffusers transformer directories (e.g. a quantized checkpoint folder and the 16-bit folder
    it was made from), read from their config.json files only.

    Raises:
      ValueError: an unreadable or unknown config, another family, or the config fields in which they differ (named).
    """
    (family, ours), (other_family, theirs) = detect_dir(directory), detect_dir(other)
    differ = (["family"] if other_family is not family else
              differing_fields(family.config_from_diffusers(ours), family.config_from_diffusers(theirs)))
    if differ:
        raise ValueError(f"{other}: not the model of {directory} (config differs in {differ})")
    return family


def load_diffusers(directory: str | os.PathLike, dtype: Any = None, config_overrides: Mapping[str, Any] | None = None
                   ) -> tuple[Family, Any, nnx.Module]:
    """``(family, cfg, model)`` of a diffusers transformer directory of any registered family (arguments as
    :meth:`Family.from_diffusers`)."""
    family, _ = detect_dir(directory)
    cfg, model = family.from_diffusers(directory, dtype, config_overrides)
    return family, cfg, model


def load_pipeline_transformers(pipeline_dir: str | os.PathLike, *subfolders: str, dtype: Any = None,
                               config_overrides: Mapping[str, Any] | None = None) -> list[nnx.Module]:
    """The transformers of a local diffusers pipeline directory, one per subfolder (default ``transformer``), e.g.
    Ideogram 4's ``"transformer", "unconditional_transformer"``; each family detected from its config.json."""
    return [load_diffusers(Path(pipeline_dir) / sub, dtype, config_overrides)[2]
            for sub in (subfolders or ("transformer",))]

"""A self-contained quantized checkpoint folder: everything needed to run the W4A4 model, nothing else.

Layout of a folder written by :func:`save_quantized_checkpoint` (format version :data:`FORMAT_VERSION`):

* ``config.json``: the model's diffusers config (``_class_name`` picks the family, ``models.families``).
* ``model.safetensors``: the model's diffusers state dict (diffusers keys, torch layout: a linear's ``weight`` is
  ``(out, in)``, exactly what the family's ``to_diffusers_state`` writes), in the model's dtype, *without* the
  quantized linears' ``weight`` and ``bias`` (a linear's NNX path is its diffusers key prefix, so layer ``NAME``
  replaces ``NAME.weight`` / ``NAME.bias``). JAX (``models.families``) and torch (``models.torch_w4a4``) read it
  alike.
* ``quantized.safetensors``: for every quantized linear ``NAME``, the arrays of
  :func:`kroquant_jax.qlinear.to_state` under ``NAME/KEY``: ``NAME/blocks`` (the transform's blocks ``(d/n, n, n)``),
  ``NAME/transform_params.I`` (the parameterization's leaves), ``NAME/weight.codes`` ``uint8 (o, d/2)`` and
  ``NAME/weight.scales`` (the packed MXFP4 / NVFP4 residual and its block scales; NVFP4 adds its per-tensor scale),
  ``NAME/lowrank_left*`` / ``NAME/lowrank_right*`` (the low-rank branch, packed for LoRaQ, float32 for SVDQuant) and
  ``NAME/bias``.
* ``quantization_config.json``: ``format_version``, ``numerics_version`` (:data:`kroquant_jax.provenance
  .NUMERICS_VERSION`), ``class_name``, ``weight_format``, ``recipe`` (name) and ``settings`` (every recipe setting,
  dotted), ``layers`` (``{NAME: {"meta": to_state's metadata, "replaces": {diffusers key: shape}, "heldout_error":
  float}}``; a fused layer adds ``"members": [paths]``), ``left_16bit``
  (``{NAME: reason}``), ``extra`` (the writer's notes, e.g. the sampler of its evaluation) and ``files_sha256``
  (the SHA-256 of ``model.safetensors`` and ``quantized.safetensors``, so that a digest of this file keys the
  weights; folders written before it have none).

**Fused layers.** A layer named ``a|b|c`` (``kroquant_jax.shared_inputs.fused_name``) is one ``QuantizedLinear`` of
linears that read the same input, their weights stacked along the outputs (one transform, one low-rank branch, as
the fused GEMM serves them): it replaces every member's ``weight`` / ``bias``, and :meth:`QuantizedCheckpoint.overrides`
gives each member its rows of the fused output (``models.quantize_model.split_qlinear_overrides``, at the members' own
output widths: q|k|v and w1|w3 split equally, FLUX.1's single-block q|k|v|proj_mlp 3 x 3072 + 12288).

:func:`load_quantized_checkpoint` rebuilds the model (the quantized linears' 16-bit kernels are zeros: they are never
used, the W4A4 layers replace them through :meth:`QuantizedCheckpoint.overrides`) and the ``{name: QuantizedLinear}``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

__all__ = ["FORMAT_VERSION", "QuantizedCheckpoint", "layer_members", "linear_overrides", "load_quantized_checkpoint",
           "save_quantized_checkpoint"]

FORMAT_VERSION = 2


@dataclasses.dataclass
class QuantizedCheckpoint:
    """A loaded quantized checkpoint.

    Attributes:
      family: the family's name in ``models.families`` (``"pixart"``, ``"sana"``, ``"flux"``, ``"ideogram4"``).
      cfg: the family's config dataclass.
      model: the NNX model (quantized linears' kernels are zero placeholders).
      qlayers: ``{name: QuantizedLinear}``.
      config: the parsed ``quantization_config.json``.
    """

    family: str
    cfg: Any
    model: Any
    qlayers: dict
    config: dict

    def overrides(self, forward=None) -> Any:
        """The per-linear overrides that run the W4A4 layers (:func:`linear_overrides`: a fused layer's members each
        take their rows of its output)."""
        return linear_overrides(self.qlayers, self.model, forward)

    def served_overrides(self, options: Any = None, *, jit: bool = False) -> Any:
        """The linear overrides that run the W4A4 layers served (``pallas_kernels.served``: prepared once with
        ``options.strategy``, then its packed forward; ``options.impl`` None runs the compiled kernels on a GPU and the
        jnp reference elsewhere). ``options`` None: ``served.default_strategy`` of these layers on this device
        (``"fp8_mgpu"`` on Hopper where it serves every layer, else ``"dequant"``). A padded layer
        (``QLinearConfig.input_pad``) gets its inputs zero-padded first.

        ``jit``: prepare every layer in one jitted program (one compile, where op by op each operation compiles on
        its own for every layer shape; what the benchmarks' tiny CPU runs use). Off by default: ``kroquant generate``
        prepares op by op, and one program would let XLA change the prepared bits on a GPU (it may drop a rounding to
        a narrower float inside a program).

        Returns a ``models.layers.SharedOverrides`` (each served layer held once; see :func:`linear_overrides`).

        Raises:
          ValueError: naming a layer the strategy cannot serve (e.g. activations and weight in other formats).
        """
        from pallas_kernels import served

        from models.layers import SharedOverrides

        if jit:
            import jax

            names = list(self.qlayers)  # a jitted dict comes back in sorted key order: keep the layers' order
            return jax.jit(lambda qlayers: dataclasses.replace(self, qlayers={n: qlayers[n] for n in names})
                           .served_overrides(options))(self.qlayers)
        if options is None:
            options = served.ServeOptions(strategy=served.default_strategy(self.qlayers.values())[0])
        parts = []
        for name, layer in self.qlayers.items():
            try:
                prepared = served.serve(layer, strategy=options.strategy)
            except (TypeError, ValueError) as err:
                raise ValueError(f"layer {name!r}: strategy {options.strategy!r} cannot serve it: {err}") from None
            forward = functools.partial(_compiled_served_forward(), options=options, pad=layer.config.input_pad)
            parts.append(_layer_overrides(name, prepared, self.model, forward))
        return SharedOverrides.merged(*parts)


def layer_members(name: str, model: Any) -> tuple[str, ...]:
    """The linears of ``model`` a stored layer ``name`` replaces: itself, or a fused layer's members
    (``kroquant_jax.shared_inputs.members_of``).

    Raises:
      ValueError: a member that is no linear of the model (its output widths are :func:`member_widths`).
    """
    from kroquant_jax.shared_inputs import members_of
    from models.layers import linears

    members = members_of(name)
    available = linears(model)
    unknown = [m for m in members if m not in available]
    if unknown:
        which = f"quantized layer {name!r}" if len(members) == 1 else f"member {unknown[0]!r} of fused layer {name!r}"
        raise ValueError(f"{which} is not a linear of the model (e.g. {sorted(available)[:3]})")
    return members


def member_widths(members: tuple[str, ...], model: Any) -> list[int]:
    """The output widths of ``members`` (linears of ``model``), in order: how a fused output is split."""
    from models.layers import linears

    available = linears(model)
    return [available[m].out_features for m in members]


def linear_overrides(qlayers: Mapping[str, Any], model: Any, forward=None) -> Any:
    """``{linear path: override}`` of ``{name: QuantizedLinear}`` (``models.quantize_model.qlinear_overrides``),
    where a fused layer ``a|b|c`` gives each member its rows of the fused output
    (``models.quantize_model.split_qlinear_overrides``), as one ``models.layers.SharedOverrides`` (each
    layer held once: a fused layer runs once in a jitted sampler that takes the overrides as an argument);
    :func:`layer_members` checks the names against ``model``."""
    from models.layers import SharedOverrides

    return SharedOverrides.merged(*(_layer_overrides(name, layer, model, forward) for name, layer in qlayers.items()))


def _layer_overrides(name: str, layer: Any, model: Any, forward) -> Any:
    """The ``SharedOverrides`` of one stored layer: its members' rows (a fused layer) or the whole layer."""
    from models import quantize_model

    members = layer_members(name, model)
    if len(members) > 1:
        return quantize_model.split_qlinear_overrides(layer, list(members), forward,
                                                      widths=member_widths(members, model), name=name)
    return quantize_model.whole_layer_overrides(layer, name, forward)


@functools.cache
def _compiled_served_forward():
    """One served layer's forward compiled as a unit: a model's calls of one shape and options then trace and lower
    its kernels once (28 PixArt-Σ blocks' 280 layers would otherwise lower their kernels 280 times)."""
    import jax

    return jax.jit(_served_forward, static_argnames=("options", "pad"))


def _served_forward(layer: Any, x: Any, *, options: Any, pad: int) -> Any:
    import jax.numpy as jnp

    from pallas_kernels import served

    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])  # (..., in_features)
    return served.forward(layer, x, options=options)


def save_quantized_checkpoint(directory: str | os.PathLike, model: Any, qlayers: Mapping[str, Any], *,
                              recipe_name: str, recipe: Any, reports: Mapping[str, Mapping] | None = None,
                              left_16bit: Mapping[str, str] | None = None, extra: Mapping | None = None) -> None:
    """Writes ``model`` with its ``qlayers`` as a self-contained folder (layout: module doc), atomically (a temporary
    folder renamed onto ``directory``, replacing an older one).

    Args:
      directory: the folder to write.
      model: the 16-bit NNX model of a registered family (``models.families``).
      qlayers: ``{linear path: QuantizedLinear}``; every name must be a linear of ``model``, or a fused layer
        ``a|b|c`` of linears that read one input (its output features: the members' in that order).
      recipe_name, recipe: the recipe's name and object (its settings are recorded).
      reports: optional per-layer reports (``heldout_error`` is recorded).
      left_16bit: ``{name: reason}`` of the linears left unquantized.
      extra: JSON-able notes stored under ``extra``.
    """
    from kroquant_jax import provenance, qlinear
    from kroquant_jax.fileio import atomic_write_json, publishable, replace_folder
    from models import convert, families
    from models.layers import linears

    family = families.family_of(model)
    diffusers_config = family.config_of(model).to_diffusers_config()
    available = linears(model)
    members = {name: layer_members(name, model) for name in qlayers}
    params = {k: np.ascontiguousarray(v) for k, v in family.to_diffusers_state(model).items()}
    arrays, layers = {}, {}
    for name, layer in qlayers.items():
        out_features = sum(available[m].out_features for m in members[name])
        if layer.config.out_features != out_features:
            raise ValueError(f"quantized layer {name!r}: {layer.config.out_features} output features, the model's "
                             f"linear(s) {list(members[name])} have {out_features}")
        replaced = {}
        for member in members[name]:
            if f"{member}.weight" not in params:
                raise ValueError(f"quantized layer {name!r}: no diffusers key {member}.weight in the model's state "
                                 f"(or two stored layers replace {member})")
            replaced.update({k: list(params[k].shape) for k in (f"{member}.weight", f"{member}.bias")
                             if k in params})
        for key in replaced:
            del params[key]
        state, meta = qlinear.to_state(layer)
        arrays.update({f"{name}/{k}": np.ascontiguousarray(v) for k, v in state.items()})
        layers[name] = {"meta": meta, "replaces": replaced}
        if len(members[name]) > 1:
            layers[name]["members"] = list(members[name])
        if reports and name in reports and reports[name].get("heldout_error") is not None:
            layers[name]["heldout_error"] = float(reports[name]["heldout_error"])
    first = next(iter(qlayers.values()), None)
    config = {"format_version": FORMAT_VERSION, "numerics_version": provenance.NUMERICS_VERSION,
              "class_name": diffusers_config["_class_name"],
              "weight_format": None if first is None else type(first.weight.fmt).__name__,
              "recipe": recipe_name, "settings": provenance.recipe_settings(recipe), "layers": layers,
              "left_16bit": dict(left_16bit or {}), "extra": dict(extra or {})}
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        atomic_write_json(tmp / "config.json", diffusers_config)
        convert.write_safetensors(tmp / "model.safetensors", params, metadata={"format": "kroquant-diffusers-params"})
        convert.write_safetensors(tmp / "quantized.safetensors", arrays, metadata={"format": "kroquant-qlinears"})
        # the weights' digests in the folder's own record: what keys a run on the folder (kroquant generate's --out)
        # without hashing gigabytes again
        config["files_sha256"] = {name: provenance.file_digest(tmp / name)
                                  for name in ("model.safetensors", "quantized.safetensors")}
        atomic_write_json(tmp / "quantization_config.json", json.loads(json.dumps(config, default=float)))
        publishable(tmp)
        replace_folder(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def load_quantized_checkpoint(directory: str | os.PathLike, dtype: Any = None,
                              config_overrides: Mapping[str, Any] | None = None) -> QuantizedCheckpoint:
    """Loads a folder written by :func:`save_quantized_checkpoint`.

    Args:
      directory: the folder.
      dtype: the model's dtype (default: the stored parameters' dtype).
      config_overrides: JAX-side config fields to set (e.g. ``{"attention_impl": "cudnn"}``).

    Raises:
      ValueError: a missing file or another format version (named). convert.ConversionError: parameters that do not
        fit the config (every missing, unexpected and mis-shaped key).
    """
    from kroquant_jax import qlinear
    from models import convert, families

    directory = Path(directory)
    for name in ("config.json", "model.safetensors", "quantized.safetensors", "quantization_config.json"):
        if not (directory / name).exists():
            raise ValueError(f"{directory}: no {name} (not a quantized checkpoint folder written by kroquant)")
    qconfig = convert.read_json_object(directory / "quantization_config.json")  # a corrupt file named
    if qconfig.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory / 'quantization_config.json'}: format_version {qconfig.get('format_version')!r}"
                         f", this library reads {FORMAT_VERSION}")
    if not isinstance(qconfig.get("layers"), dict):
        raise ValueError(f"{directory / 'quantization_config.json'}: no 'layers' object (not written by kroquant)")
    config = convert.read_json_object(directory / "config.json")
    family = families.detect(config, str(directory / "config.json"))
    cfg = dataclasses.replace(family.config_from_diffusers(config), **dict(config_overrides or {}))
    state = convert.read_safetensors(directory / "model.safetensors")
    stored_dtype = next((v.dtype for v in state.values() if convert.is_float_dtype(v.dtype)), np.dtype(np.float32))
    np_dtype = convert.resolve_dtype(dtype) if dtype is not None else stored_dtype
    names = list(qconfig["layers"])
    for name in names:
        for key, shape in qconfig["layers"][name]["replaces"].items():
            state[key] = np.zeros(shape, stored_dtype)  # placeholder: the W4A4 layer replaces this linear
    model = family.from_diffusers_state(state, cfg, np_dtype)
    qlayers = {}
    arrays = convert.read_safetensors(directory / "quantized.safetensors")
    packed_file = directory / "quantized.safetensors"
    stray = sorted(k for k in arrays if k.partition("/")[0] not in qconfig["layers"])
    if stray:
        raise ValueError(f"{packed_file}: arrays of no layer in quantization_config.json: {stray[:5]}"
                         f"{' ...' if len(stray) > 5 else ''}")
    for name in names:
        prefix = f"{name}/"
        layer_state = {k[len(prefix):]: np.asarray(v) for k, v in arrays.items() if k.startswith(prefix)}
        if not layer_state:
            raise ValueError(f"{packed_file}: no arrays for layer {name!r}")
        try:
            qlayers[name] = qlinear.from_state(layer_state, qconfig["layers"][name]["meta"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{packed_file}: layer {name!r}: {err}") from None
    return QuantizedCheckpoint(family=family.name, cfg=cfg, model=model, qlayers=qlayers, config=qconfig)

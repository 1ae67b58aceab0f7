"""Run a kroquant quantized checkpoint folder in PyTorch / diffusers: the W4A4 simulation, no JAX needed.

    import torch
    from models.torch_w4a4 import load_w4a4_transformer

    transformer = load_w4a4_transformer("runs/pixart/quantized-kroquant_loraq", dtype=torch.bfloat16)
    pipe = diffusers.PixArtSigmaPipeline.from_pretrained("PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
                                                         transformer=transformer, torch_dtype=torch.bfloat16)

:func:`load_w4a4_transformer` reads a folder written by ``models.quantized_checkpoint.save_quantized_checkpoint``
(``kroquant quantize-checkpoint``'s ``OUT/quantized-RECIPE``), builds the diffusers transformer class named by its
``config.json`` (``_class_name``: PixArt-Σ, SANA, FLUX.1, Ideogram 4, the families of ``models.families``), loads the
16-bit weights of ``model.safetensors`` (diffusers keys; a missing, unexpected or mis-shaped key raises naming it)
and replaces every quantized ``nn.Linear`` (and SANA's 1x1 ``nn.Conv2d``) by a :class:`W4A4Linear` that computes the
simulated path of ``kroquant_jax.qlinear.qlinear_forward`` (paper eq. 11)::

    y = Q(x T) Q(W~ - L R)^T + (x T)(L R)^T + b

with the same numerics: the block transform ``T`` in f32, the activations fake-quantized per call in the layer's
activation format (:func:`fake_quant`: MXFP4 with E8M0 scales in the layer's scale mode, NVFP4 with E4M3 block scales
and a per-tensor scale over the whole input, E2M1 round to nearest with ties to even, subnormals flushed, a block
with NaN/Inf becomes NaN), the weight and a packed low-rank branch dequantized exactly from their codes and scales
(:func:`dequantize`), the products in f32, the result cast to the input's dtype.

The fake quantization and the dequantization are bit for bit those of ``kroquant_jax.formats`` (tested on CPU); a
whole forward agrees with the JAX W4A4 forward to float tolerance (the f32 matmuls sum in another order).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["W4A4Linear", "dequantize", "fake_quant", "load_w4a4_transformer", "w4a4_layer_from_state"]

#: The folder format this module reads (``models.quantized_checkpoint.FORMAT_VERSION``).
FORMAT_VERSION = 2
_FILES = ("config.json", "model.safetensors", "quantized.safetensors", "quantization_config.json")

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_THRESHOLDS_UP = (0.25, 1.25, 2.5, 5.0)  # a tie rounds down (to the even magnitude below): count v > t
_THRESHOLDS_UP_INCLUSIVE = (0.75, 1.75, 3.5)  # a tie rounds up (to the even magnitude above): count v >= t
_EXP_MASK = 0x7F800000
_E8M0_BIAS, _E8M0_NAN = 127, 0xFF
_E2M1_MAX, _E4M3_MAX, _E4M3_TINY = 6.0, 448.0, 2.0 ** -6


# ---------------------------------------------------------------------------------------------------------------------
# The FP4 formats (the math of kroquant_jax.formats, in torch)
# ---------------------------------------------------------------------------------------------------------------------


def _flush(x: torch.Tensor) -> torch.Tensor:
    """f32 subnormals -> signed zeros (bit test)."""
    bits = x.view(torch.int32)
    return torch.where((bits & _EXP_MASK) == 0, (bits & torch.iinfo(torch.int32).min).view(torch.float32), x)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` (int32 in ``[-126, 127]``) built from bits."""
    return ((exponent + 127).to(torch.int32) << 23).view(torch.float32)


def _e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (int64, bit 3 = sign) of f32 values in units of the block scale: nearest, ties to even, +-6."""
    mag = v.abs()
    idx = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    for t in _THRESHOLDS_UP:
        idx += (mag > t).to(torch.int64)
    for t in _THRESHOLDS_UP_INCLUSIVE:
        idx += (mag >= t).to(torch.int64)
    sign = ((v.view(torch.int32) >> 31) & 1).to(torch.int64)
    return sign << 3 | idx


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)[(codes & 0xF).to(torch.int64)]


def _mx_exponent(amax: torch.Tensor, mode: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32, in ``[-127, 127]``) of each block from its f32 absolute maximum."""
    bits = amax.view(torch.int32)
    if mode == "even":
        bits = (bits + (1 << 21)) & _EXP_MASK
    exp_field = (bits >> 23) & 0xFF
    floor_log2 = exp_field - 127
    if mode in ("floor", "even"):
        e = floor_log2 - 2
    elif mode == "ceil":
        e = floor_log2 + ((bits & 0x7FFFFF) > 0).to(torch.int32) - 2
    elif mode == "rceil":
        threshold = 1.5 * _pow2(floor_log2.clamp(-126, 127))
        e = torch.where(amax > threshold, floor_log2 - 1, floor_log2 - 2)
        e = torch.where(exp_field == 0, torch.full_like(e, -127), e)
    else:
        raise ValueError(f"unknown MXFP4 scale mode {mode!r} (known: floor, ceil, even, rceil)")
    return e.clamp(-_E8M0_BIAS, _E8M0_BIAS).to(torch.int32)


def _mx_values(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """f32 values of E2M1 codes ``(..., nb, block)`` with E8M0 bytes ``(..., nb)`` (byte 0 keeps its normal results,
    byte 0xFF is NaN, subnormal results flushed)."""
    values = _e2m1_decode(codes)
    b = scale_bytes.to(torch.int32)[..., None]
    scale_hi = (b.clamp(1, 254) << 23).view(torch.float32)
    out = torch.where(b == 0, (values * 2.0 ** -63) * 2.0 ** -64, values * scale_hi)
    out = torch.where(b == _E8M0_NAN, torch.full_like(out, float("nan")), out)
    return _flush(out)


def _nv_values(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """f32 values of E2M1 codes ``(..., nb, block)`` with E4M3 block scales ``(..., nb)`` and the tensor scale."""
    return _flush(_e2m1_decode(codes) * scales.to(torch.float32)[..., None] * tensor_scale)


def _nv_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """``amax(|x|) / (448 * 6)`` over the whole tensor (f32 0-d), ``1.0`` for an all-zero or empty one."""
    xf = _flush(x)
    amax = torch.where(torch.isfinite(xf), xf, torch.zeros_like(xf)).abs().amax() if xf.numel() else \
        torch.zeros((), dtype=torch.float32, device=x.device)
    divisor = torch.full_like(amax, _E4M3_MAX * _E2M1_MAX)
    return torch.where(amax > 0, amax / divisor, torch.ones_like(amax))


def _check_fmt(fmt: Mapping[str, Any], width: int) -> tuple[str, int]:
    name, block = fmt.get("name"), fmt.get("block_size")
    if name not in ("mxfp4", "nvfp4") or not isinstance(block, int) or block <= 0:
        raise ValueError(f"unknown quantization format {dict(fmt)!r} (expected mxfp4 or nvfp4 with a block_size)")
    if width % block:
        raise ValueError(f"{name}: width {width} is not a multiple of the block {block}")
    return name, block


def fake_quant(x: torch.Tensor, fmt: Mapping[str, Any]) -> torch.Tensor:
    """Quantize-then-dequantize ``x (..., d)`` along its last axis, bit for bit ``kroquant_jax.formats.fake_quant``.

    Args:
      x: ``(..., d)`` floating tensor (computed in f32), ``d`` a multiple of the block.
      fmt: the format's description (``QuantFormat.to_json()``: ``{"name": "mxfp4", "block_size": 32,
        "scale_mode": "floor"}`` or ``{"name": "nvfp4", "block_size": 16}``).

    Returns:
      f32 ``(..., d)``.
    """
    name, block = _check_fmt(fmt, x.shape[-1])
    x = _flush(x.to(torch.float32).contiguous())
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)  # (..., nb, block)
    bad = ~torch.isfinite(blocks)
    nonfinite = bad.any(dim=-1)  # (..., nb)
    amax = torch.where(bad, torch.zeros_like(blocks), blocks).abs().amax(dim=-1) if blocks.numel() else \
        blocks.new_zeros(blocks.shape[:-1])  # (..., nb)
    if name == "mxfp4":
        e = _mx_exponent(amax, fmt.get("scale_mode", "floor"))
        codes = _e2m1_encode(_flush(blocks * _pow2((-e).clamp(-126, 127))[..., None]))
        scale_bytes = torch.where(nonfinite, torch.full_like(e, _E8M0_NAN), e + _E8M0_BIAS)
        values = _mx_values(codes, scale_bytes)
    else:
        tensor_scale = _nv_tensor_scale(x)
        block_over_max = amax / torch.full_like(amax, _E2M1_MAX)
        s_blk = (block_over_max / tensor_scale.expand_as(amax)).clamp(_E4M3_TINY, _E4M3_MAX).to(torch.float8_e4m3fn)
        inv_tensor_scale = torch.ones_like(tensor_scale) / tensor_scale
        reciprocal = inv_tensor_scale.expand_as(amax) / s_blk.to(torch.float32)  # (..., nb)
        codes = _e2m1_encode(_flush(blocks * reciprocal[..., None]).clamp(-_E2M1_MAX, _E2M1_MAX))
        values = _nv_values(codes, s_blk, tensor_scale)
    values = torch.where(nonfinite[..., None], torch.full_like(values, float("nan")), values)
    return values.reshape(x.shape)


def dequantize(codes: np.ndarray | torch.Tensor, scales: np.ndarray | torch.Tensor, tensor_scale: float,
               fmt: Mapping[str, Any]) -> torch.Tensor:
    """The f32 values ``(..., d)`` of a stored ``QuantizedArray``, bit for bit ``kroquant_jax.formats.dequantize``.

    Args:
      codes: ``uint8 (..., d/2)``, element ``2i`` in the low nibble.
      scales: ``uint8 (..., d/block)``: E8M0 bytes (MXFP4) or the bytes of the E4M3 block scales (NVFP4).
      tensor_scale: NVFP4's per-tensor scale (ignored for MXFP4).
      fmt: the format's description (:func:`fake_quant`).
    """
    codes, scales = torch.as_tensor(np.array(codes)), torch.as_tensor(np.array(scales))
    name, block = _check_fmt(fmt, codes.shape[-1] * 2)
    unpacked = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)  # (..., d)
    grouped = unpacked.reshape(*unpacked.shape[:-1], unpacked.shape[-1] // block, block)
    if scales.shape != grouped.shape[:-1]:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes of shape {tuple(codes.shape)} "
                         f"({name}, block {block})")
    if name == "mxfp4":
        values = _mx_values(grouped, scales)
    else:
        values = _nv_values(grouped, scales.view(torch.float8_e4m3fn), torch.tensor(tensor_scale, dtype=torch.float32))
    return values.reshape(unpacked.shape)


# ---------------------------------------------------------------------------------------------------------------------
# The W4A4 layer
# ---------------------------------------------------------------------------------------------------------------------


def _as_bits(x: torch.Tensor | None) -> torch.Tensor | None:
    """An f32 tensor stored as its int32 bits, so that ``module.to(dtype)`` / ``.half()`` leave it exact (only
    floating tensors are cast; devices still move)."""
    return None if x is None else x.to(torch.float32).contiguous().view(torch.int32)


class W4A4Linear(nn.Module):
    """One quantized linear: eq. 11 with the simulated (fake-quant) activations; see the module docstring.

    Buffers (f32 values stored as int32 bits): ``blocks (d/n, n, n)``, ``weight (o, d)`` (the dequantized residual
    ``Q(W~ - L R)``), ``lowrank_left (o, r)`` / ``lowrank_right (r, d)`` (dequantized when packed) and ``bias (o,)``,
    the last three optional.

    Args:
      input_pad: zero columns appended to the input (a linear whose width is not a multiple of the block, padded to
        it: ``QLinearConfig.input_pad``); the layer takes inputs of width ``in_features - input_pad``.
      conv1x1: the layer replaces a 1x1 ``nn.Conv2d`` (SANA's GLUMBConv): inputs ``(b, d, h, w)``, channels first.
    """

    def __init__(self, blocks: torch.Tensor, weight: torch.Tensor, act_fmt: Mapping[str, Any],
                 lowrank_left: torch.Tensor | None = None, lowrank_right: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, input_pad: int = 0, conv1x1: bool = False):
        super().__init__()
        out_features, in_features = weight.shape
        if not 0 <= input_pad < in_features:
            raise ValueError(f"input_pad={input_pad} must be in [0, {in_features})")
        nb, n, _ = blocks.shape
        if nb * n != in_features:
            raise ValueError(f"transform blocks {tuple(blocks.shape)} do not fit a weight {tuple(weight.shape)}")
        _check_fmt(act_fmt, in_features)
        if (lowrank_left is None) != (lowrank_right is None) or (lowrank_left is not None and (
                lowrank_left.shape[0] != out_features or lowrank_right.shape[1] != in_features
                or lowrank_left.shape[1] != lowrank_right.shape[0])):
            raise ValueError(f"low-rank factors {None if lowrank_left is None else tuple(lowrank_left.shape)}, "
                             f"{None if lowrank_right is None else tuple(lowrank_right.shape)} do not fit a weight "
                             f"{tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias {tuple(bias.shape)} does not fit a weight {tuple(weight.shape)}")
        self.in_features, self.out_features, self.conv1x1 = in_features, out_features, conv1x1
        self.input_pad = input_pad
        self.act_fmt = dict(act_fmt)
        for name, value in (("blocks", blocks), ("weight", weight), ("lowrank_left", lowrank_left),
                            ("lowrank_right", lowrank_right), ("bias", bias)):
            self.register_buffer(name, _as_bits(value))

    def _f32(self, name: str) -> torch.Tensor | None:
        value = getattr(self, name)
        return None if value is None else value.view(torch.float32)

    @property
    def input_width(self) -> int:
        """The width of the inputs the layer takes (``in_features - input_pad``)."""
        return self.in_features - self.input_pad

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in_features - input_pad)`` -> ``(..., o)`` in ``x.dtype`` (computed in f32)."""
        if x.shape[-1] != self.input_width:
            raise ValueError(f"W4A4Linear: input of shape {tuple(x.shape)} does not match its width "
                             f"{self.input_width} (in_features={self.in_features}, input_pad={self.input_pad})")
        blocks = self._f32("blocks")
        nb, n, _ = blocks.shape
        x32 = nn.functional.pad(x.to(torch.float32), (0, self.input_pad))  # (..., in_features)
        xt = torch.einsum("...bi,bij->...bj", x32.reshape(*x.shape[:-1], nb, n), blocks).reshape(x32.shape)  # x T
        y = torch.matmul(fake_quant(xt, self.act_fmt), self._f32("weight").T)  # (..., o)
        if self.lowrank_left is not None:
            y = y + torch.matmul(torch.matmul(xt, self._f32("lowrank_right").T), self._f32("lowrank_left").T)
        if self.bias is not None:
            y = y + self._f32("bias")
        return y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv1x1:
            return self.linear(x.movedim(1, -1)).movedim(-1, 1)  # (b, d, h, w) -> (b, o, h, w)
        return self.linear(x)

    def extra_repr(self) -> str:
        rank = 0 if self.lowrank_left is None else self.lowrank_left.shape[1]
        pad = f", input_pad={self.input_pad}" if self.input_pad else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, act={self.act_fmt['name']}, "
                f"rank={rank}, bias={self.bias is not None}{pad}{', conv1x1' if self.conv1x1 else ''}")


def _stored_array(state: Mapping[str, torch.Tensor], prefix: str, meta: Mapping[str, Any], name: str, where: str
                  ) -> torch.Tensor:
    """The f32 values of the ``QuantizedArray`` stored under ``prefix`` (codes, scales, tensor scale)."""
    keys = [f"{prefix}.codes", f"{prefix}.scales", f"{prefix}.tensor_scale"]
    for key in keys:
        if key not in state:
            raise ValueError(f"{where}: layer {name!r} lacks the array {name}/{key}")
    try:
        return dequantize(state[keys[0]].numpy(), state[keys[1]].numpy(), float(state[keys[2]].reshape(-1)[0]),
                          meta["fmt"])
    except ValueError as err:
        raise ValueError(f"{where}: layer {name!r}, {name}/{prefix}: {err}") from None


def w4a4_layer_from_state(name: str, state: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                          where: str = "quantized.safetensors", conv1x1: bool = False) -> W4A4Linear:
    """The :class:`W4A4Linear` of layer ``name`` from its arrays and metadata (``kroquant_jax.qlinear.to_state``'s
    keys and ``meta``, as ``quantized.safetensors`` and ``quantization_config.json`` store them); ``where`` names
    the file in errors."""
    config = meta["config"]

    def dense(key):
        if key not in state:
            raise ValueError(f"{where}: layer {name!r} lacks the array {name}/{key}")
        return state[key].to(torch.float32)

    weight = _stored_array(state, "weight", meta["weight"], name, where)
    left = right = None
    if meta["lowrank"] is not None:
        if meta["lowrank"]["quantized"]:
            left = _stored_array(state, "lowrank_left", meta["lowrank"]["left"], name, where)
            right = _stored_array(state, "lowrank_right", meta["lowrank"]["right"], name, where)
        else:
            left, right = dense("lowrank_left"), dense("lowrank_right")
    expected = (config["out_features"], config["in_features"])
    if tuple(weight.shape) != expected:
        raise ValueError(f"{where}: layer {name!r}: weight {tuple(weight.shape)}, its config says {expected}")
    try:
        return W4A4Linear(dense("blocks"), weight, config["act_fmt"], left, right,
                          dense("bias") if meta["has_bias"] else None, input_pad=config.get("input_pad", 0),
                          conv1x1=conv1x1)
    except ValueError as err:
        raise ValueError(f"{where}: layer {name!r}: {err}") from None


# ---------------------------------------------------------------------------------------------------------------------
# The folder
# ---------------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_folder(directory: Path) -> None:
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such folder")
    missing = [name for name in _FILES if not (directory / name).exists()]
    if missing:
        hint = " (a diffusers checkpoint: load it with the class's from_pretrained)" if \
            any(directory.glob("diffusion_pytorch_model*.safetensors*")) else ""
        raise ValueError(f"{directory}: no {missing[0]}: not a quantized checkpoint folder written by kroquant "
                         f"quantize-checkpoint{hint}")


def _empty_model(cls: type, config: dict) -> nn.Module:
    """The diffusers model of ``config`` with its parameters on the meta device when accelerate is installed (they
    are all assigned from the file; buffers are built as usual), else a plain construction."""
    try:
        from accelerate import init_empty_weights
    except ImportError:
        return cls.from_config(config)
    with init_empty_weights(include_buffers=False):
        return cls.from_config(config)


def load_w4a4_transformer(directory: str | os.PathLike, dtype: torch.dtype | None = None,
                          device: str | torch.device | None = None) -> nn.Module:
    """The diffusers transformer of a quantized checkpoint folder, its quantized linears run as :class:`W4A4Linear`.

    Args:
      directory: a folder written by ``kroquant quantize-checkpoint`` (``OUT/quantized-RECIPE``).
      dtype: the dtype of the 16-bit parameters and of the activations between layers (default: the stored one);
        the W4A4 layers keep f32 buffers and compute in f32 whatever the model's dtype.
      device: where to put the model (default: the CPU).

    Returns:
      the diffusers model (``eval()`` mode).

    Raises:
      ValueError: not a quantized checkpoint folder (names the missing file), another format version, a class that
        diffusers does not have, a missing, unexpected or mis-shaped key (named), a quantized layer that is no
        ``nn.Linear`` / 1x1 ``nn.Conv2d`` of the model or does not fit it (named).
    """
    import diffusers
    from safetensors.torch import load_file

    directory = Path(directory)
    _check_folder(directory)
    qconfig = _read_json(directory / "quantization_config.json")
    if qconfig.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory / 'quantization_config.json'}: format_version {qconfig.get('format_version')!r}"
                         f", this loader reads {FORMAT_VERSION} (rewrite the folder with kroquant quantize-checkpoint)")
    config = _read_json(directory / "config.json")
    class_name = config.get("_class_name")
    cls = getattr(diffusers, str(class_name), None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ValueError(f"{directory / 'config.json'}: _class_name {class_name!r} is not a diffusers model class "
                         f"(diffusers {diffusers.__version__})")
    layers: dict = qconfig.get("layers", {})
    replaced = {key for info in layers.values() for key in info["replaces"]}
    state = load_file(str(directory / "model.safetensors"))
    stored_dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    dtype = stored_dtype if dtype is None else dtype
    where = directory / "model.safetensors"
    model = _empty_model(cls, config)
    expected = model.state_dict()
    params = {name for name, _ in model.named_parameters()}
    missing = sorted(k for k in expected if k not in state and k not in replaced and k in params)
    unexpected = sorted(k for k in state if k not in expected)
    mis_shaped = sorted(f"{k}: stored {tuple(state[k].shape)}, {class_name} has {tuple(expected[k].shape)}"
                        for k in state if k in expected and state[k].shape != expected[k].shape)
    problems = [f"missing key {k}" for k in missing] + [f"unexpected key {k}" for k in unexpected] + \
        [f"mis-shaped key {k}" for k in mis_shaped]
    if problems:
        raise ValueError(f"{where}: does not fit {class_name}: " + "; ".join(problems))
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)

    arrays = load_file(str(directory / "quantized.safetensors"))
    where = directory / "quantized.safetensors"
    for name, info in layers.items():
        if "members" in info:  # kroquant quantize-checkpoint --fuse-shared-inputs
            raise ValueError(f"{directory / 'quantization_config.json'}: layer {name!r} is a fused shared-input layer "
                             f"of {len(info['members'])} linears; this loader replaces one nn.Linear per stored "
                             f"layer (quantize without --fuse-shared-inputs for torch)")
        try:
            target = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"{directory / 'quantization_config.json'}: quantized layer {name!r} is not a module "
                             f"of {class_name}") from None
        conv1x1 = isinstance(target, nn.Conv2d)
        if conv1x1 and (target.kernel_size != (1, 1) or target.stride != (1, 1) or target.groups != 1
                        or target.padding not in ((0, 0), "valid")):
            raise ValueError(f"quantized layer {name!r}: a {target} is not a 1x1 convolution")
        if not (conv1x1 or isinstance(target, nn.Linear)):
            raise ValueError(f"quantized layer {name!r}: a {type(target).__name__}, not an nn.Linear of {class_name}")
        prefix = f"{name}/"
        layer = w4a4_layer_from_state(name, {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)},
                                      info["meta"], str(where), conv1x1)
        widths = (target.in_channels, target.out_channels) if conv1x1 else (target.in_features, target.out_features)
        if widths != (layer.input_width, layer.out_features):
            raise ValueError(f"quantized layer {name!r}: (in, out) = {(layer.input_width, layer.out_features)}, "
                             f"{class_name}'s module has {widths}")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:  # pragma: no cover - every parameter is checked above
        raise ValueError(f"{where}: parameter {leftover[0]} was not loaded")
    return nn.Module.to(model, device=device or "cpu", dtype=dtype).eval()  # diffusers' .to warns on any dtype

"""Weight memory of the W4A4 layers against bf16: packed codes + block scales + low-rank factors + transform.

Per quantized linear ``W (o, d)`` (``QuantizedArray`` storage, :attr:`kroquant_jax.formats.QuantizedArray.nbytes`):

* codes: ``o * d / 2`` bytes (two E2M1 codes per byte);
* block scales: one byte per ``fmt.block_size`` elements, ``o * d / 32`` bytes (MXFP4, E8M0) or ``o * d / 16``
  (NVFP4, E4M3), plus the 4-byte per-tensor scale (stored for both formats, ``1.0`` for MXFP4);
* low-rank branch ``L (o, r)``, ``R (r, d)``: packed as LoRaQ stores them (``lowrank_fmt=MXFP4()``: each quantized
  along its last axis, so ``r`` and ``d`` must be multiples of 32) or 16-bit (``lowrank_fmt=None``: ``2 r (o + d)``
  bytes; SVDQuant). The GPU path keeps them packed: the W4A4 GEMM decodes a packed ``L`` in its epilogue, and ``R``
  is dequantized on the fly into a transient ``(r, d)`` bf16 copy for the small ``h = (x T) R^T`` GEMM;
* the online transform: KroQuant's 15 parameters per 32-block (``15 d / 32`` f32, what the K2 kernel reads), or the
  K1 blocks ``(d/32, 32, 32)`` in bf16, or nothing (identity / fixed Hadamard);
* the bias (same in both; ``o`` bf16) is left out of both sides.

``bf16`` baseline: ``2 o d`` bytes. :data:`PRESETS` lists the quantized linears of each model (the transformer blocks'
attention and MLP linears; AdaLN modulation, embedders and the final layer stay 16-bit), and :func:`preset_table`
sums them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from kroquant_jax.formats import MXFP4, NVFP4, QuantFormat, check_format

__all__ = ["LinearShape", "PRESETS", "TRANSFORM_STORAGES", "WeightBytes", "linear_weight_bytes", "preset_memory",
           "preset_table", "markdown_table"]

TransformStorage = Literal["kron_params", "k1_blocks_bf16", "none"]
#: The storages of the online transform (see the module docstring).
TRANSFORM_STORAGES = ("kron_params", "k1_blocks_bf16", "none")


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """``count`` linears of shape ``(out_features, in_features)`` in a model."""

    name: str
    out_features: int
    in_features: int
    count: int


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Bytes of one layer (or a sum of layers)."""

    codes: int
    scales: int
    lowrank: int
    transform: int
    bf16: int

    @property
    def packed(self) -> int:
        """Everything the W4A4 layer stores for its weight."""
        return self.codes + self.scales + self.lowrank + self.transform

    @property
    def ratio(self) -> float:
        """bf16 bytes / packed bytes (the compression factor)."""
        return self.bf16 / self.packed

    def __add__(self, other: "WeightBytes") -> "WeightBytes":
        return WeightBytes(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def scaled(self, n: int) -> "WeightBytes":
        return WeightBytes(*(getattr(self, f.name) * n for f in dataclasses.fields(self)))


def _packed_bytes(rows: int, cols: int, fmt: QuantFormat) -> tuple[int, int]:
    """(codes, scales + tensor scale) bytes of a ``(rows, cols)`` array packed in ``fmt`` along its last axis."""
    blk = fmt.block_size
    if cols % blk:
        raise ValueError(f"a ({rows}, {cols}) array cannot be packed in {fmt.name}: {cols} is no multiple of {blk}")
    return rows * cols // 2, rows * cols // blk * fmt.scale_dtype.itemsize + 4


def linear_weight_bytes(out_features: int, in_features: int, *, fmt: QuantFormat = MXFP4(), rank: int = 0,
                        lowrank_fmt: Optional[QuantFormat] = MXFP4(),
                        transform: TransformStorage = "kron_params") -> WeightBytes:
    """Weight bytes of one W4A4 linear ``(out_features, in_features)`` and of its bf16 original.

    Args:
      fmt: format of the packed residual weight (``MXFP4()``, ``NVFP4()``).
      rank: low-rank branch rank ``r`` (0: none).
      lowrank_fmt: the format ``L`` and ``R`` are packed in (``MXFP4()``: LoRaQ's storage), or ``None`` for 16-bit
        factors (SVDQuant's).
      transform: storage of the online transform, one of :data:`TRANSFORM_STORAGES` (see the module docstring).

    Raises:
      TypeError: ``fmt`` or ``lowrank_fmt`` is no :class:`~kroquant_jax.formats.QuantFormat` (e.g. a name).
      ValueError: an unknown ``transform``, or a width that is no multiple of the format's block.
    """
    check_format(fmt, "linear_weight_bytes: fmt")
    if lowrank_fmt is not None:
        check_format(lowrank_fmt, "linear_weight_bytes: lowrank_fmt")
    if transform not in TRANSFORM_STORAGES:
        raise ValueError(f"linear_weight_bytes: transform={transform!r} must be one of {TRANSFORM_STORAGES}")
    o, d = out_features, in_features
    codes, scales = _packed_bytes(o, d, fmt)
    lr = 0
    if rank and lowrank_fmt is None:
        lr = 2 * rank * (o + d)
    elif rank:
        cl, sl = _packed_bytes(o, rank, lowrank_fmt)
        cr, sr = _packed_bytes(rank, d, lowrank_fmt)
        lr = cl + sl + cr + sr
    tr = {"kron_params": 4 * 15 * (d // 32), "k1_blocks_bf16": 2 * 32 * d, "none": 0}[transform]
    return WeightBytes(codes=codes, scales=scales, lowrank=lr, transform=tr, bf16=2 * o * d)


def _ffn(name, hidden, inner, count, fused_gate=False):
    up = 2 * inner if fused_gate else inner
    return [LinearShape(f"{name}.up", up, hidden, count), LinearShape(f"{name}.down", hidden, inner, count)]


#: Quantized linears per model (transformer blocks only). Ideogram 4's w1 and w3 are listed as one fused
#: (2 * 12288, 4608) SwiGLU weight, as the fused epilogue packs them.
PRESETS: dict[str, list[LinearShape]] = {
    # PixArt-Sigma (0.6B): 28 blocks, hidden 1152; self- and cross-attention q/k/v/o, GELU MLP 4608.
    "pixart_sigma": [LinearShape("attn.qkvo", 1152, 1152, 28 * 4), LinearShape("cross.qkvo", 1152, 1152, 28 * 4),
                     *_ffn("ff", 1152, 4608, 28)],
    # SANA 1.6B: 20 blocks, hidden 2240; linear self-attention and cross-attention q/k/v/o; GLUMBConv 1x1 convs
    # (inverted 2240 -> 2 * 5600, point 5600 -> 2240; the depthwise 3x3 stays 16-bit).
    "sana_1600m": [LinearShape("attn.qkvo", 2240, 2240, 20 * 4), LinearShape("cross.qkvo", 2240, 2240, 20 * 4),
                   *_ffn("glumbconv", 2240, 5600, 20, fused_gate=True)],
    # FLUX.1: 19 double-stream blocks (image and text streams: q/k/v/o each, MLP 12288), 38 single-stream blocks
    # (q/k/v, proj_mlp 3072 -> 12288, proj_out 15360 -> 3072).
    "flux1": [LinearShape("double.qkvo", 3072, 3072, 19 * 2 * 4), *_ffn("double.ff", 3072, 12288, 19 * 2),
              LinearShape("single.qkv", 3072, 3072, 38 * 3), LinearShape("single.proj_mlp", 12288, 3072, 38),
              LinearShape("single.proj_out", 3072, 15360, 38)],
    # Ideogram 4: 34 blocks, hidden 4608 = 18 heads x 256, q/k/v/o, SwiGLU 12288 (w1, w3 fused; w2).
    "ideogram4": [LinearShape("attn.qkvo", 4608, 4608, 34 * 4), *_ffn("swiglu", 4608, 12288, 34, fused_gate=True)],
}


def preset_memory(preset: str, *, fmt: QuantFormat = MXFP4(), rank: int = 0,
                  lowrank_fmt: Optional[QuantFormat] = MXFP4(), transform: TransformStorage = "kron_params"
                  ) -> WeightBytes:
    """Total weight bytes of a preset's quantized linears (see :func:`linear_weight_bytes`)."""
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    total: Optional[WeightBytes] = None
    for s in PRESETS[preset]:
        wb = linear_weight_bytes(s.out_features, s.in_features, fmt=fmt, rank=rank, lowrank_fmt=lowrank_fmt,
                                 transform=transform).scaled(s.count)
        total = wb if total is None else total + wb
    return total


#: The configurations of the table: (label, fmt, rank, low-rank factor format (None: bf16), transform storage).
TABLE_CONFIGS = (
    ("MXFP4, KroQuant, no low-rank", MXFP4(), 0, None, "kron_params"),
    ("MXFP4, KroQuant + LoRaQ r=128 (MXFP4 factors)", MXFP4(), 128, MXFP4(), "kron_params"),
    ("MXFP4, KroQuant + r=128 bf16 factors", MXFP4(), 128, None, "kron_params"),
    ("NVFP4, no transform, no low-rank", NVFP4(), 0, None, "none"),
    ("NVFP4 + LoRaQ r=128 (MXFP4 factors)", NVFP4(), 128, MXFP4(), "kron_params"),
)


def preset_table() -> list[dict]:
    """One row per (preset, configuration): GiB of bf16 and of packed weights, and the ratio."""
    rows = []
    for preset in PRESETS:
        for label, fmt, rank, lowrank_fmt, transform in TABLE_CONFIGS:
            wb = preset_memory(preset, fmt=fmt, rank=rank, lowrank_fmt=lowrank_fmt, transform=transform)
            rows.append({"preset": preset, "config": label, "bf16_GiB": wb.bf16 / 2**30,
                         "packed_GiB": wb.packed / 2**30, "codes_GiB": wb.codes / 2**30,
                         "scales_GiB": wb.scales / 2**30, "lowrank_GiB": wb.lowrank / 2**30,
                         "transform_MiB": wb.transform / 2**20, "ratio": wb.ratio})
    return rows


def markdown_table() -> str:
    """:func:`preset_table` as a Markdown table (the one in docs/w4a4.md)."""
    lines = ["| preset | configuration | bf16 GiB | packed GiB | (codes / scales / low-rank GiB) | ratio |",
             "| --- | --- | ---: | ---: | --- | ---: |"]
    for r in preset_table():
        lines.append(f"| {r['preset']} | {r['config']} | {r['bf16_GiB']:.3f} | {r['packed_GiB']:.3f} | "
                     f"{r['codes_GiB']:.3f} / {r['scales_GiB']:.3f} / {r['lowrank_GiB']:.3f} | {r['ratio']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table())

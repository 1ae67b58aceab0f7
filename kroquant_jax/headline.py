"""Headline figures: the project's measured numbers in one machine-readable file, and the README tables made from it.

``benchmarks/results/headline.json`` is one JSON object: key = figure name, value = a :class:`Figure` record::

    {"w4a4_layer_dequant_vs_bf16_min_m4096": {"value": 0.43, "unit": "x", "higher_is_better": true,
      "device": "<device>", "jax": "<version>", "date_utc": "<ISO date>", "command": "python3 benchmarks/...",
      "source": "benchmarks/results/w4a4_models.json"}, ...}

Benchmarks and evaluations write their keys with :func:`update` (atomic; other keys untouched). The README holds
blocks between ``<!-- headline:NAME -->`` and ``<!-- /headline:NAME -->`` markers; :func:`render_readme` regenerates
every block from the figures with the templates of :data:`TABLES`, and a test fails when the README differs from what
the JSON renders, so no measured number is ever typed into the README by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import string
from pathlib import Path
from typing import Mapping

from kroquant_jax.fileio import atomic_write_json

__all__ = ["Figure", "TABLES", "load", "update", "render_block", "render_readme", "HeadlineError", "add_arguments",
           "checked_source"]


class HeadlineError(ValueError):
    """A malformed headline file, a missing key, or a README whose markers do not match."""


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure and where it came from.

    Attributes:
      value: the number (finite).
      unit: its unit ("us", "ms", "s", "x", "dB", "fraction", ...).
      higher_is_better: the direction of improvement.
      device: what it ran on (the GPU name, or "cpu (2 cores)").
      jax: the jax version of the run.
      date_utc: when it was measured (ISO date, optionally with a time).
      command: the command that produced it.
      source: the results file it was read from, relative to the repository root.
    """

    value: float
    unit: str
    higher_is_better: bool
    device: str
    jax: str
    date_utc: str
    command: str
    source: str

    def __post_init__(self):
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise HeadlineError(f"value={self.value!r} must be a finite number")
        if not isinstance(self.higher_is_better, bool):
            raise HeadlineError(f"higher_is_better={self.higher_is_better!r} must be true or false")
        for name in ("unit", "device", "jax", "date_utc", "command", "source"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise HeadlineError(f"{name}={getattr(self, name)!r} must be a non-empty string")
        if not self.source.startswith("benchmarks/results/"):
            raise HeadlineError(f"source={self.source!r} must be a file under benchmarks/results/")


_FIELDS = tuple(f.name for f in dataclasses.fields(Figure))


def _figure(key: str, record) -> Figure:
    if not isinstance(record, dict):
        raise HeadlineError(f"headline key {key!r}: expected an object, got {type(record).__name__}")
    missing = [f for f in _FIELDS if f not in record]
    unknown = sorted(set(record) - set(_FIELDS))
    if missing or unknown:
        raise HeadlineError(f"headline key {key!r}: missing fields {missing}, unknown fields {unknown}")
    try:
        return Figure(**record)
    except HeadlineError as e:
        raise HeadlineError(f"headline key {key!r}: {e}") from None


def load(path: str | Path) -> dict[str, Figure]:
    """Reads and validates a headline file; raises :class:`HeadlineError` naming the file and key at fault."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise HeadlineError(f"{path}: no headline file") from None
    except json.JSONDecodeError as e:
        raise HeadlineError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HeadlineError(f"{path}: expected one JSON object of figures")
    try:
        return {key: _figure(key, record) for key, record in raw.items()}
    except HeadlineError as e:
        raise HeadlineError(f"{path}: {e}") from None


def update(path: str | Path, figures: Mapping[str, Figure], replace_prefix: str | None = None) -> dict[str, Figure]:
    """Sets ``figures`` in the headline file at ``path`` (created if absent), keeping every other key; atomic.

    ``replace_prefix``: a run that replaces a whole family of figures (e.g. ``"demo_"``) also removes the keys with
    that prefix that it does not set, so no figure of an earlier run of another shape stays behind."""
    path = Path(path)
    current = load(path) if path.exists() else {}
    if replace_prefix is not None:
        if not replace_prefix:
            raise HeadlineError("replace_prefix must be a non-empty key prefix")
        stray = sorted(k for k in figures if not k.startswith(replace_prefix))
        if stray:
            raise HeadlineError(f"replace_prefix {replace_prefix!r}: keys {stray} do not have it")
        current = {k: f for k, f in current.items() if not k.startswith(replace_prefix)}
    for key, fig in figures.items():
        if not isinstance(fig, Figure):
            raise HeadlineError(f"headline key {key!r}: expected a Figure, got {type(fig).__name__}")
        current[key] = fig
    atomic_write_json(path, {k: dataclasses.asdict(current[k]) for k in sorted(current)})
    return current


def add_arguments(parser: argparse.ArgumentParser, keys: str, default_command: str) -> None:
    """``--headline JSON``, ``--device``, ``--command`` for a main that writes the headline ``keys`` (words for the
    help) from the summary it writes to its own ``--out``."""
    parser.add_argument("--headline", metavar="JSON",
                        help=f"set {keys} in this headline file; needs --out under benchmarks/results/ (the "
                             "figures' source)")
    parser.add_argument("--device", help="the machine, for the headline figures (default: the record's own)")
    parser.add_argument("--command", default=default_command,
                        help="the command that made the record, for the headline figures")


def checked_source(parser: argparse.ArgumentParser, args: argparse.Namespace, repo: str | Path) -> str | None:
    """With ``--headline``: ``--out`` relative to ``repo`` (the figures' ``source``); a ``parser.error`` (one line,
    exit 2) when ``--out`` is missing or outside ``benchmarks/results/``. Without ``--headline``: None. Call it before
    the expensive part."""
    if not args.headline:
        return None
    out = getattr(args, "out", None)
    rel = os.path.relpath(os.path.abspath(out), repo) if out else ""
    if not rel.startswith("benchmarks/results/"):
        parser.error("--headline needs --out under benchmarks/results/ (the summary file the figures point to)")
    return rel


# The README's tables. Each cell is a str.format template over figure values, e.g. "{key:.0f} µs"; a row's
# "keys" are the figures it shows (their devices and dates go in the table's last column).
TABLES: dict[str, dict] = {
    "gpu": {
        "header": ["what", "measured", "goal", "page"],
        "rows": [
            ["fused transform + MXFP4 quantize, K1 (dense 32x32 blocks) at 4096 x 16384, fp16",
             "{tq_k1_us_4096x16384_fp16:.0f} µs, {tq_k1_frac_copy_bw_4096x16384_fp16:.0%} of copy bandwidth; "
             "Scale/K1 {tq_scale_over_k1_4096x16384_fp16:.2f}; {tq_xla_over_k1_4096x16384_fp16:.1f}x faster than XLA",
             "within 15% of the copy floor; K1 ≥ Scale", "[kernels](docs/kernels.md)"],
            ["W4A4 GEMM, Ideogram 4 q (4096 x 4608 x 4608), CUPTI",
             "dequantize + cuBLAS {w4a4_gemm_ideogram4_q_m4096_dequant_us:.0f} µs, Mosaic GPU kernel "
             "{w4a4_gemm_ideogram4_q_m4096_mgpu_us:.0f} µs, Triton kernel {w4a4_gemm_ideogram4_q_m4096_triton_us:.0f} µs "
             "vs bf16 cuBLAS {w4a4_gemm_ideogram4_q_m4096_bf16_us:.0f} µs",
             "≥ 1x", "[w4a4](docs/w4a4.md)"],
            ["W4A4 layer (transform + quantize + low-rank + GEMM), layer shapes of FLUX.1 / PixArt-Σ / SANA / "
             "Ideogram 4 w2; wall time of a jitted loop of calls, not CUPTI",
             "best strategy (dequantize + cuBLAS) {w4a4_layer_dequant_vs_bf16_min_m4096:.2f}–"
             "{w4a4_layer_dequant_vs_bf16_max_m4096:.2f}x bf16 at m = 4096 "
             "({w4a4_layer_dequant_vs_bf16_m4096_over_shapes:.0f} shapes), "
             "{w4a4_layer_dequant_vs_bf16_min_m512:.2f}–{w4a4_layer_dequant_vs_bf16_max_m512:.2f}x at m = 512 "
             "({w4a4_layer_dequant_vs_bf16_m512_over_shapes:.0f} shapes)",
             "≥ 1x at 4096, > 1x at 512", "[w4a4](docs/w4a4.md)"],
            ["W4A4 layer on the FP8 tensor cores (MXFP4 re-encoded exactly in E4M3; transform + quantize, re-encode, "
             "low-rank input and GEMM counted, CUPTI), Ideogram 4 and FLUX.1 shapes",
             "fused kernel: slowest shape {w4a4_layer_fp8_mgpu_speedup_vs_bf16_min_m4096:.2f}x bf16 at m = 4096 "
             "(of {w4a4_layer_fp8_mgpu_speedup_vs_bf16_min_m4096_over_shapes:.0f} shapes), "
             "{w4a4_layer_fp8_mgpu_speedup_vs_bf16_min_m512:.2f}x at m = 512 "
             "(of {w4a4_layer_fp8_mgpu_speedup_vs_bf16_min_m512_over_shapes:.0f}); XLA's FP8 GEMM: "
             "{w4a4_layer_fp8_speedup_vs_bf16_min_m4096:.2f}x / {w4a4_layer_fp8_speedup_vs_bf16_min_m512:.2f}x",
             "≥ 1.5x at 4096, ≥ 1.1x at 512", "[w4a4](docs/w4a4.md)"],
            ["W4A4 GEMM with its epilogue in one Mosaic GPU kernel (E4M3 operands, powers of two, bias, rank-128 "
             "low-rank term), Ideogram 4 shapes, CUPTI (the quantizer not included)",
             "m = 4096: w1|w3 and w2 {fp8_mgpu_gemm_speedup_vs_bf16_min_m4096_ideogram4_w13_w2:.2f}x bf16 (slower of "
             "the two; {fp8_mgpu_gemm_speedup_vs_fp8_xla_min_m4096_ideogram4_w13_w2:.2f}x XLA's FP8 GEMM + "
             "epilogue), q {fp8_mgpu_gemm_speedup_vs_bf16_m4096_ideogram4_q:.2f}x; m = 512: q and w1|w3 "
             "{fp8_mgpu_gemm_speedup_vs_bf16_min_m512_ideogram4_q_w13:.2f}x (slower of the two; w2 not measured)",
             "≥ 1.5x at 4096, ≥ 1.1x at 512", "[w4a4](docs/w4a4.md)"],
            ["whole Ideogram 4 forward (34 blocks, 4224 tokens), every linear W4A4, median wall time",
             "fused FP8 kernel, q | k | v as one W4A4 layer (one transform, as w1 | w3): "
             "{ideogram4_forward_fp8_mgpu_fused_qkv_ms:.1f} ms "
             "({ideogram4_forward_fp8_mgpu_fused_qkv_speedup_vs_bf16:.2f}x the "
             "{ideogram4_forward_fp8_mgpu_fused_qkv_run_bf16_ms:.1f} ms bf16 forward of that run; earlier run "
             "{ideogram4_forward_fp8_mgpu_fused_qkv_earlier_run_speedup_vs_bf16:.2f}x; kernel-time sums "
             "{ideogram4_forward_fp8_mgpu_fused_qkv_device_time_speedup_vs_bf16:.2f}x; transform + quantize + E4M3 "
             "re-encode {ideogram4_forward_fp8_mgpu_fused_qkv_quantizer_fraction_of_gemms:.0%} of the GEMMs' time, "
             "goal ≤ 25%); q, k, v separate: {ideogram4_forward_fp8_mgpu_ms:.1f} ms "
             "({ideogram4_forward_fp8_mgpu_speedup_vs_bf16:.2f}x the {ideogram4_forward_fp8_mgpu_run_bf16_ms:.1f} ms "
             "bf16 of that run, quantizer {ideogram4_forward_fp8_mgpu_quantizer_fraction_of_gemms:.0%}); "
             "earlier run: FP8 strategy {ideogram4_forward_fp8_ms:.1f} ms "
             "({ideogram4_forward_fp8_speedup_vs_bf16:.2f}x), dequantize + cuBLAS {ideogram4_forward_dequant_ms:.1f} "
             "ms ({ideogram4_forward_dequant_speedup_vs_bf16:.2f}x), bf16 {ideogram4_forward_bf16_ms:.1f} ms",
             "≥ 1.3x bf16", "[w4a4](docs/w4a4.md)"],
            ["calibrate all 280 linears of a PixArt-Σ-shaped model (KroQuant 100 steps + LoRaQ rank 128)",
             "{calibration_cold_pixart_h200_s:.0f} s cold ({calibration_compile_pixart_h200_s:.0f} s XLA compile), "
             "{calibration_run_pixart_h200_s:.0f} s run",
             "≤ 3 min cold", "[calibration](docs/calibration.md)"],
            ["served strategies on a real checkpoint (the testbed's QAD export, 100 W4A4 layers, the inputs of its "
             "16-bit model): layer outputs vs eq. 11 in float64, and 192 images",
             "`fp8_mgpu` (the Hopper default): at worst {served_fp8_mgpu_layer_error_over_bf16_floor_max_testbed:.3f}x "
             "the bf16 rounding of the exact product (`dequant` "
             "{served_dequant_layer_error_over_bf16_floor_max_testbed:.3f}x); images "
             "{served_fp8_mgpu_minus_dequant_psnr_db_testbed:+.2f} dB vs `dequant`'s (paired, against the 16-bit "
             "model)",
             "as exact as `dequant`", "[w4a4](docs/w4a4.md)"],
            ["whole PixArt-Σ and FLUX.1 forwards at 1024 px (one sampler step, random weights, every quantizable "
             "linear W4A4)",
             "PixArt-Σ (28 blocks, cuDNN attention in both): `fp8_mgpu` {pixart_forward_fp8_mgpu_speedup_vs_bf16:.2f}x "
             "the {pixart_forward_bf16_cudnn_ms:.1f} ms bf16 step, {pixart_forward_fp8_mgpu_fused_speedup_vs_bf16:.2f}x "
             "with its shared-input groups fused (q|k|v, k|v; "
             "{pixart_forward_fp8_mgpu_fused_speedup_vs_bf16_fused:.2f}x a bf16 model fused alike); FLUX.1-schnell "
             "(57 blocks): `dequant` "
             "{flux_forward_dequant_speedup_vs_bf16:.2f}x, `fp8_mgpu` {flux_forward_fp8_mgpu_speedup_vs_bf16:.2f}x "
             "(cuDNN attention in both), {flux_forward_fp8_mgpu_fused_speedup_vs_bf16:.2f}x with its shared-input "
             "groups fused ({flux_forward_fp8_mgpu_fused_speedup_vs_bf16_fused:.2f}x a bf16 model fused alike; part of "
             "the gain is the same cuDNN attention kernel running faster in the W4A4 step, not explained), "
             "{flux_forward_fp8_mgpu_fused_no_command_buffers_speedup_vs_bf16:.2f}x without XLA's command buffers "
             "(as `fp8_mgpu` samplers now compile; steadier too). "
             "The served outputs are {pixart_forward_fp8_mgpu_rel_l2_vs_simulate:.4f} (PixArt-Σ) and "
             "{flux_forward_fp8_mgpu_rel_l2_vs_simulate:.4f} (FLUX.1, fused; relative L2) from the fake-quant "
             "forward's. On PixArt-Σ's narrow layers (d = 1152) W4A4 is slower than bf16",
             "measured (no goal)", "[w4a4](docs/w4a4.md)"],
            ["Ideogram 4 bf16 forward, 6144 padded tokens",
             "{ideogram4_bf16_forward_padded_ms:.1f} ms", "1.2x the bf16 roofline", "[ideogram4](docs/ideogram4.md)"],
        ],
    },
    "distill": {
        "header": ["what", "measured", "goal", "page"],
        "rows": [
            ["QAD: one-branch W4A4 (MXFP4) testbed student, from calibrated PTQ layers (the recipe in "
             "docs/qad.md), flow-matching weight 1.0; held-out captions vs the 16-bit CFG images",
             "best student {testbed_qad_psnr_heldout_db:.2f} dB at 20 forwards / image, chroma ratio "
             "{testbed_qad_chroma_ratio:.3f} (CFG folded into a 16-bit branch on all 3,723 training records, then "
             "smoothed KroQuant + GPTQ + LoRaQ, then QAD, which stays under its PTQ start: "
             "{testbed_folded_ptq_psnr_heldout_db:.2f} dB, the best one-branch W4A4 model) vs the best two-branch "
             "PTQ (smoothed KroQuant + GPTQ + LoRaQ) {testbed_best_ptq_psnr_heldout_db:.2f} dB at 40 (the same "
             "captions, seeds and sampler); the folded 16-bit branch itself: "
             "{testbed_distill_16bit_psnr_heldout_db:.2f} dB ({testbed_distill_16bit_psnr_heldout_db_1023_records:.2f} "
             "on 1,023 records, whose fold quantized gave {testbed_folded_ptq_psnr_heldout_db_1023_records:.2f}); "
             "QAD from the teacher's PTQ layers (1,023 records, about 600 steps): "
             "{testbed_qad_psnr_heldout_db_teacher_ptq_init:.2f} dB, chroma ratio "
             "{testbed_qad_chroma_ratio_teacher_ptq_init:.3f} (from the GPTQ store itself: "
             "{testbed_qad_psnr_heldout_db_gptq_init:.2f} dB; from SmoothQuant + LoRaQ: "
             "{testbed_qad_psnr_heldout_db_smoothquant_loraq_init:.2f} vs "
             "{testbed_smoothquant_loraq_psnr_heldout_db:.2f} dB); naive-distillation control "
             "{testbed_naive_distill_psnr_heldout_db:.2f} dB (fm weight 0.25, 1,023 records)",
             "beat every two-branch PTQ; chroma within 3% of 1", "[qad](docs/qad.md)"],
            ["QAD training step of the whole Ideogram 4 (34 blocks, W4A4 student + bf16 teacher, both CFG branches, "
             "1K layout), one H200",
             "{ideogram4_qad_step_s_1gpu:.2f} s per step, {ideogram4_qad_peak_gib_1gpu:.1f} GiB peak (batch 1)",
             "— (measured: what fits)", "[qad](docs/qad.md)"],
            ["DMD2: 4-step one-branch W4A4 (MXFP4 fake quant) testbed student, from the SmoothQuant + LoRaQ "
             "layers, 185 generator updates; Fréchet distance to the real glyphs over the 16-bit teacher's "
             "(20 steps x CFG 3)",
             "{testbed_dmd2_4step_fd_ratio_vs_teacher:.2f}x at {testbed_stack_forward_passes_ratio:.0f}x fewer "
             "forward passes (the PTQ model itself at 4 steps: "
             "{testbed_dmd2_ptq_w4a4_4step_fd_ratio_vs_teacher:.2f}x); "
             "caption accuracy {testbed_dmd2_4step_caption_accuracy:.3f} vs the teacher's "
             "{testbed_dmd2_teacher_caption_accuracy:.3f}",
             "≤ 1.10x", "[dmd2](docs/dmd2.md)"],
            ["DMD2 on the QAD student (the testbed stack: QAD -> DMD2), 4-step one-branch W4A4 (MXFP4 fake quant), "
             "205 generator updates; the same Fréchet ratio",
             "{testbed_dmd2_qad_chain_4step_fd_ratio_vs_teacher:.2f}x (the QAD student itself at 4 steps: "
             "{testbed_dmd2_qad_chain_untrained_4step_fd_ratio_vs_teacher:.2f}x); caption accuracy "
             "{testbed_dmd2_qad_chain_4step_caption_accuracy:.3f}; the unguided 20-step teacher, the real score's "
             "target: {testbed_dmd2_teacher_unguided_fd_ratio_vs_teacher:.2f}x, caption accuracy "
             "{testbed_dmd2_teacher_unguided_caption_accuracy:.3f}",
             "≤ 1.10x", "[dmd2](docs/dmd2.md)"],
            ["The testbed stack, every stage on the same metrics (one H100 run: best PTQ store -> QAD -> DMD2, "
             "1,024 training captions x 2 seeds); Fréchet ratio vs the 16-bit teacher (20 steps x CFG 3) and "
             "caption accuracy",
             "PTQ W4A4, 20 x 2 branches: {testbed_stack_ptq_w4a4_fd_ratio_vs_teacher:.2f}x, "
             "{testbed_stack_ptq_w4a4_caption_accuracy:.3f}; QAD W4A4, 20 x 1: "
             "{testbed_stack_qad_w4a4_fd_ratio_vs_teacher:.2f}x, {testbed_stack_qad_w4a4_caption_accuracy:.3f}; "
             "QAD -> DMD2, 4 x 1: {testbed_stack_qad_dmd2_4step_fd_ratio_vs_teacher:.2f}x, "
             "{testbed_stack_qad_dmd2_4step_caption_accuracy:.3f} "
             "(teacher {testbed_stack_teacher_caption_accuracy:.3f}); "
             "a second DMD2 run served (its exported checkpoint on dequant + cuBLAS): "
             "{testbed_stack_qad_dmd2_4step_served_fd_ratio_vs_teacher:.2f}x, "
             "{testbed_stack_qad_dmd2_4step_served_caption_accuracy:.3f}, "
             "{testbed_dmd2_served_psnr_vs_fake_quant_db:.1f} dB from its fake-quant images (mean PSNR over "
             "images, an identical image counted as 99 dB)",
             "— (measured)", "[dmd2](docs/dmd2.md)"],
            ["DMD2: the same with a 16-bit student, 600 generator updates",
             "{testbed_dmd2_16bit_4step_fd_ratio_vs_teacher:.2f}x (the teacher's weights at 4 steps, untrained: "
             "{testbed_dmd2_16bit_untrained_4step_fd_ratio_vs_teacher:.2f}x); caption accuracy "
             "{testbed_dmd2_16bit_4step_caption_accuracy:.3f} vs the teacher's "
             "{testbed_dmd2_16bit_teacher_caption_accuracy:.3f}",
             "— (the control)", "[dmd2](docs/dmd2.md)"],
            ["The whole stack per 1K image on full-size Ideogram 4 (random weights, batch 1, 4224 tokens, end to end "
             "without the VAE): bf16 48 steps x 2 transformers vs one branch x 4 steps on the W4A4 fused FP8 kernel",
             "{ideogram4_stack_speedup_per_image:.2f}x ({ideogram4_stack_bf16_48x2_ms_per_image:.0f} ms -> "
             "{ideogram4_stack_w4a4_fp8_mgpu_fused_qkv_4x1_ms_per_image:.0f} ms, q | k | v as one W4A4 layer; "
             "separate: {ideogram4_stack_unfused_qkv_speedup_per_image:.2f}x, "
             "{ideogram4_stack_w4a4_fp8_mgpu_4x1_ms_per_image:.0f} ms, same run); the step and branch cut alone, "
             "bf16 (earlier run): {ideogram4_stack_bf16_4x1_speedup_per_image:.1f}x",
             "≥ 30x (moonshot ≥ 40x)", "[dmd2](docs/dmd2.md)"],
            ["The same stack at a throughput batch: 4 images per call, then batch 1, back to back on one H100 "
             "(q | k | v as one W4A4 layer)",
             "{ideogram4_stack_speedup_per_image_b4:.2f}x at batch 4 ({ideogram4_stack_bf16_48x2_ms_per_image_b4:.0f} "
             "ms -> {ideogram4_stack_w4a4_fp8_mgpu_fused_qkv_4x1_ms_per_image_b4:.0f} ms per image); "
             "{ideogram4_stack_speedup_per_image_b1_h100:.2f}x at batch 1 "
             "({ideogram4_stack_bf16_48x2_ms_per_image_b1_h100:.0f} ms -> "
             "{ideogram4_stack_w4a4_fp8_mgpu_fused_qkv_4x1_ms_per_image_b1_h100:.0f} ms): batching helps bf16 more",
             "≥ 30x", "[dmd2](docs/dmd2.md)"],
            ["The testbed stack per image (served W4A4 layers, dequant + cuBLAS, stand-in calibration: speed only): "
             "16-bit teacher 20 steps x 2 CFG branches vs one branch x 4 steps on W4A4",
             "{testbed_stack_w4a4_4x1_speedup_per_image_b1:.2f}x at batch 1, "
             "{testbed_stack_w4a4_4x1_speedup_per_image_b64:.2f}x at batch 64 (the same cut in 16 bits: "
             "{testbed_stack_bf16_4x1_speedup_per_image_b1:.2f}x / {testbed_stack_bf16_4x1_speedup_per_image_b64:.2f}x"
             ": at 256 tokens the W4A4 layers cost time)",
             "— (measured)", "[dmd2](docs/dmd2.md)"],
        ],
    },
    "demo": {
        "header": ["method", "PSNR (dB) ↑ training captions, not calibration",
                   "PSNR (dB) ↑ held-out variants of trained concepts", "PSNR (dB) ↑ NOVEL concepts, never trained",
                   "SSIM ↑ (same three groups)", "layer error mean"],
        "rows": [[name, *(f"{{demo_psnr_db_{group}_{key}:.2f}} ± {{demo_psnr_sem_db_{group}_{key}:.2f}}"
                          for group in ("train", "variant", "novel")),
                  " / ".join(f"{{demo_ssim_{group}_{key}:.3f}}" for group in ("train", "variant", "novel")),
                  "—" if key == "16bit" else f"{{demo_layer_error_mean_{key}:.4f}}"]
                 for name, key in [("16-bit vs the dataset glyph", "16bit"), ("RTN", "rtn"),
                                   ("Hadamard-32", "hadamard32"), ("KroQuant", "kroquant"),
                                   ("KroQuant + LoRaQ", "kroquant_loraq")]],
    },
    "demo-time": {
        "header": ["run", "wall time"],
        "rows": [["`kroquant demo`, default settings (capture, 4 calibrations, 5 x 10 images; imports excluded)",
                  "{demo_wall_s:.0f} s"]],
    },
    "testbed-layers": {
        "header": ["all 100 linears of the testbed, test rows", "measured", "goal"],
        "rows": [["KroQuant beats its Hadamard-32 init", "{testbed_kroquant_beats_hadamard_fraction:.0%} of the layers",
                  "≥ 90%"],
                 ["smoothed KroQuant beats both SmoothQuant and Hadamard-32",
                  "{testbed_smoothed_kroquant_beats_both_fraction:.0%} of the layers", "≥ 90%"],
                 ["GPTQ rounding vs round-to-nearest, smoothed KroQuant with its two earlier starts: mean layer error",
                  "{gptq_layer_error_reduction_fraction:.1%} lower", "≥ 10% lower"]],
    },
    "testbed-lowrank": {
        "header": ["24 held-out captions x 3 generation seeds, vs the 16-bit images", "measured", "goal"],
        "rows": [["best KroQuant-family recipe (with a low-rank branch) minus the better of SVDQuant and "
                  "SmoothQuant + LoRaQ", "{testbed_lowrank_best_kroquant_family_psnr_margin_db:+.2f} dB PSNR",
                  "≥ +0.5 dB"],
                 ["the same minus the better of both baselines with GPTQ rounding",
                  "{testbed_lowrank_best_kroquant_family_psnr_margin_vs_gptq_baselines_db:+.2f} dB PSNR",
                  "— (control)"],
                 *[[name, f"{{testbed_lowrank_psnr_db_heldout_{key}:.2f}} ± "
                          f"{{testbed_lowrank_psnr_sem_db_heldout_{key}:.2f}} dB "
                          f"(seeds {{testbed_lowrank_psnr_seed_min_db_heldout_{key}:.2f}}–"
                          f"{{testbed_lowrank_psnr_seed_max_db_heldout_{key}:.2f}}), "
                          f"SSIM {{testbed_lowrank_ssim_heldout_{key}:.3f}}",
                   "—"]
                   for name, key in [("SVDQuant", "svdquant"), ("SmoothQuant + LoRaQ", "smoothquant_loraq"),
                                     ("SmoothQuant + GPTQ + LoRaQ", "smoothquant_gptq_loraq"),
                                     ("SVDQuant + GPTQ", "svdquant_gptq"),
                                     ("smoothed KroQuant + GPTQ + LoRaQ", "smoothed_kroquant_gptq_loraq")]]],
    },
    "testbed": {
        "header": ["method (24 held-out captions x 3 generation seeds)", "PSNR (dB) ↑ (per-seed range)", "SSIM ↑",
                   "mean layer error"],
        "rows": [*[[name, f"{{testbed_eval_psnr_db_heldout_{key}:.2f}} ± {{testbed_eval_psnr_sem_db_heldout_{key}:.2f}} "
                          f"({{testbed_eval_psnr_seed_min_db_heldout_{key}:.2f}}–"
                          f"{{testbed_eval_psnr_seed_max_db_heldout_{key}:.2f}})",
                    f"{{testbed_eval_ssim_heldout_{key}:.3f}}", f"{{testbed_eval_layer_error_mean_{key}:.4f}}"]
                   for name, key in [("RTN", "rtn"), ("Hadamard-32", "hadamard32"), ("SmoothQuant", "smoothquant"),
                                     ("KroQuant", "kroquant"), ("smoothed KroQuant", "smoothed_kroquant"),
                                     ("smoothed KroQuant + GPTQ", "smoothed_kroquant_gptq"),
                                     ("RTN + LoRaQ", "rtn_loraq"), ("Hadamard-32 + LoRaQ", "hadamard32_loraq"),
                                     ("KroQuant + LoRaQ", "kroquant_loraq"), ("SVDQuant", "svdquant"),
                                     ("SmoothQuant + LoRaQ", "smoothquant_loraq"),
                                     ("smoothed KroQuant + LoRaQ", "smoothed_kroquant_loraq"),
                                     ("SmoothQuant + GPTQ + LoRaQ", "smoothquant_gptq_loraq"),
                                     ("SVDQuant + GPTQ", "svdquant_gptq"),
                                     ("smoothed KroQuant + GPTQ + LoRaQ", "smoothed_kroquant_gptq_loraq")]],
                 ["issue 17 goal (c): best KroQuant-family recipe with a low-rank branch minus the better of "
                  "SVDQuant and SmoothQuant + LoRaQ (goal ≥ +0.5 dB)",
                  "{testbed_best_kroquant_family_psnr_margin_db:+.2f} dB", "—", "—"],
                 ["control: the same minus the better of SVDQuant + GPTQ and SmoothQuant + GPTQ + LoRaQ",
                  "{testbed_best_kroquant_family_psnr_margin_vs_gptq_baselines_db:+.2f} dB", "—", "—"]],
    },
}


def _keys_of(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def _cell(text: str) -> str:
    """A markdown table cell: a ``|`` in the text (``w1|w3``) escaped, so that it does not end the cell."""
    return re.sub(r"(?<!\\)\|", r"\\|", text)


#: What a template says a figure's unit is: its format spec ``%`` (a fraction) or the text right after it.
_UNIT_AFTER = ((" µs", "us"), (" ms", "ms"), (" dB", "dB"), ("x", "x"))


def _template_units(template: str) -> dict[str, str]:
    """``{key: unit}`` for the placeholders of ``template`` whose unit the text shows (``{k:.0f} µs``, ``{k:.1%}``,
    ``{k:.2f}x``, ...); placeholders without one (counts, ratios in words) are not listed."""
    units = {}
    for m in re.finditer(r"\{(\w+):([^}]*)\}", template):
        key, spec, after = m.group(1), m.group(2), template[m.end():m.end() + 3]
        if spec.endswith("%"):
            units[key] = "fraction"
        for text, unit in _UNIT_AFTER:
            if after.startswith(text) and not spec.endswith("%"):
                units[key] = unit
    return units


def render_block(name: str, figures: Mapping[str, Figure]) -> str:
    """The markdown of README block ``name``: the table of :data:`TABLES` filled in, then one line per distinct
    (device, jax, date) naming what was measured where. Raises naming the first missing key."""
    if name not in TABLES:
        raise HeadlineError(f"unknown README block {name!r}; known: {sorted(TABLES)}")
    table = TABLES[name]
    values = {}
    used: list[str] = []
    for row in table["rows"]:
        for cell in row:
            for key in _keys_of(cell):
                if key not in figures:
                    raise HeadlineError(f"README block {name!r} needs headline key {key!r}, which is missing")
                shown = _template_units(cell).get(key)
                if shown is not None and shown != figures[key].unit:
                    raise HeadlineError(f"README block {name!r} shows headline key {key!r} in {shown!r}, but it is "
                                        f"recorded in {figures[key].unit!r}")
                values[key] = figures[key].value
                if key not in used:
                    used.append(key)
    lines = ["| " + " | ".join(_cell(c) for c in table["header"]) + " |", "|" + "---|" * len(table["header"])]
    lines += ["| " + " | ".join(_cell(cell.format_map(values)) for cell in row) + " |" for row in table["rows"]]
    provenance: dict[tuple, list[str]] = {}
    for key in used:
        f = figures[key]
        provenance.setdefault((f.device, f.jax, f.date_utc[:10]), [])
        if f.source not in provenance[(f.device, f.jax, f.date_utc[:10])]:
            provenance[(f.device, f.jax, f.date_utc[:10])].append(f.source)
    lines.append("")
    for (device, jax_version, date), sources in sorted(provenance.items()):
        lines.append(f"Measured on {device}, jax {jax_version}, {date}: "
                     + ", ".join(f"`{s}`" for s in sources) + ".")
    return "\n".join(lines)


_BLOCK = re.compile(r"<!-- headline:(?P<name>[\w-]+) -->[ \t]*\r?\n(?P<body>.*?)<!-- /headline:(?P=name) -->", re.S)


def render_readme(text: str, figures: Mapping[str, Figure]) -> str:
    """``text`` with every headline block regenerated from ``figures``.

    Raises :class:`HeadlineError` if a marker is unmatched, a block of :data:`TABLES` is missing or repeated, or a
    block's opening marker is not alone on its line (such a block would never be regenerated, so ``--check`` could
    not see it go stale)."""
    opened = re.findall(r"<!-- headline:([\w-]+) -->", text)
    closed = re.findall(r"<!-- /headline:([\w-]+) -->", text)
    if sorted(opened) != sorted(closed):
        raise HeadlineError(f"README headline markers do not match: opened {opened}, closed {closed}")
    if sorted(opened) != sorted(TABLES):
        missing, repeated = sorted(set(TABLES) - set(opened)), sorted({n for n in opened if opened.count(n) > 1})
        raise HeadlineError(f"README headline blocks: missing {missing}, repeated {repeated}, unknown "
                            f"{sorted(set(opened) - set(TABLES))}")
    rendered: list[str] = []

    def block(m: re.Match) -> str:
        name = m.group("name")
        rendered.append(name)
        return f"<!-- headline:{name} -->\n{render_block(name, figures)}\n<!-- /headline:{name} -->"

    out = _BLOCK.sub(block, text)
    if sorted(rendered) != sorted(opened):
        raise HeadlineError(f"README headline blocks {sorted(set(opened) - set(rendered))}: the opening marker must "
                            "end its line and the block end with its closing marker")
    return out

"""H200 benchmark of the FP8 W4A4 / W4A8 layer (``pallas_kernels.fp8_gemm``) against bf16 and dequant + cuBLAS.

Per model layer shape ``(n, k)`` (``models.layer_shapes``: Ideogram 4 and FLUX.1 first, then PixArt-Sigma and SANA)
and ``m`` in (4096, 512), three rotating input sets (different activations and weights per call), rank-128 low-rank
branch, a KroQuant (K2) transform near the Hadamard init:

* ``bf16_xla``: ``x W^T`` on bf16 operands, bf16 output (XLA / cuBLAS): the baseline.
* ``dequant_layer``: the served default today: K2 transform + MXFP4 quantize kernel, ``h = x (R T^T)^T``, both packed
  operands decoded to bf16, one cuBLAS GEMM ``[Q(xT) | h] [W | L]^T`` (``w4a4_gemm.w4a4_matmul_dequant``).
* ``fp8_w4a4``: the layer as served (``fp8_gemm.DEFAULT_ACT_ENCODE``): the quantize kernel and the activations'
  E4M3 encoding, ``h``, one FP8 GEMM (f32 output), the epilogue fusion (row/column powers of two, ``h L^T``, output
  bf16) (``fp8_gemm.fp8_linear_forward``), the weight re-encoded once beforehand. The encodings explicitly:
  ``fp8_w4a4_kernel`` (the quantizer's FP8 output mode, ``act_encode="kernel"``: a pre-pass for the rows' reference
  exponents, then the quantizing pass writes E4M3 + row powers of two), ``fp8_w4a4_xla`` (packed MXFP4 re-encoded by
  an XLA fusion); ``fp8_w4a4_bf16gemm``: the FP8 GEMM writes bf16 (half the bytes, one more rounding).
  ``fp8_w4a4_two_phase``: the quantizer writes packed MXFP4, one Pallas kernel re-encodes it
  (``act_encode="two_phase"``).
* ``quant_mxfp4`` / ``quant_fp8`` / ``quant_two_phase`` / ``quant_xla_reencode``: the activation side alone: the
  quantize kernel (packed MXFP4), its FP8 output mode (pre-pass + quantizing pass), the kernel + the Pallas re-encode,
  the kernel + the XLA re-encode (bytes compared with the last: ``quant_*_bytes_equal``; the layer outputs:
  ``fp8_w4a4*_equal_to_xla_encode``).
* ``fp8_w4a4_precise``: the same with ``accumulation="precise"`` (partial sums promoted to fp32; GPU only).
* ``fp8_w4a8``: ``x T`` in f32 (XLA) and per-token E4M3 activations, the same FP8 GEMM and epilogue.
* ``fp8_gemm_only``: the FP8 GEMM alone on E4M3 operands, bf16 output: the floor of the FP8 strategies.
* ``fp8_mgpu_w4a4``: the layer as the ``"fp8_mgpu"`` strategy serves it: the K1 transform + quantize kernel, the XLA
  re-encode, ``h``, and ONE fused Mosaic GPU kernel for the FP8 GEMM with its powers of two and ``h L^T``, bf16 out
  (``fp8_linear_forward(..., gemm="mgpu")``; the same transform prepared as K1, ``L / sw`` made once beforehand).

Timing: device time from the profiler (CUPTI kernel durations, ``kroquant_jax.timing.gpu_kernel_events``): per case all
variants run inside one trace, each as 20 calls after warm-up, separated by a host pause; the device events are split
into variants at those pauses, and per variant the kernels of each call are summed (median over calls) and listed per
kernel (median µs per call: the quantizer's share). Wall time of the same calls is recorded too (fallback).

Checks (``--check-rows`` rows of each case's first input set): every variant's output against the exact float64
eq. 11 product of the same quantized operands (relative L2 error), the fraction of activation rows whose block
exponents span <= 14 binades (exact in E4M3), and, at the accuracy shapes, the FP8 GEMM with f32 output in each
accumulation mode (XLA default, precise, fast, split-K 512) against the dequant GEMM with f32 output.

    python benchmarks/fp8_bench.py --out $OUT/fp8_bench.json            # the H200
    python benchmarks/fp8_bench.py --tiny --interpret --out /tmp/f.json  # CPU validation (interpret mode)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import fp8_encoding as FE  # noqa: E402
from kroquant_jax import timing  # noqa: E402
from kroquant_jax import transforms as T  # noqa: E402
from kroquant_jax.fileio import atomic_write_json  # noqa: E402
from kroquant_jax.formats import MXFP4, dequantize, quantize  # noqa: E402
from models.layer_shapes import PRESET_LABELS, preset_layer_shapes, shape_table  # noqa: E402
from pallas_kernels import fp8_gemm as G8  # noqa: E402
from pallas_kernels.fp8_gemm_mgpu import prescale_left  # noqa: E402
from pallas_kernels import transform_quantize as TQ  # noqa: E402
from pallas_kernels import w4a4_gemm as G  # noqa: E402

RANK = 128
N_SETS = 3
_mxfp4_to_e4m3 = jax.jit(FE.mxfp4_to_e4m3, static_argnames=("order", "count_inexact", "arithmetic", "group"))
# (model, layer, n, k): the real checkpoints' come from models.layer_shapes (derived from the presets, in priority
# order: the run stops starting cases at --budget-s); these are the CPU validation's.
TINY_LAYERS = [("tiny", "attn.q", 256, 256), ("tiny", "ffn.w2", 128, 512)]
ACCURACY_LAYERS = ("ideogram4.attn.q", "ideogram4.ffn.w2", "flux1.single.proj_out", "pixart_sigma.attn.q",
                   "tiny.ffn.w2")
HEADLINE_MODELS = ("ideogram4", "flux1")


# ---------------------------------------------------------------------------------------------------------------------
# Device time from the profiler.
# ---------------------------------------------------------------------------------------------------------------------


def _per_call(events, n_calls: int) -> dict:
    """``us`` (median over calls of the summed kernel time), ``timing`` and ``kernels_us`` (median per call of each
    kernel): ``timing.calls_device_time``."""
    if not events:
        return {}
    t = timing.calls_device_time(events, n_calls)
    return {"us": t.us, "timing": t.method, "kernels_us": t.kernels_us}


def time_variants(fns: dict, sets: list, n_calls: int, pause_s: float = 0.05) -> dict:
    """Device time of each ``fns[name](*sets[i % len(sets)])`` (already compiled), all in one profiler trace.

    Returns ``{name: {"us", "timing", "kernels_us", "wall_us"}}``; ``us`` falls back to the wall time when the trace
    has no GPU events (CPU) or cannot be split into one segment per variant."""
    out = {name: {} for name in fns}
    trace_dir = tempfile.mkdtemp(prefix="fp8bench_")
    with jax.profiler.trace(trace_dir):
        for name, fn in fns.items():
            time.sleep(pause_s)
            t0 = time.perf_counter()
            y = None
            for i in range(n_calls):
                y = fn(*sets[i % len(sets)])
            jax.block_until_ready(y)
            out[name]["wall_us"] = (time.perf_counter() - t0) / n_calls * 1e6
    try:
        events = timing.gpu_kernel_events(trace_dir)
    except Exception as e:  # noqa: BLE001 - recorded, wall time used
        events = []
        print(f"  profiler read failed: {e!r}")
    # Split at the host pauses: gaps longer than half the pause separate variants.
    segments, cur = [], []
    for ev in events:
        if cur and ev[0] - (cur[-1][0] + cur[-1][1]) > pause_s * 0.5e9:
            segments.append(cur)
            cur = []
        cur.append(ev)
    if cur:
        segments.append(cur)
    ok = len(segments) == len(fns)
    for (name, rec), seg in zip(out.items(), segments if ok else [[]] * len(fns)):
        rec.update(_per_call(seg, n_calls))
        if "us" not in rec:
            rec.update(us=rec["wall_us"], timing="wallclock" + ("" if not events else f" ({len(segments)} segments)"))
    return out


def kernel_shares(kernels_us: dict) -> dict:
    """Per-call µs grouped: the transform + quantize kernel (``tq_*``), GEMM library kernels, the rest (XLA fusions)."""
    groups = {"quantizer": 0.0, "gemm": 0.0, "other": 0.0}
    for name, us in kernels_us.items():
        low = name.lower()
        if low.startswith("tq_"):
            groups["quantizer"] += us
        elif any(s in low for s in ("nvjet", "gemm", "cutlass", "sm90", "xmma", "cublas", "dot")):
            groups["gemm"] += us
        else:
            groups["other"] += us
    return groups


# ---------------------------------------------------------------------------------------------------------------------
# Inputs and variants.
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))  # one program per shape (op by op, each op compiles)
def make_set(key, m: int, n: int, k: int, act: str = "mxfp4"):
    """One rotating input set: ``x`` bf16 (outlier channels), and the layer's pieces built from random weights."""
    kx, kw, kl, kr, kt = jax.random.split(key, 5)
    x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.where(jnp.arange(k) % 97 == 0, 20.0, 1.0)
    w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
    left = quantize(jax.random.normal(kl, (n, RANK), jnp.float32) * 0.02, MXFP4())
    right = jax.random.normal(kr, (RANK, k), jnp.float32) * 0.02
    params = jax.tree.map(lambda v: v * (1.0 + 0.1 * jax.random.normal(kt, v.shape)), T.get("kron_lu").init(k))
    transform = TQ.prepare("kron_lu", params, d=k)
    blocks = transform.dense_blocks()  # (k/32, 32, 32)
    # T folded into R (the served layer's R T^T), rows in the even/odd order of the packed L
    r_folded = jnp.einsum("rjc,jkc->rjk", right.reshape(RANK, -1, 32), blocks).reshape(RANK, k)
    r_folded = r_folded[G.even_odd_permutation(RANK)].astype(jnp.bfloat16)
    qw = quantize(w, MXFP4())
    layer8 = G8.Fp8Linear(transform=transform, weight=G8.prepare_weight(qw), right=r_folded,
                          left=G.dequantize_bf16(left, order="even_odd"), bias=None, act=act)
    # the fused kernel's layer as Fp8MgpuStrategy.prepare makes it: the transform as K1, L / sw once
    layer8_mgpu = dataclasses.replace(layer8, transform=TQ.prepare("kron_lu", params, d=k, kernel="k1"),
                                      left_over_scale=prescale_left(layer8.left, layer8.weight))
    return {"x": x.astype(jnp.bfloat16), "w_bf16": w.astype(jnp.bfloat16), "qw": qw, "left_q": left,
            "transform": transform, "r_folded": r_folded, "layer8": layer8, "layer8_mgpu": layer8_mgpu}


def variants(impl: str) -> dict:
    """``{name: fn(set) -> (m, n) bf16}``."""
    def tq(s):
        return TQ.transform_quantize(s["x"], s["transform"], MXFP4(), impl=impl, round_to_input=False)

    def h_of(s):
        return jnp.matmul(s["x"], s["r_folded"].T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def w4a8(s):
        layer = s["layer8"]
        return G8.fp8_linear_forward(G8.Fp8Linear(layer.transform, layer.weight, layer.right, layer.left, None,
                                                  act="fp8"), s["x"], impl=impl)

    def fp8_enc(s, enc):
        return G8.fp8_linear_forward(dataclasses.replace(s["layer8"], act_encode=enc), s["x"], impl=impl)

    def quant_fp8(s):
        return TQ.transform_quantize_fp8(s["x"], s["transform"], MXFP4(), impl=impl, round_to_input=False).values

    return {
        "bf16_xla": lambda s: jnp.matmul(s["x"], s["w_bf16"].T),
        "dequant_layer": lambda s: G.w4a4_matmul_dequant(tq(s), s["qw"], lowrank=(h_of(s), s["left_q"])),
        "fp8_w4a4": lambda s: G8.fp8_linear_forward(s["layer8"], s["x"], impl=impl),
        "fp8_w4a4_kernel": lambda s: fp8_enc(s, "kernel"),
        "fp8_w4a4_xla": lambda s: fp8_enc(s, "xla"),
        "fp8_w4a4_two_phase": lambda s: fp8_enc(s, "two_phase"),
        "quant_mxfp4": lambda s: tq(s).codes,
        "quant_fp8": quant_fp8,
        "quant_two_phase": lambda s: TQ.reencode_e4m3(tq(s), impl=impl).values,
        "quant_xla_reencode": lambda s: FE.mxfp4_to_e4m3(tq(s), order="even_odd", count_inexact=False).values,
        "fp8_w4a4_bf16gemm": lambda s: G8.fp8_linear_forward(s["layer8"], s["x"], impl=impl, gemm_dtype=jnp.bfloat16),
        "fp8_w4a4_precise": lambda s: G8.fp8_linear_forward(s["layer8"], s["x"], impl=impl, accumulation="precise"),
        "fp8_w4a8": w4a8,
        "fp8_gemm_only": lambda s: G8.fp8_matmul(s["a8"], s["layer8"].weight),
        "fp8_mgpu_w4a4": lambda s: G8.fp8_linear_forward(s["layer8_mgpu"], s["x"], impl=impl, out_dtype=jnp.bfloat16,
                                                         gemm="mgpu"),
    }


def _rows(q, rows: int):
    """The first ``rows`` rows of a packed QuantizedArray (the quantizer is row-wise)."""
    return dataclasses.replace(q, codes=q.codes[:rows], scales=q.scales[:rows])


def exact_reference(s, xq, rows: int, act: str) -> np.ndarray:
    """float64 eq. 11 on the quantized operands of ``s`` for its first ``rows`` rows (``xq``: its quantized
    activations)."""
    x = s["x"][:rows]
    if act == "fp8":
        a = FE.per_token_e4m3(TQ.reference_apply(x.astype(jnp.float32), s["transform"]))
    else:
        a = _rows(xq, rows)
    h = jnp.matmul(x, s["r_folded"].T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return G8.fp8_matmul_reference(a, s["qw"], lowrank=(h, s["left_q"]))


def _bits(y: jax.Array) -> jax.Array:
    """An array's bit patterns (so that NaNs compare equal): E4M3 as uint8, f32 as int32, bf16 as int16."""
    width = {1: jnp.uint8, 2: jnp.int16, 4: jnp.int32}[jnp.dtype(y.dtype).itemsize]
    return jax.lax.bitcast_convert_type(y, width)


def _rel(y, ref: np.ndarray) -> float:
    y = np.asarray(jax.device_get(y), np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-300))


def accuracy(s, xq, rows: int) -> dict:
    """FP8 GEMM (f32 output) per accumulation mode vs dequant GEMM (f32 output) vs float64, no low-rank."""
    a = _rows(xq, rows)
    ref = G8.fp8_matmul_reference(a, s["qw"])
    out = {"dequant_gemm_f32": _rel(G.w4a4_matmul_dequant(a, s["qw"], out_dtype=jnp.float32), ref)}
    modes = {"fp8_default": {}, "fp8_precise": {"accumulation": "precise"}, "fp8_fast": {"accumulation": "fast"},
             "fp8_split512_default": {"k_split": 512}}
    for name, kw in modes.items():
        k = s["qw"].shape[1]
        if "k_split" in kw and k % kw["k_split"]:
            continue
        try:
            out[name] = _rel(G8.fp8_matmul(a, s["layer8"].weight, out_dtype=jnp.float32, **kw), ref)
        except Exception as e:  # noqa: BLE001 - e.g. a preset XLA:CPU rejects
            out[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def run_case(model, layer, n, k, m, *, impl, n_calls, check_rows, do_accuracy, keep=None):
    # the quantizer compiled once for the sets (called eagerly, the kernel is traced and compiled again per call)
    quantize_x = jax.jit(lambda x, t: TQ.transform_quantize(x, t, MXFP4(), impl=impl, round_to_input=False))
    sets, xqs = [], []
    for i in range(N_SETS):
        s = make_set(jax.random.PRNGKey(1000 * i + m + n), m, n, k)
        xqs.append(quantize_x(s["x"], s["transform"]))
        if not keep or "fp8_gemm_only" in keep:  # its operand
            s["a8"] = _mxfp4_to_e4m3(xqs[-1], order=G8.operand_order(s["layer8"].weight))
        sets.append(s)
    jax.block_until_ready([s["layer8"] for s in sets])
    case = {"model": model, "layer": layer, "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k, "variants": {}}
    # spans of the (random) activations after the quantizer: fraction of rows exact in E4M3
    xq0 = xqs[0]
    st = FE.span_stats(xq0)
    case["act_rows_in_range"] = st["fraction_in_range"]
    case["act_max_span"] = st["max_span"]
    case["weight_inexact"] = int(sets[0]["layer8"].weight.inexact)
    fns = {}
    for name, fn in variants(impl).items():
        if keep and name not in keep:
            continue
        rec = case["variants"][name] = {}
        try:
            t0 = time.perf_counter()
            jitted = jax.jit(fn)
            y0 = jax.block_until_ready(jitted(sets[0]))
            rec["compile_and_first_s"] = time.perf_counter() - t0
            rec["finite"] = bool(jnp.all(jnp.isfinite(y0)))
            fns[name] = jitted
            for _ in range(2):
                jax.block_until_ready([jitted(s) for s in sets])
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            rec.update(error=f"{type(e).__name__}: {str(e)[:400]}", trace=traceback.format_exc()[-1000:])
    timed = time_variants({nm: (lambda s, f=f: f(s)) for nm, f in fns.items()}, [(s,) for s in sets], n_calls)
    for name, rec in timed.items():
        case["variants"][name].update(rec)
        if "kernels_us" in rec:
            case["variants"][name]["shares_us"] = kernel_shares(rec["kernels_us"])
    base = case["variants"].get("bf16_xla", {}).get("us")
    for rec in case["variants"].values():
        if base and "us" in rec:
            rec["speedup_vs_bf16"] = base / rec["us"]
    # checks against the exact float64 product of the same quantized operands (first check_rows rows of set 0)
    rows = min(check_rows, m)
    refs = {}
    for name in ("dequant_layer", "fp8_w4a4", "fp8_w4a4_kernel", "fp8_w4a4_xla", "fp8_w4a4_bf16gemm", "fp8_w4a8",
                 "fp8_mgpu_w4a4"):
        if name in fns:
            act = "fp8" if name == "fp8_w4a8" else "mxfp4"
            if act not in refs:
                refs[act] = exact_reference(sets[0], xq0, rows, act)
            y = fns[name](sets[0])[:rows]
            case["variants"][name]["rel_err_vs_exact"] = _rel(y, refs[act])
    # the FP8 output mode writes the XLA re-encode's bytes, so the layer output is the same (all rows, every set)
    for new, old, key in (("quant_fp8", "quant_xla_reencode", "quant_fp8_bytes_equal"),
                          ("quant_two_phase", "quant_xla_reencode", "quant_two_phase_bytes_equal"),
                          ("fp8_w4a4", "fp8_w4a4_xla", "fp8_w4a4_equal_to_xla_encode"),
                          ("fp8_w4a4_kernel", "fp8_w4a4_xla", "fp8_w4a4_kernel_equal_to_xla_encode"),
                          ("fp8_w4a4_two_phase", "fp8_w4a4_xla", "fp8_w4a4_two_phase_equal_to_xla_encode")):
        if new in fns and old in fns:
            case[key] = all(bool(jnp.array_equal(_bits(fns[new](s)), _bits(fns[old](s)))) for s in sets)
    if do_accuracy:
        case["accuracy_f32_out"] = accuracy(sets[0], xq0, rows)
    return case


def headline(result: dict) -> dict:
    """The issue's headline keys from the cases: the smallest W4A4 layer speed-up over the Ideogram 4 and FLUX.1
    shapes, on the FP8 strategy (``w4a4_layer_fp8_*``) and on the fused kernel (``w4a4_layer_fp8_mgpu_*``)."""
    out = {}
    for variant, prefix in (("fp8_w4a4", "w4a4_layer_fp8"), ("fp8_mgpu_w4a4", "w4a4_layer_fp8_mgpu")):
        for m in (4096, 512):
            ratios = [c["variants"][variant]["speedup_vs_bf16"] for c in result["cases"]
                      if c["m"] == m and c["model"] in HEADLINE_MODELS and "speedup_vs_bf16" in c["variants"].get(
                          variant, {})]
            if ratios:
                out[f"{prefix}_speedup_vs_bf16_min_m{m}"] = min(ratios)
                out[f"{prefix}_speedup_vs_bf16_min_m{m}_over_shapes"] = len(ratios)
    return out


def table(result: dict) -> str:
    cols = ["bf16_xla", "dequant_layer", "fp8_w4a4", "fp8_w4a4_kernel", "fp8_w4a4_two_phase", "fp8_w4a4_xla",
            "fp8_w4a4_bf16gemm", "fp8_w4a8", "fp8_gemm_only", "fp8_mgpu_w4a4", "quant_mxfp4", "quant_fp8",
            "quant_two_phase", "quant_xla_reencode"]
    lines = ["| model | layer | m | n | k | " + " | ".join(f"{c} µs" for c in cols)
             + " | fp8_w4a4 / bf16 | fp8_mgpu_w4a4 / bf16 | quantizer µs (share of fp8_w4a4 / fp8_mgpu_w4a4) "
               "| rel err dequant / w4a4 / w4a8 / mgpu |",
             "| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in cols) + " | ---: | ---: | ---: | --- |"]
    for c in result["cases"]:
        v = c["variants"]
        cells = [f"{v[x]['us']:.1f}" if "us" in v.get(x, {}) else ("error" if x in v else "–") for x in cols]
        ratios, shares = [], []
        for name in ("fp8_w4a4", "fp8_mgpu_w4a4"):
            f = v.get(name, {})
            ratios.append(f"{f['speedup_vs_bf16']:.2f}x" if "speedup_vs_bf16" in f else "–")
            qs = f.get("shares_us", {}).get("quantizer")
            shares.append(f"{qs:.1f} ({qs / f['us']:.0%})" if qs and "us" in f else "–")
        errs = " / ".join(f"{v[x]['rel_err_vs_exact']:.1e}" if "rel_err_vs_exact" in v.get(x, {}) else "–"
                          for x in ("dequant_layer", "fp8_w4a4", "fp8_w4a8", "fp8_mgpu_w4a4"))
        lines.append(f"| {c['model']} | {c['layer']} | {c['m']} | {c['n']} | {c['k']} | " + " | ".join(cells)
                     + f" | {' | '.join(ratios)} | {' / '.join(shares)} | {errs} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/fp8_bench.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU validation)")
    p.add_argument("--interpret", action="store_true", help="the quantizer kernel in Pallas interpret mode (CPU)")
    p.add_argument("--ms", default="4096,512")
    p.add_argument("--layers", default="", help="comma-separated 'model.layer' names (default: all, priority order)")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new case after this many seconds")
    p.add_argument("--calls", type=int, default=20, help="timed calls per variant")
    p.add_argument("--check-rows", type=int, default=128)
    p.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--no-accuracy", action="store_true", help="skip the accumulation-mode accuracy checks")
    args = p.parse_args(argv)
    t_start = time.time()
    keep = set(args.layers.split(",")) - {""}
    if args.tiny:
        shapes = TINY_LAYERS
    else:  # only the presets that --layers names, if it does (each preset's model is built to read its shapes)
        labels = [label for label in PRESET_LABELS if label in {name.split(".", 1)[0] for name in keep}]
        shapes = shape_table(preset_layer_shapes(*labels)) if labels or not keep else []
    if keep:
        unknown = keep - {f"{s[0]}.{s[1]}" for s in shapes}
        if unknown:
            raise SystemExit(f"--layers: unknown {sorted(unknown)}")
        shapes = [s for s in shapes if f"{s[0]}.{s[1]}" in keep]
    ms = [40, 16] if args.tiny else [int(v) for v in args.ms.split(",")]
    impl = "interpret" if args.interpret else ("pallas" if jax.default_backend() == "gpu" else "reference")
    dev = jax.devices()[0]
    result = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax": jax.__version__,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "impl": impl, "rank": RANK, "n_sets": N_SETS, "calls": args.calls, "cases": [], "stopped_early": False,
              "method": "CUPTI kernel time per call (summed; median over calls), all variants of a case in one "
                        "profiler trace split at host pauses; rotating inputs; after compile + 2 warm-up rounds"}

    def save():
        result["headline"] = headline(result)
        atomic_write_json(args.out, result)

    for model, layer, n, k in shapes:
        for m in ms:
            if time.time() - t_start > args.budget_s:
                result["stopped_early"] = True
                break
            t0 = time.time()
            try:
                case = run_case(model, layer, n, k, m, impl=impl, n_calls=N_SETS if args.tiny else args.calls,
                                check_rows=args.check_rows, keep=set(args.variants.split(",")) - {""},
                                do_accuracy=(f"{model}.{layer}" in ACCURACY_LAYERS and m == min(ms)
                                             and not args.no_accuracy))
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                case = {"model": model, "layer": layer, "m": m, "n": n, "k": k, "variants": {},
                        "error": f"{type(e).__name__}: {str(e)[:400]}", "trace": traceback.format_exc()[-1500:]}
            case["case_s"] = time.time() - t0
            result["cases"].append(case)
            v = case["variants"]
            print(f"[{time.time() - t_start:6.1f} s] {model:12s} {layer:15s} m={m:5d} "
                  + " ".join(f"{nm}={v[nm]['us']:.1f}" for nm in v if "us" in v[nm])
                  + (f" ERROR {case['error'][:200]}" if "error" in case else ""), flush=True)
            flags = {k: v for k, v in case.items() if k.endswith(("_bytes_equal", "_equal_to_xla_encode"))}
            if flags:
                print(f"    {flags}", flush=True)
            if "accuracy_f32_out" in case:
                print(f"    accuracy (f32 out, rel err vs float64): {case['accuracy_f32_out']}", flush=True)
            save()
    result["wall_s"] = time.time() - t_start
    save()
    print(table(result))
    print(result["headline"])
    return result


if __name__ == "__main__":
    main()

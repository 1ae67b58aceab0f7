"""H200 benchmark of the FP4 forward pass: W4A4 layer vs bf16 ``A W^T``, fused epilogues vs GEMM + separate op.

Per layer shape ``(n, k)`` of Ideogram 4, PixArt-Sigma, SANA and FLUX.1 (``models.layer_shapes``) and ``m`` in
(4096, 512):

* ``bf16_xla``: XLA/cuBLAS ``A W^T`` on bf16 operands (bf16 output): the baseline.
* ``w4a4_gemm_<fmt>_<compute>``: the Pallas W4A4 GEMM alone on packed operands (MXFP4 bf16 / fp8 modes, NVFP4).
* ``w4a4_dequant_mxfp4``: "dequantize + cuBLAS" (``w4a4_gemm.w4a4_matmul_dequant``): both packed operands decoded to
  bf16 by XLA fusions, one cuBLAS GEMM; ``..._xla_fused``: the same without the optimization barrier (XLA may fuse
  the decode into its own GEMM). ``w4a4_mgpu_mxfp4``: the Mosaic GPU kernel (``w4a4_gemm_mgpu``; the weight in its
  prepared layout, made once like the packing).
* ``w4a4_layer_lr_fused``: one layer as served (``pallas_kernels.served.forward``, ``strategy="kernel"``): fused K2
  transform+quantize kernel (``transform_quantize``) + the low-rank input ``h = A (R T^T)^T`` (XLA; ``T`` folded
  into ``R`` at packing time, so the branch needs no ``A T``) + the W4A4 GEMM with ``h L^T`` fused in its epilogue
  (rank 128, ``L`` packed in MXFP4 and decoded in the epilogue). ``w4a4_layer_lr_beside``: the same with the
  low-rank product as a separate XLA GEMM + add (``lowrank="beside"``, ``L`` resident in bf16).
  ``w4a4_layer_nolr``: transform+quantize + GEMM only. ``transform_quantize_only``: the quantizer kernel alone.
  ``w4a4_layer_dequant``: the default strategy, transform+quantize + ``h`` + "dequantize + cuBLAS" with
  ``[A | h] [W | L]^T`` as one GEMM. ``w4a4_layer_mgpu``: ``strategy="mgpu"``, transform+quantize + ``h`` + the
  Mosaic GPU GEMM + ``h L^T`` beside it (XLA, ``L`` resident in bf16; W's scales are transposed per call here, a few
  µs). References: ``served.reference`` of the same layer.
* Epilogues (Ideogram 4 shapes: q projection + RMSNorm over heads of 256, fused w1|w3 + SwiGLU): the fused kernel vs
  the same kernel without epilogue + the op in XLA vs XLA ``A W^T`` + the op, on bf16 and on MXFP4 operands.

Timing (device time): one jitted ``fori_loop`` of ``N`` calls over ``R = 3`` rotating input sets (operands of
different layers, more bytes than the 60 MB L2 for the large shapes), an ``optimization_barrier`` on the loop carry
so nothing is hoisted, ``block_until_ready``; the median over repeats of (wall time / N) after warm-up. With
``--timer cupti``: the CUPTI kernel durations of each call summed (``kroquant_jax.timing.device_time``), median
of 30 calls, and each kernel's median time per call in ``kernels_us`` (which kernels a variant runs, and where its time
goes). Each variant's output is checked against an f32 reference (relative error and NaN check, stored in the JSON).

    python benchmarks/w4a4_bench.py --out $OUT/w4a4.json                # on the H200 (default set, --budget-s)
    python benchmarks/w4a4_bench.py --tiny --interpret --out /tmp/w.json  # CPU validation (interpret mode)

A variant that fails to compile or run is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import timing  # noqa: E402
from kroquant_jax import transforms as T  # noqa: E402
from kroquant_jax.fileio import atomic_write_text  # noqa: E402
from kroquant_jax.formats import MXFP4, NVFP4, dequantize, quantize  # noqa: E402
from models.layer_shapes import PRESET_LABELS, preset_layer_shapes, shape_table  # noqa: E402
from pallas_kernels import epilogues as E  # noqa: E402
from pallas_kernels import served as S  # noqa: E402
from pallas_kernels import w4a4_gemm as G  # noqa: E402
from pallas_kernels import w4a4_gemm_mgpu as GM  # noqa: E402

try:
    from pallas_kernels import transform_quantize as TQ  # noqa: E402
except Exception:  # noqa: BLE001 - the fused quantizer lives in another module (recorded as missing)
    TQ = None

RANK = 128
N_SETS = 3

# The real checkpoints' layers timed, by priority (the run stops at --budget-s); their shapes come from
# models.layer_shapes (derived from the presets).
PRIORITY = ("ideogram4.attn.q", "ideogram4.ffn.w13", "ideogram4.ffn.w2", "flux1.attn.q", "flux1.ff.up",
            "pixart_sigma.attn.q", "pixart_sigma.ff.up", "sana_1600m.attn.q", "sana_1600m.glumb.inverted",
            "flux1.ff.down", "pixart_sigma.ff.down", "sana_1600m.glumb.point", "flux1.single.proj_out")
# (model, layer, n, k): output features, input features (CPU validation).
TINY_SHAPES = [("tiny", "attn.q", 512, 256), ("tiny", "ffn.w13", 256, 128)]


# ---------------------------------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------------------------------


def n_calls_for(flops, target_s, tiny):
    """Calls per timed loop: about ``target_s`` seconds (at least two rounds of the input sets; tiny: one round)."""
    return N_SETS if tiny else timing.calls_for(flops, target_s, minimum=N_SETS * 2)


def _rel_err(y, ref):
    y = np.asarray(jax.device_get(y), np.float32)
    ref = np.asarray(jax.device_get(ref), np.float32)
    nan = bool(np.isnan(y).any())
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30)), nan


# ---------------------------------------------------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------------------------------------------------


def make_layer(key, m, n, k, with_outliers=True):
    """bf16 activations, bf16 weight, and LoRaQ-like low-rank factors for one layer."""
    ka, kw, kl, kr = jax.random.split(key, 4)
    a = jax.random.normal(ka, (m, k), jnp.float32)
    if with_outliers:
        a = a * jnp.where(jnp.arange(k) % 97 == 0, 20.0, 1.0)
    w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
    left = jax.random.normal(kl, (n, RANK), jnp.float32) * 0.02
    right = jax.random.normal(kr, (RANK, k), jnp.float32) * 0.02
    return a.astype(jnp.bfloat16), w.astype(jnp.bfloat16), left.astype(jnp.bfloat16), right.astype(jnp.bfloat16)


# ---------------------------------------------------------------------------------------------------------------------
# Variants: each returns (fn, input_sets, reference_fn or None).
# ---------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)  # one jitted quantizer per format: its programs compiled once per input shape
def _quantize_jit(fmt):
    return jax.jit(lambda x: quantize(x, fmt))


def _everything(name: str) -> bool:
    return True


# Each builder takes ``want`` (variant name -> bool, default: all): it makes the operands of the variants kept only.


def gemm_variants(layers, interpret, tiny, want=_everything):
    """bf16 XLA vs the W4A4 GEMM (operands pre-quantized)."""
    out = {}

    def bf16(a, w):
        return jnp.matmul(a, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    if want("bf16_xla"):
        out["bf16_xla"] = (bf16, [(a, w) for a, w, _, _ in layers],
                           lambda a, w: jnp.matmul(a.astype(jnp.float32), w.astype(jnp.float32).T))
    for fmt, compute in ((MXFP4(), "bf16"), (MXFP4(), "fp8"), (NVFP4(), "bf16")):
        if not want(f"w4a4_gemm_{fmt.name}_{compute}"):
            continue
        q = _quantize_jit(fmt)
        sets = [(q(a), q(w)) for a, w, _, _ in layers]
        bs = G.BlockSizes(16, 32, 64, 4, 2) if tiny else None

        def fn(qa, qw, compute=compute, bs=bs):
            return G.w4a4_matmul(qa, qw, compute=compute, block_sizes=bs, interpret=interpret)

        out[f"w4a4_gemm_{fmt.name}_{compute}"] = (
            fn, sets, lambda qa, qw: jnp.matmul(dequantize(qa, jnp.float32), dequantize(qw, jnp.float32).T))
    out.update(dequant_mgpu_variants(layers, interpret, tiny, want=want))
    return out


def _ref_packed(qa, qw):
    return jnp.matmul(dequantize(qa, jnp.float32), dequantize(qw, jnp.float32).T)


def dequant_mgpu_variants(layers, interpret=False, tiny=False, mgpu_configs=None, want=_everything):
    """The "dequantize + cuBLAS" strategy (with and without the barrier) and the Mosaic GPU kernel on MXFP4 operands.

    ``mgpu_configs``: ``{suffix: MgpuGemmConfig}`` for extra Mosaic GPU tilings (``w4a4_mgpu_mxfp4_<suffix>``). Off the
    GPU the Mosaic variant is skipped unless ``interpret`` (then its jnp mirror runs: a CPU check of the plumbing).
    """
    mgpu = jax.default_backend() == "gpu" or interpret
    configs = {"": None, **(mgpu_configs or {})} if mgpu else {}
    names = ["w4a4_dequant_mxfp4", "w4a4_dequant_mxfp4_xla_fused",
             *("w4a4_mgpu_mxfp4" + (f"_{suffix}" if suffix else "") for suffix in configs)]
    if not any(want(name) for name in names):
        return {}
    q = _quantize_jit(MXFP4())
    sets = [(q(a.astype(jnp.float32)), q(w.astype(jnp.float32))) for a, w, _, _ in layers]
    out = {"w4a4_dequant_mxfp4": (lambda qa, qw: G.w4a4_matmul_dequant(qa, qw), sets, _ref_packed),
           "w4a4_dequant_mxfp4_xla_fused": (lambda qa, qw: G.w4a4_matmul_dequant(qa, qw, materialize=False), sets,
                                            _ref_packed)}
    out = {name: v for name, v in out.items() if want(name)}
    if not mgpu:
        return out
    impl = S.resolve_impl(None)  # the Mosaic GPU kernel, or its jnp mirror off the GPU
    for suffix, cfg in configs.items():
        if not want("w4a4_mgpu_mxfp4" + (f"_{suffix}" if suffix else "")):
            continue
        m, k = layers[0][0].shape
        n = layers[0][1].shape[0]
        num_sms = int(getattr(jax.devices()[0], "core_count", 0) or 132) if impl == "pallas" else 132
        cfg = cfg or GM.default_config(m, n, k, num_sms)
        # The weight in the kernel's layout (scales transposed, padded), prepared once like the packing itself.
        msets = [(qa, GM.prepare_operand(qw, rows_multiple=cfg.cta_n, k_multiple=cfg.tile_k), qw) for qa, qw in sets]

        def fn(qa, wp, qw, cfg=cfg):
            del qw
            return GM.w4a4_matmul_mgpu(qa, wp, config=cfg, impl=impl)

        out["w4a4_mgpu_mxfp4" + (f"_{suffix}" if suffix else "")] = (fn, msets, lambda qa, wp, qw: _ref_packed(qa, qw))
    return out


LAYER_VARIANTS = ("w4a4_layer_lr_fused", "w4a4_layer_lr_beside", "w4a4_layer_nolr", "transform_quantize_only",
                  "w4a4_layer_dequant", "w4a4_layer_mgpu")


def layer_variants(layers, interpret, tiny, want=_everything):
    """The whole served W4A4 layer (``pallas_kernels.served.forward``): transform+quantize kernel + low-rank input +
    GEMM strategy (+ fused / beside low-rank), on :class:`~pallas_kernels.served.ServedLinear` layers built from the
    random factors (``T`` folded into ``R``, as ``served.serve`` does)."""
    if TQ is None or not any(want(name) for name in LAYER_VARIANTS):
        return {}
    k = layers[0][0].shape[1]
    params = T.get("kron_lu").init(k)
    prepared = TQ.prepare("kron_lu", params, d=k)
    blocks = T.get("kron_lu").blocks(params)  # (k/32, 32, 32): A T = blockdiag(A_j K_j)
    q = _quantize_jit(MXFP4())
    perm = G.even_odd_permutation(RANK)
    sets = []
    for a, w, left, right in layers:
        # T folded into R at packing time: (A T) R^T = A (R T^T)^T; R's rows in the even/odd order of packed L.
        r_folded = jnp.einsum("rjc,jkc->rjk", right.astype(jnp.float32).reshape(RANK, -1, 32),
                              blocks).reshape(RANK, k).astype(jnp.bfloat16)
        left_q = q(left.astype(jnp.float32))
        packed = S.ServedLinear(transform=prepared, weight=q(w.astype(jnp.float32)), right=r_folded[perm],
                                left=left_q, bias=None)  # L packed (MXFP4), decoded in the GEMM epilogue
        resident = S.ServedLinear(transform=prepared, weight=packed.weight, right=r_folded,
                                  left=dequantize(left_q, jnp.bfloat16), bias=None)  # L resident in bf16
        nolr = S.ServedLinear(transform=prepared, weight=packed.weight, right=None, left=None, bias=None)
        sets.append((a, packed, resident, nolr))
    impl = "interpret" if interpret else None
    kernel = S.ServeOptions(strategy="kernel", impl=impl, gemm_blocks=G.BlockSizes(16, 32, 64, 4, 2) if tiny else None)

    def served(which, options):
        def fn(a, packed, resident, nolr):
            return S.forward({"packed": packed, "resident": resident, "nolr": nolr}[which], a, options=options)
        return fn

    def ref(which):
        def fn(a, packed, resident, nolr):
            return S.reference({"packed": packed, "resident": resident, "nolr": nolr}[which], a, out_dtype=jnp.float32)
        return fn

    def tq(a, packed, *_):
        return S.quantized_inputs(packed, a, S.resolve_impl(impl))[0]

    out = {"w4a4_layer_lr_fused": (served("packed", kernel), sets, ref("packed")),
           "w4a4_layer_lr_beside": (served("resident", dataclasses.replace(kernel, lowrank="beside")), sets,
                                    ref("resident")),
           "w4a4_layer_nolr": (served("nolr", kernel), sets, ref("nolr")),
           "transform_quantize_only": (tq, sets, None),
           "w4a4_layer_dequant": (served("packed", S.ServeOptions(impl=impl)), sets, ref("packed"))}
    if jax.default_backend() == "gpu" or interpret:  # the Mosaic GPU GEMM (its jnp mirror off the GPU), h L^T beside
        out["w4a4_layer_mgpu"] = (served("resident", S.ServeOptions(strategy="mgpu", impl=impl)), sets,
                                  ref("resident"))
    return {name: v for name, v in out.items() if want(name)}


def epilogue_variants(layers, kind, interpret, tiny, want=_everything):
    """Fused epilogue vs GEMM kernel + XLA op vs XLA GEMM + op (``kind`` 'rmsnorm' or 'swiglu')."""
    bs = E.EpilogueBlockSizes(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2) if tiny else None
    nw = (1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(5), (256,))).astype(jnp.float32)
    q = _quantize_jit(MXFP4())
    out = {}
    for operands in ("bf16", "mxfp4"):
        names = [f"{kind}_{operands}_fused", f"{kind}_{operands}_gemm_kernel_then_op", f"{kind}_bf16_xla_then_op"]
        if not any(want(name) for name in names[:3 if operands == "bf16" else 2]):
            continue
        sets = []
        for a, w, _, _ in layers:
            if kind == "swiglu":
                w = E.pack_swiglu_weight(w)  # once, at packing time
            sets.append((a, w) if operands == "bf16" else (q(a.astype(jnp.float32)), q(w.astype(jnp.float32))))
        if kind == "rmsnorm":
            def fused(a, w, bs=bs):
                return E.gemm_rmsnorm(a, w, nw, block_sizes=bs, interpret=interpret)

            def op(c):
                return E.rmsnorm_heads(c, nw)
        else:
            def fused(a, w, bs=bs):
                return E.gemm_swiglu(a, w, block_sizes=bs, interpret=interpret)

            def op(c):  # on the permuted output: pairs are adjacent
                cf = c.astype(jnp.float32).reshape(c.shape[0], -1, 2)
                return (jax.nn.silu(cf[..., 0]) * cf[..., 1]).astype(c.dtype)

        def unfused_kernel(a, w, bs=bs, op=op):
            return op(E.gemm(a, w, block_sizes=bs, interpret=interpret))

        def ref(a, w, op=op):
            return op(E.gemm_reference(a, w))

        out[f"{kind}_{operands}_fused"] = (fused, sets, ref)
        out[f"{kind}_{operands}_gemm_kernel_then_op"] = (unfused_kernel, sets, ref)
        if operands == "bf16":
            def xla_then_op(a, w, op=op):
                return op(jnp.matmul(a, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))

            out[f"{kind}_bf16_xla_then_op"] = (xla_then_op, sets, ref)
    return {name: v for name, v in out.items() if want(name)}


# ---------------------------------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------------------------------


def run_case(name, fn, sets, ref, *, flops, target_s, tiny, validate=True, timer="loop"):
    """One variant: timed (``timer="loop"``: ``timing.loop_time``; ``"cupti"``: ``timing.device_time``, the summed
    CUPTI kernel time of each call, median of 30 calls, with the median time of every kernel in ``kernels_us``), then
    checked against ``ref``."""
    rec = {"variant": name}
    try:
        if timer == "cupti":
            jitted = jax.jit(fn)
            y0 = jax.block_until_ready(jitted(*sets[0]))
            t = timing.device_time(lambda s: jitted(*s), sets, n_iter=N_SETS if tiny else 30, warmup=2)
            rec.update(us=t.us, timing=t.method, kernels_us=t.kernels_us, tflops=flops / t.us / 1e6)
        else:
            t = timing.loop_time(fn, sets, n_calls=n_calls_for(flops, target_s, tiny), repeats=2 if tiny else 5)
            y0 = t.y0
            rec.update(us=t.median_s * 1e6, us_all=[x * 1e6 for x in t.samples_s], tflops=flops / t.median_s / 1e12,
                       timing="loop")
        if validate and ref is not None:
            err, nan = _rel_err(y0, jax.jit(ref)(*sets[0]))
            rec.update(rel_err=err, nan=nan)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        rec.update(error=f"{type(e).__name__}: {str(e)[:400]}", trace=traceback.format_exc()[-1200:])
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/w4a4.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU validation)")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--ms", default="4096,512")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new cases after this many seconds")
    p.add_argument("--target-s", type=float, default=0.02, help="approximate seconds of work per timed loop")
    p.add_argument("--only", default="", help="comma-separated models to run (default: all, in priority order)")
    p.add_argument("--layers", default="",
                   help="comma-separated layers to run, 'model.layer' or 'layer' (e.g. ideogram4.ffn.w2,ff.down)")
    p.add_argument("--no-layer", action="store_true")
    p.add_argument("--no-epilogues", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--tables-from", default="", help="print the docs tables of an existing JSON and exit")
    p.add_argument("--variants", default="", help="comma-separated substrings: run only variants whose name has one")
    p.add_argument("--timer", choices=("loop", "cupti"), default="loop",
                   help="loop: wall time of a jitted fori_loop per call (default); cupti: summed CUPTI kernel time per "
                        "call with a per-kernel breakdown (falls back to wall clock where the profiler sees no GPU)")
    args = p.parse_args(argv)
    if args.tables_from:
        with open(args.tables_from) as f:
            print(doc_tables(json.load(f)))
        return None
    t_start = time.time()
    ms = [int(x) for x in args.ms.split(",")]
    if args.tiny:
        ms = [40, 16]
    if args.tiny:
        shapes = TINY_SHAPES
    else:  # only the presets that --only / model-qualified --layers name (each preset's model is built for its shapes)
        prefixes = {name.split(".", 1)[0] for name in PRIORITY}
        wanted = set(args.only.split(",")) if args.only else prefixes
        named = [name for name in args.layers.split(",") if name]
        if named and all(name.split(".", 1)[0] in prefixes for name in named):
            wanted = wanted & {name.split(".", 1)[0] for name in named}
        labels = [label for label in PRESET_LABELS if label in wanted]
        real = preset_layer_shapes(*labels) if labels else {}
        shapes = shape_table({name: real[name] for name in PRIORITY if name in real})
    if args.only:
        keep = set(args.only.split(","))
        shapes = [s for s in shapes if s[0] in keep]
    if args.layers:
        keep = set(args.layers.split(","))
        shapes = [s for s in shapes if f"{s[0]}.{s[1]}" in keep or s[1] in keep]
    dev = jax.devices()[0]
    result = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax": jax.__version__,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "interpret": args.interpret, "tiny": args.tiny, "rank": RANK, "n_sets": N_SETS,
              "method": ("median over repeats of wall(jitted fori_loop of N calls on rotating inputs)/N"
                         if args.timer == "loop" else
                         "CUPTI kernel time per call (summed), median of 30 calls on rotating inputs; kernels_us: "
                         "median per kernel"),
              "timer": args.timer,
              "cases": [], "stopped_early": False}

    def save():
        atomic_write_text(args.out, json.dumps(result, indent=1))  # creates the folder

    tasks = []
    for model, layer, n, k in shapes:
        for m in ms:
            tasks.append((model, layer, n, k, m, "full" if model in ("ideogram4", "tiny") else "lean"))
        last_full = [sh for sh in shapes if sh[0] in ("ideogram4", "tiny")][-1:]
        if (model, layer, n, k) in last_full and not args.no_sweep:  # tiling sweep after Ideogram's shapes
            tasks += [(model, "attn.q", *shapes[0][2:], m, "sweep") for m in ms]
    for model, layer, n, k, m, mode in tasks:
        if time.time() - t_start > args.budget_s:
            result["stopped_early"] = True
            break
        layers = [make_layer(jax.random.PRNGKey(100 * i + m), m, n, k) for i in range(N_SETS)]
        flops = 2.0 * m * n * k
        keep = args.variants.split(",") if args.variants else None

        def want(key, lean=mode == "lean", keep=keep):  # the variants this case runs: the builders make only theirs
            return (not lean or key in LEAN) and (keep is None or any(x in key for x in keep))

        if mode == "sweep":
            variants = sweep_variants(layers, args.interpret, args.tiny, want=want)
        else:
            variants = dict(gemm_variants(layers, args.interpret, args.tiny, want=want))
            if not args.no_layer:
                variants.update(layer_variants(layers, args.interpret, args.tiny, want=want))
            epi = "rmsnorm" if layer == "attn.q" else ("swiglu" if layer == "ffn.w13" else None)
            if mode == "full" and epi and not args.no_epilogues:
                variants.update(epilogue_variants(layers, epi, args.interpret, args.tiny, want=want))
        case = {"model": model, "layer": layer, "m": m, "n": n, "k": k, "flops": flops, "mode": mode, "variants": []}
        result["cases"].append(case)
        for name, (fn, sets, ref) in variants.items():
            if time.time() - t_start > args.budget_s:
                result["stopped_early"] = True
                break
            rec = run_case(name, fn, sets, ref, flops=flops, target_s=args.target_s, tiny=args.tiny, timer=args.timer)
            case["variants"].append(rec)
            msg = f"{rec['us']:9.1f} us" if "us" in rec else rec.get("error", "?")[:110]
            print(f"{model[:9]:9s} {layer[:12]:12s} m={m:4d} n={n:5d} k={k:5d} {name:34s} {msg}"
                  f"{'  err=%.1e' % rec['rel_err'] if 'rel_err' in rec else ''}", flush=True)
            base = next((v["us"] for v in case["variants"] if v["variant"] == "bf16_xla" and "us" in v), None)
            if base and "us" in rec:
                rec["speedup_vs_bf16_xla"] = base / rec["us"]
            save()
    result["wall_s"] = time.time() - t_start
    save()
    print(summary_table(result))
    return result


LEAN = ("bf16_xla", "w4a4_gemm_mxfp4_bf16", "w4a4_gemm_mxfp4_fp8", "w4a4_layer_lr_fused", "w4a4_dequant_mxfp4",
        "w4a4_mgpu_mxfp4", "w4a4_layer_dequant")
SWEEP = [(128, 128, 128, 8, 3, 1), (128, 128, 64, 4, 4, 1), (64, 128, 128, 4, 3, 1), (128, 256, 64, 8, 3, 1),
         (128, 128, 64, 8, 3, 2), (64, 64, 128, 4, 4, 1)]


def sweep_variants(layers, interpret=False, tiny=False, want=_everything):
    """Tilings of the W4A4 GEMM (MXFP4, bf16 and fp8 modes)."""
    tilings = [(16, 32, 64, 4, 2, 2)] if tiny else SWEEP
    names = {(t, compute): "mxfp4_{}_bm{}_bn{}x{}_bk{}_w{}_s{}".format(compute, t[0], t[1], t[5], *t[2:5])
             for t in tilings for compute in ("bf16", "fp8")}
    if not any(want(name) for name in names.values()):
        return {}
    q = _quantize_jit(MXFP4())
    sets = [(q(a.astype(jnp.float32)), q(w.astype(jnp.float32))) for a, w, _, _ in layers]
    out = {}
    for bm, bn, bk, nw, ns, nsub in tilings:
        bs = G.BlockSizes(bm, bn, bk, nw, ns, nsub)
        for compute in ("bf16", "fp8"):
            def fn(qa, qw, bs=bs, compute=compute):
                return G.w4a4_matmul(qa, qw, compute=compute, block_sizes=bs, interpret=interpret)

            out[f"mxfp4_{compute}_bm{bm}_bn{bn}x{nsub}_bk{bk}_w{nw}_s{ns}"] = (
                fn, sets, lambda qa, qw: jnp.matmul(dequantize(qa, jnp.float32), dequantize(qw, jnp.float32).T))
    return {name: v for name, v in out.items() if want(name)}


def doc_tables(result) -> str:
    """Condensed Markdown tables for docs/w4a4.md: layers vs bf16, epilogues fused vs unfused, the tiling sweep."""
    def us(case, name):
        v = next((v for v in case["variants"] if v["variant"] == name), None)
        if v is None:
            return None, "–"
        if "us" not in v:
            return None, "error"
        return v["us"], f"{v['us']:.1f}"

    gemm_cols = ["bf16_xla", "w4a4_gemm_mxfp4_bf16", "w4a4_gemm_mxfp4_fp8", "w4a4_gemm_nvfp4_bf16",
                 "w4a4_dequant_mxfp4", "w4a4_mgpu_mxfp4", "transform_quantize_only", "w4a4_layer_nolr",
                 "w4a4_layer_lr_fused", "w4a4_layer_lr_beside", "w4a4_layer_dequant", "w4a4_layer_mgpu"]
    out = ["| model | layer | m | n | k | " + " | ".join(gemm_cols) + " | best layer / bf16 |",
           "| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in gemm_cols) + " | ---: |"]
    for c in result["cases"]:
        if c.get("mode") == "sweep":
            continue
        cells = [us(c, name) for name in gemm_cols]
        base = cells[0][0]
        layer_t = [t for t, _ in cells[8:] if t]
        ratio = f"{base / min(layer_t):.2f}x" if base and layer_t else "–"
        out.append(f"| {c['model']} | {c['layer']} | {c['m']} | {c['n']} | {c['k']} | "
                   + " | ".join(txt for _, txt in cells) + f" | {ratio} |")
    out += ["", "| epilogue | operands | m | fused µs | same kernel + XLA op µs | XLA GEMM + op µs | fused speedup |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in result["cases"]:
        for epi in ("rmsnorm", "swiglu"):
            for ops in ("bf16", "mxfp4"):
                f, ftxt = us(c, f"{epi}_{ops}_fused")
                if ftxt == "–":
                    continue
                u, utxt = us(c, f"{epi}_{ops}_gemm_kernel_then_op")
                x, xtxt = us(c, f"{epi}_bf16_xla_then_op") if ops == "bf16" else (None, "–")
                sp = f"{u / f:.2f}x" if f and u else "–"
                out.append(f"| {epi} | {ops} | {c['m']} | {ftxt} | {utxt} | {xtxt} | {sp} |")
    sweep = [c for c in result["cases"] if c.get("mode") == "sweep"]
    if sweep:
        out += ["", "| tiling (MXFP4 GEMM, Ideogram 4 q 4608x4608) | m | µs | TFLOP/s |", "| --- | ---: | ---: | ---: |"]
        for c in sweep:
            for v in c["variants"]:
                t = f"{v['us']:.1f} | {v['tflops']:.0f}" if "us" in v else "error | –"
                out.append(f"| {v['variant']} | {c['m']} | {t} |")
    return "\n".join(out)


def summary_table(result) -> str:
    """A Markdown table of a result dict (the one in docs/w4a4.md)."""
    lines = ["| model | layer | m | n | k | variant | us | vs bf16 XLA | rel err |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for c in result["cases"]:
        for v in c["variants"]:
            us = f"{v['us']:.1f}" if "us" in v else "error"
            sp = f"{v['speedup_vs_bf16_xla']:.2f}x" if "speedup_vs_bf16_xla" in v else ""
            err = f"{v['rel_err']:.1e}" if "rel_err" in v else ""
            lines.append(f"| {c['model']} | {c['layer']} | {c['m']} | {c['n']} | {c['k']} | {v['variant']} | {us} | "
                         f"{sp} | {err} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

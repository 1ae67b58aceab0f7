"""The whole quantized DiT forward on the H200: full-size Ideogram 4 in bf16 against W4A4 on the GPU.

One conditional forward of ``models.ideogram4.IDEOGRAM4`` (9.28 B parameters, random bf16 weights generated on the
device, blocks stacked and run by ``lax.scan``), batch 1, the packed 1K layout of ``benchmarks/ideogram4_serving.py``
(128 text + 64 x 64 image tokens = 4224 tokens, no mask, cuDNN attention), text projection included. Variants
(``--variants``, default all; ``w4a4_unfused`` only while within ``--budget-s``):

* ``bf16``: the plain forward (XLA / cuBLAS linears).
* ``bf16_fused_qkv``: the same with q, k, v as one GEMM over their concatenated kernels
  (``models.ideogram4_serving.bf16_qkv_hooks``): the bf16 counterpart of ``w4a4_fp8_mgpu_fused_qkv``.
* ``w4a4_dequant``: every quantizable linear (the 7 per block) replaced by its W4A4 layer (paper eq. 11) on the
  served layers' default strategy, "dequantize + cuBLAS" (``pallas_kernels.served``, ``ServeOptions()``):
  the fused K2 transform + MXFP4 quantize kernel, ``h = x (R T^T)^T`` (XLA, rank 128), both packed operands decoded
  to bf16 by XLA fusions and one cuBLAS GEMM ``[Q(xT) | h] [W | L]^T`` over ``K = d + 128``; the q/k RMSNorm and the
  SwiGLU of the fused ``w1 | w3`` layer (gate/up row pairs) as XLA ops on its bf16 output.
* ``w4a4_fused``: the same layers on the Pallas-Triton kernels (``strategy="kernel"``): one W4A4 GEMM (MXFP4, bf16
  tensor-core mode) with the packed-``L`` low-rank term in its epilogue; q and k with the per-head RMSNorm fused into
  that epilogue (``projection_norm`` hooks), ``w1 | w3`` one fused ``(24576, 4608)`` layer with the SwiGLU in its
  epilogue (``swiglu`` hook); ``to_v``, ``to_out.0``, ``w2`` plain.
* ``w4a4_unfused``: the Triton kernels, the norm and the SwiGLU as XLA ops after the plain W4A4 GEMM.
* ``w4a4_fp8``: the served FP8 strategy (``strategy="fp8"``): the MXFP4 operands re-encoded in E4M3, XLA's FP8 GEMM,
  the powers of two, bias and the bf16 ``h L^T`` GEMM in XLA fusions after it.
* ``w4a4_fp8_mgpu``: the same FP8 layers on the fused Mosaic GPU kernel (``strategy="fp8_mgpu"``,
  ``pallas_kernels/fp8_gemm_mgpu.py``: powers of two, bias and ``h L^T`` in the GEMM's accumulator and epilogue; the
  kernel writes bf16, a norm then runs in XLA on it, as after a bf16 linear; w1|w3's SwiGLU in the kernel's
  epilogue).
* ``w4a4_fp8_mgpu_fused_qkv``: ``w4a4_fp8_mgpu`` with q, k, v as one W4A4 layer ``[W_q; W_k; W_v]`` (one
  transform, one low-rank branch, as ``w1 | w3``; ``build_block_qlinears(fuse_qkv=True)``): one quantizer call and
  one ``(3 x 4608, 4608)`` GEMM per block instead of three; the other layers are the very ones of ``w4a4_fp8_mgpu``.
  It needs a checkpoint whose q, k, v were calibrated as one layer.
* ``w4a4_fp8_mgpu_two_phase``, ``w4a4_fp8_mgpu_kernel_encode``: the same layers with the activations' E4M3 operand
  made by the Pallas re-encode kernel (``act_encode="two_phase"``) or by the quantizer itself (``"kernel"``) instead
  of XLA's fusion (``ACT_ENCODES`` in ``pallas_kernels/fp8_gemm.py``; the same bytes).
* ``w4a4_fp8_mgpu_one_launch``: the quantizer writes the E4M3 operand itself in one launch of whole-row programs
  (``act_encode="one_launch"``).
* ``w4a4_fp8_mgpu_k2``: the same layers with each transform prepared as K2 (the blocks rebuilt from the
  Kronecker-LU parameters in registers in every program) instead of the strategy's K1 (its dense 32 x 32 blocks,
  made once in the kernel's f32 product order): the same bytes, a different quantizer kernel.

``--compile-cache DIR`` turns on JAX's persistent compilation cache in ``DIR``: a later run that compiles the same
programs (same shapes and settings) loads them, and its ``compile_s`` times the load.

``--kernels`` adds a CUPTI profile of each timed forward: device time per kernel name (a kernel in the scanned block
sums over the blocks), the costliest names, and the total device time per forward beside the wall time.

``--blocks N`` builds the model with the real config but only ``N`` of its 34 blocks (random weights either way):
the blocks are identical in shape and work, so block time scales with ``N``; the text projection, embeddings and
final layer (bf16 in every variant) run once, so at small ``N`` they weigh more and the bf16 / W4A4 ratio lies
closer to 1 than the full model's. The JSON and the printout name ``N`` of the real block count.

``--reference-variants`` runs the named variants' served layers on their jnp references (``impl="reference"``, the
default off the GPU) even with ``--interpret``: one CPU run then checks the interpreted kernels of some variants and
the wiring of the others (their layers, hooks and output checks) without interpreting every kernel. The JSON records
the list.

Checks: the relative error of each forward's output (image tokens) against the others (all must be finite: the W4A4
forwards run the same quantized layers, so they differ by rounding, amplified through the blocks, not by the
quantization error they both have against bf16), and layer 0's served layers (``to_q`` + norm, ``w1 | w3`` +
SwiGLU, ``w2``) on each W4A4 strategy against the served layer's jnp reference. ``--check`` adds the expensive part:
the ``simulate`` forward (the same quantized layers through ``qlinear_forward(path="simulate")``, fake quant, f32
math) and the layers against it.

The quantized layers are built on the device from the model's random bf16 weights with the real layer math
(``build_qlinear``'s: ``W~ = W T^{-T}``, LoRaQ-style factors ``L, R`` stored in MXFP4, residual ``Q(W~ - L R)``);
only the calibration is replaced: ``T`` is a random KroQuant (Kronecker-LU) transform near the Hadamard init, and
``L, R`` (rank 128) come from a one-pass randomized range finder of ``W~`` (``L = Q``, ``R = Q^T W~``).

Before the ``w4a4_fused`` forward (unless ``--no-tune``), the epilogue kernels' tiles are chosen on the real operands
(layer 0's q and w1|w3 at the forward's token count): the fastest of a few candidates is used, and the unfused
alternative is timed beside them. Times: medians over repeats of back-to-back calls after a warm-up
(``kroquant_jax.timing.wall_times``), kernels with ``timing.loop_time`` (jitted loop over rotating operands).

    python benchmarks/dit_forward_w4a4.py --out $OUT/dit_forward_w4a4.json          # the H200 (about 3 minutes)
    python benchmarks/dit_forward_w4a4.py --variants bf16,w4a4_dequant,w4a4_fused --blocks 8 --no-tune
    python benchmarks/dit_forward_w4a4.py --preset tiny --interpret --check          # CPU validation (interpret mode)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gzip
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kroquant_jax import calibrate, timing  # noqa: E402
from kroquant_jax.fileio import StagedResults, atomic_write_bytes  # noqa: E402
from kroquant_jax.qlinear import QuantizedLinear, qlinear_forward  # noqa: E402
from models import ideogram4 as ig  # noqa: E402
from models import ideogram4_sampling as sampling  # noqa: E402
from models import ideogram4_serving as serving  # noqa: E402
from models.quantize_model import (FusedLinearHooks, SharedOverrides, layer_at,  # noqa: E402
                                   split_qlinear_overrides, whole_layer_overrides)
from pallas_kernels import epilogues as E  # noqa: E402
from pallas_kernels import served as S  # noqa: E402
from pallas_kernels import w4a4_gemm as G  # noqa: E402
from scripts.common_args import add_compile_cache, choice_list  # noqa: E402

TRANSFORM = "kron_lu"
#: Timed forwards, in the order they run (``--variants`` picks a subset; ``w4a4_unfused`` is optional).
VARIANTS = ("bf16", "bf16_fused_qkv", "w4a4_dequant", "w4a4_fp8", "w4a4_fp8_mgpu", "w4a4_fp8_mgpu_fused_qkv",
            "w4a4_fp8_mgpu_two_phase", "w4a4_fp8_mgpu_kernel_encode", "w4a4_fp8_mgpu_one_launch", "w4a4_fp8_mgpu_k2",
            "w4a4_fused", "w4a4_unfused")
BF16_VARIANTS = ("bf16", "bf16_fused_qkv")
#: The fused-kernel variants: the ``Fp8Linear.act_encode`` of their layers (None: the strategy's default) and the
#: ``transform_kernel`` they are served with (None: the strategy's K1).
MGPU_VARIANTS = {"w4a4_fp8_mgpu": (None, None), "w4a4_fp8_mgpu_two_phase": ("two_phase", None),
                 "w4a4_fp8_mgpu_kernel_encode": ("kernel", None), "w4a4_fp8_mgpu_one_launch": ("one_launch", None),
                 "w4a4_fp8_mgpu_k2": (None, "k2")}
KERNEL_ROWS = 16  # --kernels: the costliest kernel names kept per forward
# Block linears of the scanned model (paths of the one stacked block) and how the W4A4 forward runs them.
PLAIN, NORMED = serving.BLOCK_PLAIN, serving.BLOCK_NORMED
GATE, UP = serving.BLOCK_GATE, serving.BLOCK_UP


# ---------------------------------------------------------------------------------------------------------------------
# Checks and timing.
# ---------------------------------------------------------------------------------------------------------------------


def mgpu_variant(served_mgpu: dict, act_encode: Optional[str]) -> dict:
    """The fused-kernel layers with another activation encode (:data:`MGPU_VARIANTS`; None: as served)."""
    if act_encode is None:
        return served_mgpu
    return {path: dataclasses.replace(layer, act_encode=act_encode) for path, layer in served_mgpu.items()}


def rel_err(y: jax.Array, ref: jax.Array) -> float:
    y = np.asarray(jax.device_get(y), np.float32)
    ref = np.asarray(jax.device_get(ref), np.float32)
    if not np.isfinite(y).all():
        return float("nan")
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def layer_checks(q: dict, served: dict, x: jax.Array, x_ff: jax.Array, norm_w: jax.Array, opts: dict,
                 strategies: tuple[str, ...], simulate: bool) -> dict[str, float]:
    """Layer 0 of each kind on each strategy (``"dequant"``, ``"kernel"``: the Pallas-Triton kernels with the fused
    epilogues) against the jnp reference of the served layer (same quantizer, f32 GEMM: the strategy's own error),
    and with ``simulate`` also against the simulated layer (``qlinear_forward(path="simulate")``, f32)."""
    out = {}
    head = norm_w.shape[0]
    sim = jax.jit(lambda layer, a: qlinear_forward(layer, a, "simulate"))
    options = {
        "dequant": S.ServeOptions(impl=opts["impl"]),
        "kernel": S.ServeOptions(strategy="kernel", impl=opts["impl"], gemm_blocks=opts["gemm_blocks"],
                                 norm_blocks=opts["norm_blocks"], swiglu_blocks=opts["swiglu_blocks"]),
    }
    cases = [
        ("to_q+norm", NORMED[0], x, dict(op="rmsnorm", norm_weight=norm_w, head_dim=head, eps=1e-5),
         lambda y: E.rmsnorm_heads(y, norm_w, head_dim=head, eps=1e-5)),
        ("w1|w3+swiglu", GATE, x, dict(op="swiglu"), E.swiglu),
        ("w2", PLAIN[2], x_ff, {}, lambda y: y),
    ]
    for name, path, a, op, after in cases:
        layer0, served0 = layer_at(q[path], 0), layer_at(served[path], 0)
        ref = jax.jit(functools.partial(S.reference, out_dtype=jnp.float32, **op))(served0, a)
        simulated = after(sim(layer0, a.astype(jnp.float32))) if simulate else None
        for strategy in strategies:
            y = jax.jit(functools.partial(S.forward, out_dtype=jnp.float32, options=options[strategy], **op))(
                served0, a)
            out[f"{name}: {strategy} vs served reference"] = rel_err(y, ref)
            if simulate:
                out[f"{name}: {strategy} vs simulate"] = rel_err(y, simulated)
    return out


def tune_epilogues(served: dict, x: jax.Array, norm_w: jax.Array, interpret: bool, tiny: bool
                   ) -> tuple[dict, E.EpilogueBlockSizes | None, E.EpilogueBlockSizes | None]:
    """Time the fused epilogue kernels with candidate tiles against the unfused W4A4 GEMM + XLA op on layer 0..2's
    operands (the forward's token count); return the table and the fastest tiles of each op."""
    impl = "interpret" if interpret else "pallas"
    head = norm_w.shape[0]
    x_sets = {}
    for path in (NORMED[0], GATE):
        layer = served[path]
        sets = []
        for i in range(min(3, layer.weight.codes.shape[0])):
            s_i = layer_at(layer, i)
            x_q, lowrank = jax.jit(functools.partial(S.quantized_inputs, impl=impl))(s_i, x)
            sets.append((x_q, s_i.weight, *lowrank))
        x_sets[path] = sets
    if tiny:
        norm_cands = [E.EpilogueBlockSizes(block_m=16, block_n=64, block_k=32, tile=16, num_warps=4, num_stages=2)]
        swiglu_cands = [E.EpilogueBlockSizes(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=2)]
        gemm_bs = G.BlockSizes(16, 32, 32, 4, 2)
    else:
        # 64-row tiles (the packed default before this benchmark), 128-row tiles (the default since), and 128 x 64.
        norm_cands = [E.EpilogueBlockSizes(block_m=64), E.EpilogueBlockSizes(block_m=128),
                      E.EpilogueBlockSizes(block_m=128, block_k=64)]
        swiglu_cands = [E.EpilogueBlockSizes(block_m=64), E.EpilogueBlockSizes(block_m=128)]
        gemm_bs = None
    table: dict[str, Any] = {}
    best: dict[str, tuple[float, Any]] = {}
    m = x.shape[0]
    for op, path, cands in (("rmsnorm", NORMED[0], norm_cands), ("swiglu", GATE, swiglu_cands)):
        n, k = served[path].out_features, served[path].in_features
        flops = 2.0 * m * n * k

        def fused_fn(x_q, w, h, left, bs=None, op=op):
            if op == "rmsnorm":
                return E.gemm_rmsnorm(x_q, w, norm_w, head_dim=head, eps=1e-5, lowrank=(h, left), block_sizes=bs,
                                      interpret=interpret)
            return E.gemm_swiglu(x_q, w, lowrank=(h, left), block_sizes=bs, interpret=interpret)

        def unfused_fn(x_q, w, h, left, op=op):
            y = G.w4a4_matmul(x_q, w, lowrank=(h, left), block_sizes=gemm_bs, interpret=interpret)
            if op == "rmsnorm":
                return S.apply_op(y, S.OpCall("rmsnorm", norm_w, head, 1e-5))
            return S.apply_op(y, S.OpCall("swiglu"))

        variants = [(f"{op}_fused_{_tiles_name(bs)}", functools.partial(fused_fn, bs=bs), bs) for bs in cands]
        variants.append((f"{op}_w4a4_gemm_then_xla_op", unfused_fn, "unfused"))
        for name, fn, bs in variants:
            try:
                n_calls = len(x_sets[path]) if tiny else timing.calls_for(flops, 0.02, minimum=2 * len(x_sets[path]))
                t = timing.loop_time(fn, x_sets[path], n_calls=n_calls, repeats=2 if tiny else 5).median_s
                table[name] = {"us": t * 1e6, "tflops": flops / t / 1e12}
                if bs != "unfused" and (op not in best or t < best[op][0]):
                    best[op] = (t, bs)
            except Exception as err:  # noqa: BLE001 - recorded, the run goes on
                table[name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
            print(f"  tune {name:48s} {table[name].get('us', float('nan')):10.1f} us", flush=True)
    return table, best.get("rmsnorm", (None, norm_cands[0]))[1], best.get("swiglu", (None, swiglu_cands[0]))[1]


def _tiles_name(bs: E.EpilogueBlockSizes | None) -> str:
    if bs is None:
        return "default"
    return f"bm{bs.block_m}_bn{bs.block_n}_bk{bs.block_k}_t{bs.tile}_w{bs.num_warps}_s{bs.num_stages}"


def _tiles_json(bs: Any) -> Any:
    return None if bs is None else dataclasses.asdict(bs)


# ---------------------------------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=("full", "tiny"), default="full")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU validation)")
    parser.add_argument("--reference-variants", type=choice_list(VARIANTS, "variant"), default=(),
                        help="these variants' served layers run their jnp references (impl 'reference') whatever "
                             "--interpret says (default none): one CPU run can check the wiring of some variants "
                             "cheaply beside others on the interpreted kernels")
    parser.add_argument("--variants", type=choice_list(VARIANTS, "variant"), default=VARIANTS,
                        help=f"comma-separated subset of {','.join(VARIANTS)} (run in that order; default all)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="build only this many of the model's transformer blocks (default all: 34; tiny: 2)")
    parser.add_argument("--check", action="store_true",
                        help="also the simulated (fake-quant, f32) forward and the layers against it (expensive)")
    parser.add_argument("--text-tokens", type=int, default=None, help="default 128 (tiny: 3)")
    parser.add_argument("--height", type=int, default=None, help="pixels, default 1024 (tiny: 32)")
    parser.add_argument("--rank", type=int, default=None, help="low-rank rank (default 128; tiny: 32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="optional stages (epilogue tile choice, layer checks, the --check simulation, the "
                             "unfused W4A4 forward) start only before this many seconds")
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--kernels", action="store_true",
                        help="also profile each timed forward (CUPTI): device time per kernel name, summed over the "
                             "blocks, median of 3 calls")
    parser.add_argument("--hlo-dir", default=None,
                        help="also write each forward's optimized HLO (gzipped text) into this folder")
    add_compile_cache(parser, timing="compile_s then times the load")
    parser.add_argument("--out", default=None, help="JSON (default $OUT/dit_forward_w4a4.json, else /tmp)")
    args = parser.parse_args(argv)
    if args.compile_cache:  # before anything compiles
        calibrate.enable_compile_cache(args.compile_cache)
    start = time.perf_counter()
    tiny = args.preset == "tiny"
    on_gpu = jax.default_backend() == "gpu"
    impl = S.resolve_impl("interpret" if args.interpret else None)
    base = ig.tiny_config() if tiny else ig.IDEOGRAM4
    blocks_n = base.num_layers if args.blocks is None else args.blocks
    if not 1 <= blocks_n <= base.num_layers:
        parser.error(f"--blocks {args.blocks}: the {args.preset} model has {base.num_layers} blocks")
    cfg = dataclasses.replace(base, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, scan_layers=True,
                              num_layers=blocks_n, attention_impl="cudnn" if on_gpu else "xla")
    rank = args.rank or (32 if tiny else 128)
    text_tokens = args.text_tokens or (3 if tiny else 128)
    height = args.height or (32 if tiny else 1024)
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "dit_forward_w4a4.json"))
    device = jax.local_devices()[0]
    partial_model = blocks_n < base.num_layers
    payload: dict[str, Any] = {
        "what": ("Ideogram 4 forward, batch 1, random bf16 weights: bf16 vs W4A4 (served layers on the dequant + "
                 "cuBLAS strategy and on the Pallas-Triton kernels)"
                 + (f"; ONLY {blocks_n} OF THE REAL {base.num_layers} TRANSFORMER BLOCKS (time scales with the block "
                    f"count; compare ratios, not times)" if partial_model else "")),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(device, "device_kind", str(device)), "jax": jax.__version__, "preset": args.preset,
        "blocks": blocks_n, "model_blocks": base.num_layers, "variants": list(args.variants),
        "impl": impl, "reference_variants": list(args.reference_variants), "attention_impl": cfg.attention_impl,
        "rank": rank, "transform": TRANSFORM,
        "method": f"median of {args.repeats} repeats of {args.inner} back-to-back calls after a warm-up call "
                  "(AOT-compiled, block_until_ready per repeat)",
        "command_args": list(sys.argv[1:] if argv is None else argv),
        "timings_ms": {}, "bf16_over": {}, "fastest_bf16": None, "fastest_bf16_over": {}, "compile_s": {},
        "errors": {}, "checks": {}, "finite": {},
        "kernels": {}}

    results = StagedResults(out_path, payload, start)  # saved after each stage; a stage's error is recorded
    save, stage = results.save, results.stage

    def within_budget(name: str) -> bool:
        if time.perf_counter() - start < args.budget_s:
            return True
        payload["errors"][name] = f"skipped: {time.perf_counter() - start:.0f} s > --budget-s {args.budget_s:g}"
        return False

    # The model (random bf16 weights on the device) and its quantized layers.
    graphdef, (state,), payload["init_s"] = serving.random_states(cfg, (0,))
    model = nnx.merge(graphdef, state)
    t0 = time.perf_counter()
    q: dict[str, QuantizedLinear] = serving.build_block_qlinears(model, jax.random.key(123), rank)
    served = serving.serve_block_layers(q)
    fused_qkv = "w4a4_fp8_mgpu_fused_qkv" in args.variants
    mgpu_variants = [v for v in MGPU_VARIANTS if v in args.variants or (fused_qkv and v == "w4a4_fp8_mgpu")]
    if "w4a4_fp8" in args.variants:  # the fused-kernel variants prepare their own layers below
        served_fp8 = serving.serve_block_layers(q, "fp8")
        timing.block(served_fp8)
    served_mgpu = {}  # transform_kernel -> the fused-kernel layers
    for kernel_name in dict.fromkeys(MGPU_VARIANTS[v][1] for v in mgpu_variants):
        served_mgpu[kernel_name] = serving.serve_block_layers(q, "fp8_mgpu", transform_kernel=kernel_name)
        timing.block(served_mgpu[kernel_name])
    if fused_qkv:  # q | k | v as one layer; every other layer is w4a4_fp8_mgpu's own
        qkv = serving.build_block_qlinears(model, jax.random.key(123), rank, fuse_qkv=True)[serving.BLOCK_QKV]
        served_qkv = {**{p: v for p, v in served_mgpu[None].items() if p not in serving.BLOCK_QKV_MEMBERS},
                      serving.BLOCK_QKV: serving.serve_block_layers({serving.BLOCK_QKV: qkv}, "fp8_mgpu")[
                          serving.BLOCK_QKV]}
        del qkv
        timing.block(served_qkv)
    timing.block((q, served))
    payload["build_quantized_s"] = time.perf_counter() - t0
    payload["memory_gib_after_build"] = timing.device_memory_gib()
    save()
    print(f"[{time.perf_counter() - start:6.1f} s] model ({blocks_n} of {base.num_layers} blocks) + quantized layers "
          f"built", flush=True)

    # Inputs: one prompt, packed layout (no padding, no mask).
    grid = sampling.grid_for(height, height)
    layout = sampling.prepare_ids([text_tokens], grid[0], grid[1], text_tokens)
    position_ids, segment_ids, indicator = sampling.layout_arrays(layout)
    tokens = int(indicator.shape[1])
    keys = jax.random.split(jax.random.key(7), 4)
    latents = jax.random.normal(keys[0], (1, tokens, cfg.in_channels), jnp.bfloat16)
    text = (np.asarray(layout.indicator) == ig.LLM_TOKEN_INDICATOR)[..., None]
    features = (jax.random.normal(keys[1], (1, tokens, cfg.llm_features_dim), jnp.bfloat16) * text).astype(jnp.bfloat16)
    timestep = jnp.full((1,), 0.5, jnp.bfloat16)
    payload.update(tokens=tokens, text_tokens=text_tokens, image_tokens=layout.num_image_tokens,
                   flops=serving.forward_flops(cfg, tokens, text_projection_tokens=tokens))
    image = np.asarray(layout.indicator[0]) == ig.OUTPUT_IMAGE_INDICATOR

    # Activations of the forward's shape for the layer checks and the epilogue tiles.
    x = jax.random.normal(keys[2], (tokens, cfg.hidden_size), jnp.bfloat16)
    x_ff = (jax.random.normal(keys[3], (tokens, cfg.intermediate_size), jnp.float32) * 0.3).astype(jnp.bfloat16)
    norm_w = (1.0 + 0.1 * jax.random.normal(keys[3], (cfg.attention_head_dim,))).astype(jnp.float32)
    tiny_gemm = G.BlockSizes(16, 32, 32, 4, 2) if tiny else None
    opts = {"impl": impl, "gemm_blocks": tiny_gemm, "norm_blocks": None, "swiglu_blocks": None}
    if tiny:
        opts["norm_blocks"] = E.EpilogueBlockSizes(block_m=16, block_n=64, block_k=32, tile=16, num_warps=4,
                                                   num_stages=2)
        opts["swiglu_blocks"] = E.EpilogueBlockSizes(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=2)
    if ("w4a4_fused" in args.variants and not args.no_tune and impl != "reference"
            and within_budget("tune_epilogues")):
        tuned = stage("tune_epilogues", lambda: tune_epilogues(served, x, norm_w, args.interpret, tiny))
        if tuned is not None:
            payload["epilogue_tiles"], opts["norm_blocks"], opts["swiglu_blocks"] = tuned
    payload["chosen_tiles"] = {"rmsnorm": _tiles_json(opts["norm_blocks"]),
                               "swiglu": _tiles_json(opts["swiglu_blocks"])}

    # The forwards: the served layers as hooks of the scanned model (stacked entries).
    def impl_of(name: str) -> str:
        return "reference" if name in args.reference_variants else impl

    kernel = S.ServeOptions(strategy="kernel", gemm_blocks=opts["gemm_blocks"])
    entries = {
        **({"bf16_fused_qkv": serving.bf16_qkv_hooks(model).entries()} if "bf16_fused_qkv" in args.variants else {}),
        **({"w4a4_fp8_mgpu_fused_qkv": serving.block_served_hooks(served_qkv, S.ServeOptions(
            strategy="fp8_mgpu", impl=impl_of("w4a4_fp8_mgpu_fused_qkv"))).entries()} if fused_qkv else {}),
        "w4a4_dequant": serving.block_served_hooks(served, S.ServeOptions(impl=impl_of("w4a4_dequant"))).entries(),
        **({"w4a4_fp8": serving.block_served_hooks(served_fp8, S.ServeOptions(
            strategy="fp8", impl=impl_of("w4a4_fp8"))).entries()} if "w4a4_fp8" in args.variants else {}),
        **{name: serving.block_served_hooks(mgpu_variant(served_mgpu[MGPU_VARIANTS[name][1]], MGPU_VARIANTS[name][0]),
                                            S.ServeOptions(strategy="fp8_mgpu", impl=impl_of(name))).entries()
           for name in mgpu_variants},
        "w4a4_fused": serving.block_served_hooks(served, dataclasses.replace(
            kernel, impl=impl_of("w4a4_fused"), fused=True, norm_blocks=opts["norm_blocks"],
            swiglu_blocks=opts["swiglu_blocks"])).entries(),
        "w4a4_unfused": serving.block_served_hooks(served, dataclasses.replace(
            kernel, impl=impl_of("w4a4_unfused"), fused=False)).entries(),
        "simulate": FusedLinearHooks(SharedOverrides.merged(  # w1|w3 held once: one fake-quant forward of it
            *(whole_layer_overrides(q[p], p) for p in (*NORMED, *PLAIN)),
            split_qlinear_overrides(q[GATE], [GATE, UP])), stacked=True).entries(),
    }
    fwd_args = (latents, timestep, features, position_ids, segment_ids, indicator)

    def forward(state_, entries_, *inputs):
        m = nnx.merge(graphdef, state_)
        hooks = None if entries_ is None else FusedLinearHooks.from_entries(entries_, stacked=True)
        return m(*inputs, hooks=hooks)  # (1, L, C)

    outputs: dict[str, jax.Array] = {}

    def run_forward(name: str, timed: bool = True) -> None:
        t_c = time.perf_counter()
        call_args = (state, entries.get(name), *fwd_args)
        compiled = jax.jit(forward).lower(*call_args).compile()
        payload["compile_s"][name] = time.perf_counter() - t_c
        outputs[name] = jax.block_until_ready(compiled(*call_args))
        payload["finite"][name] = bool(jnp.all(jnp.isfinite(outputs[name])))
        if timed:
            samples = timing.wall_times(lambda: compiled(*call_args), repeats=args.repeats, inner=args.inner)
            payload["timings_ms"][name] = timing.summary_ms(samples)
            if "bf16" in payload["timings_ms"]:
                payload["bf16_over"][name] = (payload["timings_ms"]["bf16"]["median_ms"]
                                              / payload["timings_ms"][name]["median_ms"])
            bf16_ms = {b: payload["timings_ms"][b]["median_ms"] for b in BF16_VARIANTS if b in payload["timings_ms"]}
            if bf16_ms:  # against the faster bf16 forward of this run (fused q | k | v or not)
                fastest = min(bf16_ms, key=bf16_ms.get)
                payload["fastest_bf16"] = fastest
                payload["fastest_bf16_over"] = {n: bf16_ms[fastest] / t["median_ms"]
                                                for n, t in payload["timings_ms"].items()}
            print(f"  {name:14s} {payload['timings_ms'][name]['median_ms']:9.2f} ms  ({blocks_n} of "
                  f"{base.num_layers} blocks)", flush=True)
        if timed and args.kernels:
            t = timing.device_time(lambda _: compiled(*call_args), [None], n_iter=3, warmup=0)
            top = sorted(t.kernels_us.items(), key=lambda kv: -kv[1])[:KERNEL_ROWS]
            payload["kernels"][name] = {"device_ms": t.us / 1e3, "method": t.method,
                                        "top_ms": {k: v / 1e3 for k, v in top},
                                        "launches": {k: t.kernel_launches.get(k, 0) for k, _ in top}}
        if args.hlo_dir:
            hlo = Path(args.hlo_dir) / f"dit_forward_{name}.hlo.txt.gz"
            atomic_write_bytes(hlo, gzip.compress(compiled.as_text().encode("utf-8")))  # creates the folder

    for name in args.variants:
        if name != "w4a4_unfused":
            stage(f"forward_{name}", functools.partial(run_forward, name))

    def img(name: str) -> jax.Array:
        return np.asarray(jax.device_get(outputs[name][0]), np.float32)[image]  # (image tokens, C)

    def compare() -> None:
        for a, b in (("bf16_fused_qkv", "bf16"), ("w4a4_fp8_mgpu_fused_qkv", "bf16_fused_qkv"),
                     ("w4a4_fp8_mgpu_fused_qkv", "bf16"), ("w4a4_fp8_mgpu_fused_qkv", "w4a4_fp8_mgpu"),
                     ("w4a4_fp8", "w4a4_dequant"), ("w4a4_fp8", "bf16"), ("w4a4_fp8", "simulate"),
                     ("w4a4_fp8_mgpu", "w4a4_fp8"), ("w4a4_fp8_mgpu", "bf16"),
                     ("w4a4_fp8_mgpu_two_phase", "w4a4_fp8_mgpu"), ("w4a4_fp8_mgpu_kernel_encode", "w4a4_fp8_mgpu"),
                     ("w4a4_fp8_mgpu_k2", "w4a4_fp8_mgpu"), ("w4a4_fp8_mgpu_one_launch", "w4a4_fp8_mgpu"),
                     ("w4a4_dequant", "w4a4_fused"), ("w4a4_dequant", "w4a4_unfused"), ("w4a4_fused", "w4a4_unfused"),
                     ("w4a4_dequant", "simulate"), ("w4a4_fused", "simulate"), ("w4a4_unfused", "simulate"),
                     ("bf16", "simulate"), ("w4a4_dequant", "bf16"), ("w4a4_fused", "bf16")):
            if a in outputs and b in outputs:
                payload["checks"][f"forward {a} vs {b}"] = rel_err(img(a), img(b))
        save()

    compare()
    # The dequant strategy's layers always (cheap: XLA), the Triton kernels' with --check (they were checked before).
    strategies = (("dequant",) if "w4a4_dequant" in args.variants else ()) + (
        ("kernel",) if args.check and {"w4a4_fused", "w4a4_unfused"} & set(args.variants) else ())
    if strategies and within_budget("layer_checks"):
        checks = stage("layer_checks", lambda: layer_checks(q, served, x, x_ff, norm_w, opts, strategies,
                                                            simulate=args.check))
        if checks:
            payload["checks"]["layers"] = checks
            for name, value in checks.items():
                print(f"  check {name:45s} rel err {value:.2e}")
    if args.check and within_budget("forward_simulate"):
        stage("forward_simulate", lambda: run_forward("simulate", timed=False))
    if "w4a4_unfused" in args.variants and within_budget("forward_w4a4_unfused"):
        stage("forward_w4a4_unfused", lambda: run_forward("w4a4_unfused"))
    compare()
    payload["memory_gib_final"] = timing.device_memory_gib()
    save()
    print_table(payload)
    return payload


def print_table(payload: dict[str, Any]) -> None:
    print(f"\n{payload['device']} jax {payload['jax']} {payload['date_utc']} tokens={payload.get('tokens')} "
          f"impl={payload['impl']} rank={payload['rank']}")
    print(f"  blocks: {payload['blocks']} of the model's {payload['model_blocks']}"
          + (" (NOT the whole model: times scale with the block count; the ratios are what compare)"
             if payload["blocks"] < payload["model_blocks"] else ""))
    fastest = payload.get("fastest_bf16")
    for name, timing in payload["timings_ms"].items():
        ratio = payload["bf16_over"].get(name)
        best = payload.get("fastest_bf16_over", {}).get(name) if fastest not in (None, "bf16") else None
        print(f"  forward {name:28s} {timing['median_ms']:9.2f} ms  (bf16 / this = "
              f"{'' if ratio is None else f'{ratio:.2f}x'}"
              f"{'' if best is None else f', {fastest} / this = {best:.2f}x'}; "
              f"compile {payload['compile_s'].get(name, float('nan')):.1f} s)")
    for name, prof in payload.get("kernels", {}).items():
        print(f"  kernels of {name}: {prof['device_ms']:.2f} ms device time per forward ({prof['method']})")
        for kernel, ms in prof["top_ms"].items():
            print(f"    {ms:8.3f} ms  {prof.get('launches', {}).get(kernel, 0):5d}x  {kernel}")
    for name, tile in payload.get("epilogue_tiles", {}).items():
        print(f"  kernel {name:48s} {tile.get('us', float('nan')):10.1f} us")
    print(f"  finite outputs: {payload['finite']}")
    for name, value in payload["checks"].items():
        if isinstance(value, dict):
            for k, v in value.items():
                print(f"  {k:55s} rel err {v:.2e}")
        else:
            print(f"  {name:55s} rel err {value:.2e}")
    for name, err in payload["errors"].items():
        print(f"  ERROR {name}: {err[:300]}")


if __name__ == "__main__":
    main()

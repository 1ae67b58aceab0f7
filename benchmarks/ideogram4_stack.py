"""The whole serving stack of Ideogram 4 per image on the H200: the 48-step two-transformer bf16 pipeline against one
branch x 4 steps on W4A4, end to end, batch 1 or a throughput batch (issue 16, "The whole stack, per image").

Full-size transformers (``models.ideogram4.IDEOGRAM4``, 9.28 B parameters each, blocks stacked under ``lax.scan``),
random bf16 weights generated on the device (``models.ideogram4_serving.random_states``; speed only), one prompt in the
packed 1K layout of ``benchmarks/ideogram4_serving.py`` and ``benchmarks/dit_forward_w4a4.py`` (128 text tokens +
64 x 64 image tokens = 4224 tokens, one segment, no mask, cuDNN attention on the GPU), ``--batch-size`` such prompts
per call (a throughput batch). Systems, in the order they run
(``--systems``; each one whole image from noise and text features to the final latents, the text projection
included, as ONE AOT-compiled jitted call):

* ``bf16_48x2``: the pipeline as ``models.ideogram4_sampling`` runs it (``denoise_loop``): the conditional and the
  unconditional transformer (two random weight sets), the default 48-step schedule and guidance schedule (7.0 x 45,
  3.0 x 3), one ``lax.scan`` over the steps: 96 forwards per image. The unconditional transformer's buffers are
  freed after it (nothing else uses them).
* ``bf16_4x1``: one branch (the conditional transformer alone, no CFG: the guidance folded into the weights, as the
  QAD / DMD2 student has it; ``unguided_denoise_loop``) x 4 steps of the resolution-aware schedule, bf16: 4 forwards.
  Against ``bf16_48x2`` it isolates the step-count and branch factor (24x in forwards).
* ``w4a4_fp8_4x1``: the same one-branch 4-step loop with every quantizable block linear (the 7 per block) a W4A4
  layer served on the FP8 strategy (``ServeOptions(strategy="fp8")``), built as ``dit_forward_w4a4.py``'s
  ``w4a4_fp8`` variant from the conditional transformer's weights (``ideogram4_serving.build_block_qlinears``: the
  real layer math, stand-in calibration; ``serve_block_layers(..., "fp8")``, ``block_served_hooks``: q / k with their
  RMSNorm, ``w1 | w3`` with the SwiGLU): against ``bf16_4x1`` it is the FP8 forward's factor.
* ``w4a4_fp8_mgpu_4x1``: the same layers on the ``"fp8_mgpu"`` strategy: each GEMM with its powers of two, bias
  and low-rank term as one Mosaic GPU kernel (``pallas_kernels/fp8_gemm_mgpu.py``; off the GPU its jnp mirror).
* ``w4a4_fp8_mgpu_fused_qkv_4x1``: ``w4a4_fp8_mgpu_4x1`` with q, k, v as one W4A4 layer ``[W_q; W_k; W_v]`` (one
  transform and low-rank branch, ``build_block_qlinears(fuse_qkv=True)``; the other layers are the very ones of
  ``w4a4_fp8_mgpu_4x1``): one quantizer call and one GEMM per block for the three. It needs a checkpoint whose q, k,
  v were calibrated as one layer.
* ``w4a4_dequant_4x1`` (optional, only while within ``--budget-s``): the same layers on the default strategy
  (dequantize + one cuBLAS GEMM).

VAE decode not included (not ported: the Ideogram 4 VAE stays in diffusers; the JSON says so).

Timing: each system's compiled call once as a warm-up, then the median of ``--repeats`` wall times of one call each
(one call makes ``--batch-size`` images; ``ms_per_image`` is the median over the batch size), ``block_until_ready``
on its output (``kroquant_jax.timing.wall_times`` / ``summary_ms``). A call runs for seconds
(the 48-step loop) or hundreds of ms (4 steps) and is one dispatch, so host dispatch is negligible at these lengths.
Compile seconds (lower + compile) per system are recorded beside.

Derived: ``speedup_per_image`` (``bf16_48x2``'s median / each system's), ``forward_passes_per_image`` (steps x
branches: 96, 4, 4), ``per_forward_ratio`` (time per forward of ``bf16_48x2`` over each system's; the 48-step loop's
unconditional forwards see only the 4096 image tokens, so its mean forward is slightly cheaper than a 4224-token one),
and the headline ``ideogram4_stack_speedup_per_image``: ``bf16_48x2`` over the fastest W4A4 one-branch 4-step system of
this run (the issue's goal: >= 30x). Checks: every output finite, and the relative error of each W4A4 system's final
latents against ``bf16_4x1``'s (same weights, noise and schedule: a sign that the served layers are wired in, zero
would mean they are not; not a quality measure, the weights are random).

The JSON (``--out``, default ``$OUT/ideogram4_stack.json``) is written atomically after each stage, so a timeout keeps
what finished; a failing stage records its error and the run goes on.

    python benchmarks/ideogram4_stack.py --out $OUT/ideogram4_stack.json        # the H200 (a few minutes)
    python benchmarks/ideogram4_stack.py --batch-size 4 --repeats 2 --systems bf16_48x2,w4a4_fp8_mgpu_fused_qkv_4x1
    python benchmarks/ideogram4_stack.py --preset tiny --interpret              # CPU validation (seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kroquant_jax import timing  # noqa: E402
from kroquant_jax.fileio import StagedResults  # noqa: E402
from models import ideogram4 as ig  # noqa: E402
from models import ideogram4_sampling as sampling  # noqa: E402
from models import ideogram4_serving as serving  # noqa: E402
from models.layers import FusedLinearHooks  # noqa: E402
from pallas_kernels import served as S  # noqa: E402
from scripts.common_args import choice_list, positive_int  # noqa: E402

#: ``{system: (steps, branches, served strategy or None for bf16)}``, in the order they run.
SYSTEMS = {"bf16_48x2": (48, 2, None), "bf16_4x1": (4, 1, None), "w4a4_fp8_4x1": (4, 1, "fp8"),
           "w4a4_fp8_mgpu_4x1": (4, 1, "fp8_mgpu"), "w4a4_fp8_mgpu_fused_qkv_4x1": (4, 1, "fp8_mgpu"),
           "w4a4_dequant_4x1": (4, 1, "dequant")}
FUSED_QKV = ("w4a4_fp8_mgpu_fused_qkv_4x1",)  # q | k | v served as one layer
OPTIONAL = ("w4a4_dequant_4x1",)  # run only while within --budget-s
BASELINE = "bf16_48x2"
REFERENCE_4X1 = "bf16_4x1"
GOAL_SPEEDUP = 30.0  # issue 16: the stack >= 30x faster per 1K image than the bf16 48-step two-transformer pipeline
NO_VAE = "VAE decode not included (not ported)"


def derive(payload: dict[str, Any]) -> None:
    """Per-image times, speedups, forward passes and per-forward ratios against ``bf16_48x2``, and the headline (in
    place). Every system makes the same batch per call, so a ratio of call times is a ratio of times per image."""
    times = {name: t["median_ms"] for name, t in payload["timings_ms"].items()}
    payload["ms_per_image"] = {name: ms / payload["batch_size"] for name, ms in times.items()}
    forwards = payload["forward_passes_per_image"]
    payload["speedup_per_image"], payload["per_forward_ratio"] = {}, {}
    if BASELINE not in times:
        return
    for name, ms in times.items():
        speedup = times[BASELINE] / ms
        payload["speedup_per_image"][name] = speedup
        payload["per_forward_ratio"][name] = speedup * forwards[name] / forwards[BASELINE]
    stacks = [name for name in times if SYSTEMS[name][2] is not None]
    if stacks:
        fastest = min(stacks, key=times.get)
        payload["fastest_stack"] = fastest
        payload["ideogram4_stack_speedup_per_image"] = payload["speedup_per_image"][fastest]
        payload["goal_met"] = payload["ideogram4_stack_speedup_per_image"] >= GOAL_SPEEDUP


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=("full", "tiny"), default="full")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU validation)")
    parser.add_argument("--systems", type=choice_list(tuple(SYSTEMS), "system"), default=tuple(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (run in that order; default all)")
    parser.add_argument("--text-tokens", type=int, default=None, help="default 128 (tiny: 3)")
    parser.add_argument("--height", type=int, default=None, help="pixels, square image (default 1024; tiny: 32)")
    parser.add_argument("--rank", type=int, default=None, help="low-rank rank (default 128; tiny: 32)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed calls per system after the warm-up")
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="images per call, each the one-prompt packed layout (default 1)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help=f"optional systems ({', '.join(OPTIONAL)}) start only before this many seconds")
    parser.add_argument("--out", default=None, help="JSON (default $OUT/ideogram4_stack.json, else /tmp)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tiny = args.preset == "tiny"
    impl = S.resolve_impl("interpret" if args.interpret else None)
    # bf16 weights and activations, stacked blocks under lax.scan, cuDNN flash attention on the GPU.
    cfg = dataclasses.replace(ig.tiny_config() if tiny else ig.IDEOGRAM4, dtype=jnp.bfloat16,
                              param_dtype=jnp.bfloat16, scan_layers=True,
                              attention_impl="cudnn" if jax.default_backend() == "gpu" else "xla")
    rank = args.rank or (32 if tiny else 128)
    text_tokens = args.text_tokens or (3 if tiny else 128)
    height = args.height or (32 if tiny else 1024)
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "ideogram4_stack.json"))
    device = jax.local_devices()[0]
    grid = sampling.grid_for(height, height)
    batch = args.batch_size
    layout = sampling.prepare_ids([text_tokens] * batch, grid[0], grid[1], text_tokens)  # packed: no padding, no mask
    schedules = {name: sampling.flow_schedule(height, height, steps) if branches == 2 else
                 sampling.flow_schedule(height, height, steps, guidance_schedule=None, guidance_scale=1.0)
                 for name, (steps, branches, _) in SYSTEMS.items()}
    payload: dict[str, Any] = {
        "what": (f"Ideogram 4 per 1K image, batch {batch}, random weights (speed only): the bf16 48-step "
                 "two-transformer pipeline vs one branch x 4 steps (bf16, W4A4 served layers), end to end (text "
                 "projection, sampler, all steps)"),
        "vae": NO_VAE,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
        "jax": jax.__version__, "flax": flax.__version__, "python": platform.python_version(),
        "preset": args.preset, "batch_size": batch, "command_args": list(sys.argv[1:] if argv is None else argv),
        "systems": list(args.systems), "impl": impl, "attention_impl": cfg.attention_impl, "rank": rank,
        "height": height, "width": height, "text_tokens": text_tokens, "image_tokens": layout.num_image_tokens,
        "tokens": int(layout.indicator.shape[1]), "params_per_transformer": ig.count_params(cfg),
        "schedules": {name: {"steps": s.num_steps, "branches": SYSTEMS[name][1],
                             "guidance": [float(g) for g in s.guidance] if SYSTEMS[name][1] == 2 else None}
                      for name, s in schedules.items() if name in args.systems},
        "forward_passes_per_image": {name: SYSTEMS[name][0] * SYSTEMS[name][1] for name in args.systems},
        "method": (f"one AOT-compiled jitted call per batch of {batch} image(s) (text projection + lax.scan over the "
                   f"steps); a warm-up call, then the median of {args.repeats} calls, block_until_ready each; "
                   f"ms_per_image = that median / {batch}"),
        "timings_ms": {}, "compile_s": {}, "finite": {}, "checks": {}, "memory_gib": {}, "errors": {}}

    results = StagedResults(out_path, payload, start, before_save=derive)  # saved after each stage, errors recorded
    save = results.save

    def stage(name: str, fn: Callable[[], Any]) -> Any:
        def and_memory() -> Any:  # the device memory after the stage, also when it failed (e.g. out of memory)
            try:
                return fn()
            finally:
                payload["memory_gib"][name] = timing.device_memory_gib()

        return results.stage(name, and_memory)

    # Weights (two random sets on the device: conditional, unconditional) and the inputs of one image.
    seeds = (0, 1) if BASELINE in args.systems else (0,)
    graphdef, states, payload["init_s"] = serving.random_states(cfg, seeds)
    payload["memory_gib"]["weights"] = timing.device_memory_gib()
    keys = jax.random.split(jax.random.key(11), 2)
    text_features = jax.random.normal(keys[0], (batch, text_tokens, cfg.llm_features_dim), cfg.dtype)  # (B, T, F)
    noise = jax.random.normal(keys[1], (batch, layout.num_image_tokens, cfg.in_channels), jnp.float32)  # (B, N, C)
    arrays = sampling.layout_arrays(layout)  # (position_ids, None, indicator)
    save()
    print(f"[{time.perf_counter() - start:6.1f} s] {len(states)} transformer(s) of {payload['params_per_transformer']}"
          f" parameters on the device", flush=True)

    def two_branch(cond_state, uncond_state, noise_, features, position_ids, segment_ids, indicator, sigmas,
                   model_times, guidance):
        return sampling.denoise_loop(nnx.merge(graphdef, cond_state), nnx.merge(graphdef, uncond_state), noise_,
                                     features, (position_ids, segment_ids, indicator), sigmas, model_times, guidance,
                                     num_text_slots=text_tokens)  # (B, N, C)

    def one_branch(cond_state, entries, noise_, features, position_ids, segment_ids, indicator, sigmas, model_times):
        hooks = None if entries is None else FusedLinearHooks.from_entries(entries, stacked=True)
        return sampling.unguided_denoise_loop(nnx.merge(graphdef, cond_state), noise_, features,
                                              (position_ids, segment_ids, indicator), sigmas, model_times,
                                              num_text_slots=text_tokens, hooks=hooks)  # (B, N, C)

    outputs: dict[str, jax.Array] = {}

    def run_system(name: str, fn: Callable, *call_args: Any) -> None:
        t_c = time.perf_counter()
        compiled = jax.jit(fn).lower(*call_args).compile()
        payload["compile_s"][name] = time.perf_counter() - t_c
        out = jax.block_until_ready(compiled(*call_args))  # the warm-up call
        payload["finite"][name] = bool(jnp.all(jnp.isfinite(out)))
        samples = timing.wall_times(lambda: compiled(*call_args), repeats=args.repeats, inner=1)
        payload["timings_ms"][name] = timing.summary_ms(samples)
        outputs[name] = out
        print(f"  {name:18s} {payload['timings_ms'][name]['median_ms'] / batch:10.1f} ms per image "
              f"(compile {payload['compile_s'][name]:.1f} s)", flush=True)

    def schedule_arrays(name: str, guided: bool) -> tuple[jax.Array, ...]:
        schedule = schedules[name]
        return (jnp.asarray(schedule.sigmas), jnp.asarray(schedule.model_times),
                *((jnp.asarray(schedule.guidance),) if guided else ()))

    inputs = (noise, text_features, *arrays)
    if BASELINE in args.systems:
        stage(BASELINE, functools.partial(run_system, BASELINE, two_branch, states[0], states[1], *inputs,
                                          *schedule_arrays(BASELINE, True)))
        # Nothing below uses the unconditional transformer: give its buffers back before the W4A4 layers are built.
        for leaf in jax.tree_util.tree_leaves(states.pop(1)):
            leaf.delete()
    cond_state = states[0]
    if REFERENCE_4X1 in args.systems:
        stage(REFERENCE_4X1, functools.partial(run_system, REFERENCE_4X1, one_branch, cond_state, None, *inputs,
                                               *schedule_arrays(REFERENCE_4X1, False)))

    # The W4A4 layers of the conditional transformer, served on each strategy that a chosen system runs.
    strategies = [SYSTEMS[name][2] for name in args.systems if SYSTEMS[name][2] is not None]

    def build() -> dict[str, Any]:
        t0 = time.perf_counter()
        model = nnx.merge(graphdef, cond_state)
        qlayers = serving.build_block_qlinears(model, jax.random.key(123), rank)
        served = {strategy: serving.serve_block_layers(qlayers, strategy) for strategy in dict.fromkeys(strategies)}
        del qlayers
        for name in FUSED_QKV:
            if name in args.systems:  # q | k | v as one layer; every other layer is the same system's unfused one
                qkv = serving.build_block_qlinears(model, jax.random.key(123), rank, fuse_qkv=True)[serving.BLOCK_QKV]
                strategy = SYSTEMS[name][2]
                served[name] = {**{p: v for p, v in served[strategy].items() if p not in serving.BLOCK_QKV_MEMBERS},
                                serving.BLOCK_QKV: serving.serve_block_layers({serving.BLOCK_QKV: qkv}, strategy)[
                                    serving.BLOCK_QKV]}
                del qkv
        timing.block(served)
        payload["build_quantized_s"] = time.perf_counter() - t0
        return served

    served = stage("build_quantized", build) if strategies else None
    for name in args.systems:
        strategy = SYSTEMS[name][2]
        if strategy is None or served is None:
            continue
        elapsed = time.perf_counter() - start
        if name in OPTIONAL and elapsed > args.budget_s:
            payload["errors"][name] = f"skipped: {elapsed:.0f} s > --budget-s {args.budget_s:g}"
            continue
        options = S.ServeOptions(strategy=strategy, impl=impl)
        entries = serving.block_served_hooks(served[name if name in FUSED_QKV else strategy], options).entries()
        stage(name, functools.partial(run_system, name, one_branch, cond_state, entries, *inputs,
                                      *schedule_arrays(name, False)))
        if name in outputs and REFERENCE_4X1 in outputs:  # ||y - ref|| / ||ref|| over the final latents
            got, ref = (np.asarray(jax.device_get(outputs[n]), np.float32) for n in (name, REFERENCE_4X1))
            payload["checks"][f"{name} vs {REFERENCE_4X1} final latents rel err"] = float(
                np.linalg.norm(got - ref) / np.linalg.norm(ref))
    payload["memory_gib"]["final"] = timing.device_memory_gib()
    save()
    print(table(payload), flush=True)
    return payload


def table(payload: dict[str, Any]) -> str:
    """The run's summary: one row per timed system (ms per image, forwards, speedup per image and per forward against
    ``bf16_48x2``, compile seconds, finite output), the headline, the checks, the errors."""
    lines = [f"\n{payload['device']} jax {payload['jax']} flax {payload['flax']} {payload['date_utc']} "
             f"batch={payload['batch_size']} tokens={payload['tokens']} impl={payload['impl']} "
             f"attention={payload['attention_impl']}",
             f"  {'system':18s} {'ms / image':>11s} {'forwards':>8s} {'speedup':>8s} {'per fwd':>8s} "
             f"{'compile s':>9s}  finite"]
    for name in payload["timings_ms"]:
        ratios = [payload[key].get(name) for key in ("speedup_per_image", "per_forward_ratio")]
        ratio_text = " ".join(f"{'' if r is None else f'{r:7.2f}x':>8s}" for r in ratios)
        lines.append(f"  {name:18s} {payload['ms_per_image'][name]:11.1f} "
                     f"{payload['forward_passes_per_image'][name]:8d} "
                     f"{ratio_text} {payload['compile_s'][name]:9.1f}  {payload['finite'][name]}")
    if "ideogram4_stack_speedup_per_image" in payload:
        lines.append(f"  ideogram4_stack_speedup_per_image = {payload['ideogram4_stack_speedup_per_image']:.2f}x "
                     f"({BASELINE} / {payload['fastest_stack']}; goal >= {GOAL_SPEEDUP:g}x: "
                     f"{'met' if payload['goal_met'] else 'not met'})")
    lines += [f"  {name:55s} {value:.3e}" for name, value in payload["checks"].items()]
    lines.append(f"  {payload['vae']}")
    lines += [f"  ERROR {name}: {err[:300]}" for name, err in payload["errors"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

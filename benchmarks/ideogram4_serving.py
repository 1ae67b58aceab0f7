"""Serving cost of Ideogram 4 in JAX (bf16): one forward, one CFG step (two transformers), the whole 48-step loop.

Full-size transformers (``models.ideogram4.IDEOGRAM4``, 9.28 B parameters each) with random bf16 weights generated on
the device by a jitted initialiser (nothing is transferred), at 1K resolution (1024 x 1024 -> 64 x 64 = 4096 image
tokens), in two token layouts of one prompt:

* ``padded``: the pipeline's layout, text padded to 2048 slots: 6144 tokens, block-diagonal segment mask;
* ``packed``: only the real text tokens (``--text-tokens``, default 128): 4224 tokens, one segment, no mask.
  Equivalent on the image tokens (tests/test_ideogram4.py checks it).

Measured, per layout: the conditional transformer's forward exactly as diffusers runs it (text projection included),
one guided Euler step (conditional + unconditional transformer, text projection cached per prompt, as the sampler of
``models.ideogram4_sampling`` runs it), and the whole default schedule (48 steps, guidance 7.0 x 45 then 3.0 x 3) as
one jitted ``lax.scan``. Times are medians over repeats after a warm-up call, each repeat ``block_until_ready`` around
``--inner`` back-to-back calls. FLOPs are counted analytically (matmuls only: 2 per multiply-add; attention as dense
``4 L^2 hidden`` per layer), and the roofline is FLOPs over the bf16 matmul rate measured in the same run (8192^3) and
over the nominal 780 TFLOP/s the issue uses.

Usage::

    python benchmarks/ideogram4_serving.py --preset tiny              # CPU validation, seconds
    python benchmarks/ideogram4_serving.py --preset full --out $OUT/ideogram4_serving.json   # the H200
    python benchmarks/ideogram4_serving.py --preset full --torch-baseline --torch-compile   # PyTorch, same shapes

The JAX part imports neither torch nor diffusers. ``--torch-baseline`` (run it as its own process: JAX and PyTorch
would compete for the GPU memory) times diffusers' own ``Ideogram4Transformer2DModel`` (on the GPU machine, which has
torch but no diffusers, install the carried wheel first:
``pip install --no-index --no-deps --target /tmp/site .whl/diffusers-*.whl`` and put ``/tmp/site`` on
``PYTHONPATH``), eager and ``torch.compile``, on the same shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kroquant_jax import timing  # noqa: E402
from kroquant_jax.fileio import atomic_write_json  # noqa: E402
from models import ideogram4 as ig  # noqa: E402
from models import ideogram4_sampling as sampling  # noqa: E402
from models import ideogram4_serving as serving  # noqa: E402

NOMINAL_BF16_TFLOPS = 780.0  # the issue's H200 bf16 rate for its roofline
ISSUE_TORCH_MS = {"eager": 369.0, "torch.compile": 263.0}  # the issue's numbers (H200, diffusers, padded 6144)


# ----------------------------------------------------------------------------------------------------------------
# the measured matmul rate (the roofline's second denominator)
# ----------------------------------------------------------------------------------------------------------------


def matmul_tflops(size: int, repeats: int) -> float:
    """Measured bf16 matmul rate (size^3, random data) in TFLOP/s."""
    keys = jax.random.split(jax.random.key(7), 2)
    a = jax.random.normal(keys[0], (size, size), jnp.bfloat16)
    b = jax.random.normal(keys[1], (size, size), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    timing.block(matmul(a, b))
    seconds = statistics.median(timing.wall_times(lambda: matmul(a, b), repeats=repeats, inner=5))
    return 2.0 * size**3 / seconds / 1e12


# ----------------------------------------------------------------------------------------------------------------
# the model on the device
# ----------------------------------------------------------------------------------------------------------------


def _compile(fn: Callable, *args: Any, static: dict[str, Any] | None = None) -> tuple[Callable, float]:
    start = time.perf_counter()
    compiled = jax.jit(fn, static_argnames=tuple(static or ())).lower(*args, **(static or {})).compile()
    return compiled, time.perf_counter() - start


def run_layout(name: str, cfg: ig.Ideogram4Config, models: dict[str, Any], text_tokens: int, text_slots: int,
               grid: tuple[int, int], schedule: sampling.FlowSchedule, args: argparse.Namespace,
               peak_tflops: float) -> dict[str, Any]:
    """All measurements of one token layout (one prompt of ``text_tokens`` tokens in ``text_slots`` slots)."""
    layout = sampling.prepare_ids([text_tokens], grid[0], grid[1], text_slots)
    arrays = sampling.layout_arrays(layout)  # padding -> mask; packed -> no mask
    tokens = layout.indicator.shape[1]
    num_image = layout.num_image_tokens
    keys = jax.random.split(jax.random.key(11), 3)
    dtype = cfg.dtype
    text_features = jnp.concatenate(  # left padding carries zeros, real tokens random
        [jnp.zeros((1, text_slots - text_tokens, cfg.llm_features_dim), dtype),
         jax.random.normal(keys[0], (1, text_tokens, cfg.llm_features_dim), dtype)], axis=1)  # (1, T, F)
    noise = jax.random.normal(keys[1], (1, num_image, cfg.in_channels), jnp.float32)  # (1, N, C)
    cond_graph, uncond_graph = models["cond"][0], models["uncond"][0]
    cond_state, uncond_state = models["cond"][1], models["uncond"][1]
    result: dict[str, Any] = {"tokens": tokens, "text_tokens": text_tokens, "text_slots": text_slots,
                              "image_tokens": num_image, "attention_mask": arrays[1] is not None,
                              "timings": {}, "compile_s": {}, "errors": {}}

    cond_flops = serving.forward_flops(cfg, tokens, text_projection_tokens=tokens)
    cached_cond = serving.forward_flops(cfg, tokens, text_projection_tokens=0)
    uncond_flops = serving.forward_flops(cfg, num_image, text_projection_tokens=0)
    step_flops = cached_cond["total"] + uncond_flops["total"]
    loop_flops = schedule.num_steps * step_flops + 2.0 * text_slots * cfg.llm_features_dim * cfg.hidden_size
    result["flops"] = {"forward": cond_flops, "cfg_step": step_flops, "loop": loop_flops}

    def roofline(flops: float, seconds: float) -> dict[str, float]:
        return {"tflops_achieved": flops / seconds / 1e12,
                "roofline_ms_nominal": 1e3 * flops / (NOMINAL_BF16_TFLOPS * 1e12),
                "ratio_to_nominal_roofline": seconds / (flops / (NOMINAL_BF16_TFLOPS * 1e12)),
                "roofline_ms_measured_peak": 1e3 * flops / (peak_tflops * 1e12),
                "ratio_to_measured_roofline": seconds / (flops / (peak_tflops * 1e12))}

    # 1. the conditional forward as diffusers runs it (text projection over every token)
    def forward(state, latents, t, features, position_ids, segment_ids, indicator):
        model = nnx.merge(cond_graph, state)
        return model(latents, t, features, position_ids, segment_ids, indicator)  # (1, L, C)

    try:
        latents_full = jnp.concatenate([jnp.zeros((1, text_slots, cfg.in_channels), jnp.float32), noise],
                                       axis=1).astype(dtype)  # (1, L, C)
        features_full = jnp.concatenate([text_features, jnp.zeros((1, num_image, cfg.llm_features_dim), dtype)],
                                        axis=1)  # (1, L, F)
        t = jnp.full((1,), 0.5, dtype)
        fwd_args = (cond_state, latents_full, t, features_full, *arrays)
        compiled, seconds = _compile(forward, *fwd_args)
        result["compile_s"]["forward"] = seconds
        timing.block(compiled(*fwd_args))
        samples = timing.wall_times(lambda: compiled(*fwd_args), repeats=args.repeats, inner=args.inner)
        result["timings"]["forward"] = {**timing.summary_ms(samples),
                                        **roofline(cond_flops["total"], statistics.median(samples))}
        del features_full
    except Exception as err:  # noqa: BLE001 (record and go on: one failure must not lose the other numbers)
        result["errors"]["forward"] = f"{type(err).__name__}: {err}"[:2000]
        traceback.print_exc()

    # 2. one guided Euler step (both transformers; text projection cached per prompt)
    def prepare(state_c, state_u, features, position_ids, segment_ids, indicator, num_text_slots):
        return sampling.prepare_branches(nnx.merge(cond_graph, state_c), nnx.merge(uncond_graph, state_u), features,
                                         (position_ids, segment_ids, indicator), num_text_slots)

    def cfg_step(state_c, state_u, branches, latents, model_time, sigma, sigma_next, guidance, num_text_slots):
        velocity = sampling.guided_velocity(nnx.merge(cond_graph, state_c), nnx.merge(uncond_graph, state_u),
                                            branches, latents, model_time, guidance, num_text_slots)
        return sampling.euler_step(latents, velocity, sigma, sigma_next)  # (1, N, C)

    try:
        branches = jax.jit(prepare, static_argnames=("num_text_slots",))(
            cond_state, uncond_state, text_features, *arrays, num_text_slots=text_slots)
        step_index = 0
        per_step = tuple(jnp.float32(x) for x in (schedule.model_times[step_index], schedule.sigmas[step_index],
                                                  schedule.sigmas[step_index + 1], schedule.guidance[step_index]))
        step_args = (cond_state, uncond_state, branches, noise, *per_step)
        compiled, seconds = _compile(cfg_step, *step_args, static={"num_text_slots": text_slots})
        result["compile_s"]["cfg_step"] = seconds
        timing.block(compiled(*step_args))
        state = {"latents": noise, "branches": branches}
        del branches, step_args  # the state dict holds the only reference, cleared below to free the memory

        def chained_step():  # each step consumes the previous step's latents, as in the loop
            state["latents"] = compiled(cond_state, uncond_state, state["branches"], state["latents"], *per_step)
            return state["latents"]

        samples = timing.wall_times(chained_step, repeats=args.repeats, inner=args.inner)
        result["timings"]["cfg_step"] = {**timing.summary_ms(samples), **roofline(step_flops, statistics.median(samples))}
        result["loop_extrapolated_s"] = schedule.num_steps * statistics.median(samples)
        state.clear()
    except Exception as err:  # noqa: BLE001
        result["errors"]["cfg_step"] = f"{type(err).__name__}: {err}"[:2000]
        traceback.print_exc()

    # 3. the whole schedule, one jitted lax.scan (text projection once, then N guided steps)
    if args.loop_runs > 0:
        def loop(state_c, state_u, noise_, features, position_ids, segment_ids, indicator, sigmas, model_times,
                 guidance, num_text_slots):
            return sampling.denoise_loop(nnx.merge(cond_graph, state_c), nnx.merge(uncond_graph, state_u), noise_,
                                         features, (position_ids, segment_ids, indicator), sigmas, model_times,
                                         guidance, num_text_slots)

        try:
            loop_args = (cond_state, uncond_state, noise, text_features, *arrays, jnp.asarray(schedule.sigmas),
                         jnp.asarray(schedule.model_times), jnp.asarray(schedule.guidance))
            compiled, seconds = _compile(loop, *loop_args, static={"num_text_slots": text_slots})
            result["compile_s"]["loop"] = seconds
            outputs = []
            # no separate warm-up: compiled ahead of time, weights already resident
            samples = timing.wall_times(lambda: outputs.append(compiled(*loop_args)) or outputs[-1],
                                        repeats=args.loop_runs, inner=1)
            latents = outputs[-1]
            result["timings"]["loop"] = {**timing.summary_ms(samples),
                                         **roofline(loop_flops, statistics.median(samples)),
                                         "steps": schedule.num_steps, "runs": args.loop_runs,
                                         "finite": bool(jnp.all(jnp.isfinite(latents)))}
        except Exception as err:  # noqa: BLE001
            result["errors"]["loop"] = f"{type(err).__name__}: {err}"[:2000]
            traceback.print_exc()
    result["memory_gib_after"] = timing.device_memory_gib()
    return result


# ----------------------------------------------------------------------------------------------------------------
# the PyTorch baseline: diffusers' own Ideogram4Transformer2DModel (a separate process: `--torch-baseline`)
# ----------------------------------------------------------------------------------------------------------------


def run_torch_baseline(args: argparse.Namespace, out_path: Path) -> dict[str, Any]:
    """Time diffusers' ``Ideogram4Transformer2DModel`` (eager, then torch.compile) on the same shapes, random bf16
    weights (uniform in ``+-1/sqrt(fan_in)``), built on the device from ``cfg.to_diffusers_config()``."""
    import torch  # noqa: PLC0415
    from diffusers import Ideogram4Transformer2DModel  # noqa: PLC0415 - only this process needs torch / diffusers

    tiny = args.preset == "tiny"
    cfg = ig.tiny_config() if tiny else ig.IDEOGRAM4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    height, width = args.height or (64 if tiny else 1024), args.width or (64 if tiny else 1024)
    text_tokens, text_slots = args.text_tokens or (6 if tiny else 128), args.text_slots or (16 if tiny else 2048)
    grid = sampling.grid_for(height, width)
    with torch.device(device):
        model = Ideogram4Transformer2DModel(**cfg.to_diffusers_config()).to(torch.bfloat16).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-1.0, 1.0, generator=generator).mul_(1.0 / math.sqrt(param.shape[-1]))
    import diffusers  # noqa: PLC0415

    payload: dict[str, Any] = {"torch": torch.__version__, "diffusers": diffusers.__version__,
                               "model": "diffusers.Ideogram4Transformer2DModel", "device": torch.cuda.get_device_name() if device == "cuda"
                               else "cpu", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                   timespec="seconds"), "timings_ms": {}, "errors": {}}

    def synchronize():
        if device == "cuda":
            torch.cuda.synchronize()

    def time_forward(fn, inputs) -> dict[str, Any]:
        with torch.no_grad():
            fn(**inputs)
            synchronize()
            samples = timing.wall_times(lambda: fn(**inputs), repeats=args.repeats, inner=args.inner,
                                        sync=lambda _: synchronize())
        return timing.summary_ms(samples)

    def inputs_for(slots: int) -> dict[str, Any]:
        layout = sampling.prepare_ids([text_tokens], grid[0], grid[1], slots)
        length = layout.indicator.shape[1]
        as_long = lambda a: torch.from_numpy(a.astype(np.int64)).to(device)  # noqa: E731
        return {"hidden_states": torch.randn(1, length, cfg.in_channels, device=device, dtype=torch.bfloat16),
                "timestep": torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),
                "encoder_hidden_states": torch.randn(1, length, cfg.llm_features_dim, device=device,
                                                     dtype=torch.bfloat16),
                "position_ids": as_long(layout.position_ids), "segment_ids": as_long(layout.segment_ids),
                "indicator": as_long(layout.indicator)}

    runs = [("eager", "padded", model, text_slots), ("eager", "packed", model, text_tokens)]
    if args.torch_compile:
        runs.append(("torch.compile", "padded", None, text_slots))
    for mode, layout_name, fn, slots in runs:
        key = f"{mode}/{layout_name}"
        try:
            if fn is None:
                start = time.perf_counter()
                fn = torch.compile(model)
                inputs = inputs_for(slots)
                with torch.no_grad():
                    fn(**inputs)
                synchronize()
                payload[f"compile_s/{key}"] = time.perf_counter() - start
            payload["timings_ms"][key] = time_forward(fn, inputs_for(slots))
        except Exception as err:  # noqa: BLE001
            payload["errors"][key] = f"{type(err).__name__}: {err}"[:2000]
            traceback.print_exc()
        atomic_write_json(out_path, payload)
        print(key, payload["timings_ms"].get(key, {}).get("median_ms"), flush=True)
    if device == "cuda":
        payload["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    atomic_write_json(out_path, payload)
    return payload


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=("full", "tiny"), default="full")
    parser.add_argument("--height", type=int, default=None, help="pixels (default 1024; tiny: 64)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--text-tokens", type=int, default=None, help="real text tokens (default 128; tiny: 6)")
    parser.add_argument("--text-slots", type=int, default=None, help="padded text slots (default 2048; tiny: 16)")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=2)
    parser.add_argument("--loop-runs", type=int, default=1, help="timed runs of the whole loop per layout (0: skip)")
    parser.add_argument("--layouts", default="packed,padded")
    parser.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto")
    parser.add_argument("--matmul-size", type=int, default=None)
    parser.add_argument("--list-layers", action="store_true",
                        help="unrolled list of blocks instead of lax.scan over stacked blocks (34x the compile time)")
    parser.add_argument("--torch-baseline", action="store_true",
                        help="time diffusers' Ideogram4Transformer2DModel instead (its own process)")
    parser.add_argument("--torch-compile", action="store_true", help="with --torch-baseline: also torch.compile")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/ideogram4_serving.json, else "
                        "benchmarks/results/ideogram4_serving[_tiny].json)")
    args = parser.parse_args(argv)

    tiny = args.preset == "tiny"
    if args.torch_baseline:
        default = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))
        return run_torch_baseline(args, Path(args.out) if args.out else default / "ideogram4_serving_torch.json")
    on_gpu = jax.default_backend() == "gpu"
    attention = args.attention if args.attention != "auto" else ("cudnn" if on_gpu else "xla")
    base = ig.tiny_config() if tiny else ig.IDEOGRAM4
    cfg = dataclasses.replace(base, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention_impl=attention,
                              scan_layers=not args.list_layers)
    height = args.height or (64 if tiny else 1024)
    width = args.width or (64 if tiny else 1024)
    text_tokens = args.text_tokens or (6 if tiny else 128)
    text_slots = args.text_slots or (16 if tiny else 2048)
    grid = sampling.grid_for(height, width)
    schedule = sampling.flow_schedule(height, width, args.steps,
                                      guidance_schedule=sampling.DEFAULT_GUIDANCE_SCHEDULE if args.steps == 48
                                      else None, guidance_scale=None if args.steps == 48 else 7.0)
    if args.out:
        out_path = Path(args.out)
    elif os.environ.get("OUT"):
        out_path = Path(os.environ["OUT"]) / "ideogram4_serving.json"
    else:
        out_path = Path(__file__).resolve().parent / "results" / f"ideogram4_serving{'_tiny' if tiny else ''}.json"

    device = jax.local_devices()[0]
    payload: dict[str, Any] = {
        "what": "Ideogram 4 transformer serving cost in JAX, bf16 random weights, batch 1",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
        "jax": jax.__version__, "flax": getattr(__import__("flax"), "__version__", "?"),
        "python": platform.python_version(), "preset": args.preset, "attention_impl": attention,
        "scan_layers": cfg.scan_layers, "params_per_transformer": ig.count_params(cfg), "height": height,
        "width": width,
        "steps": args.steps, "guidance": [float(g) for g in schedule.guidance],
        "method": f"median of {args.repeats} repeats of {args.inner} back-to-back calls after one warm-up call, "
                  f"block_until_ready per repeat; loop: {args.loop_runs} run(s) of the AOT-compiled scan",
        "issue_torch_reference_ms_padded_forward": ISSUE_TORCH_MS, "layouts": {}, "errors": {},
    }
    payload["matmul_bf16_tflops"] = matmul_tflops(args.matmul_size or (512 if tiny else 8192), 5 if tiny else 10)
    peak = payload["matmul_bf16_tflops"]
    graphdef, (cond_state, uncond_state), payload["init_s_both"] = serving.random_states(cfg, (0, 1))
    models = {"cond": (graphdef, cond_state), "uncond": (graphdef, uncond_state)}
    payload["memory_gib_weights"] = timing.device_memory_gib()
    atomic_write_json(out_path, payload)

    layouts = {"packed": text_tokens, "padded": text_slots}
    for name in args.layouts.split(","):
        if name not in layouts:
            raise ValueError(f"unknown layout {name!r}; known: {sorted(layouts)}")
        payload["layouts"][name] = run_layout(name, cfg, models, text_tokens, layouts[name], grid, schedule, args,
                                              peak)
        atomic_write_json(out_path, payload)  # partial results survive a later failure
        if attention == "cudnn" and "forward" in payload["layouts"][name]["errors"]:
            # cuDNN refused this layout (e.g. its mask): measure it with XLA attention instead, and say so.
            xla_cfg = dataclasses.replace(cfg, attention_impl="xla")
            xla_graph = nnx.graphdef(nnx.eval_shape(lambda: ig.Ideogram4Transformer(xla_cfg, rngs=nnx.Rngs(0))))
            xla_models = {"cond": (xla_graph, cond_state), "uncond": (xla_graph, uncond_state)}
            payload["layouts"][f"{name}_xla_attention"] = run_layout(name, xla_cfg, xla_models, text_tokens,
                                                                     layouts[name], grid, schedule, args, peak)
            atomic_write_json(out_path, payload)

    payload["memory_gib_final"] = timing.device_memory_gib()
    atomic_write_json(out_path, payload)
    print_table(payload)
    return payload


def print_table(payload: dict[str, Any]) -> None:
    print(f"\n{payload['device']} jax {payload['jax']} {payload['date_utc']} attention={payload['attention_impl']} "
          f"matmul {payload['matmul_bf16_tflops']:.0f} TFLOP/s")
    print(f"{'layout':8} {'tokens':>6} {'what':10} {'median ms':>10} {'TFLOP/s':>8} {'x roofline(780)':>15} "
          f"{'x roofline(meas)':>16}")
    for name, layout in payload["layouts"].items():
        for what, timing in layout["timings"].items():
            print(f"{name:8} {layout['tokens']:6d} {what:10} {timing['median_ms']:10.1f} "
                  f"{timing['tflops_achieved']:8.1f} {timing['ratio_to_nominal_roofline']:15.2f} "
                  f"{timing['ratio_to_measured_roofline']:16.2f}")
        if "loop_extrapolated_s" in layout:
            print(f"{name:8} {payload['steps']} x step = {layout['loop_extrapolated_s']:.2f} s")
        for what, err in layout["errors"].items():
            print(f"{name:8} {what}: ERROR {err[:300]}")
    memory = payload.get("memory_gib_final", {})
    if memory:
        print(f"peak memory {memory.get('peak_bytes_in_use', float('nan')):.1f} GiB")


if __name__ == "__main__":
    main()

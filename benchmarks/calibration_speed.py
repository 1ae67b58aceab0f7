"""Calibration speed: every linear layer of a PixArt-Σ-shaped model, KroQuant (100 Adam steps) + LoRaQ, vmapped
engine vs. a plain per-layer Python loop over the same engine stages.

Layers: 28 blocks x 10 quantized linears (self-attn q/k/v/out, cross-attn q/k/v/out, ff up 1152->4608, ff down
4608->1152; cross k/v read the projected 1152-wide caption features, as in the real model; ``--text-dim 4096`` for
4096-wide ones): 224 layers of 1152x1152, 28 of 4608x1152, 28 of 1152x4608. Data: synthetic DiT-like layers
(:mod:`kroquant_jax.synthetic`, outlier channels, heavy-tailed tokens, power-law weight spectra) with the engine's
default row counts (1024 calibration + 256 validation + 256 test rows per layer); one block's 10 layers are generated and reused by
every block (the time does not depend on the values; each layer name still draws its own rows).

Per shape group (largest first), three stages are timed on the host clock around calls that return host numpy (so
device work is finished): ``calibrate_layers`` (KroQuant: λ at the Hadamard init, Adam scan, held-out safeguard),
the transformed weight ``W T^{-T}`` (one jitted call per layer), ``loraq_layers`` (randomized-SVD init, Adam fit,
Cayley rotation). Settings are the engine defaults (:class:`CalibrationConfig`, :class:`LoRaQConfig`), except
``max_layers_per_program`` (the recipe is built by :func:`kroquant_jax.calibrate.recipe_from_args`).

* **vmapped**: each stage over the whole group (stacked, chunks of ``--max-layers-per-program``, one compiled program
  per group and stage).
* **loop**: the same stages one layer at a time (``max_layers_per_program=1``: a jit of the single-layer program,
  called in a Python loop) over the first ``--loop-layers`` layers of the group; the mean time of the layers that
  compiled nothing, times the group's layer count, is the *extrapolated* loop time (said so in the record).

Order: the loop on the largest group, the vmapped engine on every group (``--vmapped-groups``: only those), the loop
on the other groups (while ``--time-budget`` lasts), then warm vmapped reruns (a second call in the same process) where
time is left; ``--loops-first`` runs the loop on every group before the vmapped engine, ``--warm-first`` each group's
warm rerun right after its cold run.

Compilation is separated from run time by JAX's monitoring events (tracing, lowering and XLA compilation spans; their
union within a stage is its compile time): ``run = wall - compile``. Each stage also lists its XLA compilations
(``programs``: name and seconds, those over 0.1 s) and how many were loaded from the persistent compilation cache
(``--compile-cache DIR``; a load is timed as a compilation). If time is left, the vmapped stages are run
again (warm) as a direct check. The JSON record (``--out``) is rewritten atomically after every stage, with
``in_progress`` naming the stage under way, so a run stopped by a timeout keeps what it measured.

``--compile-only`` runs nothing: it lowers and compiles the KroQuant and LoRaQ programs of every selected group, as
the vmapped engine (``--max-layers-per-program`` stacked layers, or the group's count) and as the loop (one layer) would
compile them, from abstract shapes, and records per program the tracing+lowering and XLA compile seconds (wall, and
the process's CPU time, less sensitive to other load on a shared machine), the StableHLO op count, and, from the
optimized HLO, its instruction count and the kernel-level operations (fusions, dots, custom calls, while loops: a
proxy for the per-kernel code generation and autotuning work of a GPU compile).

Usage (CPU check):  python benchmarks/calibration_speed.py --preset tiny --out /tmp/calibration_speed.json
Compile times:      python benchmarks/calibration_speed.py --compile-only --out /tmp/calibration_compile.json
Device:             python3 benchmarks/calibration_speed.py --time-budget 250 --out $OUT/calibration_speed.json
FFN loop + warm:    python3 benchmarks/calibration_speed.py --groups 4608x1152 1152x4608 --vmapped-groups 4608x1152 \
                        --loop-layers 3 --loops-first --time-budget 226 --out $OUT/calibration_speed_ffn.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import faulthandler
import functools
import json
import os
import re
import signal
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import calibrate, lowrank, synthetic, timing, transforms  # noqa: E402
from kroquant_jax.layerset import atomic_write_bytes, engine_compiler_options, program_config  # noqa: E402
from scripts.common_args import add_compile_cache  # noqa: E402

_CAL = calibrate.CalibrationConfig()
_RUN = calibrate.RunConfig()
_LQ = lowrank.LoRaQConfig()
PRESETS = {
    # PixArt-Σ shapes at the engine's defaults (rows, steps, rank); ``heldout`` rows validate and as many test.
    "pixart": dict(blocks=28, d=1152, ffn=4608, rows=_RUN.num_rows, heldout=_RUN.num_validation, steps=_CAL.steps,
                   rank=_LQ.rank, loraq_steps=_LQ.steps, rotation_steps=_LQ.rotation_steps, loop_layers=4,
                   max_layers_per_program=112),
    "tiny": dict(blocks=3, d=64, ffn=128, rows=96, heldout=32, steps=5, rank=32, loraq_steps=5, rotation_steps=3,
                 loop_layers=3, max_layers_per_program=16),
}

def _log_compile(t_start: float, over: float = 1.0):
    """``CompileClock.on_compile``: print the XLA compilations that take ``over`` seconds or more."""
    def log(name: str, seconds: float) -> None:
        if seconds >= over:
            print(f"    [{time.perf_counter() - t_start:6.1f} s] compiled {name} in {seconds:.1f} s", flush=True)
    return log


def memory() -> dict:
    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return {"peak_bytes_in_use": None, "note": "this backend reports no memory statistics"}
    return {"peak_bytes_in_use": int(stats.get("peak_bytes_in_use", 0)),
            "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 3),
            "bytes_limit": int(stats.get("bytes_limit", 0))}


def hlo_counts(lowered, compiled) -> dict:
    """Size of a program: StableHLO ops of the lowering; instructions, kernel-level operations (fusions, dots,
    custom calls, reductions... outside fused computations), fusions, custom calls and while loops of the optimized
    HLO."""
    stablehlo = len(re.findall(r"= \"?stablehlo\.[a-z_]+", lowered.as_text()))
    text = compiled.as_text()
    kernels = fusions = 0
    for comp in re.split(r"\n(?=\S.*\{\n)", text):
        head = comp.split("\n", 1)[0]
        if "fused" in head.split("(")[0] or "fused" in head.split(" ")[0]:
            continue  # the body of a fusion is one kernel, counted at its call
        lines = [ln for ln in comp.split("\n")[1:] if re.match(r"\s+\S+ = ", ln)]
        kernels += sum(1 for ln in lines if re.search(r" (fusion|dot|custom-call|convolution|reduce|sort|scatter|"
                                                      r"gather)\(", ln))
        fusions += sum(1 for ln in lines if " fusion(" in ln)
    return {"stablehlo_ops": stablehlo, "hlo_instructions": len(re.findall(r"^\s+\S+ = ", text, flags=re.M)),
            "kernel_ops": kernels, "fusions": fusions, "custom_calls": text.count("custom-call("),
            "custom_call_targets": dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))),
            "while_loops": text.count(" while(")}


def compile_only(args, record: dict, shape_groups: dict, save) -> dict:
    """Lowers and compiles (does not run) the KroQuant and LoRaQ programs of every shape group (see the module
    docstring); fills ``record["programs"]``."""
    sds = jax.ShapeDtypeStruct
    param = transforms.get("kron_lu")
    recipe = bench_recipe(args)
    cal = program_config(recipe.calibration)
    lq = program_config(recipe.loraq)
    record["programs"] = {}
    for (o, d), count in shape_groups.items():
        for mode, n in (("vmapped", min(args.max_layers_per_program, count)), ("loop", 1)):
            p0 = jax.tree.map(lambda x: sds((n,) + x.shape, x.dtype), param.init(d))
            builds = {
                "kroquant": lambda: calibrate.calibration_program.lower(
                    p0, sds((n, args.rows, d), np.float32), sds((n, args.heldout, d), np.float32),
                    sds((n, args.heldout, d), np.float32), sds((n, o, d), np.float32), parameterization=param,
                    cfg=cal),
                "loraq": lambda: lowrank.loraq_program.lower(sds((n, o, d), np.float32), lq)}
            for stage, build in builds.items():
                key = f"{stage} {o}x{d} {mode} ({n} layer{'s' if n > 1 else ''})"
                save(f"compile {key}")
                t0 = time.perf_counter()
                lowered = build()
                t1, c1 = time.perf_counter(), time.process_time()
                compiled = lowered.compile()
                t2, c2 = time.perf_counter(), time.process_time()
                record["programs"][key] = {"layers": n, "lower_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3),
                                           "compile_cpu_s": round(c2 - c1, 3), **hlo_counts(lowered, compiled)}
                print(f"  {key}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s, "
                      f"{record['programs'][key]['kernel_ops']} kernel ops", flush=True)
    record["complete"] = True
    save()
    return record


def bench_recipe(args) -> calibrate.Recipe:
    """KroQuant + LoRaQ at the engine defaults but for the preset's rows, steps, rank and program size (validation
    and test rows: ``args.heldout`` each)."""
    return calibrate.recipe_from_args("kroquant+loraq", {
        "calib_steps": args.steps, "calib_rows": args.rows, "calib_validation": args.heldout,
        "calib_test": args.heldout, "rank": args.rank, "loraq_steps": args.loraq_steps,
        "rotation_steps": args.rotation_steps, "precision": args.precision,
        "max_layers_per_program": args.max_layers_per_program})


def build_layers(args) -> dict:
    block0 = synthetic.pixart_sigma_shapes(1, args.d, args.ffn, args.text_dim)
    base = synthetic.synthetic_layer_set(block0, n=args.rows + 2 * args.heldout, seed=0)
    layers = {}
    for b in range(args.blocks):
        for name, layer in base.items():
            layers[name.replace("transformer_blocks.0.", f"transformer_blocks.{b}.")] = layer
    return layers


@functools.partial(jax.jit, static_argnames="transform")
def _transformed_weight(w, params, transform):
    """``W T^{-T}`` ``(o, d)``."""
    p = transforms.get(transform)
    return transforms.apply_to_weights(w, p.inverse_blocks(params))


def transformed_weights(layers: dict, results: dict) -> dict:
    return {n: np.asarray(_transformed_weight(layers[n].weight, results[n].params, results[n].transform))
            for n in layers}


def flops(o: int, d: int, args) -> dict:
    """Analytic matmul FLOPs per layer (multiply-adds x 2; fake quantization and small ops not counted).

    KroQuant step: output product forward + its two backward products (``6 m o d``) and the block transforms of both
    operands forward + backward (``4 (m + o) d 32``). LoRaQ: the two randomized SVDs of the init (``(2 + 4*2 + 1)``
    products ``(o, d) x (d, r + 16)`` each), Adam step ``L R`` forward + backward (``6 o r d``), rotation step the same
    plus ``L O``, ``O^T R`` forward + backward (``4 (o + d) r^2``).
    """
    m, r, k = args.rows, args.rank, args.rank + 16
    kq = args.steps * (6 * m * o * d + 4 * (m + o) * d * 32)
    lq = 2 * 11 * 2 * o * d * k + args.loraq_steps * 6 * o * r * d + args.rotation_steps * (
        6 * o * r * d + 4 * (o + d) * r * r)
    return {"kroquant": float(kq), "loraq": float(lq)}


def summarize(record: dict) -> dict:
    """Totals over the shape groups measured so far (``groups_measured``; all of them once the run completes)."""
    gs = [g for g in record["groups"].values() if "vmapped_cold" in g]
    if not gs:
        return {}
    summ = {
        "groups_measured": [k for k, g in record["groups"].items() if "vmapped_cold" in g],
        "layers_measured": sum(g["layers"] for g in gs),
        "vmapped_cold_wall_s": round(sum(g["vmapped_cold"]["total"]["wall_s"] for g in gs), 2),
        "vmapped_compile_s": round(sum(g["vmapped_cold"]["total"]["compile_s"] for g in gs), 2),
        "vmapped_run_s": round(sum(g["vmapped_cold"]["total"]["run_s"] for g in gs), 2),
        "vmapped_xla_compilations": int(sum(g["vmapped_cold"]["total"]["compiles"] for g in gs)),
    }
    if all(isinstance(g.get("vmapped_warm"), dict) for g in gs):
        summ["vmapped_warm_wall_s"] = round(sum(g["vmapped_warm"]["total"]["wall_s"] for g in gs), 2)
        summ["vmapped_warm_xla_compilations"] = int(sum(g["vmapped_warm"]["total"]["compiles"] for g in gs))
    for stage in ("kroquant", "transform_weights", "loraq"):
        summ[f"vmapped_{stage}_run_s"] = round(sum(g["vmapped_cold"][stage]["run_s"] for g in gs), 2)
    for s in ("kroquant", "loraq"):
        fl = sum(g["flops_per_layer"][s] * g["layers"] for g in gs)
        run = summ[f"vmapped_{s}_run_s"]
        summ[f"{s}_matmul_tflop"] = round(fl / 1e12, 1)
        summ[f"{s}_achieved_tflops"] = round(fl / 1e12 / run, 2) if run > 0 else None
    summ["per_group_speedup_run"] = {
        k: round(g["loop_extrapolated_run_s"] / (g["vmapped_warm"]["total"]["wall_s"] if isinstance(
            g.get("vmapped_warm"), dict) else g["vmapped_cold"]["total"]["run_s"]), 2)
        for k, g in record["groups"].items() if "vmapped_cold" in g and "loop_extrapolated_run_s" in g}
    if all("loop_extrapolated_run_s" in g for g in gs):
        summ["loop_extrapolated_run_s"] = round(sum(g["loop_extrapolated_run_s"] for g in gs), 2)
        summ["loop_compile_s"] = round(sum(g["loop_compile_s"] for g in gs), 2)
        summ["loop_note"] = ("extrapolated: per shape group, the mean wall time of the timed loop layers that compiled "
                             "nothing x the group's layer count; layers timed per group: "
                             + ", ".join(f"{k} {g['loop_warm_layers_timed']} of {g['layers']}"
                                         for k, g in record["groups"].items() if g in gs))
        steady = summ.get("vmapped_warm_wall_s", summ["vmapped_run_s"])
        summ["speedup_run"] = round(summ["loop_extrapolated_run_s"] / steady, 2)
        summ["speedup_run_note"] = ("loop (extrapolated, compiled programs) / vmapped "
                                    + ("warm rerun wall" if "vmapped_warm_wall_s" in summ else "cold wall - compile"))
        summ["speedup_with_compile"] = round((summ["loop_extrapolated_run_s"] + summ["loop_compile_s"])
                                             / summ["vmapped_cold_wall_s"], 2)
        summ["goal_10x_met"] = bool(summ["speedup_run"] >= 10)
    return summ


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="pixart")
    ap.add_argument("--text-dim", type=int, default=None, help="input width of cross-attn k/v (default: d)")
    ap.add_argument("--precision", default=_CAL.objective.precision, choices=["highest", "high", "default"])
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument("--groups", nargs="*", default=None, help="only these shape groups, e.g. 1152x4608")
    ap.add_argument("--vmapped-groups", nargs="*", default=None,
                    help="run the vmapped engine only on these of the selected groups (default: all)")
    ap.add_argument("--loops-first", action="store_true",
                    help="the loop on every group before the vmapped engine (default: the largest group's loop only)")
    ap.add_argument("--warm-first", action="store_true",
                    help="warm rerun of each vmapped group right after its cold run (default: at the end)")
    ap.add_argument("--compile-only", action="store_true",
                    help="lower and compile the programs without running them (compile times and program sizes)")
    add_compile_cache(ap)
    ap.add_argument("--time-budget", type=float, default=250.0,
                    help="seconds from the start; loop layers and warm reruns are skipped once it is spent")
    ap.add_argument("--out", default="benchmarks/results/calibration_speed.json")
    for k, v in PRESETS["pixart"].items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"(pixart preset: {v})")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)
    faulthandler.register(signal.SIGTERM, chain=True)  # a timeout shows where the run was
    t_start = time.perf_counter()
    clock = timing.compile_clock()
    clock.on_compile = _log_compile(t_start)
    elapsed = lambda: time.perf_counter() - t_start  # noqa: E731

    dev = jax.local_devices()[0]
    record = {
        "benchmark": "calibration_speed", "preset": args.preset,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "jax_version": jax.__version__, "device": dev.device_kind, "platform": dev.platform,
        "num_local_devices": jax.local_device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "engine_xla_options": engine_compiler_options(),
        "compile_cache": args.compile_cache,
        "config": {k: getattr(args, k) for k in ("blocks", "d", "ffn", "text_dim", "rows", "heldout", "steps", "rank",
                                                  "loraq_steps", "rotation_steps", "loop_layers",
                                                  "max_layers_per_program", "precision")},
        "method": ("per shape group: calibrate_layers (KroQuant kron_lu, Adam lr 1e-2) -> W T^-T -> loraq_layers "
                   "(init 'best', Adam 1e-3, Cayley SGD 0.5, branch MXFP4); wall = host clock around calls returning "
                   "host numpy; compile = union of JAX trace/lower/XLA-compile event spans inside the stage; "
                   "run = wall - compile"),
        "groups": {},
    }

    def save(stage=None):
        if stage is None:
            record.pop("in_progress", None)
        else:
            record["in_progress"] = stage
            print(f"[{elapsed():6.1f} s] {stage}", flush=True)
        atomic_write_bytes(args.out, (json.dumps(record, indent=2) + "\n").encode())

    if args.compile_only:
        shapes = synthetic.pixart_sigma_shapes(args.blocks, args.d, args.ffn, args.text_dim)
        shape_groups = collections.Counter(shapes.values())
        if args.groups:
            available = [f"{o}x{d}" for o, d in shape_groups]
            if not set(args.groups) <= set(available):
                raise SystemExit(f"--groups {args.groups}: the model's shape groups are {available}")
            shape_groups = {k: v for k, v in shape_groups.items() if f"{k[0]}x{k[1]}" in args.groups}
        record["method"] = ("lower (trace + StableHLO) and XLA-compile each program from abstract shapes, one after "
                            "the other in this process; nothing is run")
        return compile_only(args, record, shape_groups, save)
    save("data")
    layers, st = timing.measure(lambda: build_layers(args), clock)
    record["data_seconds"] = st["wall_s"]
    groups: dict[tuple, list[str]] = {}
    for n, layer in layers.items():
        groups.setdefault(layer.weight.shape, []).append(n)
    groups = dict(sorted(groups.items(), key=lambda kv: -len(kv[1]) * kv[0][0] * kv[0][1]))
    if args.groups:
        available = [f"{o}x{d}" for o, d in groups]
        if not set(args.groups) <= set(available):
            raise SystemExit(f"--groups {args.groups}: the model's shape groups are {available}")
        groups = {k: v for k, v in groups.items() if f"{k[0]}x{k[1]}" in args.groups}
        record["groups_selected"] = args.groups
    if args.vmapped_groups is not None:
        selected = [f"{o}x{d}" for o, d in groups]
        if not set(args.vmapped_groups) <= set(selected):
            raise SystemExit(f"--vmapped-groups {args.vmapped_groups}: the selected shape groups are {selected}")
        record["vmapped_groups_selected"] = args.vmapped_groups
    record["num_layers"] = sum(len(v) for v in groups.values())
    record["layer_shapes"] = {f"{o}x{d}": len(v) for (o, d), v in groups.items()}
    print(f"{record['num_layers']} layers {record['layer_shapes']}, data {st['wall_s']} s", flush=True)

    recipe = bench_recipe(args)
    cal, run = recipe.calibration, recipe.run
    lq = dataclasses.replace(recipe.loraq, max_layers_per_program=args.max_layers_per_program)
    cal1 = dataclasses.replace(cal, max_layers_per_program=1)
    lq1 = dataclasses.replace(lq, max_layers_per_program=1)
    run1 = dataclasses.replace(run, shard=False)

    def pipeline(sub: dict, c, lqc, tag: str, r) -> tuple[dict, dict, dict]:
        save(f"{tag}: calibrate_layers")
        res, s_k = timing.measure(lambda: calibrate.calibrate_layers(sub, c, run=r), clock)
        save(f"{tag}: transformed weights")
        w_t, s_w = timing.measure(lambda: transformed_weights(sub, res), clock)
        save(f"{tag}: loraq_layers")
        br, s_l = timing.measure(lambda: lowrank.loraq_layers(w_t, lqc, run=r), clock)
        return res, br, {"kroquant": s_k, "transform_weights": s_w, "loraq": s_l}

    def total(stages: dict) -> dict:
        return {k: round(sum(s[k] for s in stages.values()), 3)
                for k in ("wall_s", "compile_s", "run_s", "compiles", "cache_hits")}

    vm_results, vm_branches, loop_out = {}, {}, {}

    def compare(key: str, names: list) -> None:
        """Loop vs. vmapped on the loop's layers (one program per layer vs. stacked: equal up to rounding)."""
        both = [n for n in names if n in loop_out and n in vm_results]
        if both:
            record["groups"][key]["loop_vs_vmapped_max_abs_diff"] = {
                "transform_test_error": max(abs(loop_out[n][0] - vm_results[n].test_error) for n in both),
                "loraq_weight_error_final": max(abs(loop_out[n][1] - float(vm_branches[n].error_final))
                                                for n in both)}

    def run_loop(key: str, names: list) -> None:
        g = record["groups"][key]
        per_layer = {}
        for n in names[:args.loop_layers]:
            if elapsed() > args.time_budget:
                g["loop_truncated"] = "time budget"
                break
            r1, b1, s1 = pipeline({n: layers[n]}, cal1, lq1, f"loop {key} {n}", run1)
            loop_out[n] = (r1[n].test_error, float(b1[n].error_final))
            per_layer[n] = {**s1, "total": total(s1)}
            g["loop_layers"] = per_layer
            save()
        warm = [v for v in per_layer.values() if v["total"]["compiles"] == 0]
        if warm:
            mean = lambda k: float(np.mean([v[k]["wall_s"] for v in warm]))  # noqa: E731
            g["loop_warm_layers_timed"] = len(warm)
            g["loop_warm_seconds_per_layer"] = {k: round(mean(k), 4) for k in
                                                ("kroquant", "transform_weights", "loraq", "total")}
            g["loop_extrapolated_run_s"] = round(mean("total") * len(names), 2)
            g["loop_compile_s"] = round(sum(v["total"]["compile_s"] for v in per_layer.values()), 2)
            print(f"  loop {key}: {g['loop_warm_seconds_per_layer']} s/layer over {len(warm)} compiled-warm "
                  f"layers, x {len(names)} = {g['loop_extrapolated_run_s']} s (extrapolated)", flush=True)
        compare(key, names)
        record["summary"] = summarize(record)
        save()

    def run_vmapped(key: str, names: list) -> None:
        g = record["groups"][key]
        res, br, stages = pipeline({n: layers[n] for n in names}, cal, lq, f"vmapped {key} ({len(names)} layers)",
                                   run)
        vm_results.update(res)
        vm_branches.update(br)
        g["vmapped_cold"] = {**stages, "total": total(stages)}
        g["vmapped_run_seconds_per_layer"] = {k: round(v["run_s"] / len(names), 4) for k, v in stages.items()}
        g["memory_after_vmapped"] = memory()
        print(f"  vmapped {key}: " + ", ".join(f"{k} {v['wall_s']} s (compile {v['compile_s']})"
                                               for k, v in stages.items()), flush=True)
        compare(key, names)
        record["summary"] = summarize(record)
        save()

    def run_warm(key: str, names: list) -> None:
        """The vmapped stages again in the same process (programs compiled): a direct check of run = wall - compile."""
        g = record["groups"][key]
        if elapsed() + 1.2 * g["vmapped_cold"]["total"]["run_s"] > args.time_budget:
            g["vmapped_warm"] = "skipped: time budget"
            save()
            return
        _, _, stages = pipeline({n: layers[n] for n in names}, cal, lq, f"vmapped warm {key}", run)
        g["vmapped_warm"] = {**stages, "total": total(stages)}
        print(f"  vmapped warm {key}: {g['vmapped_warm']['total']['wall_s']} s "
              f"(cold run {g['vmapped_cold']['total']['run_s']} s)", flush=True)
        record["summary"] = summarize(record)
        save()

    # Order: the loop on the largest group (a quick check of the single-layer programs), the vmapped engine on every
    # vmapped group (the headline number; with --warm-first each followed by its warm rerun), then the loop on the
    # other groups while the time budget lasts, then the warm reruns where time is left.
    keys = {f"{o}x{d}": names for (o, d), names in groups.items()}
    vmapped_keys = [k for k in keys if args.vmapped_groups is None or k in args.vmapped_groups]
    for (o, d), names in groups.items():
        record["groups"][f"{o}x{d}"] = {"layers": len(names), "flops_per_layer": flops(o, d, args)}
    first = next(iter(keys))
    if not args.skip_loop:
        for key in (keys if args.loops_first else [first]):
            run_loop(key, keys[key])
    for key in vmapped_keys:
        run_vmapped(key, keys[key])
        if args.warm_first:
            run_warm(key, keys[key])
    if not args.skip_loop and not args.loops_first:
        for key, names in keys.items():
            if key != first:
                run_loop(key, names)
    if not args.warm_first:
        for key in vmapped_keys:
            run_warm(key, keys[key])

    record["summary"] = summarize(record)
    record["memory"] = {**memory(), "note": (
        "peak_bytes_in_use of device 0 since the process started (the XLA allocator's high-water mark of live buffers: "
        "program inputs, outputs and temporaries of the largest chunk, plus anything else alive then; not the "
        "preallocated pool). The vmapped programs are the largest, so this is their peak.")}
    record["vmapped_quality"] = {
        "transform_test_error_mean": float(np.mean([r.test_error for r in vm_results.values()])),
        "hadamard_test_error_mean": float(np.mean([r.test_errors["init0"] for r in vm_results.values()])),
        "loraq_weight_error_init_16bit_branch_mean": float(np.mean([float(b.error_init)
                                                                    for b in vm_branches.values()])),
        "loraq_weight_error_final_mxfp4_branch_mean": float(np.mean([float(b.error_final)
                                                                     for b in vm_branches.values()])),
    } if vm_results else "no vmapped group run"
    record["complete"] = True
    save()
    print(json.dumps({k: record[k] for k in ("summary", "memory", "vmapped_quality")}, indent=2))
    return record


if __name__ == "__main__":
    main()

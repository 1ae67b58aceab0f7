"""Where the GPU compile time of the calibration engine's programs goes: the KroQuant and LoRaQ programs of one
PixArt-Σ shape group, lowered once per variant and XLA-compiled under different compile options (:data:`VARIANTS`),
one after the other or concurrently from threads, each variant in a fresh process (XLA keeps autotuning results for
the life of a process, so a second compile in the same process would reuse the first's).

Per variant the child process records, per program: lowering seconds, XLA compile seconds (wall), and the run time of
the compiled program on the same synthetic layers (first call and a second, warm call), and saves the outputs; the
parent compares every variant's outputs with the first variant's (KroQuant's validation / test errors, LoRaQ's weight
errors), names the ``best`` variant (the shortest compile among those whose warm run times stay within
``--run-slack`` of the first variant's, with its options as an ``XLA_FLAGS`` string) and prints a table.
``--profile VARIANT`` traces that variant's compilation with the jax profiler and lists
the host-side XLA events that took longest (the HLO passes, autotuning, LLVM / ptxas).

The programs are the engine's own (:data:`kroquant_jax.calibrate.calibration_program`,
:data:`kroquant_jax.lowrank.loraq_program`) without the library's compile options (``__wrapped__`` under a plain
``jax.jit``): each variant's options are passed to ``Lowered.compile(compiler_options=...)``, so ``xla_default`` is XLA
as it is shipped.

Usage (CPU check):  python benchmarks/calibration_compile_probe.py --preset tiny --out-dir /tmp/probe
Device:             python3 benchmarks/calibration_compile_probe.py --out-dir /tmp/probe --budget 200 \
                        --variants xla_default no_triton_gemm no_fusion_autotuner; cp /tmp/probe/probe.json $OUT/
(``--out-dir`` also holds each variant's outputs, so keep it off ``$OUT``; docs/calibration.md, "Next device run".)
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax.fileio import atomic_path, atomic_write_json  # noqa: E402

#: name -> (compile options, compile the programs concurrently from threads)
VARIANTS = {
    "xla_default": ({}, False),
    "autotune0": ({"xla_gpu_autotune_level": 0}, False),
    # only the choice between XLA's native and Triton's block-level emitter per fusion (GEMM autotuning kept)
    "no_fusion_autotuner": ({"xla_gpu_experimental_enable_fusion_autotuner": False}, False),
    "autotune0_threads": ({"xla_gpu_autotune_level": 0}, True),
    "no_triton_gemm": ({"xla_gpu_enable_triton_gemm": False}, False),
    "xla_default_threads": ({}, True),
}
PRESETS = {
    # the 28 FFN-up layers of PixArt-Σ (4608 x 1152) at the engine defaults, as one program each
    "pixart": dict(o=4608, d=1152, layers=28),
    "tiny": dict(o=64, d=64, layers=3, rows=96, heldout=32, steps=5, rank=32, loraq_steps=5, rotation_steps=3),
}


def _recipe(args):
    from kroquant_jax import calibrate

    fields = {"calib_steps": args.steps, "calib_rows": args.rows, "calib_validation": args.heldout,
              "calib_test": args.heldout, "rank": args.rank, "loraq_steps": args.loraq_steps,
              "rotation_steps": args.rotation_steps, "max_layers_per_program": max(args.layers, 1)}
    return calibrate.recipe_from_args("kroquant+loraq", fields)


def _inputs(args):
    """The group's stacked inputs: ``(kroquant args, loraq args)`` as host numpy (the same in every variant)."""
    from kroquant_jax import calibrate, synthetic, transforms

    recipe = _recipe(args)
    run = recipe.run
    shapes = {f"layer{i}": (args.o, args.d) for i in range(args.layers)}
    layers = synthetic.synthetic_layer_set(shapes, n=run.num_rows + run.num_validation + run.num_test, seed=0)
    param = transforms.get("kron_lu")
    rows = [calibrate.layer_rows(n, layers[n], run) for n in shapes]
    p0 = jax_tree_stack([param.init(args.d)] * args.layers)
    kq = [p0] + [np.stack([r[i] for r in rows]) for i in range(3)] + [np.stack([layers[n].weight for n in shapes])]
    return kq, [kq[-1]]


def jax_tree_stack(trees):
    import jax

    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def host_events(trace_dir: str, top: int = 40) -> list:
    """``[[name, seconds, count], ...]``: the longest host-side events (XLA's own, no Python frames) of a profiler
    trace, summed by name (events nest, so sums overlap)."""
    from jax.profiler import ProfileData

    total, count = collections.Counter(), collections.Counter()
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/host"):
                continue
            for line in plane.lines:
                for ev in line.events:
                    if ev.name.startswith("$"):
                        continue
                    total[ev.name] += ev.duration_ns / 1e9
                    count[ev.name] += 1
    return [[name[:160], round(sec, 3), count[name]] for name, sec in total.most_common(top)]


def child(args) -> dict:
    """One variant in this process: lower, compile, run twice; writes ``<variant>.json`` and ``<variant>.npz``."""
    import jax

    from kroquant_jax import calibrate, lowrank, transforms
    from kroquant_jax.layerset import program_config

    options, threads = VARIANTS[args.child]
    recipe = _recipe(args)
    kq_fn = jax.jit(calibrate.calibration_program.__wrapped__, static_argnames=("parameterization", "cfg"))
    lq_fn = jax.jit(lowrank.loraq_program.__wrapped__, static_argnames="cfg")
    kq_in, lq_in = _inputs(args)
    rec = {"variant": args.child, "options": options, "threads": threads, "jax_version": jax.__version__,
           "device": jax.local_devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "programs": {}}
    t0 = time.perf_counter()
    dev_kq = jax.device_put(kq_in)
    dev_lq = jax.device_put(lq_in)
    jax.block_until_ready((dev_kq, dev_lq))
    rec["device_put_s"] = round(time.perf_counter() - t0, 3)
    sds = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    static = {"kroquant": dict(parameterization=transforms.get("kron_lu"), cfg=program_config(recipe.calibration)),
              "loraq": dict(cfg=program_config(recipe.loraq))}
    lowered = {}
    for name, fn, ins in (("kroquant", kq_fn, dev_kq), ("loraq", lq_fn, dev_lq)):
        t0 = time.perf_counter()
        lowered[name] = fn.lower(*sds(ins), **static[name])
        rec["programs"][name] = {"lower_s": round(time.perf_counter() - t0, 3)}

    def compile_one(name):
        t = time.perf_counter()
        exe = lowered[name].compile(compiler_options=dict(options) or None)
        return name, exe, time.perf_counter() - t

    trace_dir = tempfile.mkdtemp(prefix="kq_probe_") if args.profile == args.child else None
    if trace_dir:
        jax.profiler.start_trace(trace_dir)
    t0 = time.perf_counter()
    if threads:
        with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
            done = list(pool.map(compile_one, lowered))
    else:
        done = [compile_one(name) for name in lowered]
    rec["compile_wall_s"] = round(time.perf_counter() - t0, 3)
    if trace_dir:
        jax.profiler.stop_trace()
        rec["profile_host_events"] = host_events(trace_dir)
    compiled = {}
    for name, exe, sec in done:
        compiled[name] = exe
        rec["programs"][name]["compile_s"] = round(sec, 3)
    outputs = {}
    for name, ins in (("kroquant", dev_kq), ("loraq", dev_lq)):
        runs = []
        for _ in range(2):
            t = time.perf_counter()
            out = jax.block_until_ready(compiled[name](*ins))
            runs.append(round(time.perf_counter() - t, 3))
        rec["programs"][name].update(run_first_s=runs[0], run_warm_s=runs[1])
        outputs[name] = jax.device_get(out)
    _, losses, _, err = outputs["kroquant"]
    branch = outputs["loraq"]
    with atomic_path(os.path.join(args.out_dir, f"{args.child}.npz"), suffix=".npz") as tmp:
        np.savez(tmp, kroquant_errors=np.asarray(err), kroquant_losses=np.asarray(losses),
                 loraq_error_init=np.asarray(branch.error_init), loraq_error_fit=np.asarray(branch.error_fit),
                 loraq_error_final=np.asarray(branch.error_final))
    rec["kroquant_test_error_mean"] = float(np.mean(np.asarray(err)[:, 1, 1]))
    rec["loraq_error_final_mean"] = float(np.mean(np.asarray(branch.error_final)))
    atomic_write_json(os.path.join(args.out_dir, f"{args.child}.json"), rec)
    return rec


def best_variant(variants: dict, baseline: str, slack: float) -> dict:
    """The measured variant with the shortest compile (wall) among those whose warm run times stay within ``slack``
    (e.g. 0.05) of the ``baseline`` variant's, and its options as an ``XLA_FLAGS`` string (to measure the whole model
    with them: ``XLA_FLAGS=... benchmarks/calibration_speed.py``)."""
    measured = {v: r for v, r in variants.items() if isinstance(r, dict) and "programs" in r}
    if baseline not in measured:
        return {"variant": None, "xla_flags": "", "note": f"baseline {baseline} not measured"}
    base = measured[baseline]

    def keeps_run_time(r):
        return all(r["programs"][p]["run_warm_s"] <= (1 + slack) * base["programs"][p]["run_warm_s"]
                   for p in ("kroquant", "loraq"))

    name = min((v for v, r in measured.items() if keeps_run_time(r)), key=lambda v: measured[v]["compile_wall_s"])
    flags = " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in measured[name]["options"].items())
    return {"variant": name, "xla_flags": flags, "run_time_slack": slack,
            "baseline": baseline,
            "rule": "shortest compile among the variants whose warm run times stay within the slack of the baseline's"}


def compare(out_dir: str, base: str, other: str) -> dict:
    """Largest absolute differences of ``other``'s outputs from ``base``'s, and the values' scale."""
    a, b = np.load(os.path.join(out_dir, f"{base}.npz")), np.load(os.path.join(out_dir, f"{other}.npz"))
    return {k: {"max_abs_diff": float(np.max(np.abs(a[k] - b[k]))), "max_abs": float(np.max(np.abs(a[k])))}
            for k in a.files}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="pixart")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--profile", default=None, choices=list(VARIANTS),
                    help="trace this variant's compilation with the jax profiler")
    ap.add_argument("--budget", type=float, default=1e9,
                    help="seconds: no variant is started once this much time has passed")
    ap.add_argument("--child-timeout", type=float, default=240.0)
    ap.add_argument("--run-slack", type=float, default=0.05,
                    help="'best' variant: warm run times at most this fraction above the first variant's")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    for k in ("o", "d", "layers", "rows", "heldout", "steps", "rank", "loraq_steps", "rotation_steps"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    args = ap.parse_args(argv)
    from kroquant_jax import calibrate, lowrank

    defaults = dict(rows=calibrate.RunConfig().num_rows, heldout=calibrate.RunConfig().num_validation,
                    steps=calibrate.CalibrationConfig().steps, rank=lowrank.LoRaQConfig().rank,
                    loraq_steps=lowrank.LoRaQConfig().steps, rotation_steps=lowrank.LoRaQConfig().rotation_steps)
    for k, v in {**defaults, **PRESETS[args.preset]}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.child:
        return child(args)

    t_start = time.perf_counter()
    record = {"benchmark": "calibration_compile_probe", "preset": args.preset,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
              "config": {k: getattr(args, k) for k in ("o", "d", "layers", "rows", "heldout", "steps", "rank",
                                                       "loraq_steps", "rotation_steps")},
              "method": ("each variant in a fresh process: lower the KroQuant and LoRaQ programs of the group "
                         "(stacked layers), XLA-compile with the variant's options (sequentially or from 2 threads), "
                         "run each compiled program twice on the same synthetic layers; outputs compared with the "
                         "first variant's"),
              "variants": {}}
    out_json = os.path.join(args.out_dir, "probe.json")
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in record["config"]]
    for v in args.variants:
        if time.perf_counter() - t_start > args.budget:
            record["variants"][v] = "skipped: budget"
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child", v, "--out-dir", args.out_dir,
               "--preset", args.preset, *passthrough] + (["--profile", args.profile] if args.profile else [])
        t0 = time.perf_counter()
        print(f"[{t0 - t_start:6.1f} s] variant {v}", flush=True)
        try:
            proc = subprocess.run(cmd, timeout=args.child_timeout, capture_output=True, text=True)
            ok = proc.returncode == 0
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {args.child_timeout} s"
        wall = round(time.perf_counter() - t0, 1)
        path = os.path.join(args.out_dir, f"{v}.json")
        if ok and os.path.exists(path):
            with open(path) as f:
                record["variants"][v] = {**json.load(f), "process_wall_s": wall}
            base = args.variants[0]
            if base != v and os.path.exists(os.path.join(args.out_dir, f"{base}.npz")):
                record["variants"][v]["diff_vs_" + base] = compare(args.out_dir, base, v)
        else:
            record["variants"][v] = {"error": tail, "process_wall_s": wall}
            print(tail, flush=True)
        record["best"] = best_variant(record["variants"], args.variants[0], args.run_slack)
        atomic_write_json(out_json, record)

    print(f"\n{'variant':22s} {'KQ compile':>10s} {'LQ compile':>10s} {'wall':>7s} {'KQ run':>7s} {'LQ run':>7s} "
          f"{'KQ err diff':>11s} {'LQ err diff':>11s}")
    for v, r in record["variants"].items():
        if not isinstance(r, dict) or "programs" not in r:
            print(f"{v:22s} {str(r)[:80]}")
            continue
        p = r["programs"]
        diff = next((d for k, d in r.items() if k.startswith("diff_vs_")), None)
        kd = f"{diff['kroquant_errors']['max_abs_diff']:.2e}" if diff else "-"
        ld = f"{diff['loraq_error_final']['max_abs_diff']:.2e}" if diff else "-"
        print(f"{v:22s} {p['kroquant']['compile_s']:10.1f} {p['loraq']['compile_s']:10.1f} "
              f"{r['compile_wall_s']:7.1f} {p['kroquant']['run_warm_s']:7.2f} {p['loraq']['run_warm_s']:7.2f} "
              f"{kd:>11s} {ld:>11s}")
    if record["variants"]:
        print(f"\nbest: {record['best']['variant']} (XLA_FLAGS='{record['best']['xla_flags']}')")
    for v, r in record["variants"].items():
        if isinstance(r, dict) and r.get("profile_host_events"):
            print(f"\nlongest host events while compiling ({v}; nested, so sums overlap):")
            for name, sec, n in r["profile_host_events"][:25]:
                print(f"  {sec:8.2f} s {n:6d}x  {name[:110]}")
    return record


if __name__ == "__main__":
    main()

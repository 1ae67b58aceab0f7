"""The QAD training step of full-size Ideogram 4 (``models.qad_sharded``): step time, peak memory, the largest block
count (and batch) that fits, and the projection to the whole 34-block model; on any number of devices.

Each *trial* builds the sharded step for one setting (blocks, batch, remat, master / optimizer dtypes), creates random
teacher weights and the student on the devices (nothing crosses the host), compiles the step ahead of time (its
``memory_analysis``), runs ``--warmup`` steps, then times ``--repeats`` chained steps (wall clock around each
``block_until_ready``ed step, ``kroquant_jax.timing.wall_times``; the step is seconds long, so launch overhead is
nothing) and reads every device's ``peak_bytes_in_use``. A trial that runs out of device memory (RESOURCE_EXHAUSTED)
is recorded as ``"oom"`` and the run goes on.

The allocator's peak is a high-water mark of the process: a trial's ``peak_gib`` is its own only when no earlier trial
went higher (``peak_is_own``); ``step_peak_estimate_gib`` (memory in use before the step + the compiled step's
temporary and non-donated output buffers) is each trial's own.

After the ``--blocks`` trials of the main setting, the measured peaks and times are fitted by a line in the block
count (intercept: embeddings, text projection, one block's activations; slope: a block's weights, gradients, moments
and saved activations), and

* ``--search-dtypes M:O,...``: for each master:optimizer dtype pair, the largest block count predicted to fit (the
  fitted line, with the exactly counted difference in parameter, gradient and moment bytes of that pair) is tried,
  one fewer on "oom" (``--search-tries``);
* ``--search-batch``: at the largest block count that ran in the main setting, the batch is doubled until "oom";
* ``projection``: the fitted peak and step time at 34 blocks (a projection, not a measurement) per setting.

``--budget-s`` stops starting trials that would not finish in time (estimated from the slowest trial so far); the
JSON is rewritten (atomically) after every trial, so a killed run keeps what it measured.

Usage::

    python benchmarks/qad_step.py --tiny --out /tmp/qad_step_tiny.json                   # CPU smoke test, seconds
    python benchmarks/qad_step.py --blocks 2,4 --search-dtypes float32:float32,bfloat16:bfloat16 \\
        --budget-s 80 --out $OUT/qad_step_1gpu.json                                       # one H200
    python benchmarks/qad_step.py --blocks 34 --batch 2 --search-batch --out $OUT/qad_step_2gpu.json   # two H200s

``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 0.95 here (set before jax starts; an explicit value is kept), so the
search can use nearly all of the device memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kroquant_jax import timing  # noqa: E402
from kroquant_jax.fileio import atomic_write_json  # noqa: E402
from models import ideogram4 as ig  # noqa: E402
from models import ideogram4_serving as serving  # noqa: E402
from models import qad  # noqa: E402
from models import qad_sharded as qs  # noqa: E402

FULL_BLOCKS = ig.IDEOGRAM4.num_layers
GIB = 2**30


# ----------------------------------------------------------------------------------------------------------------
# one trial
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a trial varies."""

    blocks: int
    batch: int
    remat: bool
    master_dtype: str
    opt_dtype: str

    def label(self) -> str:
        return (f"{self.blocks} blocks, batch {self.batch}, remat {'on' if self.remat else 'off'}, master "
                f"{self.master_dtype}, moments {self.opt_dtype}")

    def same_line(self) -> tuple:
        """Trials on one fitted line differ only in the block count."""
        return self.batch, self.remat, self.master_dtype, self.opt_dtype


def sharded_config(args: argparse.Namespace, setting: Setting) -> qs.ShardedQADConfig:
    method = qad.QADConfig(fmt=args.fmt, ste=args.ste, batch_size=setting.batch,
                           schedule=qad.GuidanceSchedule(noisy=7.0, clean=3.0))
    return qs.ShardedQADConfig(qad=method, num_blocks=setting.blocks, text_tokens=args.text_tokens,
                               grid=(args.grid, args.grid), master_dtype=setting.master_dtype,
                               opt_dtype=setting.opt_dtype, compute_dtype=args.compute_dtype,
                               teacher_dtype=args.teacher_dtype, remat=setting.remat,
                               transform_block=args.transform_block, rank=args.rank)


def tree_bytes(tree: Any, per_device: bool) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs with shardings: all of it, or what one device holds."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        if per_device and leaf.sharding is not None:
            shard = leaf.sharding.shard_shape(leaf.shape)
            size = math.prod(shard) * np.dtype(leaf.dtype).itemsize
        total += size
    return total


_RESIDENT: dict[tuple, dict[str, float]] = {}


def resident_bytes(base: ig.Ideogram4Config, args: argparse.Namespace, setting: Setting,
                   mesh: Any) -> dict[str, float]:
    """Per-device GiB of the teacher, the student's trainable parameters (and as much again for their gradients) and
    the optimizer state of ``setting``, counted from the shapes (nothing is allocated). Every block adds the same
    arrays, so counts at 1 and 2 blocks give all the others."""
    if setting.blocks > 2:
        one, two = (resident_bytes(base, args, dataclasses.replace(setting, blocks=b), mesh) for b in (1, 2))
        return {k: one[k] + (setting.blocks - 1) * (two[k] - one[k]) for k in one}
    key = (base, setting, mesh.devices.size)
    if key not in _RESIDENT:
        _RESIDENT[key] = _count_resident(base, args, setting, mesh)
    return _RESIDENT[key]


def _count_resident(base: ig.Ideogram4Config, args: argparse.Namespace, setting: Setting,
                    mesh: Any) -> dict[str, float]:
    program = qs.build(base, sharded_config(args, setting), mesh)
    state, frozen = jax.eval_shape(program.init, jax.random.key(0))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                         program.state_shardings)
    frozen = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), frozen,
                          program.frozen_shardings)
    teacher = tree_bytes(frozen, True) / GIB
    trainable = tree_bytes(state["trainable"], True) / GIB
    moments = tree_bytes(state["opt_state"], True) / GIB
    return {"teacher_gib": teacher, "trainable_gib": trainable, "gradients_gib": trainable, "moments_gib": moments,
            "total_gib": teacher + 2 * trainable + moments}


def _is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _memory(devices: list) -> list[dict[str, float]]:
    return [timing.device_memory_gib(d) for d in devices]


def run_trial(base: ig.Ideogram4Config, args: argparse.Namespace, setting: Setting, mesh: Any,
              high_water: list[float], progress: Any = None) -> dict[str, Any]:
    """Build, create, compile, warm up and time one setting. ``high_water``: the largest peak seen so far (updated).
    ``progress(record)`` is called after each phase with the record so far (status ``"running"``), so that a run
    killed mid-trial keeps what the trial had measured."""
    devices = list(mesh.devices.flat)
    record: dict[str, Any] = {**dataclasses.asdict(setting), "label": setting.label(), "status": "running"}
    progress = progress or (lambda _: None)
    began = time.perf_counter()
    program = state = frozen = batch = compiled = None
    holder: dict[str, Any] = {}
    try:
        record["resident"] = resident_bytes(base, args, setting, mesh)
        program = qs.build(base, sharded_config(args, setting), mesh)
        t0 = time.perf_counter()
        state, frozen = program.init(jax.random.key(args.seed))
        batch = program.make_batch(jax.random.key(args.seed + 1))
        timing.block((state, frozen, batch))
        record["init_s"] = time.perf_counter() - t0
        progress(record)
        in_use = _memory(devices)
        record["memory_after_init_gib"] = in_use
        t0 = time.perf_counter()
        compiled = program.step.lower(state, frozen, batch).compile()
        record["compile_s"] = time.perf_counter() - t0
        progress(record)
        analysis = compiled.memory_analysis()
        if analysis is not None:
            fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                      "generated_code_size_in_bytes")
            record["memory_analysis_gib"] = {f.replace("_size_in_bytes", ""): getattr(analysis, f) / GIB
                                             for f in fields if hasattr(analysis, f)}
            ma = record["memory_analysis_gib"]
            if {"temp", "output", "alias"} <= set(ma):
                # in use before the step (counted from the shapes where the device keeps no statistics) + the step's
                # temporaries + its outputs that do not reuse a donated input
                before = (max(m["bytes_in_use"] for m in in_use) if all("bytes_in_use" in m for m in in_use)
                          else record["resident"]["teacher_gib"] + record["resident"]["trainable_gib"]
                          + record["resident"]["moments_gib"])
                record["step_peak_estimate_gib"] = before + ma["temp"] + ma["output"] - ma["alias"]
        holder["state"] = state
        state = None

        def one_step():
            holder["state"], metrics = compiled(holder["state"], frozen, batch)
            return metrics

        metrics, record["warmup_step_s"] = None, []
        for _ in range(args.warmup):  # compiled ahead of time: each warm-up step is a step, timed on its own
            t0 = time.perf_counter()
            metrics = one_step()
            timing.block((metrics, holder["state"]))
            record["warmup_step_s"].append(time.perf_counter() - t0)
            progress(record)
        record["first_metrics"] = {k: float(v) for k, v in metrics.items()}
        # random weights: a non-finite loss is recorded, the timing and memory still hold
        record["finite"] = bool(all(np.isfinite(v) for v in record["first_metrics"].values()))
        samples = timing.wall_times(one_step, repeats=args.repeats, inner=1,
                                    sync=lambda m: timing.block((m, holder["state"])))
        record["step"] = timing.summary_ms(samples)
        record["step_s"] = statistics.median(samples)
        memory = _memory(devices)
        record["memory_gib"] = memory
        peaks = [m["peak_bytes_in_use"] for m in memory if "peak_bytes_in_use" in m]
        if peaks:
            record["peak_gib"] = max(peaks)
            record["peak_is_own"] = record["peak_gib"] > high_water[0] or not high_water[0]
            record["bytes_limit_gib"] = min(m["bytes_limit"] for m in memory if "bytes_limit" in m)
            high_water[0] = max(high_water[0], record["peak_gib"])
        record["flops"] = step_flops(program, setting)
        record["tflops_per_s"] = record["flops"]["total"] / record["step_s"] / 1e12
        record["status"] = "ok"
    except Exception as err:  # noqa: BLE001 (record and go on: an oom is a result)
        record["status"] = "oom" if _is_oom(err) else "error"
        record["error"] = f"{type(err).__name__}: {err}"[:1500]
        if record["status"] == "error":
            traceback.print_exc()
        memory = _memory(devices)
        peaks = [m["peak_bytes_in_use"] for m in memory if "peak_bytes_in_use" in m]
        if peaks:
            high_water[0] = max(high_water[0], max(peaks))
    finally:
        program = state = frozen = batch = compiled = None
        holder.clear()
        gc.collect()
        jax.clear_caches()
    record["trial_s"] = time.perf_counter() - began
    return record


def step_flops(program: qs.ShardedQAD, setting: Setting) -> dict[str, float]:
    """Matmul FLOPs of one step (``models.ideogram4_serving.forward_flops``; the text projection over the text
    tokens): the teacher's two branches, the student's forward, its backward (twice the forward) and, with remat,
    the blocks' forward again. Analytic; the quantizers, norms and the transform are not counted."""
    cfg = program.config
    tokens, image = cfg.tokens, cfg.grid[0] * cfg.grid[1]
    conditional = serving.forward_flops(program.teacher_config, tokens, cfg.text_tokens)["total"]
    unconditional = serving.forward_flops(program.teacher_config, image, 0)["total"]
    blocks_only = serving.forward_flops(program.student_config, tokens, 0)
    recompute = blocks_only["linears"] + blocks_only["attention"] if setting.remat else 0.0
    teacher = setting.batch * (conditional + unconditional)
    student = setting.batch * (3 * conditional + recompute)
    return {"teacher": teacher, "student": student, "total": teacher + student}


# ----------------------------------------------------------------------------------------------------------------
# fits, search, projection
# ----------------------------------------------------------------------------------------------------------------


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(intercept, slope)`` of ``y = a + b x`` through two or more points of distinct x."""
    xs = np.array([p[0] for p in points], float)
    ys = np.array([p[1] for p in points], float)
    if len(set(xs.tolist())) < 2:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), float(slope)


def peak_of(record: dict) -> float | None:
    """The trial's own peak: the allocator's when it is the trial's own, else the compiled estimate."""
    if record.get("peak_is_own") and "peak_gib" in record:
        return record["peak_gib"]
    return record.get("step_peak_estimate_gib")


def fits_of(trials: list[dict]) -> dict[tuple, dict]:
    """Per setting line (batch, remat, dtypes): the fitted peak and step time against the block count."""
    lines: dict[tuple, list[dict]] = {}
    for rec in trials:
        if rec["status"] == "ok":
            key = (rec["batch"], rec["remat"], rec["master_dtype"], rec["opt_dtype"])
            lines.setdefault(key, []).append(rec)
    out = {}
    for key, recs in lines.items():
        peak = fit_line([(r["blocks"], peak_of(r)) for r in recs if peak_of(r) is not None])
        step = fit_line([(r["blocks"], r["step_s"]) for r in recs])
        out[key] = {"peak": peak, "step": step, "trials": [r["blocks"] for r in recs]}
    return out


def predicted_peak(fit: tuple[float, float], reference: dict, other: dict, blocks: int) -> float:
    """The fitted peak of the reference setting at ``blocks``, moved by the counted resident bytes of ``other``."""
    intercept, slope = fit
    return intercept + slope * blocks + other["total_gib"] - reference["total_gib"]


def largest_fitting(base: ig.Ideogram4Config, args: argparse.Namespace, mesh: Any, fit: tuple[float, float],
                    reference: Setting, setting: Setting, limit_gib: float) -> tuple[int, dict]:
    """The largest block count (<= 34) predicted to fit in ``limit_gib`` (times ``--fill``) for ``setting``."""
    best, details = 0, {}
    for blocks in range(1, FULL_BLOCKS + 1):
        ref = resident_bytes(base, args, dataclasses.replace(reference, blocks=blocks), mesh)
        oth = resident_bytes(base, args, dataclasses.replace(setting, blocks=blocks), mesh)
        peak = predicted_peak(fit, ref, oth, blocks)
        details[blocks] = peak
        if peak <= args.fill * limit_gib:
            best = blocks
    return best, details


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny Ideogram 4 on the CPU (smoke test)")
    p.add_argument("--blocks", default="2,4", help="block counts of the main setting, run in this order")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the number of devices)")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--master-dtype", choices=sorted(qs.DTYPES), default="float32")
    p.add_argument("--opt-dtype", choices=sorted(qs.DTYPES), default="float32")
    p.add_argument("--compute-dtype", choices=sorted(qs.DTYPES), default="bfloat16")
    p.add_argument("--teacher-dtype", choices=sorted(qs.DTYPES), default="bfloat16")
    p.add_argument("--fmt", choices=sorted(qad.FORMATS), default="mxfp4")
    p.add_argument("--ste", choices=("identity", "clipped"), default="identity")
    p.add_argument("--transform-block", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--text-tokens", type=int, default=None, help="default 128 (tiny: 6)")
    p.add_argument("--grid", type=int, default=None, help="image-token grid side (default 64 = 1K; tiny: 4)")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                   help="auto: cuDNN flash attention on a GPU (falls back to xla if the first trial fails in it)")
    p.add_argument("--devices", type=int, default=None, help="use the first N devices (default all)")
    p.add_argument("--search-dtypes", default="", help="master:opt pairs to search the largest block count for")
    p.add_argument("--search-tries", type=int, default=2, help="block counts tried per searched pair (one fewer "
                   "after an oom)")
    p.add_argument("--search-batch", action="store_true", help="double the batch at the largest block count")
    p.add_argument("--fill", type=float, default=0.97, help="fraction of the memory limit a prediction may use")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="the limit the search predicts against (default: the device's bytes_limit)")
    p.add_argument("--max-batch", type=int, default=64, help="--search-batch stops here")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=None, help="start no trial that would end after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/qad_step.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.text_tokens = 6 if args.text_tokens is None else args.text_tokens
        args.grid = 4 if args.grid is None else args.grid
    args.text_tokens = 128 if args.text_tokens is None else args.text_tokens
    args.grid = 64 if args.grid is None else args.grid
    for pair in filter(None, args.search_dtypes.split(",")):
        master, _, opt = pair.partition(":")
        if master not in qs.DTYPES or opt not in qs.DTYPES:
            p.error(f"--search-dtypes: {pair!r} is not master:opt with dtypes from {sorted(qs.DTYPES)}")
    try:
        args.block_list = [int(b) for b in args.blocks.split(",") if b]
    except ValueError:
        p.error(f"--blocks {args.blocks!r}: a comma-separated list of block counts")
    if not args.block_list or min(args.block_list) < 1:
        p.error(f"--blocks {args.blocks!r}: give at least one block count >= 1")
    if args.warmup < 1 or args.repeats < 1:
        p.error(f"--warmup {args.warmup} and --repeats {args.repeats} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    devices = jax.devices()[:args.devices] if args.devices else jax.devices()
    if args.devices and len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {len(devices)} device(s) present")
    mesh = qs.make_mesh(devices)
    n_dev = len(devices)
    batch = n_dev if args.batch is None else args.batch
    if batch % n_dev:
        raise SystemExit(f"--batch {batch} must be a multiple of the {n_dev} devices")
    on_gpu = devices[0].platform == "gpu"
    attention = ("cudnn" if on_gpu else "xla") if args.attention == "auto" else args.attention
    architecture = ig.tiny_config() if args.tiny else ig.IDEOGRAM4
    base = dataclasses.replace(architecture, attention_impl=attention)
    main_setting = Setting(args.block_list[0], batch, args.remat, args.master_dtype, args.opt_dtype)

    import flax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    payload: dict[str, Any] = {
        "what": "QAD training step of Ideogram 4 (W4A4 fake-quant student + frozen teacher, both CFG branches), "
                "random weights, models.qad_sharded",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": devices[0].device_kind, "platform": devices[0].platform, "num_devices": n_dev,
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
        "python": platform.python_version(), "argv": sys.argv[1:] if argv is None else list(argv),
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "architecture": "tiny" if args.tiny else "IDEOGRAM4", "attention_impl": attention,
        "tokens": {"text": args.text_tokens, "image": args.grid**2, "total": args.text_tokens + args.grid**2},
        "fixed": {"fmt": args.fmt, "ste": args.ste, "compute_dtype": args.compute_dtype,
                  "teacher_dtype": args.teacher_dtype, "transform_block": args.transform_block, "rank": args.rank},
        "trials": [], "skipped": [], "fits": [], "searches": [], "projection": {},
    }
    high_water = [0.0]

    def save():
        atomic_write_json(args.out, payload)

    def budget_allows(setting: Setting) -> bool:
        if args.budget_s is None or not payload["trials"]:
            return True
        estimate = max(r["trial_s"] for r in payload["trials"])
        if time.perf_counter() - started + estimate > args.budget_s:
            payload["skipped"].append({**dataclasses.asdict(setting), "reason": f"budget: {estimate:.0f} s more "
                                       f"would pass --budget-s {args.budget_s:g}"})
            save()
            return False
        return True

    def trial(setting: Setting) -> dict | None:
        nonlocal base
        if not budget_allows(setting):
            return None
        print(f"[{time.perf_counter() - started:6.1f} s] {setting.label()} ...", flush=True)
        payload["trials"].append(None)  # the running trial's place

        def progress(partial: dict) -> None:
            payload["trials"][-1] = {**partial, "trial_s": time.perf_counter() - began}
            save()

        began = time.perf_counter()
        record = run_trial(base, args, setting, mesh, high_water, progress)
        payload["trials"].pop()
        failed_in_cudnn = any(w in record.get("error", "").lower() for w in ("cudnn", "flash", "dot_product"))
        if (record["status"] == "error" and failed_in_cudnn and base.attention_impl == "cudnn"
                and args.attention == "auto" and not payload["trials"]):
            payload["cudnn_error"] = record.get("error")
            base = dataclasses.replace(base, attention_impl="xla")
            payload["attention_impl"] = "xla (cudnn failed in the first trial)"
            payload["trials"].append(None)
            record = run_trial(base, args, setting, mesh, high_water, progress)
            payload["trials"].pop()
        payload["trials"].append(record)
        save()
        shown = {k: record.get(k) for k in ("status", "step_s", "peak_gib", "step_peak_estimate_gib", "compile_s")}
        print(f"    {shown}", flush=True)
        return record

    for blocks in args.block_list:
        trial(dataclasses.replace(main_setting, blocks=blocks))

    # the peak against the block count in the main setting: fitted, or one point and the counted bytes per block
    main_fit = fits_of(payload["trials"]).get(main_setting.same_line())
    main_ok = [r for r in payload["trials"] if r["status"] == "ok" and peak_of(r) is not None
               and (r["batch"], r["remat"], r["master_dtype"], r["opt_dtype"]) == main_setting.same_line()]
    peak_line = None
    if main_fit is not None and main_fit["peak"] is not None:
        peak_line = {"intercept_slope": main_fit["peak"], "source": f"fitted to blocks {main_fit['trials']}"}
    elif main_ok:
        point = main_ok[-1]
        one, two = (resident_bytes(base, args, dataclasses.replace(main_setting, blocks=b), mesh) for b in (1, 2))
        slope = two["total_gib"] - one["total_gib"]
        peak_line = {"intercept_slope": (peak_of(point) - slope * point["blocks"], slope),
                     "source": f"the measured peak at {point['blocks']} blocks and the counted parameter, gradient "
                               "and moment bytes per block (saved activations not counted)"}
    payload["peak_line"] = peak_line
    limit = args.memory_limit_gib or next((r["bytes_limit_gib"] for r in payload["trials"]
                                           if "bytes_limit_gib" in r), None)
    payload["memory_limit_gib"] = limit
    for pair in filter(None, args.search_dtypes.split(",")):
        master, _, opt = pair.partition(":")
        search: dict[str, Any] = {"master_dtype": master, "opt_dtype": opt, "tried": []}
        payload["searches"].append(search)
        if peak_line is None or limit is None:
            search["note"] = "no peak line (needs a measured trial) or no device memory limit"
            continue
        setting = dataclasses.replace(main_setting, master_dtype=master, opt_dtype=opt)
        predicted, details = largest_fitting(base, args, mesh, peak_line["intercept_slope"], main_setting, setting,
                                             limit)
        search["predicted_largest_blocks"] = predicted
        search["predicted_peak_gib"] = {str(k): v for k, v in details.items()}
    save()  # the predictions stand even if no search trial fits in the budget
    for search in payload["searches"]:
        blocks = search.get("predicted_largest_blocks", 0)
        setting = dataclasses.replace(main_setting, master_dtype=search["master_dtype"],
                                      opt_dtype=search["opt_dtype"])
        for _ in range(args.search_tries):
            if blocks < 1:
                break
            done = [r for r in payload["trials"] if r["status"] in ("ok", "oom")
                    and Setting(r["blocks"], r["batch"], r["remat"], r["master_dtype"], r["opt_dtype"])
                    == dataclasses.replace(setting, blocks=blocks)]
            record = done[-1] if done else trial(dataclasses.replace(setting, blocks=blocks))
            if record is None:
                break
            search["tried"].append({"blocks": blocks, "status": record["status"], "measured_before": bool(done)})
            if record["status"] == "ok":
                search["largest_blocks_measured"] = blocks
                break
            if record["status"] != "oom":
                break
            blocks -= 1
        save()

    if args.search_batch:
        ran = [r for r in payload["trials"] if r["status"] == "ok" and (r["remat"], r["master_dtype"],
               r["opt_dtype"]) == (main_setting.remat, main_setting.master_dtype, main_setting.opt_dtype)]
        if ran:
            blocks = max(r["blocks"] for r in ran)
            largest, stopped_by = batch, f"--max-batch {args.max_batch}"
            while largest * 2 <= args.max_batch:
                record = trial(dataclasses.replace(main_setting, blocks=blocks, batch=largest * 2))
                if record is None or record["status"] != "ok":
                    stopped_by = "--budget-s" if record is None else record["status"]
                    break
                largest *= 2
            payload["largest_batch"] = {"blocks": blocks, "batch": largest, "stopped_by": stopped_by}

    fits = fits_of(payload["trials"])
    payload["fits"] = [{"batch": k[0], "remat": k[1], "master_dtype": k[2], "opt_dtype": k[3],
                        "blocks_measured": v["trials"],
                        "peak_gib_intercept_slope": v["peak"], "step_s_intercept_slope": v["step"]}
                       for k, v in fits.items()]
    projection = {}
    for k, v in fits.items():
        if v["peak"] is None or v["step"] is None:
            continue
        name = f"batch{k[0]}_remat{'on' if k[1] else 'off'}_{k[2]}_{k[3]}"
        projection[name] = {"blocks": FULL_BLOCKS, "peak_gib": v["peak"][0] + v["peak"][1] * FULL_BLOCKS,
                            "step_s": v["step"][0] + v["step"][1] * FULL_BLOCKS,
                            "per_block_peak_gib": v["peak"][1], "per_block_step_s": v["step"][1],
                            "from_blocks": v["trials"], "note": "a projection from the fitted line, not measured"}
    payload["projection"] = projection
    ok = [r for r in payload["trials"] if r["status"] == "ok"]
    if ok:
        best = max(ok, key=lambda r: (r["blocks"], r["batch"]))
        suffix = "1gpu" if n_dev == 1 else f"{n_dev}gpu"
        peak = peak_of(best)
        payload["headline"] = {f"ideogram4_qad_step_s_{suffix}": best["step_s"],
                               ("ideogram4_qad_peak_gib_1gpu" if n_dev == 1 else
                                f"ideogram4_qad_peak_gib_per_gpu_{suffix}"): peak,
                               "record": best["label"]}
    payload["total_s"] = time.perf_counter() - started
    save()
    print(f"{'setting':<72} {'status':>6} {'step s':>8} {'peak GiB':>9} {'TFLOP/s':>8}")
    for r in payload["trials"]:
        peak = peak_of(r) if r["status"] == "ok" else None
        print(f"{r['label']:<72} {r['status']:>6} {r.get('step_s', float('nan')):8.3f} "
              f"{peak if peak is not None else float('nan'):9.2f} {r.get('tflops_per_s', float('nan')):8.1f}")
    for name, proj in projection.items():
        print(f"projection ({name}) at {FULL_BLOCKS} blocks: peak {proj['peak_gib']:.1f} GiB, step "
              f"{proj['step_s']:.2f} s (from blocks {proj['from_blocks']})")
    print(f"wrote {args.out} ({payload['total_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

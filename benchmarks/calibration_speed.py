"""Calibration speed: every linear layer of a PixArt-Σ-shaped model, KroQuant (100 Adam steps) + LoRaQ, vmapped
engine vs. a plain per-layer Python loop over the same engine stages.

Layers: 28 blocks x 10 quantized linears (self-attn q/k/v/out, cross-attn q/k/v/out, ff up 1152->4608, ff down
4608->1152; cross k/v read the projected 1152-wide caption features, as in the real model; ``--text-dim 4096`` for
4096-wide ones). Data: synthetic DiT-like layers (:mod:`kroquant_jax.synthetic`); to keep data generation out of the
device budget, one block's 10 layers are generated and reused by all blocks (the timing does not depend on values).

Timed stages (per layer): ``calibrate_layers`` (KroQuant, Hadamard init, held-out safeguard) and ``loraq_layers`` on
the transformed weight (Adam fit + Cayley rotation). The vmapped engine stacks equal shapes; the loop runs the same
stages with one layer per program (``max_layers_per_program=1``), over ``--loop-blocks`` blocks, extrapolated
linearly to all blocks (said so in the output). Each mode is run once cold (compilation included) and once warm.

Usage (CPU validation):  python -m benchmarks.calibration_speed --preset tiny
Device:                   python -m benchmarks.calibration_speed --out $OUT/calibration_speed.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kroquant_jax import calibrate, lowrank, synthetic, transforms  # noqa: E402
from kroquant_jax.layerset import atomic_write_bytes  # noqa: E402

PRESETS = {
    "pixart": dict(blocks=28, d=1152, ffn=4608, rows=1024, heldout=256, steps=100, rank=128, loraq_steps=500,
                   rotation_steps=500, loop_blocks=2),
    "tiny": dict(blocks=3, d=64, ffn=128, rows=96, heldout=32, steps=5, rank=32, loraq_steps=5, rotation_steps=3,
                 loop_blocks=2),
}


def peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def build_layers(args) -> dict:
    block0 = synthetic.pixart_sigma_shapes(1, args.d, args.ffn, args.text_dim)
    base = synthetic.synthetic_layer_set(block0, n=args.rows + args.heldout, seed=0)
    layers = {}
    for b in range(args.blocks):
        for name, layer in base.items():
            layers[name.replace("transformer_blocks.0.", f"transformer_blocks.{b}.")] = layer
    return layers


def run_engine(layers, args, per_layer_programs: bool):
    """KroQuant calibration + LoRaQ; returns (seconds, mean held-out error of the transform)."""
    chunk = 1 if per_layer_programs else args.max_layers_per_program
    cal = calibrate.CalibrationConfig(transform="kron_lu", steps=args.steps, num_rows=args.rows,
                                      num_heldout=args.heldout, max_layers_per_program=chunk,
                                      shard=not per_layer_programs, objective=calibrate.objectives.ObjectiveConfig(
                                          precision=args.precision))
    lq = lowrank.LoRaQConfig(rank=args.rank, steps=args.loraq_steps, rotation_steps=args.rotation_steps,
                             max_layers_per_program=chunk, shard=not per_layer_programs)
    t0 = time.perf_counter()
    per_layer_seconds = {}
    if per_layer_programs:
        results, branches = {}, {}
        for name, layer in layers.items():  # a plain Python loop, one layer at a time
            t_layer = time.perf_counter()
            r = calibrate.calibrate_layers({name: layer}, cal)[name]
            p = transforms.get("kron_lu")
            w_t = np.asarray(transforms.apply_to_weights(jnp.asarray(layer.weight), p.inverse_blocks(r.params)))
            branches.update(lowrank.loraq_layers({name: w_t}, lq))
            results[name] = r
            per_layer_seconds[name] = time.perf_counter() - t_layer
    else:
        results = calibrate.calibrate_layers(layers, cal)
        print(f"  calibrate_layers (KroQuant) done at {time.perf_counter() - t0:.1f} s", flush=True)
        p = transforms.get("kron_lu")
        w_t = {n: np.asarray(transforms.apply_to_weights(jnp.asarray(layers[n].weight),
                                                         p.inverse_blocks(results[n].params))) for n in layers}
        branches = lowrank.loraq_layers(w_t, lq)
        print(f"  loraq_layers done at {time.perf_counter() - t0:.1f} s", flush=True)
    seconds = time.perf_counter() - t0
    return seconds, per_layer_seconds, {
        "transform_heldout_error_mean": float(np.mean([r.heldout_error for r in results.values()])),
        "hadamard_heldout_error_mean": float(np.mean([r.heldout_errors["init0"] for r in results.values()])),
        "loraq_weight_error_mean": float(np.mean([float(b.error_final) for b in branches.values()])),
        "loraq_init_weight_error_16bit_branch_mean": float(np.mean([float(b.error_init) for b in branches.values()])),
        "no_branch_weight_error_mean": float(np.mean([float(lowrank.weight_error(jnp.asarray(
            transforms.apply_to_weights(jnp.asarray(layers[n].weight), transforms.get("kron_lu").inverse_blocks(
                results[n].params))), None, None)) for n in branches])),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="pixart")
    ap.add_argument("--text-dim", type=int, default=None, help="input width of cross-attn k/v (default: d)")
    ap.add_argument("--max-layers-per-program", type=int, default=64)
    ap.add_argument("--precision", default="highest", choices=["highest", "high", "default"])
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument("--time-budget", type=float, default=250.0, help="seconds; the warm vmapped rerun (last) is "
                    "skipped when it would not fit")
    ap.add_argument("--out", default="benchmarks/results/calibration_speed.json")
    for k, v in PRESETS["pixart"].items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"(pixart preset: {v})")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    dev = jax.local_devices()[0]
    record = {
        "benchmark": "calibration_speed", "preset": args.preset,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "jax_version": jax.__version__, "device": dev.device_kind, "platform": dev.platform,
        "num_local_devices": jax.local_device_count(),
        "config": {k: getattr(args, k) for k in ("blocks", "d", "ffn", "text_dim", "rows", "heldout", "steps", "rank",
                                                  "loraq_steps", "rotation_steps", "loop_blocks",
                                                  "max_layers_per_program", "precision")},
    }

    def save():
        atomic_write_bytes(args.out, (json.dumps(record, indent=2) + "\n").encode())

    t0 = time.perf_counter()
    layers = build_layers(args)
    record["num_layers"] = len(layers)
    record["layer_shapes"] = sorted({f"{l.weight.shape[0]}x{l.weight.shape[1]}" for l in layers.values()})
    record["data_seconds"] = round(time.perf_counter() - t0, 2)
    print(f"{len(layers)} layers, shapes {record['layer_shapes']}, data {record['data_seconds']} s", flush=True)
    save()

    start = time.perf_counter()
    sec, _, quality = run_engine(layers, args, per_layer_programs=False)
    record["vmapped_cold_seconds"] = round(sec, 2)
    record["vmapped_quality"] = quality
    record["peak_bytes_in_use"] = peak_bytes()
    print(f"vmapped engine (cold): {sec:.1f} s, peak {record['peak_bytes_in_use']} B, {quality}", flush=True)
    save()

    if not args.skip_loop:
        # Blocks 0 .. loop_blocks-1 in a plain loop; block 0 compiles every shape's programs, the later blocks run
        # compiled programs: their per-layer times are extrapolated to the whole model.
        subset = {n: layers[n] for n in layers if int(n.split(".")[1]) < args.loop_blocks}
        sec, per_layer, _ = run_engine(subset, args, per_layer_programs=True)
        warm = [t for n, t in per_layer.items() if int(n.split(".")[1]) >= 1]
        record["loop_seconds_subset"] = round(sec, 2)
        record["loop_subset_layers"] = len(subset)
        record["loop_warm_layers"] = len(warm)
        record["loop_warm_seconds_per_block"] = round(sum(warm) / max(1, args.loop_blocks - 1), 3)
        record["loop_extrapolated_seconds"] = round(record["loop_warm_seconds_per_block"] * args.blocks, 2)
        record["loop_note"] = (f"plain per-layer loop over {len(subset)} layers ({args.loop_blocks} blocks); block 0 "
                               f"compiles, the {len(warm)} layers of the later block(s) run compiled: their time per "
                               f"block x {args.blocks} blocks is the extrapolated loop time")
        print(f"loop: {sec:.1f} s over {len(subset)} layers; extrapolated {record['loop_extrapolated_seconds']} s",
              flush=True)
        save()

    if time.perf_counter() - start + record["vmapped_cold_seconds"] > args.time_budget:
        record["vmapped_warm_skipped"] = "time budget"
    else:
        sec, _, _ = run_engine(layers, args, per_layer_programs=False)
        record["vmapped_warm_seconds"] = round(sec, 2)
        print(f"vmapped engine (warm): {sec:.1f} s", flush=True)
    vm = record.get("vmapped_warm_seconds", record["vmapped_cold_seconds"])
    if "loop_extrapolated_seconds" in record:
        record["speedup"] = round(record["loop_extrapolated_seconds"] / vm, 2)
        record["speedup_note"] = ("extrapolated compiled loop / vmapped engine "
                                  + ("warm" if "vmapped_warm_seconds" in record else "cold (compilation included)"))
        print(f"speed-up {record['speedup']}x ({record['speedup_note']})", flush=True)
    record["peak_bytes_in_use"] = peak_bytes()
    save()
    print(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    main()

"""`kroquant generate` of one quantized checkpoint folder through every W4A4 strategy, against the simulated path.

    python benchmarks/generate_served.py --checkpoint Q --prompts P.npz --out OUT.json \
        [--strategies simulate dequant kernel fp8] [--max-prompts 8]

Runs ``scripts.generate.main`` once per strategy (on a GPU: the compiled served kernels of ``pallas_kernels.served``;
``simulate`` is the fake-quant f32 reference) with the same prompts and seeds, and records per strategy the wall time
of the whole call (loading and compilation included: this is a check that the user path runs, not a speed figure)
and the relative L2 difference of its latents from the simulated ones, with the image PSNR when the latents are the
testbed's pixels. Writes the JSON record to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="quantized checkpoint folder (kroquant quantize-checkpoint)")
    p.add_argument("--prompts", required=True, help="prompt-embedding .npz (kroquant generate --prompts)")
    p.add_argument("--out", required=True, help="JSON record to write")
    p.add_argument("--strategies", nargs="+", default=["simulate", "simulate@bfloat16", "dequant", "kernel", "mgpu", "fp8", "fp8_w4a8"],
                   help="simulate first: the others are compared with it; STRATEGY@DTYPE runs the model in DTYPE "
                        "(simulate@bfloat16: the same fake-quant numerics on a bf16 model, i.e. how far bf16 "
                        "activations alone move the samples)")
    p.add_argument("--max-prompts", type=int, default=8, help="prompts generated per strategy")
    args = p.parse_args(argv)
    if args.strategies[0] != "simulate":  # the f32 fake-quant reference
        p.error("--strategies must start with simulate (the reference the others are compared with)")

    import jax

    from kroquant_jax.fileio import atomic_write_json
    from models import image_metrics
    from models.testbed.model import pixels_to_images
    from scripts import generate

    record = {"checkpoint": args.checkpoint, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date_utc": time.strftime("%Y-%m-%dT%H:%M", time.gmtime()), "strategies": {}}
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.strategies:
            strategy, _, dtype = spec.partition("@")
            out = Path(tmp) / spec
            began = time.perf_counter()
            try:
                info = generate.main(["--checkpoint", args.checkpoint, "--prompts", args.prompts, "--out", str(out),
                                      "--max-prompts", str(args.max_prompts), "--strategy", strategy, "--quiet",
                                      *(["--dtype", dtype] if dtype else [])])
            except Exception as err:  # a strategy that fails is recorded, the others still run
                record["strategies"][spec] = {"status": "error", "error": f"{type(err).__name__}: {err}"}
                print(f"{spec:17s} error: {err}", flush=True)
                atomic_write_json(args.out, record)
                continue
            wall = time.perf_counter() - began
            with np.load(out / "latents.npz") as f:
                latents = f["latents"]
            entry = {"status": "ok", "wall_s_with_compile": round(wall, 1), "finite": bool(np.isfinite(latents).all()),
                     **{k: info[k] for k in ("solver", "steps", "prompts")}}
            if reference is None:
                reference = latents
            else:
                entry["rel_l2_vs_simulate"] = float(np.linalg.norm(latents - reference) / np.linalg.norm(reference))
                if latents.shape[1] == 3:  # pixel-space testbed: image PSNR against the simulated images
                    psnr = image_metrics.psnr(pixels_to_images(latents), pixels_to_images(reference), data_range=255.0)
                    entry["psnr_vs_simulate_db"] = float(np.mean(np.minimum(psnr, 99.0)))  # 99: identical
            record["strategies"][spec] = entry
            print(f"{spec:17s} {json.dumps(entry)}", flush=True)
            atomic_write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

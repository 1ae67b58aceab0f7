"""How often MXFP4 rows exceed the 14 binades that E4M3 holds (``kroquant_jax.fp8_encoding``), on real data.

* The emoji testbed (``checkpoints/emoji_pixart``): activations of every quantizable linear captured during
  flow-matching sampling (``models.testbed.evaluation.capture_flow_layer_set``, a few training captions and steps), raw and
  after the 32-point Hadamard; the trained weights, raw and as ``W T^{-T}`` with the Hadamard.
* Every ported model family (PixArt-Sigma, SANA, FLUX.1, Ideogram 4) at a small size with its random init: the
  weights of every quantizable linear (zero-padded to a multiple of 32 where narrower).

Per set: rows, rows in range (span <= 14), the largest span, a span histogram, elements the out-of-range policy
would round. CPU; writes one JSON.

    python -m scripts.fp8_spans --out benchmarks/results/fp8_spans.json
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kroquant_jax import fp8_encoding as FE
from kroquant_jax import transforms as T
from kroquant_jax.fileio import atomic_write_json
from kroquant_jax.formats import MXFP4, quantize
from models import families, flux, ideogram4, pixart, sana
from models.testbed import data as testbed_data
from models.testbed.evaluation import capture_flow_layer_set
from models.layers import linears

SMALL_CONFIGS = {
    "pixart_sigma": lambda: families.PIXART.build(pixart.PixArtConfig(
        num_attention_heads=3, attention_head_dim=32, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=96, sample_size=8, patch_size=2, caption_channels=64, use_additional_conditions=True,
        interpolation_scale=1)),
    "sana": lambda: families.SANA.build(sana.SanaConfig(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=64,
        mlp_ratio=2.5, sample_size=8, patch_size=1)),
    "flux1": lambda: families.FLUX.build(flux.FluxConfig(
        in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
        joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(8, 12, 12))),
    "ideogram4": lambda: ideogram4.Ideogram4Transformer(
        ideogram4.tiny_config(intermediate_size=128, llm_features_dim=64), rngs=nnx.Rngs(0)),
}


def stats(x: jax.Array) -> dict:
    """``fp8_encoding.span_stats`` of ``x (rows, d)`` quantized to MXFP4 (zero-padded to a multiple of 32)."""
    return FE.span_stats(quantize(jnp.asarray(x, jnp.float32), MXFP4(), pad=True))


def hadamard(x: jax.Array) -> jax.Array:
    """``x H`` with the 32-point normalised Hadamard per block (``x (rows, d)``, d a multiple of 32)."""
    p = T.get("hadamard32")
    return T.apply_to_activations(jnp.asarray(x, jnp.float32), p.blocks(p.init(x.shape[-1])))


def merge(records: list[dict]) -> dict:
    """Sum of several ``span_stats`` records."""
    hist: dict[int, int] = {}
    for r in records:
        for s, c in r["span_histogram"].items():
            hist[int(s)] = hist.get(int(s), 0) + c
    rows = sum(r["rows"] for r in records)
    inside = sum(r["rows_in_range"] for r in records)
    return {"sets": len(records), "rows": rows, "rows_in_range": inside, "fraction_in_range": inside / max(rows, 1),
            "max_span": max((r["max_span"] for r in records), default=0),
            "span_histogram": dict(sorted(hist.items())),
            "inexact_elements": sum(r["inexact_elements"] for r in records),
            "elements": sum(r["elements"] for r in records)}


def testbed(checkpoint: str, captions: int, steps: int, rows: int, seed: int) -> dict:
    dataset = testbed_data.load_dataset(str(Path(checkpoint) / "testbed_prompts.npz"))
    _, model = families.PIXART.from_diffusers(checkpoint, "float32")
    names = list(linears(model, quantizable_only=True))
    indices = np.flatnonzero(~dataset.heldout)[:captions]
    layer_set = capture_flow_layer_set(model, dataset, indices, names, steps=steps, guidance=3.0,
                                       rows_per_layer=rows, seed=seed, batch_size=captions)
    per_layer, sets = {}, {"activations_raw": [], "activations_hadamard32": [], "weights_raw": [],
                           "weights_hadamard32": []}
    for name, (w, _, a) in layer_set.items():
        a = jnp.asarray(a, jnp.float32)
        w = jnp.asarray(w, jnp.float32)
        rec = {"activations_raw": stats(a), "activations_hadamard32": stats(hadamard(a)), "weights_raw": stats(w),
               "weights_hadamard32": stats(hadamard(w))}  # W T^{-T} = W H for the orthonormal symmetric H
        per_layer[name] = {k: {kk: v[kk] for kk in ("rows", "rows_in_range", "max_span")} for k, v in rec.items()}
        for k, v in rec.items():
            sets[k].append(v)
    return {"checkpoint": checkpoint, "captions": int(len(indices)), "steps": steps, "rows_per_layer": rows,
            "layers": len(layer_set), "summary": {k: merge(v) for k, v in sets.items()}, "per_layer": per_layer}


def random_models() -> dict:
    out = {}
    for family, build in SMALL_CONFIGS.items():
        model = build()
        recs = {name: stats(lin.kernel[...].T) for name, lin in linears(model, quantizable_only=True).items()}
        out[family] = {"summary": merge(list(recs.values())),
                       "per_layer": {n: {k: r[k] for k in ("rows", "rows_in_range", "max_span")}
                                     for n, r in recs.items()}}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/fp8_spans.json")
    p.add_argument("--checkpoint", default="checkpoints/emoji_pixart")
    p.add_argument("--captions", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows-per-layer", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "platform": jax.default_backend(), "e4m3_span": FE.E4M3_SPAN,
              "random_models": random_models()}
    atomic_write_json(args.out, result)
    result["testbed"] = testbed(args.checkpoint, args.captions, args.steps, args.rows_per_layer, args.seed)
    atomic_write_json(args.out, result)
    for k, v in result["testbed"]["summary"].items():
        print(f"testbed {k:24s} rows {v['rows']:7d} in range {v['fraction_in_range']:.4%} max span {v['max_span']}")
    for k, v in result["random_models"].items():
        s = v["summary"]
        print(f"random {k:14s} weight rows {s['rows']:6d} in range {s['fraction_in_range']:.4%} max span "
              f"{s['max_span']}")
    return result


if __name__ == "__main__":
    main()

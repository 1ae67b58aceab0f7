"""How well the emoji testbed generalises to held-out captions, by kind of held-out record.

    python -m scripts.testbed_generalisation --data data/emoji32.npz --out runs/generalisation --per-group 32

The fixed split (``models.testbed_data.is_heldout``) holds out about 5% of the glyphs by a hash of their sequence.
Two kinds of held-out record come out of that rule:

* **sibling in training**: a variant whose base emoji (``models.testbed_data.base_sequence``: skin tones and gender
  signs removed) is also the base of a training record, e.g. ``thumbs up sign, medium skin tone`` when other tones
  of the thumbs up are trained: a seen concept with a seen modifier;
* **novel concept**: nothing in training shares its base (``gear``, ``coffin``, most flags).

For the first ``--per-group`` held-out records of each kind (record order, not picked by hand) this generates the
16-bit model's image (flow-matching Euler, CFG, per-record seed as in ``scripts.eval_testbed``) and finds the nearest
image of the whole dataset (pixel MSE): the record's own glyph, a sibling (same base: right concept, other
tone/gender), or another emoji. Writes ``report.json`` and ``grid.png`` (rows: caption, target, generated, nearest)
atomically. Needs the full dataset file (``scripts.build_emoji_dataset``), numpy and jax only.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from kroquant_jax.fileio import atomic_write_text
from models import pixart, testbed, testbed_data
from models.emoji_metrics import OUTCOMES, nearest_outcome
from scripts.eval_testbed import DEFAULT_CHECKPOINT, flow_sampler, generate

GROUPS = ("sibling in training", "novel concept")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the full dataset .npz (scripts.build_emoji_dataset)")
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="diffusers PixArt directory")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--per-group", type=int, default=32, help="held-out records generated per kind")
    parser.add_argument("--grid-rows", type=int, default=12, help="rows per kind in grid.png")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1000, help="noise seed (eval_testbed's evaluation seed)")
    parser.add_argument("--batch-size", type=int, default=16)
    return parser.parse_args(argv)


def heldout_groups(dataset: testbed_data.EmojiDataset) -> dict[str, np.ndarray]:
    """``{kind: indices of held-out records}`` in record order (see the module docstring)."""
    bases = [testbed_data.base_sequence(testbed_data.text_to_sequence(s)) for s in dataset.sequences]
    trained = {base for base, held in zip(bases, dataset.heldout) if not held}
    held = np.flatnonzero(dataset.heldout)
    return {GROUPS[0]: np.array([i for i in held if bases[i] in trained], dtype=np.int64),
            GROUPS[1]: np.array([i for i in held if bases[i] not in trained], dtype=np.int64)}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dataset = testbed_data.load_dataset(args.data)
    groups = {kind: indices[:args.per_group] for kind, indices in heldout_groups(dataset).items()}
    cfg, model = pixart.from_diffusers(args.checkpoint, "float32")
    graphdef, state = nnx.split(model)
    sample = flow_sampler(graphdef, args.steps, args.guidance, cfg.in_channels)
    pool = dataset.images.astype(np.float32) / 255  # (n, s, s, 3)
    bases = [testbed_data.base_sequence(testbed_data.text_to_sequence(s)) for s in dataset.sequences]
    report = {"settings": (f"{args.checkpoint}, {args.data}: first {args.per_group} held-out records per kind, "
                           f"{args.steps} Euler steps, CFG {args.guidance:g}, seed {args.seed}; nearest image by "
                           f"pixel MSE over all {dataset.num_examples} records; jax {jax.__version__} on "
                           f"{jax.devices()[0].platform}"), "groups": {}}
    captions, rows = [], []
    for kind, indices in groups.items():
        images = np.concatenate([generate(sample, state, dataset, indices[k:k + args.batch_size], args.seed,
                                          cfg.in_channels, cfg.sample_size)
                                 for k in range(0, len(indices), args.batch_size)])  # (n, s, s, 3)
        counts, mses, records = collections.Counter(), [], []
        for image, target in zip(images, indices):
            outcome, nearest, mse = nearest_outcome(image, int(target), dataset, pool, bases)
            counts[outcome] += 1
            mses.append(mse)
            records.append({"caption": str(dataset.captions[target]), "outcome": outcome,
                            "nearest": str(dataset.captions[nearest]), "mse_to_target": round(mse, 5)})
            if len(records) <= args.grid_rows:
                captions.append(f"[{kind}] {dataset.captions[target]}")
                rows.append([dataset.images[target], image, dataset.images[nearest]])
        report["groups"][kind] = {"records": len(indices), **{o: counts[o] for o in OUTCOMES},
                                  "mse_to_target_median": float(np.median(mses)), "per_record": records}
        print(f"{kind}: {len(indices)} records; nearest = own glyph {counts[OUTCOMES[0]]}, sibling "
              f"{counts[OUTCOMES[1]]}, other emoji {counts[OUTCOMES[2]]}; median MSE to target "
              f"{np.median(mses):.4f}", flush=True)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    testbed.save_caption_grid(str(out / "grid.png"), captions, rows, ["dataset", "generated", "nearest"],
                              title="held-out captions: 16-bit testbed samples and their nearest dataset image")
    return 0


if __name__ == "__main__":
    sys.exit(main())

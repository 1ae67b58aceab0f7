"""An existing layer set of the testbed with its cross-attention keys' / values' rows from many captions.

    python benchmarks/cross_attention_rows.py --layer-set runs/ptq_stores/layer_set.safetensors \
        --data runs/emoji32.npz --out runs/xattn/layer_set.safetensors [--all-layers]
    kroquant calibrate --layers runs/xattn/layer_set.safetensors --methods hadamard32 kroquant smoothquant \
        smoothed_kroquant --calib-rows 1024 --calib-validation 512

In PixArt the input of every block's ``attn2.to_k`` / ``attn2.to_v`` is the caption projection of the text embedding:
it does not depend on the image or the denoising step, so a capture from a few sampled captions holds only their
tokens. A new capture does better with ``kroquant evaluate --text-rows-from-all-prompts --text-prompts DATA``
(``models.capture``: ``CaptureConfig.text_rows_from_all_prompts``); this main upgrades a layer set captured without
it, without sampling again: ``models.capture.text_only_rows`` of every distinct training caption of ``--data``
(``models.testbed.evaluation.training_caption_text``) plus the empty caption (the unconditional CFG branch),
de-duplicated, in a seeded random order (all of them, or ``--rows`` of them), become the rows of the ``attn2.to_k`` /
``attn2.to_v`` layers of ``--layer-set`` (whose weights must be ``--checkpoint``'s). Writes those layers alone, or with
``--all-layers`` every layer of ``--layer-set`` (the others unchanged).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "emoji_pixart"), help="diffusers PixArt folder")
    p.add_argument("--layer-set", required=True, help="captured layer set (.safetensors) of the same checkpoint")
    p.add_argument("--data", required=True, help="dataset .npz (kroquant build-emoji-dataset): its training captions")
    p.add_argument("--out", required=True, help="layer set to write (.safetensors)")
    p.add_argument("--rows", type=int, default=None, help="rows kept per layer (default: every distinct row)")
    p.add_argument("--seed", type=int, default=0, help="seed of the row order (and of the --rows subset)")
    p.add_argument("--all-layers", action="store_true",
                   help="write every layer of --layer-set, not only the cross-attention keys / values")
    args = p.parse_args(argv)
    if args.rows is not None and args.rows < 1:
        p.error(f"--rows {args.rows}: must be >= 1")

    import numpy as np

    from kroquant_jax import layerset, provenance
    from models import capture, families
    from models.layers import linears
    from models.testbed import data as testbed_data
    from models.testbed.evaluation import training_caption_text

    source = layerset.load_layer_set(args.layer_set)
    _, model = families.PIXART.from_diffusers(args.checkpoint, "float32")
    names = [n for n in families.PIXART.text_only.layers(model) if n in source]
    if not names:
        p.error(f"--layer-set {args.layer_set}: no attn2.to_k / attn2.to_v layers")
    found = linears(model)
    weights = {n: (np.asarray(found[n].kernel[...], np.float32).T,
                   None if found[n].bias is None else np.asarray(found[n].bias[...], np.float32)) for n in names}
    why = provenance.layer_set_mismatch(source, weights)
    if why is not None:
        p.error(f"--layer-set {args.layer_set}: {why}: not captured from --checkpoint {args.checkpoint}")
    text = training_caption_text(testbed_data.load_dataset(args.data))
    rows, distinct = capture.text_only_rows(families.PIXART, model, text, max_rows=args.rows or sys.maxsize,
                                            seed=args.seed, uses_cfg=True, what=f"--data {args.data}")
    kept = source if args.all_layers else {n: source[n] for n in names}
    layers = {n: (layer.weight, layer.bias, rows if n in names else layer.activations) for n, layer in kept.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    layerset.save_layer_set(args.out, layers)
    print(f"{len(names)} cross-attention key/value layers ({len(layers)} written), {len(rows)} of {distinct} distinct "
          f"rows from {len(text['context'])} training captions + the empty caption -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

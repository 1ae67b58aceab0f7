"""A layer set of the testbed's cross-attention keys / values with activation rows from many captions.

    python benchmarks/cross_attention_rows.py --layer-set runs/ptq_stores/layer_set.safetensors \
        --data runs/emoji32.npz --out runs/xattn/layer_set.safetensors
    kroquant calibrate --layers runs/xattn/layer_set.safetensors --methods hadamard32 kroquant smoothquant \
        smoothed_kroquant --calib-rows 1024 --calib-validation 512

In PixArt the input of every block's ``attn2.to_k`` / ``attn2.to_v`` is the caption projection of the text embedding:
it does not depend on the image or the denoising step, so a capture from a few sampled captions holds only their
tokens (186 distinct rows for the testbed's 32 calibration captions and the empty caption). This script computes those
rows directly, ``caption_projection(context)`` of the real tokens of every distinct training caption of ``--data``
plus the empty caption (the unconditional CFG branch), de-duplicated and shuffled, and writes them beside the weights
and biases of the ``attn2.to_k`` / ``attn2.to_v`` layers of ``--layer-set`` (a captured layer set of the same model).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "emoji_pixart"), help="diffusers PixArt folder")
    p.add_argument("--layer-set", required=True, help="captured layer set (.safetensors) of the same checkpoint")
    p.add_argument("--data", required=True, help="dataset .npz (kroquant build-emoji-dataset): its training captions")
    p.add_argument("--out", required=True, help="layer set to write (.safetensors)")
    p.add_argument("--seed", type=int, default=0, help="seed of the row shuffle")
    args = p.parse_args(argv)

    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from kroquant_jax import layerset
    from models import families
    from models.testbed import data as testbed_data

    source = load_file(args.layer_set)
    names = sorted({k.rsplit("/", 1)[0] for k in source if ".attn2.to_k/" in k or ".attn2.to_v/" in k})
    if not names:
        p.error(f"--layer-set {args.layer_set}: no attn2.to_k / attn2.to_v layers")
    _, model = families.PIXART.from_diffusers(args.checkpoint, "float32")
    dataset = testbed_data.load_dataset(args.data)
    train = np.flatnonzero(~dataset.heldout)
    _, first = np.unique(dataset.captions[train], return_index=True)
    captions = train[np.sort(first)]
    rows = []
    for start in range(0, len(captions), 256):
        part = captions[start:start + 256]
        projected = np.asarray(model.caption_projection(jnp.asarray(dataset.context[part], jnp.float32), None))
        rows.append(projected[np.asarray(dataset.context_mask[part]) > 0])  # real tokens only
    empty = np.asarray(model.caption_projection(jnp.asarray(dataset.null_context[None], jnp.float32), None))
    rows.append(empty[np.asarray(dataset.null_mask[None]) > 0])
    rows = np.unique(np.concatenate(rows).astype(np.float32), axis=0)
    rows = rows[np.random.default_rng(args.seed).permutation(len(rows))]
    layers = {n: (source[f"{n}/weight"], source.get(f"{n}/bias"), rows) for n in names}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    layerset.save_layer_set(args.out, layers)
    print(f"{len(names)} layers, {len(rows)} distinct rows from {len(captions)} training captions + the empty caption "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

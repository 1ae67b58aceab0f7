"""Encode prompts with a local diffusers pipeline's text encoder(s) into the prompt file of the other verbs.

    kroquant encode-prompts --pipeline pixart-sigma --prompt "a red fox in the snow" "a lighthouse at dusk" \
        --out prompts.npz

The family comes from the pipeline's ``model_index.json`` (``PixArtSigmaPipeline``: its T5; ``SanaPipeline``: its
Gemma encoder; ``FluxPipeline``: CLIP + T5). Writes (atomically) the ``.npz`` that ``kroquant quantize-checkpoint
--embeddings`` and ``kroquant generate --prompts`` read: PixArt/SANA ``context (P, t, c)``, ``mask (P, t)``,
``uncond_context (1, t, c)``, ``uncond_mask (1, t)`` (the negative prompt); FLUX ``context (P, t, 4096)``,
``pooled (P, 768)`` (``models.diffusers_io.encode_prompts``; torch, diffusers and transformers needed; nothing is
downloaded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scripts.common_args import UserError, check_out_file, positive_int, verb_parser

PIPELINE_FAMILIES = {"PixArtSigmaPipeline": "pixart", "PixArtAlphaPipeline": "pixart", "SanaPipeline": "sana",
                     "FluxPipeline": "flux"}
EXAMPLES = ('--pipeline pixart-sigma --prompt "a red fox in the snow" "a lighthouse at dusk" --out prompts.npz',
            "--pipeline flux-schnell --prompts-file prompts.txt --out flux_prompts.npz")


def _parse(argv):
    parser = verb_parser("encode-prompts", __doc__, EXAMPLES)
    parser.add_argument("--pipeline", required=True, help="local diffusers pipeline folder (with model_index.json)")
    parser.add_argument("--out", required=True, help="output .npz")
    texts = parser.add_mutually_exclusive_group(required=True)
    texts.add_argument("--prompt", nargs="+", help="the prompts")
    texts.add_argument("--prompts-file", help="a text file, one prompt a line (empty lines skipped)")
    parser.add_argument("--negative-prompt", default="", help="the unconditional prompt of CFG (PixArt/SANA)")
    parser.add_argument("--max-sequence-length", type=positive_int,
                        help="text tokens (default: the pipeline's: 300 for PixArt/SANA, 512 for FLUX)")
    return parser.parse_args(argv)


def pipeline_family(pipeline: str) -> str:
    """The family of a diffusers pipeline folder, from its ``model_index.json`` (a :class:`UserError` names what is
    wrong)."""
    index = Path(pipeline) / "model_index.json"
    if not Path(pipeline).is_dir():
        raise UserError(f"--pipeline {pipeline}: no such folder")
    if not index.exists():
        raise UserError(f"--pipeline {pipeline}: no model_index.json (expected a diffusers pipeline folder)")
    try:
        class_name = json.loads(index.read_text()).get("_class_name")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise UserError(f"{index}: not a valid pipeline index ({err})") from None
    if class_name not in PIPELINE_FAMILIES:
        raise UserError(f"{index}: _class_name {class_name!r} is not one of {sorted(PIPELINE_FAMILIES)}")
    return PIPELINE_FAMILIES[class_name]


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    family = pipeline_family(args.pipeline)
    check_out_file(args.out)  # before the text encoder is loaded, not at the write after it ran
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.exists():
            raise UserError(f"--prompts-file {path}: no such file")
        try:
            prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"--prompts-file {path}: not a readable UTF-8 text file ({err})") from None
        if not prompts:
            raise UserError(f"--prompts-file {path}: no prompts (one a line)")
    else:
        prompts = list(args.prompt)
    import numpy as np

    from kroquant_jax.fileio import atomic_path
    from models import diffusers_io

    arrays = diffusers_io.encode_prompts(args.pipeline, prompts, family, negative_prompt=args.negative_prompt,
                                         max_sequence_length=args.max_sequence_length)
    with atomic_path(args.out, suffix=".npz") as tmp:
        np.savez(tmp, **arrays)
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in arrays.items())
    print(f"{family}: {len(prompts)} prompt(s) encoded -> {args.out} ({shapes})", file=sys.stderr)
    return {k: tuple(v.shape) for k, v in arrays.items()}


if __name__ == "__main__":
    main()

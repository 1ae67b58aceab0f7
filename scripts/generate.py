"""Generate with a quantized checkpoint folder written by `kroquant quantize-checkpoint` (no original checkpoint).

    kroquant generate --checkpoint OUT/quantized-RECIPE --prompts prompts.npz --out runs/samples

Loads the self-contained folder (``models.quantized_checkpoint``: config, 16-bit weights, packed W4A4 layers), runs
the family's sampler (by default the one recorded when the folder was written) with the W4A4 layers through their
simulated path (``--strategy simulate``, the default on a CPU: ``kroquant_jax.qlinear.qlinear_forward(path=
"simulate")``, the fake-quantized eq. 11 in f32) or served (``--strategy dequant|kernel|mgpu|fp8|fp8_w4a8|fp8_mgpu``,
the default ``dequant`` on a GPU: ``pallas_kernels.served``, packed codes, bf16 activations; ``--impl`` picks the
compiled kernels, the Pallas interpreter or the jnp reference, by default the kernels on a GPU and the reference
elsewhere) and writes ``latents.npz`` (``latents (P, c, H, W)``, ``seeds (P,)``) to ``--out``; with ``--vae DIR`` (a
diffusers AutoencoderKL folder, torch side) also ``images/w4a4_XXXX.png``. The prompt file has the layout of
``kroquant quantize-checkpoint --embeddings`` (``models.diffusers_io.encode_prompts``).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np

from scripts.common_args import UserError, add_quiet, positive_int, verb_parser

EXAMPLES = ("--checkpoint runs/pixart/quantized-kroquant --prompts prompts.npz --out runs/samples",
            "--checkpoint runs/emoji/quantized-kroquant_loraq --prompts prompts.npz --steps 20 --latent-hw 32 32 "
            "--out runs/emoji_samples --vae sd-vae")


def _parse(argv):
    parser = verb_parser("generate", __doc__, EXAMPLES)
    parser.add_argument("--checkpoint", required=True, help="quantized checkpoint folder (quantize-checkpoint's "
                        "OUT/quantized-RECIPE)")
    parser.add_argument("--prompts", required=True, dest="embeddings", help=".npz of prompt embeddings")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--max-prompts", type=positive_int, help="only the first N prompts (default: all)")
    parser.add_argument("--steps", type=positive_int, help="denoising steps (default: the ones the folder was "
                        "evaluated with, else 20)")
    parser.add_argument("--guidance", type=float, help="CFG scale (default: the folder's, else 4.5)")
    parser.add_argument("--solver", choices=("dpm_solver_pp_2m", "flow_euler"),
                        help="sampler (default: the folder's, else the family's)")
    parser.add_argument("--shift", type=float, help="flow-matching sigma shift (default: the folder's, else the "
                        "family's)")
    parser.add_argument("--latent-hw", type=positive_int, nargs=2, metavar=("H", "W"),
                        help="latent height and width (default: the folder's, else the model's sample_size)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses the noise of seed + 1000 + i (the seeds "
                        "of quantize-checkpoint's evaluation)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: the stored one)")
    parser.add_argument("--strategy", help="how the W4A4 layers run: simulate (fake quant, f32) or a served strategy "
                        "of pallas_kernels.served (dequant, kernel, mgpu, fp8, fp8_w4a8, fp8_mgpu) (default: simulate "
                        "on a CPU, dequant on a GPU)")
    parser.add_argument("--impl", choices=("pallas", "interpret", "reference"),
                        help="served strategies: compiled Pallas kernels, the Pallas interpreter or the jnp reference "
                        "(default: the kernels on a GPU, the reference elsewhere)")
    parser.add_argument("--vae", help="diffusers AutoencoderKL directory: decode the latents to PNGs (torch)")
    add_quiet(parser)
    args = parser.parse_args(argv)
    args.synthetic_prompts, args.synthetic_tokens = None, None  # prompt_arrays' other source
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    for flag, path in (("--checkpoint", args.checkpoint), ("--prompts", args.embeddings), ("--vae", args.vae)):
        if path is not None and not Path(path).exists():
            raise UserError(f"{flag} {path}: no such file or folder")
    import jax
    from flax import nnx
    from tqdm.auto import tqdm

    from kroquant_jax.fileio import atomic_write_bytes
    from models import sampling
    from models.quantized_checkpoint import load_quantized_checkpoint
    from models import families
    from scripts.quantize_checkpoint import prompt_arrays, prompt_batches

    from pallas_kernels import served

    strategy = args.strategy or ("simulate" if jax.default_backend() == "cpu" else served.DEFAULT_STRATEGY)
    if strategy not in ("simulate", *served.strategy_names()):
        raise UserError(f"--strategy {strategy}: not simulate or a served strategy "
                        f"({', '.join(served.strategy_names())})")
    if strategy == "simulate" and args.impl:
        raise UserError(f"--impl {args.impl} applies to served strategies, not --strategy simulate")
    try:
        options = None if strategy == "simulate" else served.ServeOptions(strategy=strategy, impl=args.impl)
    except ValueError as err:
        raise UserError(f"--strategy {strategy} --impl {args.impl}: {err}") from None
    loaded = load_quantized_checkpoint(args.checkpoint, args.dtype)
    recorded = loaded.config.get("extra", {})
    steps = args.steps or recorded.get("steps") or 20
    guidance = args.guidance if args.guidance is not None else recorded.get("guidance", 4.5)
    solver = args.solver or recorded.get("solver")
    shift = args.shift if args.shift is not None else recorded.get("shift")
    solver, shift = sampling.resolve_sampler(loaded.family, solver, shift)
    size = getattr(loaded.cfg, "sample_size", None) or 128
    latent_hw = tuple(args.latent_hw or recorded.get("latent_hw") or (size, size))
    family = families.get(loaded.family)
    arrays = prompt_arrays(args, family, loaded.cfg)
    dtype = jax.tree_util.tree_leaves(nnx.state(loaded.model, nnx.Param))[0].dtype
    graphdef, state = nnx.split(loaded.model)
    sample = jax.jit(family.make_sampler(graphdef, loaded.cfg, num_steps=steps, guidance_scale=guidance,
                                         latent_hw=latent_hw, shift=shift, solver=solver))
    try:
        overrides = loaded.overrides() if options is None else loaded.served_overrides(options)
    except ValueError as err:
        raise UserError(f"--strategy {strategy}: {err}") from None
    indices = list(range(arrays["context"].shape[0]))
    latents, seeds = [], []
    for index, batch in tqdm(zip(indices, prompt_batches(arrays, indices, 1, dtype)), total=len(indices),
                             desc="generate", unit="prompt", disable=args.quiet):
        seed = args.seed + 1000 + index
        result, _ = sample({"model": state, **batch, "overrides": overrides}, jax.random.key(seed))
        latents.append(np.asarray(result, np.float32)[0])
        seeds.append(seed)
    out = Path(args.out)
    buffer = io.BytesIO()
    np.savez(buffer, latents=np.stack(latents), seeds=np.array(seeds))
    atomic_write_bytes(out / "latents.npz", buffer.getvalue())
    if args.vae:
        from models import diffusers_io
        images = diffusers_io.decode_latents(args.vae, np.stack(latents), loaded.family)
        diffusers_io.save_pngs(images, out / "images", "w4a4_")
    print(f"{loaded.family}: {len(latents)} prompt(s) generated with the W4A4 model ({loaded.config['recipe']}, "
          f"{len(loaded.qlayers)} quantized layers, {strategy}; {solver}, {steps} steps); outputs in {out}",
          file=sys.stderr)
    return {"family": loaded.family, "strategy": strategy, "solver": solver, "shift": shift, "steps": steps, "latent_hw": list(latent_hw),
            "prompts": len(latents), "out": str(out)}


if __name__ == "__main__":
    main()

"""Generate with a quantized checkpoint folder written by `kroquant quantize-checkpoint` (no original checkpoint).

    kroquant generate --checkpoint OUT/quantized-RECIPE --prompts prompts.npz --out runs/samples

Loads the self-contained folder (``models.quantized_checkpoint``: config, 16-bit weights, packed W4A4 layers), runs
the family's sampler (by default the one recorded when the folder was written) with the W4A4 layers through their
simulated path (``--strategy simulate``, the default on a CPU: ``kroquant_jax.qlinear.qlinear_forward(path=
"simulate")``, the fake-quantized eq. 11 in f32) or served (``--strategy dequant|kernel|mgpu|fp8|fp8_w4a8|fp8_mgpu``,
on a GPU by default ``served.default_strategy``'s choice, printed: ``fp8_mgpu`` on Hopper where it serves every
layer, else ``dequant``; ``pallas_kernels.served``, packed codes, bf16 activations; ``--impl`` picks the
compiled kernels, the Pallas interpreter or the jnp reference, by default the kernels on a GPU and the reference
elsewhere) and writes ``latents.npz`` (``latents (P, c, H, W)``, ``seeds (P,)``) to ``--out``; with ``--vae DIR`` (a
diffusers AutoencoderKL folder, torch side) also ``images/w4a4_XXXX.png``. The prompt file has the layout of
``kroquant quantize-checkpoint --embeddings`` (``models.diffusers_io.encode_prompts``). ``--attention cudnn`` runs
the softmax attention as cuDNN flash attention (GPU, bf16 / fp16 model) instead of the fp32-logits XLA attention.
``--out`` is claimed before the model loads (``generate_run.json``: the checkpoint's and the prompt file's SHA-256
and every sampler and serving flag): a folder holding another run's latents or images is refused, or with
``--overwrite`` cleared of them first, so no earlier image stays beside the new ones.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np

from scripts.common_args import (UserError, add_compile_cache, add_quiet, check_out_dir, finite_float, positive_float,
                                 positive_int, require_paths, verb_parser)

EXAMPLES = ("--checkpoint runs/pixart/quantized-kroquant --prompts prompts.npz --out runs/samples",
            "--checkpoint runs/emoji/quantized-kroquant_loraq --prompts prompts.npz --steps 20 --latent-hw 32 32 "
            "--out runs/emoji_samples --vae sd-vae")


def _parse(argv):
    from models.layers import ATTENTION_IMPLEMENTATIONS

    parser = verb_parser("generate", __doc__, EXAMPLES)
    parser.add_argument("--checkpoint", required=True, help="quantized checkpoint folder (quantize-checkpoint's "
                        "OUT/quantized-RECIPE)")
    parser.add_argument("--prompts", required=True, dest="embeddings", help=".npz of prompt embeddings")
    parser.add_argument("--out", required=True, help="output folder (another run's latents and images there are "
                        "refused; the same run's are replaced)")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete another run's latents and images in --out instead of refusing them")
    parser.add_argument("--max-prompts", type=positive_int, help="only the first N prompts (default: all)")
    parser.add_argument("--steps", type=positive_int, help="denoising steps (default: the ones the folder was "
                        "evaluated with, else 20)")
    parser.add_argument("--guidance", type=finite_float, help="CFG scale (default: the folder's, else 4.5)")
    parser.add_argument("--solver", choices=("dpm_solver_pp_2m", "flow_euler"),
                        help="sampler (default: the folder's, else the family's)")
    parser.add_argument("--shift", type=positive_float,
                        help="flow-matching sigma shift (default: the folder's, else the family's)")
    parser.add_argument("--latent-hw", type=positive_int, nargs=2, metavar=("H", "W"),
                        help="latent height and width (default: the folder's, else the model's sample_size)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i uses the noise of seed + 1000 + i (the seeds "
                        "of quantize-checkpoint's evaluation)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: the stored one)")
    parser.add_argument("--strategy", help="how the W4A4 layers run: simulate (fake quant, f32) or a served strategy "
                        "of pallas_kernels.served (dequant, kernel, mgpu, fp8, fp8_w4a8, fp8_mgpu) (default: simulate "
                        "on a CPU; on a GPU pallas_kernels.served.default_strategy: fp8_mgpu on Hopper where it "
                        "serves every layer, else dequant; the choice is printed)")
    parser.add_argument("--impl", choices=("pallas", "interpret", "reference"),
                        help="served strategies: compiled Pallas kernels, the Pallas interpreter or the jnp reference "
                        "(default: the kernels on a GPU, the reference elsewhere)")
    parser.add_argument("--attention", choices=ATTENTION_IMPLEMENTATIONS, default="xla",
                        help="softmax attention: xla (fp32 logits, any device) or cudnn (flash attention; NVIDIA GPU, "
                        "bfloat16/float16) (default %(default)s)")
    parser.add_argument("--vae", help="diffusers AutoencoderKL directory: decode the latents to PNGs (torch)")
    add_compile_cache(parser, "the sampler with its W4A4 layers")
    add_quiet(parser)
    args = parser.parse_args(argv)
    args.synthetic_prompts, args.synthetic_tokens = None, None  # prompt_arrays' other source
    return args


#: The files a generate run writes into --out (what another run's claim clears or refuses).
OUTPUTS = ("latents.npz", "images/w4a4_*.png")
RUN_RECORD = "generate_run.json"


def run_key(args) -> dict:
    """What decides a generate run's files: the checkpoint's configs and the prompt file (SHA-256; a quantized
    folder's ``quantization_config.json`` holds its weight files' SHA-256, so new weights are a new key), every sampler
    and serving flag as given (a default is resolved the same way on the same backend), and the backend."""
    import jax

    from kroquant_jax import provenance

    checkpoint = Path(args.checkpoint)
    digests = {name: provenance.file_digest(checkpoint / name) if (checkpoint / name).is_file() else None
               for name in ("config.json", "quantization_config.json")}
    return {"checkpoint": str(checkpoint.resolve()), "checkpoint_config_sha256": digests["config.json"],
            "quantization_config_sha256": digests["quantization_config.json"],
            "prompts_sha256": provenance.file_digest(args.embeddings), "max_prompts": args.max_prompts,
            "steps": args.steps, "guidance": args.guidance, "solver": args.solver, "shift": args.shift,
            "latent_hw": args.latent_hw, "seed": args.seed, "dtype": args.dtype, "strategy": args.strategy,
            "impl": args.impl, "attention": args.attention, "vae": None if args.vae is None else str(
                Path(args.vae).resolve()), "backend": jax.default_backend()}


def claim_out(args) -> None:
    """--out as this run's (``provenance.claim_output_folder``): another run's latents and images are refused, or
    with --overwrite deleted first; a :class:`UserError` names the flags."""
    from kroquant_jax import provenance

    try:
        provenance.claim_output_folder(args.out, RUN_RECORD, run_key(args), OUTPUTS, overwrite=args.overwrite)
    except provenance.OutputFolderError as err:
        raise UserError(str(err)) from None


def serve_options(strategy: str, impl: str | None):
    """``ServeOptions(strategy, impl)``; a combination it refuses is a :class:`UserError` naming both flags."""
    from pallas_kernels import served

    try:
        return served.ServeOptions(strategy=strategy, impl=impl)
    except ValueError as err:
        raise UserError(f"--strategy {strategy} --impl {impl}: {err}") from None


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    require_paths(("--checkpoint", args.checkpoint), ("--prompts", args.embeddings), ("--vae", args.vae))
    check_out_dir(args.out)  # a file there would fail the write after the sampling
    claim_out(args)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kroquant_jax import calibrate
    from kroquant_jax.fileio import atomic_write_bytes
    from models import families
    from models.quantized_checkpoint import load_quantized_checkpoint
    from scripts.quantize_checkpoint import prompt_arrays

    from pallas_kernels import served

    # an explicit --strategy is checked before loading; without one a GPU picks per device and layers after it
    strategy = args.strategy or ("simulate" if jax.default_backend() == "cpu" else None)
    if strategy is not None and strategy not in ("simulate", *served.strategy_names()):
        raise UserError(f"--strategy {strategy}: not simulate or a served strategy "
                        f"({', '.join(served.strategy_names())})")
    if strategy == "simulate" and args.impl:
        raise UserError(f"--impl {args.impl} applies to served strategies, not --strategy simulate")
    options = None if strategy in (None, "simulate") else serve_options(strategy, args.impl)
    if args.attention == "cudnn" and jax.default_backend() != "gpu":
        raise UserError(f"--attention cudnn needs an NVIDIA GPU (the backend is {jax.default_backend()})")
    if args.compile_cache:
        calibrate.enable_compile_cache(args.compile_cache)
    loaded = load_quantized_checkpoint(args.checkpoint, args.dtype, {"attention_impl": args.attention})
    model_dtype = jax.tree_util.tree_leaves(nnx.state(loaded.model, nnx.Param))[0].dtype
    if args.attention == "cudnn" and model_dtype not in (jnp.bfloat16, jnp.float16):
        raise UserError(f"--attention cudnn needs --dtype bfloat16 or float16 (the model is {model_dtype})")
    if strategy is None:
        strategy, why = served.default_strategy(loaded.qlayers.values())
        options = serve_options(strategy, args.impl)
        if not args.quiet:
            print(f"strategy {why}", file=sys.stderr)
    settings = sampler_settings(loaded, steps=args.steps, guidance=args.guidance, solver=args.solver,
                                shift=args.shift, latent_hw=args.latent_hw)
    family = families.get(loaded.family)
    try:  # the sampler would fail inside its trace with a message about its own arrays
        family.check_latent_hw(loaded.cfg, settings["latent_hw"])
    except ValueError as err:
        source = (f"--latent-hw {' '.join(map(str, args.latent_hw))}" if args.latent_hw else
                  f"{args.checkpoint}: its recorded latent_hw")
        raise UserError(f"{source}: {err}") from None
    arrays = prompt_arrays(args, family, loaded.cfg, "--prompts")
    try:
        overrides = loaded.overrides() if options is None else loaded.served_overrides(options)
    except ValueError as err:
        raise UserError(f"--strategy {strategy}: {err}") from None
    compiler_options = served.program_compiler_options(None if options is None else strategy)
    latents, seeds = sample_prompts(loaded.model, loaded.cfg, family, settings, arrays, overrides, (args.seed,),
                                    progress=not args.quiet, compiler_options=compiler_options)
    solver, steps, latent_hw = settings["solver"], settings["num_steps"], settings["latent_hw"]
    out = Path(args.out)
    buffer = io.BytesIO()
    np.savez(buffer, latents=latents, seeds=seeds)
    atomic_write_bytes(out / "latents.npz", buffer.getvalue())
    if args.vae:
        from models import diffusers_io
        images = diffusers_io.decode_latents(args.vae, latents, loaded.family)
        diffusers_io.save_pngs(images, out / "images", "w4a4_")
    print(f"{loaded.family}: {len(latents)} prompt(s) generated with the W4A4 model ({loaded.config['recipe']}, "
          f"{len(loaded.qlayers)} quantized layers, {strategy}; {solver}, {steps} steps); outputs in {out}",
          file=sys.stderr)
    return {"family": loaded.family, "strategy": strategy, "attention": args.attention, "solver": solver,
            "shift": settings["shift"], "steps": steps, "latent_hw": list(latent_hw), "prompts": len(latents),
            "xla_options": compiler_options, "out": str(out)}


def sampler_settings(loaded, steps: int | None = None, guidance: float | None = None, solver: str | None = None,
                     shift: float | None = None, latent_hw: tuple[int, int] | None = None) -> dict:
    """The sampler of a loaded quantized checkpoint folder: each value given, else the one recorded when the folder
    was written, else the family's default (20 steps, CFG 4.5, the model's ``sample_size``). Returns the keyword
    arguments of ``Family.make_sampler``: ``num_steps``, ``guidance_scale``, ``latent_hw``, ``shift``, ``solver``."""
    from models import sampling

    recorded = loaded.config.get("extra", {})
    solver, shift = sampling.resolve_sampler(loaded.family, solver or recorded.get("solver"),
                                             shift if shift is not None else recorded.get("shift"))
    size = getattr(loaded.cfg, "sample_size", None) or 128
    return {"num_steps": steps or recorded.get("steps") or 20,
            "guidance_scale": guidance if guidance is not None else recorded.get("guidance", 4.5),
            "latent_hw": tuple(latent_hw or recorded.get("latent_hw") or (size, size)), "shift": shift,
            "solver": solver}


def sample_prompts(model, cfg, family, settings: dict, arrays: dict, overrides: dict, seeds=(0,),
                   progress: bool = True, compiler_options: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every prompt of ``arrays`` (``scripts.quantize_checkpoint.prompt_arrays``) sampled one at a time by ``model``
    with its linears routed through ``overrides`` (``{}``: the model's own 16-bit linears), once per seed ``s`` of
    ``seeds``: prompt ``i`` starts from the noise of seed ``s + 1000 + i`` (one compiled sampler for all, compiled
    with ``compiler_options``: ``served.program_compiler_options`` of the served strategy).
    Returns ``(latents (len(seeds) * P, c, H, W) float32, their noise seeds)``, seed-major."""
    import jax
    from flax import nnx
    from tqdm.auto import tqdm

    from scripts.quantize_checkpoint import prompt_batches

    dtype = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))[0].dtype
    graphdef, state = nnx.split(model)
    sample = jax.jit(family.make_sampler(graphdef, cfg, **settings), compiler_options=compiler_options or None)
    indices = list(range(arrays["context"].shape[0]))
    batches = prompt_batches(arrays, indices, 1, dtype)
    runs = [(seed + 1000 + index, batch) for seed in seeds for index, batch in zip(indices, batches)]
    latents = []
    for noise_seed, batch in tqdm(runs, desc="generate", unit="sample", disable=not progress):
        result, _ = sample({"model": state, **batch, "overrides": overrides}, jax.random.key(noise_seed))
        latents.append(np.asarray(result, np.float32)[0])
    return np.stack(latents), np.array([noise_seed for noise_seed, _ in runs])


if __name__ == "__main__":
    main()

"""Every way of running a quantized checkpoint's W4A4 layers, on the same prompts and noise, against the 16-bit model
it was made from (issue 14: a served strategy becomes the default only where it matches the others on real
checkpoints).

For a quantized checkpoint folder (``kroquant quantize-checkpoint``, ``kroquant qad --export-dir``) and the 16-bit
diffusers folder of the same model (``--teacher``; its config must equal the folder's), every prompt of ``--prompts``
is sampled with the folder's recorded sampler (``scripts.generate.sampler_settings``; ``--steps`` etc. override it)
by:

* the 16-bit teacher (``--teacher``, its own linears: the reference);
* each of ``--strategies``: ``simulate`` (the fake-quantized eq. 11 in f32, ``QuantizedCheckpoint.overrides``) or a
  served strategy of ``pallas_kernels.served`` (``dequant``, ``fp8``, ``fp8_mgpu``, ...: packed codes, bf16
  activations; ``--impl`` as ``kroquant generate``'s).

Prompt ``i`` starts from the noise of seed ``s + 1000 + i`` for each ``s`` of ``--seeds`` (the seeds of ``kroquant
generate --seed s``), the same noise for every system. Per strategy: PSNR against the teacher and against
``simulate`` (when run), mean ± standard error over the samples; for each served strategy after the first, the paired
difference of those PSNRs to the first's (mean ± standard error of the per-sample differences: the samples are the
same, so this resolves far smaller differences than the two means' spreads); the relative L2 error of all latents;
finite; and the seconds it took (compilation included: not a speed figure). ``--space pixels`` (a pixel-space model
such as the emoji testbed: latents in [-1, 1] mapped to [0, 1] and clipped, peak 1) or ``latents`` (the reference
sample's range as the peak, as ``kroquant quantize-checkpoint``'s evaluation). Writes the JSON (``--out``,
atomically), a markdown table beside it (``.md``) and, with ``--save-latents``, every system's samples (``.npz``).
Off the GPU each served strategy's layers are prepared in one jitted program (``served_overrides(jit=True)``: op by
op, every op would compile on its own for each layer shape); on a GPU op by op, as ``kroquant generate`` prepares
them.

    python3 benchmarks/generate_strategies.py --checkpoint runs/quantized-best --teacher checkpoints/emoji_pixart \\
        --prompts prompts.npz --space pixels --strategies simulate,dequant,fp8,fp8_mgpu --seeds 0 1 \\
        --out $OUT/generate_strategies.json                                        # a GPU
    python3 benchmarks/generate_strategies.py ... --strategies simulate,dequant --impl reference --steps 2   # a CPU
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.common_args import UserError, choice_list, positive_int, require_paths  # noqa: E402

SIMULATE = "simulate"


def psnr_db(test: np.ndarray, reference: np.ndarray, space: str) -> float:
    """PSNR (dB) of one sample ``(c, H, W)`` against the reference: ``pixels`` maps [-1, 1] to [0, 1] (clipped, peak
    1; ``models.image_metrics.psnr``, the testbed's metric); ``latents`` uses the reference's value range as the
    peak (``models.image_metrics.range_psnr``, as ``kroquant quantize-checkpoint``'s evaluation)."""
    from models import image_metrics

    if space == "latents":
        return image_metrics.range_psnr(test, reference)

    def rgb(x):  # (3, H, W) in [-1, 1] -> (H, W, 3) in [0, 1]
        return np.clip((np.moveaxis(np.asarray(x, np.float64), 0, -1) + 1) / 2, 0, 1)

    return float(image_metrics.psnr(rgb(test), rgb(reference)))


def compare(latents: np.ndarray, reference: np.ndarray, space: str) -> dict:
    """``latents`` against ``reference`` (both ``(n, c, H, W)``): PSNR mean, standard error and per sample, and the
    relative L2 error of all of them."""
    per_sample = [psnr_db(x, y, space) for x, y in zip(latents, reference)]
    finite = [p for p in per_sample if np.isfinite(p)]
    sem = float(np.std(finite, ddof=1) / np.sqrt(len(finite))) if len(finite) > 1 else None
    return {"psnr_db": float(np.mean(finite)) if finite else float("inf"), "psnr_sem_db": sem,
            "psnr_per_sample_db": per_sample,
            "rel_l2": float(np.linalg.norm(latents - reference) / np.linalg.norm(reference))}


def paired_difference(row: dict, baseline: dict) -> dict:
    """Mean and standard error over the samples of ``row``'s per-sample PSNR minus ``baseline``'s (both from
    :func:`compare` on the same samples)."""
    diff = np.asarray(row["psnr_per_sample_db"], np.float64) - np.asarray(baseline["psnr_per_sample_db"], np.float64)
    diff = diff[np.isfinite(diff)]
    sem = float(np.std(diff, ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else None
    return {"psnr_db": float(np.mean(diff)) if len(diff) else float("nan"), "psnr_sem_db": sem}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="quantized checkpoint folder")
    parser.add_argument("--teacher", required=True, help="the 16-bit diffusers folder the checkpoint was made from")
    parser.add_argument("--prompts", required=True, dest="embeddings", help=".npz of prompt embeddings "
                        "(kroquant generate's --prompts)")
    parser.add_argument("--max-prompts", type=positive_int, help="only the first N prompts (default: all)")
    from pallas_kernels import served

    parser.add_argument("--strategies", default="simulate,dequant,fp8,fp8_mgpu",
                        type=choice_list((SIMULATE, *served.strategy_names()), "strategy"),
                        help="comma-separated: simulate and served strategies, run in the order of the choices "
                        "(default %(default)s)")
    parser.add_argument("--impl", choices=("pallas", "interpret", "reference"),
                        help="served strategies' kernels (default: compiled on a GPU, the jnp reference elsewhere)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="noise seeds (prompt i: seed + 1000 + i)")
    parser.add_argument("--space", choices=("pixels", "latents"), default="latents",
                        help="what the samples are, for the PSNR peak (default %(default)s)")
    parser.add_argument("--steps", type=positive_int, help="denoising steps (default: the folder's)")
    parser.add_argument("--guidance", type=float, help="CFG scale (default: the folder's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default: the stored one); the teacher is loaded in the same")
    parser.add_argument("--out", default=None, help="JSON (default $OUT/generate_strategies.json, else /tmp)")
    parser.add_argument("--save-latents", action="store_true",
                        help="also write every system's samples beside the JSON (.npz: teacher and one array per "
                             "strategy, (samples, c, H, W), seed-major)")
    args = parser.parse_args(argv)
    args.synthetic_prompts, args.synthetic_tokens = None, None  # prompt_arrays' other source
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    require_paths(("--checkpoint", args.checkpoint), ("--teacher", args.teacher), ("--prompts", args.embeddings))
    strategies = list(args.strategies)
    import jax
    from flax import nnx

    from kroquant_jax.fileio import atomic_path, atomic_write_json, atomic_write_text
    from models import families
    from models.quantized_checkpoint import load_quantized_checkpoint
    from pallas_kernels import served
    from scripts.generate import sample_prompts, sampler_settings
    from scripts.quantize_checkpoint import prompt_arrays

    options = {s: None if s == SIMULATE else served.ServeOptions(strategy=s, impl=args.impl) for s in strategies}
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "generate_strategies.json"))
    try:  # the two config.json files compared before any weights are read
        family = families.check_same_model(args.checkpoint, args.teacher)
    except (OSError, ValueError) as err:
        raise UserError(str(err)) from None
    loaded = load_quantized_checkpoint(args.checkpoint, args.dtype)
    dtype = jax.tree_util.tree_leaves(nnx.state(loaded.model, nnx.Param))[0].dtype
    _, teacher = family.from_diffusers(args.teacher, dtype)
    settings = sampler_settings(loaded, steps=args.steps, guidance=args.guidance)
    arrays = prompt_arrays(args, family, loaded.cfg)
    overrides = {}
    for strategy, option in options.items():  # every strategy's layers prepared before any sampling
        try:
            overrides[strategy] = (loaded.overrides() if option is None
                                   else loaded.served_overrides(option, jit=jax.default_backend() != "gpu"))
        except ValueError as err:
            raise UserError(f"--strategies {strategy}: {err}") from None

    def sample_all(model, layer_overrides, strategy=None):
        began = time.perf_counter()
        latents, _ = sample_prompts(model, loaded.cfg, family, settings, arrays, layer_overrides, args.seeds,
                                    progress=False, compiler_options=served.program_compiler_options(strategy))
        return latents, time.perf_counter() - began

    reference, teacher_s = sample_all(teacher, {})
    samples, seconds = {}, {}
    for strategy in strategies:
        samples[strategy], seconds[strategy] = sample_all(loaded.model, overrides[strategy],
                                                          None if strategy == SIMULATE else strategy)
        print(f"  {strategy:10s} {seconds[strategy]:7.1f} s", flush=True)
    rows = {}
    for strategy, latents in samples.items():
        rows[strategy] = {"vs_teacher": compare(latents, reference, args.space),
                          **({"vs_simulate": compare(latents, samples[SIMULATE], args.space)}
                             if SIMULATE in samples and strategy != SIMULATE else {}),
                          "finite": bool(np.isfinite(latents).all()), "seconds_with_compile": seconds[strategy]}
    served_names = [s for s in strategies if s != SIMULATE]
    for strategy in served_names[1:]:  # the same samples, so the differences are paired: a far smaller spread
        rows[strategy]["paired_vs"] = {"baseline": served_names[0], **{
            versus: paired_difference(rows[strategy][versus], rows[served_names[0]][versus])
            for versus in ("vs_teacher", "vs_simulate") if versus in rows[strategy]}}
    device = jax.devices()[0]
    payload = {
        "what": "W4A4 strategies of one quantized checkpoint vs its 16-bit teacher, same prompts, noise and sampler",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
        "jax": jax.__version__, "python": platform.python_version(),
        "command_args": list(sys.argv[1:] if argv is None else argv),
        "checkpoint": str(args.checkpoint), "recipe": loaded.config.get("recipe"), "family": loaded.family,
        "quantized_layers": len(loaded.qlayers), "teacher": str(args.teacher),
        "sampler": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items()},
        "prompts": int(arrays["context"].shape[0]), "seeds": args.seeds, "samples": int(reference.shape[0]),
        "space": args.space, "impl": args.impl, "teacher_seconds_with_compile": teacher_s, "strategies": rows}
    if args.save_latents:
        with atomic_path(str(out_path.with_suffix(".npz")), suffix=".npz") as temporary:
            np.savez(temporary, teacher=reference, **samples)
    atomic_write_json(out_path, payload)
    atomic_write_text(out_path.with_suffix(".md"), table(payload))
    print(table(payload), flush=True)
    return payload


def table(payload: dict) -> str:
    """Markdown: one row per strategy (PSNR vs the teacher and vs simulate, relative L2 vs the teacher, finite)."""
    lines = [f"{payload['device']}, jax {payload['jax']}, {payload['date_utc']}: {payload['recipe']} "
             f"({payload['quantized_layers']} W4A4 layers), {payload['samples']} samples ({payload['prompts']} "
             f"prompts x seeds {payload['seeds']}), {payload['sampler']['solver']} {payload['sampler']['num_steps']} "
             f"steps, CFG {payload['sampler']['guidance_scale']:g}; PSNR in {payload['space']} space", "",
             "| strategy | PSNR vs 16-bit teacher (dB) | rel. L2 vs teacher | PSNR vs simulate (dB) | paired "
             "difference to the first served strategy, vs teacher / vs simulate (dB) | finite |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]

    def psnr(entry):
        sem = entry["psnr_sem_db"]
        return f"{entry['psnr_db']:.2f}" + ("" if sem is None else f" ± {sem:.2f}")

    for strategy, row in payload["strategies"].items():
        versus = row.get("vs_simulate")
        paired = row.get("paired_vs", {})
        paired_cell = "—" if not paired else f"`{paired['baseline']}`: " + " / ".join(
            f"{paired[v]['psnr_db']:+.2f}" + ("" if paired[v]["psnr_sem_db"] is None else
                                               f" ± {paired[v]['psnr_sem_db']:.2f}")
            for v in ("vs_teacher", "vs_simulate") if v in paired)
        lines.append(f"| `{strategy}` | {psnr(row['vs_teacher'])} | {row['vs_teacher']['rel_l2']:.3f} | "
                     f"{'—' if versus is None else psnr(versus)} | {paired_cell} | {row['finite']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        sys.exit(f"generate_strategies.py: {err}")

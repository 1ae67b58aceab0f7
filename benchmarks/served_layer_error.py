"""Each served strategy's W4A4 layer outputs against the exact eq. 11 product in float64, on the layers of a real
quantized checkpoint and the activations its 16-bit model feeds them (issue 14: a served strategy becomes the GPU
default only where its numerics are measured on real layers, not only on the random ones of the GPU tests).

For a quantized checkpoint folder and the 16-bit diffusers folder of the same model (``--teacher``; their configs
must match), the teacher samples the first ``--max-prompts`` prompts of ``--prompts`` with the folder's recorded
sampler (``scripts.generate.sampler_settings``; ``--steps`` / ``--guidance`` override it) while
``models.capture.capture_layer_set`` records up to ``--rows`` input rows of every quantized layer (a fused layer
``a|b|c``: its first member's input, which the members share). Per layer and rows ``x (n, d)`` rounded to bf16 (what
a served layer receives):

* the reference: ``served.quantized_inputs`` of the jnp reference quantizer, then eq. 11 on those packed operands in
  float64 (``fp8_gemm.fp8_matmul_reference``: ``Q(x T) Q(W~)^T + h L^T + b``);
* each strategy of ``--strategies`` (``pallas_kernels.served``: its own quantizer kernel, GEMM and epilogue; ``--impl``
  as ``kroquant generate``'s), output in f32 where the strategy gives more than bf16; with several ``--impl`` (e.g.
  ``reference,interpret`` on a CPU) each strategy runs once per implementation on the same captured rows, its rows
  named ``STRATEGY/IMPL``;
* the floor: the reference rounded to bf16 (what any bf16-output strategy cannot beat).

Printed and written per strategy: the relative L2 error ``||y - y64|| / ||y64||`` (median, mean and largest over the
layers, the layer where it is largest), its ratio to the bf16 floor, and whether every output is finite. A strategy
whose quantizer flipped a code against the reference shows as an error well above the floor. Writes the JSON
(``--out``, atomically) and a markdown table beside it (``.md``).

    python3 benchmarks/served_layer_error.py --checkpoint runs/qadexp/qad_ptq --teacher checkpoints/emoji_pixart \\
        --prompts prompts_heldout.npz --strategies dequant,fp8,fp8_mgpu --out $OUT/served_layer_error.json   # a GPU
    python3 benchmarks/served_layer_error.py ... --strategies dequant --impl reference --steps 2               # a CPU
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.common_args import UserError, choice_list, positive_int, require_paths  # noqa: E402


def relative_error(y: np.ndarray, reference: np.ndarray) -> float:
    """``||y - reference|| / ||reference||`` in float64 (0 for an all-zero reference matched exactly)."""
    y, reference = np.asarray(y, np.float64), np.asarray(reference, np.float64)
    norm = float(np.linalg.norm(reference))
    diff = float(np.linalg.norm(y - reference))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def summarize(per_layer: dict[str, float], floors: dict[str, float]) -> dict:
    """Median, mean and largest relative error over the layers, the worst layer, and the error over the bf16 floor."""
    names = list(per_layer)
    errors = np.array([per_layer[n] for n in names])
    ratios = np.array([per_layer[n] / floors[n] if floors[n] > 0 else float("inf") for n in names])
    worst = names[int(np.argmax(errors))]
    return {"median": float(np.median(errors)), "mean": float(np.mean(errors)), "max": float(errors.max()),
            "worst_layer": worst, "median_over_bf16_floor": float(np.median(ratios)),
            "max_over_bf16_floor": float(ratios.max())}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="quantized checkpoint folder")
    parser.add_argument("--teacher", required=True, help="the 16-bit diffusers folder of the same model (its "
                        "activations feed the layers)")
    parser.add_argument("--prompts", required=True, dest="embeddings", help=".npz of prompt embeddings "
                        "(kroquant generate's --prompts)")
    parser.add_argument("--max-prompts", type=positive_int, default=4, help="prompts sampled for the capture "
                        "(default %(default)s)")
    parser.add_argument("--rows", type=positive_int, default=512, help="input rows per layer (default %(default)s)")
    from pallas_kernels import served

    parser.add_argument("--strategies", default="dequant,fp8,fp8_mgpu",
                        type=choice_list(served.strategy_names(), "strategy"),
                        help="comma-separated served strategies (default %(default)s)")
    parser.add_argument("--impl", type=choice_list(("pallas", "interpret", "reference"), "impl"),
                        help="served strategies' kernels (default: compiled on a GPU, the jnp reference elsewhere); "
                             "several, comma-separated: each strategy once per implementation, its rows named "
                             "STRATEGY/IMPL")
    parser.add_argument("--steps", type=positive_int, help="denoising steps of the capture (default: the folder's)")
    parser.add_argument("--guidance", type=float, help="CFG scale of the capture (default: the folder's)")
    parser.add_argument("--seed", type=int, default=0, help="noise and row-draw seed (default %(default)s)")
    parser.add_argument("--out", default=None, help="JSON (default $OUT/served_layer_error.json, else /tmp)")
    args = parser.parse_args(argv)
    args.synthetic_prompts, args.synthetic_tokens = None, None  # prompt_arrays' other source
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    require_paths(("--checkpoint", args.checkpoint), ("--teacher", args.teacher), ("--prompts", args.embeddings))
    strategies = list(args.strategies)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kroquant_jax.fileio import atomic_write_json, atomic_write_text
    from models import capture, families
    from models.quantized_checkpoint import layer_members, load_quantized_checkpoint
    from pallas_kernels import fp8_gemm, served
    from scripts.generate import sampler_settings
    from scripts.quantize_checkpoint import prompt_arrays, prompt_batches

    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "served_layer_error.json"))
    try:  # the two config.json files compared before any weights are read
        family = families.check_same_model(args.checkpoint, args.teacher)
    except (OSError, ValueError) as err:
        raise UserError(str(err)) from None
    loaded = load_quantized_checkpoint(args.checkpoint)
    dtype = jax.tree_util.tree_leaves(nnx.state(loaded.model, nnx.Param))[0].dtype
    _, teacher = family.from_diffusers(args.teacher, dtype)
    settings = sampler_settings(loaded, steps=args.steps, guidance=args.guidance)
    arrays = prompt_arrays(args, family, loaded.cfg)
    prepared = {}
    for name, layer in loaded.qlayers.items():  # every strategy's layers prepared before the capture
        for strategy in strategies:
            try:
                prepared[name, strategy] = served.serve(layer, strategy=strategy)
            except (TypeError, ValueError) as err:
                raise UserError(f"--strategies {strategy}: layer {name!r}: {err}") from None
    inputs = {name: layer_members(name, loaded.model)[0] for name in loaded.qlayers}
    config = capture.CaptureConfig(num_steps=settings["num_steps"], guidance_scale=settings["guidance_scale"],
                                   latent_hw=tuple(settings["latent_hw"]), rows_per_layer=args.rows, seed=args.seed,
                                   shift=settings["shift"], solver=settings["solver"],
                                   layers=tuple(sorted(set(inputs.values()))))
    prompts = list(range(arrays["context"].shape[0]))
    captured = capture.capture_layer_set(family, teacher, prompt_batches(arrays, prompts, len(prompts), dtype), config)

    impls = args.impl or (None,)
    runs = {(f"{s}/{impl}" if len(impls) > 1 else s): (s, impl) for s in strategies for impl in impls}
    errors = {label: {} for label in runs}
    floors, finite, rows = {}, dict.fromkeys(runs, True), {}
    for name, layer in loaded.qlayers.items():
        x = np.asarray(captured[inputs[name]][2], np.float32)  # (n, d') the 16-bit model's input rows
        if layer.config.input_pad:
            x = np.pad(x, [(0, 0), (0, layer.config.input_pad)])
        x2 = jnp.asarray(x, jnp.bfloat16)  # (n, d)
        rows[name] = int(x2.shape[0])
        reference_layer = served.serve_layer(layer)
        x_q, lowrank = served.quantized_inputs(reference_layer, x2, "reference")
        exact = fp8_gemm.fp8_matmul_reference(x_q, reference_layer.weight, lowrank=lowrank,
                                              bias=reference_layer.bias)  # (n, o) float64
        floors[name] = relative_error(np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64),
                                      exact)
        for label, (strategy, impl) in runs.items():
            options = served.ServeOptions(strategy=strategy, impl=impl)
            y = np.asarray(served.forward(prepared[name, strategy], x2, options=options, out_dtype=jnp.float32))
            finite[label] &= bool(np.isfinite(y).all())
            errors[label][name] = relative_error(y, exact)
    device = jax.devices()[0]
    payload = {
        "what": "served W4A4 layer outputs vs the exact eq. 11 product (float64) on the same packed operands, "
                "a real checkpoint's layers and its 16-bit model's activations",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
        "jax": jax.__version__, "python": platform.python_version(),
        "command_args": list(sys.argv[1:] if argv is None else argv),
        "checkpoint": str(args.checkpoint), "recipe": loaded.config.get("recipe"), "family": loaded.family,
        "teacher": str(args.teacher), "prompts": len(prompts),
        "capture": {"steps": config.num_steps, "guidance": config.guidance_scale, "solver": config.solver,
                    "rows_per_layer": args.rows, "seed": args.seed},
        "impl": impls[0] if len(impls) == 1 else list(impls), "layers": len(loaded.qlayers), "rows": rows,
        "bf16_floor": {"per_layer": floors, "median": float(np.median(list(floors.values()))),
                       "max": float(max(floors.values()))},
        "strategies": {label: {"finite": finite[label], **summarize(errors[label], floors), "per_layer": errors[label]}
                       for label in runs}}
    atomic_write_json(out_path, payload)
    atomic_write_text(out_path.with_suffix(".md"), table(payload))
    print(table(payload), flush=True)
    return payload


def table(payload: dict) -> str:
    """Markdown: one row per strategy (relative error vs float64 over the layers, and over the bf16 floor)."""
    capture = payload["capture"]
    floor = payload["bf16_floor"]
    lines = [f"{payload['device']}, jax {payload['jax']}, {payload['date_utc']}: {payload['recipe']} "
             f"({payload['layers']} W4A4 layers), inputs of the 16-bit model over {payload['prompts']} prompts x "
             f"{capture['steps']} steps (CFG {capture['guidance']:g}), up to {capture['rows_per_layer']} rows per "
             f"layer; relative L2 error vs eq. 11 in float64 on the same packed operands; the reference rounded to "
             f"bf16: median {floor['median']:.2e}, largest {floor['max']:.2e}", "",
             "| strategy | median | mean | largest (layer) | median / bf16 floor | largest / bf16 floor | finite |",
             "| --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for strategy, row in payload["strategies"].items():
        lines.append(f"| `{strategy}` | {row['median']:.2e} | {row['mean']:.2e} | {row['max']:.2e} "
                     f"(`{row['worst_layer']}`) | {row['median_over_bf16_floor']:.2f} | "
                     f"{row['max_over_bf16_floor']:.2f} | {row['finite']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        sys.exit(f"served_layer_error.py: {err}")

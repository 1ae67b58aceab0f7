"""The testbed's serving stack per image on the GPU (issue 16, "The whole stack, per image", testbed part).

The shipped emoji testbed DiT (``checkpoints/emoji_pixart``: PixArt-style, 10 blocks, hidden 256, 32 x 32 pixels in
16 x 16 = 256 tokens), its real prompt embeddings (the checkpoint's ``testbed_prompts.npz``), compute in bf16. Systems,
each one whole image batch from noise and caption embeddings to the final pixels as ONE AOT-compiled jitted call
(``models.testbed.model.euler_sample``: Euler steps under ``lax.scan``; with CFG both branches in one batch of 2b):

* ``teacher_20x2``: the 16-bit teacher, 20 steps x 2 CFG branches (guidance 3): 40 forwards per image (the reference
  of docs/testbed.md, docs/qad.md, docs/dmd2.md).
* ``ptq_w4a4_20x2``: the same with every quantizable linear (the 100 block linears) a W4A4 layer served on
  ``--strategy`` (``pallas_kernels.served``; default ``dequant``: the transform + quantize kernel and one cuBLAS GEMM
  over ``K = d + rank``): the two-branch PTQ model.
* ``qad_w4a4_20x1``: the W4A4 model, one branch (guidance 1, what the QAD student runs), 20 steps: 20 forwards.
* ``bf16_4x1``: the 16-bit model, one branch, 4 steps: the step and branch cut alone.
* ``dmd2_w4a4_4x1``: the W4A4 model, one branch, 4 steps (the QAD + DMD2 student): 4 forwards.

**Speed only**: the W4A4 layers are built from the teacher's real weights with the real layer math and stand-in
calibration (``kroquant_jax.qlinear.random_qlinear``: a random KroQuant transform, rank ``--rank`` factors, the
teacher's bias), because a layer's time depends on its shapes, not on its calibrated values; the images of the
trained students are judged in docs/qad.md and docs/dmd2.md. Check: the final pixels of ``ptq_w4a4_20x2`` and
``dmd2_w4a4_4x1`` against the 16-bit system of the same steps and guidance (relative L2: nonzero and
quantization-sized when the served layers are wired in). Batches (``--batches``, default 1 and 64): time per
image = the call's median wall time (``kroquant_jax.timing.wall_times``, after a warm-up call) / batch.

``--blocks N`` keeps only the checkpoint's first ``N`` of its 10 transformer blocks (the others' weights are not
loaded): every system runs the same sampler on a shallower model, so time scales with ``N`` and the W4A4 layers are
those ``N`` blocks' linears. The JSON and the printout name ``N`` of the real block count. It is for checking the
wiring quickly (the tests), not for the per-image figures.

    python3 benchmarks/testbed_stack.py --out $OUT/testbed_stack.json                 # the H200
    python3 benchmarks/testbed_stack.py --batches 2 --repeats 1 --out /tmp/t.json     # CPU validation (slow kernels
                                                                                      # run as their references)
    python3 benchmarks/testbed_stack.py --batches 2 --repeats 1 --blocks 1            # the same wiring, one block
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

# jax, the models and the served kernels are imported once the command line is parsed (main, and the helpers that
# need them): a command line argparse refuses is a one-line error without importing jax
from scripts.common_args import choice_list, positive_int  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / "checkpoints" / "emoji_pixart"
#: ``{system: (steps, guidance, W4A4)}``, in the order they run.
SYSTEMS = {"teacher_20x2": (20, 3.0, False), "ptq_w4a4_20x2": (20, 3.0, True), "qad_w4a4_20x1": (20, 1.0, True),
           "bf16_4x1": (4, 1.0, False), "dmd2_w4a4_4x1": (4, 1.0, True)}
BASELINE = "teacher_20x2"
#: The 16-bit system with the same steps and guidance as a W4A4 one (the wiring check).
SIXTEEN_BIT_OF = {"ptq_w4a4_20x2": "teacher_20x2", "dmd2_w4a4_4x1": "bf16_4x1"}


def batch_list(text: str) -> tuple[int, ...]:
    """An argparse ``type=``: comma-separated positive batch sizes, e.g. ``1,64``."""
    try:
        batches = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every batch must be >= 1")
    return batches


def forwards_per_image(name: str) -> int:
    steps, guidance, _ = SYSTEMS[name]
    return steps * (2 if guidance != 1.0 else 1)


def w4a4_layers(model: nnx.Module, key: jax.Array, rank: int) -> dict[str, Any]:
    """``{path: QuantizedLinear}`` of every quantizable linear of ``model`` from its own weights and bias (real layer
    math, stand-in calibration; layer ``i`` draws ``fold_in(key, i)``)."""
    import jax
    import jax.numpy as jnp

    from kroquant_jax.qlinear import random_qlinear
    from models.layers import linears

    out = {}
    for i, (path, linear) in enumerate(linears(model, quantizable_only=True).items()):
        w = jnp.asarray(linear.kernel[...], jnp.float32).T  # (o, d)
        layer = random_qlinear(w, jax.random.fold_in(key, i), min(rank, min(w.shape)))
        bias = None if linear.bias is None else jnp.asarray(linear.bias[...], jnp.float32)
        out[path] = layer if bias is None else dataclasses.replace(layer, bias=bias)
    return out


def load_first_blocks(checkpoint: str, blocks: int | None) -> tuple[Any, nnx.Module]:
    """``(cfg, model)`` of the diffusers checkpoint in bf16; with ``blocks``, only its first ``blocks`` transformer
    blocks (``cfg.num_layers = blocks``; the diffusers keys ``transformer_blocks.{i}.*`` of the others are dropped
    before the conversion)."""
    import jax.numpy as jnp

    from models import convert, families

    if blocks is None:
        _, cfg, model = families.load_diffusers(checkpoint, dtype=jnp.bfloat16)
        return cfg, model
    config, state = convert.read_diffusers_dir(checkpoint)
    family = families.detect(config, source=str(Path(checkpoint) / convert.CONFIG_NAME))
    cfg = dataclasses.replace(family.config_from_diffusers(config), num_layers=blocks)
    kept = {key: value for key, value in state.items()
            if not key.startswith("transformer_blocks.") or int(key.split(".")[1]) < blocks}
    return cfg, family.from_diffusers_state(kept, cfg, jnp.bfloat16)


def derive(payload: dict[str, Any]) -> None:
    """Per-image times and speed-ups against ``teacher_20x2`` at each batch (in place)."""
    payload["ms_per_image"], payload["speedup_per_image"] = {}, {}
    for batch, systems in payload["timings_ms"].items():
        per_image = {name: t["median_ms"] / int(batch) for name, t in systems.items()}
        payload["ms_per_image"][batch] = per_image
        if BASELINE in per_image:
            payload["speedup_per_image"][batch] = {n: per_image[BASELINE] / ms for n, ms in per_image.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=str(CHECKPOINT), help="the testbed's diffusers PixArt directory")
    parser.add_argument("--prompts", default=None, help="prompt embeddings .npz (default: the checkpoint's)")
    parser.add_argument("--systems", type=choice_list(tuple(SYSTEMS), "system"), default=tuple(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (run in that order; default all)")
    parser.add_argument("--strategy", default="dequant",
                        help="served strategy of the W4A4 layers (pallas_kernels.served's names; default %(default)s)")
    parser.add_argument("--batches", type=batch_list, default=(1, 64),
                        help="comma-separated image batches (default 1,64)")
    parser.add_argument("--rank", type=positive_int, default=32, help="low-rank rank (docs/qad.md's stores: 32)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed calls per system and batch")
    parser.add_argument("--blocks", type=positive_int, default=None,
                        help="only the checkpoint's first N transformer blocks (default all: 10; a quick wiring check, "
                             "not the per-image figures)")
    parser.add_argument("--out", default=None, help="JSON (default $OUT/testbed_stack.json, else /tmp)")
    args = parser.parse_args(argv)

    from pallas_kernels import served as S

    if args.strategy not in S.strategy_names():
        parser.error(f"--strategy {args.strategy!r}: one of {', '.join(S.strategy_names())}")
    from models import families

    family, config = families.detect_dir(args.checkpoint)
    model_blocks = family.config_from_diffusers(config).num_layers
    if args.blocks is not None and args.blocks > model_blocks:
        parser.error(f"--blocks {args.blocks}: the checkpoint has {model_blocks} blocks")

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kroquant_jax import timing
    from kroquant_jax.fileio import StagedResults
    from models.quantize_model import FusedLinearHooks, served_hooks
    from models.testbed import data as testbed_data
    from models.testbed import model as testbed

    prompts_path = Path(args.prompts) if args.prompts else Path(args.checkpoint) / "testbed_prompts.npz"
    start = time.perf_counter()
    cfg, model = load_first_blocks(args.checkpoint, args.blocks)
    dataset = testbed_data.load_dataset(prompts_path)
    device = jax.local_devices()[0]
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "testbed_stack.json"))
    impl = S.resolve_impl(None)
    payload: dict[str, Any] = {
        "what": ("the emoji testbed per image, bf16: 16-bit teacher 20 steps x 2 CFG branches vs W4A4 served layers "
                 "(two branches, one branch, 4 steps); speed only (stand-in calibration)"
                 + (f"; ONLY {cfg.num_layers} OF THE REAL {model_blocks} TRANSFORMER BLOCKS (a wiring check: time "
                    f"scales with the block count)" if cfg.num_layers < model_blocks else "")),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
        "jax": jax.__version__, "python": platform.python_version(),
        "command_args": list(sys.argv[1:] if argv is None else argv), "checkpoint": str(args.checkpoint),
        "prompts": str(prompts_path), "strategy": args.strategy, "impl": impl, "rank": args.rank,
        "systems": list(args.systems), "batches": list(args.batches), "blocks": cfg.num_layers,
        "model_blocks": model_blocks,
        "tokens_per_image": (cfg.sample_size // cfg.patch_size) ** 2,
        "forward_passes_per_image": {n: forwards_per_image(n) for n in args.systems},
        "method": (f"one AOT-compiled jitted call per batch (lax.scan over the Euler steps); a warm-up call, then the "
                   f"median of {args.repeats} calls, block_until_ready each; per image = median / batch"),
        "timings_ms": {}, "compile_s": {}, "finite": {}, "checks": {}, "errors": {}}
    results = StagedResults(out_path, payload, start, before_save=derive)

    graphdef, params = nnx.split(model)
    layers = w4a4_layers(model, jax.random.key(123), args.rank)
    payload["w4a4_linears"] = len(layers)
    options = S.ServeOptions(strategy=args.strategy, impl=impl)
    entries = served_hooks({p: S.serve(layer, strategy=args.strategy) for p, layer in layers.items()},
                           options=options).entries()
    timing.block(entries)
    null_context = jnp.asarray(dataset.null_context, jnp.bfloat16)  # (t, c)
    null_mask = jnp.asarray(dataset.null_mask, jnp.float32)  # (t,)

    def sample(params_, entries_, noise, context, mask, *, steps, guidance):
        m = nnx.merge(graphdef, params_)
        hooks = None if entries_ is None else FusedLinearHooks.from_entries(entries_)

        def velocity(x, t, c, k):
            return m(x.astype(jnp.bfloat16), c, t, encoder_attention_mask=k, hooks=hooks)

        return testbed.euler_sample(velocity, noise, context, mask, null_context, null_mask, steps, guidance)

    print(f"[{time.perf_counter() - start:6.1f} s] testbed model, {len(layers)} W4A4 layers on {args.strategy}",
          flush=True)
    for batch in args.batches:
        rows = np.arange(batch) % dataset.num_examples
        context = jnp.asarray(dataset.context[rows], jnp.bfloat16)  # (b, t, c)
        mask = jnp.asarray(dataset.context_mask[rows], jnp.float32)  # (b, t)
        noise = jax.random.normal(jax.random.key(batch), (batch, cfg.in_channels, cfg.sample_size, cfg.sample_size))
        payload["timings_ms"][str(batch)], payload["compile_s"][str(batch)] = {}, {}
        payload["finite"][str(batch)] = {}
        outputs: dict[str, np.ndarray] = {}
        for name in args.systems:
            steps, guidance, w4a4 = SYSTEMS[name]

            def run(name=name, steps=steps, guidance=guidance, w4a4=w4a4, batch=batch, context=context, mask=mask,
                    noise=noise):
                fn = functools.partial(sample, steps=steps, guidance=guidance)
                call_args = (params, entries if w4a4 else None, noise, context, mask)
                t0 = time.perf_counter()
                compiled = jax.jit(fn).lower(*call_args).compile()
                payload["compile_s"][str(batch)][name] = time.perf_counter() - t0
                out = jax.block_until_ready(compiled(*call_args))
                payload["finite"][str(batch)][name] = bool(jnp.all(jnp.isfinite(out)))
                outputs[name] = np.asarray(jax.device_get(out), np.float32)
                reference = SIXTEEN_BIT_OF.get(name)
                if reference in outputs:  # the served layers are wired in: a quantization-sized difference
                    ref = outputs[reference]
                    payload["checks"][f"{name} vs {reference} pixels rel err, batch {batch}"] = float(
                        np.linalg.norm(outputs[name] - ref) / np.linalg.norm(ref))
                samples = timing.wall_times(lambda: compiled(*call_args), repeats=args.repeats, inner=1)
                payload["timings_ms"][str(batch)][name] = timing.summary_ms(samples)
                print(f"  batch {batch:3d} {name:15s} {payload['timings_ms'][str(batch)][name]['median_ms']:9.2f} ms"
                      f" per call, {payload['timings_ms'][str(batch)][name]['median_ms'] / batch:8.3f} ms per image",
                      flush=True)

            results.stage(f"{name}@{batch}", run)
    results.save()
    print(table(payload), flush=True)
    return payload


def table(payload: dict[str, Any]) -> str:
    lines = [f"{payload['device']} jax {payload['jax']} {payload['date_utc']} strategy={payload['strategy']} "
             f"impl={payload['impl']} blocks={payload['blocks']} of {payload['model_blocks']}",
             f"  {'system':15s} {'fwd/img':>7s} " + " ".join(f"{'b=' + b + ' ms/img':>14s} {'x':>6s}"
                                                              for b in payload["ms_per_image"])]
    for name in payload["systems"]:
        cells = []
        for batch, per_image in payload["ms_per_image"].items():
            ms = per_image.get(name)
            x = payload["speedup_per_image"].get(batch, {}).get(name)
            cells.append(f"{'' if ms is None else f'{ms:.3f}':>14s} {'' if x is None else f'{x:.2f}x':>6s}")
        lines.append(f"  {name:15s} {payload['forward_passes_per_image'][name]:7d} " + " ".join(cells))
    for name, err in payload["errors"].items():
        lines.append(f"  ERROR {name}: {err[:300]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""One denoising step of a PixArt-Σ or FLUX.1 transformer at its real size (random weights): bf16 against every served
W4A4 strategy (issue 14's forwards beyond Ideogram 4, which ``benchmarks/dit_forward_w4a4.py`` measures).

The model is the family's preset of a real checkpoint (``models.families``: PixArt-Sigma-XL-2-1024-MS, FLUX.1-schnell)
built with random bf16 weights on the device; ``--double-blocks`` / ``--single-blocks`` keep only that many of its
blocks (the blocks of one kind are identical in shape and work, so the blocks' time scales with their number; the
embeddings and final layer then weigh more, and the bf16 / W4A4 ratio lies closer to 1 than the whole model's). Every
quantizable linear (``models.layers.linears(quantizable_only=True)``) becomes a W4A4 MXFP4 layer with the real layer
math and stand-in calibration (``kroquant_jax.qlinear.random_qlinear``: a random KroQuant transform, randomized
low-rank factors of rank ``--rank``), served through the family's linear overrides
(``QuantizedCheckpoint.served_overrides``: what ``kroquant generate`` runs). With ``--fuse-shared-inputs`` each of
the family's groups of linears that read one input (``Family.shared_inputs``: q|k|v, ...) is one stand-in W4A4 layer
of their stacked weights, as a ``kroquant quantize-checkpoint --fuse-shared-inputs`` checkpoint is served (one
quantizer call and one GEMM per group), and the system ``bf16_fused`` runs the same groups as one bf16 GEMM each (the
fair 16-bit baseline of a fused forward; ratios against both are recorded).

Every system runs the same softmax attention (``--attention``; on a GPU by default cuDNN's flash attention, what
serving uses; ``xla`` materialises the fp32 logits). One call is the family's sampler with one step at guidance 1
(``Family.make_sampler``: the noise, one forward at ``--height`` pixels, batch 1, synthetic prompt embeddings of
``--text-tokens`` tokens, the Euler / DPM update): timed as the median wall time of ``--repeats`` samples of
``--inner`` back-to-back calls after a compiling warm-up, and, with ``--kernels``, as the sum of its kernel durations
(CUPTI, ``kroquant_jax.timing.device_time``) with the costliest kernels. Checks: each W4A4 output's relative L2 error
against the bf16 output (finite; the W4A4 outputs differ from each other by rounding only) and, with ``simulate``
among ``--strategies`` (the same quantized layers fake-quantized in f32, ``QuantizedCheckpoint.overrides``), each
served output's error against it. Each served system's sampler is compiled as ``kroquant generate`` compiles it,
with its strategy's per-program XLA options (``served.program_compiler_options``, recorded as ``xla_options``);
``--xla-defaults`` compiles every system with XLA's defaults instead. Writes the JSON (``--out``, atomically) and
prints a table. Off the GPU each served system's layers are prepared in one jitted program
(``served_overrides(jit=True)``: op by op, every op would compile on its own for each layer shape); on a GPU op by
op, as ``kroquant generate`` prepares them.

    python3 benchmarks/family_forward_w4a4.py --family pixart --strategies dequant,fp8,fp8_mgpu --kernels
    python3 benchmarks/family_forward_w4a4.py --family flux --double-blocks 2 --single-blocks 4 --kernels
    python3 benchmarks/family_forward_w4a4.py --family flux --strategies fp8_mgpu --fuse-shared-inputs --kernels
    python3 benchmarks/family_forward_w4a4.py --family pixart --preset tiny --strategies dequant      # a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kroquant_jax import timing  # noqa: E402
from kroquant_jax.fileio import atomic_write_json  # noqa: E402
from kroquant_jax.qlinear import random_qlinear  # noqa: E402
from kroquant_jax.shared_inputs import fused_name  # noqa: E402
from models import families, flux, pixart  # noqa: E402
from models.layers import ATTENTION_IMPLEMENTATIONS, SharedOverrides, linears  # noqa: E402
from models.quantized_checkpoint import QuantizedCheckpoint  # noqa: E402
from pallas_kernels import served  # noqa: E402
from scripts.common_args import UserError, choice_list, positive_int  # noqa: E402
from scripts.quantize_checkpoint import prompt_arrays, prompt_batches  # noqa: E402

#: Small configs of the same architectures for the CPU (the test); the full ones are the families' presets.
TINY = {
    "pixart": dataclasses.replace(pixart.PIXART_SIGMA_XL_2_1024_MS, num_attention_heads=2, attention_head_dim=32,
                                  num_layers=2, cross_attention_dim=64, sample_size=8, caption_channels=64),
    "flux": dataclasses.replace(flux.FLUX1_SCHNELL, num_layers=1, num_single_layers=2, attention_head_dim=32,
                                num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32,
                                axes_dims_rope=(8, 12, 12)),
}
#: The fake-quantized W4A4 forward (``qlinear_forward(path="simulate")``, f32 math) as a system of ``--strategies``.
SIMULATE = "simulate"
#: The bf16 baseline with the shared-input groups as one GEMM each (``--fuse-shared-inputs``).
BF16_FUSED = "bf16_fused"
#: VAE downsampling of both families' latents.
VAE_FACTOR = 8


def model_config(family: str, preset: str, double_blocks: int | None, single_blocks: int | None):
    """The preset's config with only the blocks asked for (``double_blocks``: PixArt's blocks, FLUX's double-stream
    blocks; ``single_blocks``: FLUX's single-stream blocks)."""
    cfg = TINY[family] if preset == "tiny" else next(iter(families.get(family).presets.values()))
    changes = {}
    if double_blocks is not None:
        if not 0 < double_blocks <= cfg.num_layers:
            raise UserError(f"--double-blocks {double_blocks}: the {family} preset has {cfg.num_layers}")
        changes["num_layers"] = double_blocks
    if single_blocks is not None:
        if family != "flux":
            raise UserError(f"--single-blocks {single_blocks}: only FLUX.1 has single blocks")
        if not 0 <= single_blocks <= cfg.num_single_layers:
            raise UserError(f"--single-blocks {single_blocks}: the {family} preset has {cfg.num_single_layers}")
        changes["num_single_layers"] = single_blocks
    return dataclasses.replace(cfg, **changes), cfg


def stand_in_qlayers(model, rank: int, key: jax.Array, groups=()) -> dict:
    """``{name: QuantizedLinear}`` of every quantizable linear (MXFP4, rank ``min(rank, o, d)``), one compiled
    builder per shape; the linears of each of ``groups`` (``Family.shared_inputs``) as one fused layer ``a|b|c`` of
    their stacked weights (what ``kroquant quantize-checkpoint --fuse-shared-inputs`` stores)."""
    build = jax.jit(random_qlinear, static_argnums=2)
    by_path = linears(model, quantizable_only=True)
    grouped = {path for group in groups for path in group}
    units = [(fused_name(group), list(group)) for group in groups]
    units += [(path, [path]) for path in by_path if path not in grouped]
    out = {}
    for i, (name, members) in enumerate(units):
        w = jnp.concatenate([jnp.asarray(by_path[p].kernel[...]).T for p in members]).astype(jnp.float32)  # (o, d)
        out[name] = build(w, jax.random.fold_in(key, i), min(rank, *w.shape))
    return out


def _stacked_dense(layer: tuple, x: jax.Array) -> jax.Array:
    kernel, bias = layer  # (d, o), (o,) | None
    y = jnp.matmul(x.astype(kernel.dtype), kernel)  # (..., o)
    return y if bias is None else y + bias


def bf16_shared_input_overrides(model, groups) -> SharedOverrides:
    """The 16-bit model with each group of linears that read one input run as one GEMM of their concatenated kernels
    (and biases): the bf16 counterpart of the fused W4A4 layers (each member takes its columns of the output)."""
    by_path = linears(model)
    parts = []
    for group in groups:
        members = [by_path[p] for p in group]
        kernel = jnp.concatenate([m.kernel[...] for m in members], axis=1)  # (d, sum o)
        biases = [m.bias for m in members]
        bias = None if all(b is None for b in biases) else jnp.concatenate(
            [jnp.zeros((m.out_features,), kernel.dtype) if b is None else b[...] for m, b in zip(members, biases)])
        parts.append(SharedOverrides.split(fused_name(group), (kernel, bias), _stacked_dense, group,
                                           [m.out_features for m in members]))
    return SharedOverrides.merged(*parts)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("pixart", "flux"), required=True)
    p.add_argument("--preset", choices=("full", "tiny"), default="full")
    p.add_argument("--double-blocks", type=positive_int, help="keep this many (double-stream) blocks (default all)")
    p.add_argument("--single-blocks", type=int, help="FLUX.1: keep this many single-stream blocks (default all)")
    p.add_argument("--strategies", default="dequant,fp8,fp8_mgpu",
                   type=choice_list((SIMULATE, *served.strategy_names()), "strategy"),
                   help="comma-separated: served strategies and simulate (default %(default)s)")
    p.add_argument("--height", type=positive_int, help="image side in pixels (default 1024; tiny: 64)")
    p.add_argument("--text-tokens", type=positive_int, help="prompt tokens (default: PixArt 300, FLUX 512; tiny 4)")
    p.add_argument("--rank", type=positive_int, default=128, help="low-rank rank (default %(default)s)")
    p.add_argument("--attention", choices=ATTENTION_IMPLEMENTATIONS,
                   help="softmax attention of every system (default: cudnn on a GPU, as served; xla elsewhere)")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--inner", type=positive_int, default=2)
    p.add_argument("--kernels", action="store_true", help="add CUPTI kernel sums and the costliest kernels")
    p.add_argument("--fuse-shared-inputs", action="store_true",
                   help="the family's groups of linears that read one input (q|k|v, ...) as one W4A4 layer each, as "
                        "a --fuse-shared-inputs checkpoint serves them, and the system bf16_fused (the same groups "
                        "as one bf16 GEMM each) beside bf16")
    p.add_argument("--xla-defaults", action="store_true",
                   help="compile every system with XLA's defaults, without its strategy's per-program XLA options "
                        "(served.program_compiler_options: what kroquant generate uses), e.g. to compare XLA_FLAGS")
    p.add_argument("--out", default=None, help="JSON (default $OUT/family_forward_w4a4.json, else /tmp)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    strategies = list(args.strategies)
    tiny = args.preset == "tiny"
    cfg, preset_cfg = model_config(args.family, args.preset, args.double_blocks, args.single_blocks)
    attention = args.attention or ("cudnn" if jax.default_backend() == "gpu" else "xla")
    if attention == "cudnn" and jax.default_backend() != "gpu":
        raise UserError(f"--attention cudnn needs an NVIDIA GPU (the backend is {jax.default_backend()})")
    cfg = dataclasses.replace(cfg, attention_impl=attention)
    height = args.height or (64 if tiny else 1024)
    tokens = args.text_tokens or (4 if tiny else {"pixart": 300, "flux": 512}[args.family])
    if height % (VAE_FACTOR * 2):
        raise UserError(f"--height {height}: must be a multiple of {VAE_FACTOR * 2} (VAE factor x patch 2)")
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "family_forward_w4a4.json"))
    family = families.get(args.family)
    began = time.perf_counter()
    model = family.build(cfg, dtype=jnp.bfloat16, seed=0, on_device=not tiny)  # FLUX.1: 12B parameters
    groups = family.shared_inputs(model) if args.fuse_shared_inputs else ()
    qlayers = stand_in_qlayers(model, args.rank, jax.random.key(1), groups)
    timing.block(qlayers)
    build_s = time.perf_counter() - began
    checkpoint = QuantizedCheckpoint(family=args.family, cfg=cfg, model=model, qlayers=qlayers, config={})
    graphdef, state = nnx.split(model)
    hw = (height // VAE_FACTOR, height // VAE_FACTOR)
    sampler = family.make_sampler(graphdef, cfg, num_steps=1, guidance_scale=1.0, latent_hw=hw)
    synthetic = argparse.Namespace(embeddings=None, synthetic_prompts=1, synthetic_tokens=tokens, seed=0,
                                   max_prompts=None)  # kroquant quantize-checkpoint --synthetic-prompts 1
    batch = prompt_batches(prompt_arrays(synthetic, family, cfg), [0], 1, jnp.bfloat16)[0]
    key = jax.random.key(0)

    systems, outputs = {}, {}
    baselines = ["bf16", BF16_FUSED] if groups else ["bf16"]
    for system in [*baselines, *strategies]:
        overrides = ({} if system == "bf16" else bf16_shared_input_overrides(model, groups) if system == BF16_FUSED
                     else checkpoint.overrides() if system == SIMULATE
                     else checkpoint.served_overrides(served.ServeOptions(strategy=system),
                                                       jit=jax.default_backend() != "gpu"))
        params = {"model": state, **batch, **({"overrides": overrides} if overrides else {})}
        served_system = system not in (*baselines, SIMULATE) and not args.xla_defaults
        xla_options = served.program_compiler_options(system if served_system else None)
        sample = jax.jit(sampler, compiler_options=xla_options or None)  # as kroquant generate compiles it
        call = lambda: sample(params, key)[0]  # noqa: E731
        t0 = time.perf_counter()
        y = call()
        timing.block(y)
        row = {"first_call_s_compile_included": time.perf_counter() - t0, "xla_options": xla_options,
               **timing.summary_ms(timing.wall_times(call, repeats=args.repeats, inner=args.inner))}
        if args.kernels:
            dt = timing.device_time(lambda p: sample(p, key)[0], [params], n_iter=3, warmup=1)
            top = sorted(dt.kernels_us.items(), key=lambda kv: -kv[1])[:8]
            attention_us = timing.kernels_matching_us(dt.kernels_us, timing.CUDNN_ATTENTION_KERNELS)
            row.update(kernel_sum_ms=dt.us / 1e3, kernel_method=dt.method,
                       kernel_launches_per_call=sum(dt.kernel_launches.values()) or None,
                       attention_kernel_ms=None if attention_us is None else attention_us / 1e3,
                       top_kernels_ms={name: us / 1e3 for name, us in top})
        outputs[system] = np.asarray(y, np.float32)
        row["finite"] = bool(np.isfinite(outputs[system]).all())
        systems[system] = row
        print(f"  {system:10s} {row['median_ms']:9.2f} ms (first call {row['first_call_s_compile_included']:.1f} s)",
              flush=True)
        del overrides, params
    reference = outputs["bf16"]
    for system in [*baselines[1:], *strategies]:
        systems[system]["rel_l2_vs_bf16"] = float(np.linalg.norm(outputs[system] - reference)
                                                  / np.linalg.norm(reference))
        for base in baselines:
            suffix = "" if base == "bf16" else "_fused"
            if system == base:
                continue
            systems[system][f"speedup_vs_bf16{suffix}"] = systems[base]["median_ms"] / systems[system]["median_ms"]
            if args.kernels:
                row, base_row = systems[system], systems[base]
                row[f"kernel_speedup_vs_bf16{suffix}"] = base_row["kernel_sum_ms"] / row["kernel_sum_ms"]
                if row["attention_kernel_ms"] is not None and base_row["attention_kernel_ms"] is not None:
                    # the same attention kernel has run at different speeds in the two programs: the linears' share
                    row[f"kernel_speedup_vs_bf16{suffix}_without_attention"] = (
                        (base_row["kernel_sum_ms"] - base_row["attention_kernel_ms"])
                        / (row["kernel_sum_ms"] - row["attention_kernel_ms"]))
        if SIMULATE in outputs and system != SIMULATE:
            systems[system]["rel_l2_vs_simulate"] = float(np.linalg.norm(outputs[system] - outputs[SIMULATE])
                                                           / np.linalg.norm(outputs[SIMULATE]))
    device = jax.devices()[0]
    blocks = {"double": cfg.num_layers, "double_in_preset": preset_cfg.num_layers}
    if args.family == "flux":
        blocks.update(single=cfg.num_single_layers, single_in_preset=preset_cfg.num_single_layers)
    payload = {
        "what": f"one denoising step (sampler, guidance 1) of {args.family} at {height} px, batch 1, random weights: "
                f"bf16 vs W4A4 served strategies (MXFP4, stand-in calibration, rank {args.rank})",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(device, "device_kind", str(device)), "backend": jax.default_backend(),
        "jax": jax.__version__, "python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "command_args": list(sys.argv[1:] if argv is None else argv), "family": args.family, "preset": args.preset,
        "blocks": blocks, "attention_impl": attention, "height": height, "latent_hw": list(hw), "text_tokens": tokens,
        "quantized_layers": len(qlayers), "fused_groups": len(groups), "rank": args.rank,
        "ranks": sorted({int(layer.config.rank) for layer in qlayers.values()}), "build_s": build_s,
        "memory_gib": timing.device_memory_gib(), "systems": systems}
    atomic_write_json(out_path, payload)
    print(table(payload), flush=True)
    return payload


def table(payload: dict) -> str:
    """Markdown: one row per system (median ms, ratio to bf16, kernel sums, error vs bf16)."""
    b = payload["blocks"]
    kinds = f"{b['double']} of {b['double_in_preset']} blocks" + (
        f", {b['single']} of {b['single_in_preset']} single blocks" if "single" in b else "")
    lines = [f"{payload['device']}, jax {payload['jax']}, {payload['date_utc']}: {payload['family']} ({kinds}), "
             f"{payload.get('attention_impl', 'xla')} attention, {payload['height']} px, {payload['text_tokens']} text "
             f"tokens, {payload['quantized_layers']} W4A4 layers ({payload.get('fused_groups', 0)} of them fused "
             f"shared-input groups), ranks {payload['ranks']}", "",
             "| system | median ms | / bf16 | / bf16 fused | kernel sum ms | / bf16 (kernels) | cuDNN attention ms "
             "| / bf16 (kernels without attention) | rel. L2 vs bf16 | rel. L2 vs simulate | finite |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, row in payload["systems"].items():
        kernels, attention = row.get("kernel_sum_ms"), row.get("attention_kernel_ms")
        kernel_cells = ("— | —" if kernels is None else
                        f"{kernels:.2f} | {row.get('kernel_speedup_vs_bf16', 1.0):.2f}x")
        kernel_cells += (" | — | —" if attention is None else
                         f" | {attention:.2f} | {row.get('kernel_speedup_vs_bf16_without_attention', 1.0):.2f}x")
        fused = "—" if "speedup_vs_bf16_fused" not in row else f"{row['speedup_vs_bf16_fused']:.2f}x"
        lines.append(f"| `{name}` | {row['median_ms']:.2f} | {row.get('speedup_vs_bf16', 1.0):.2f}x | {fused} | "
                     f"{kernel_cells} | "
                     f"{row.get('rel_l2_vs_bf16', 0.0):.3f} | "
                     f"{'—' if 'rel_l2_vs_simulate' not in row else format(row['rel_l2_vs_simulate'], '.4f')} | "
                     f"{row['finite']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        sys.exit(f"family_forward_w4a4.py: {err}")

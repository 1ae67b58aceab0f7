"""The fused FP8 GEMM (``pallas_kernels/fp8_gemm_mgpu.py``) on the H200: checked, then timed against XLA's FP8 GEMM
with its epilogue (``fp8_gemm.fp8_matmul``: powers of two, bias, the bf16 ``h L^T`` GEMM) and a bf16 GEMM.

Operands: MXFP4 activations (outlier channels) and weights re-encoded in E4M3 (``even_odd`` order), rank-128 bf16
low-rank branch, f32 bias, bf16 output; by default the shapes of Ideogram 4 (``--layers q w13 w2``: q, the fused
w1|w3 and w2) or any real checkpoint's layer by its ``models.layer_shapes`` name (``flux1.attn.q``), at m = 4096
and 512. Device time (CUPTI, ``kroquant_jax.timing.device_time``: median per call over rotating input sets
after warm-up). Check: the kernel's output against its jnp mirror (the same math in f32 at HIGHEST precision) and
against the XLA path, relative L2. A failing shape is recorded with its error and the run goes on.

    python3 benchmarks/fp8_mgpu_bench.py --out $OUT/fp8_mgpu_bench.json
    python3 benchmarks/fp8_mgpu_bench.py --out $OUT/sweep.json --configs "s1:max_concurrent_steps=1" \
        "s3c32:max_concurrent_steps=3,lowrank_chunk=32"

``--configs`` adds tilings to time beside ``default_config`` (``name:field=value,...`` over
:class:`~pallas_kernels.fp8_gemm_mgpu.Fp8MgpuConfig`'s fields; ``name:+field=value,...`` changes only those fields of
each shape's ``default_config``); each is checked against the mirror before it is timed, and one that does not fit or
fails is recorded with its error. ``--row-group G`` also times the default tiling on activations with one exponent
per row and group of ``G`` K values (``fp8_encoding.mxfp4_to_e4m3(group=G)``: the accumulator rescaled between K
steps), checked against its own mirror, as the tiling ``default_row_groups``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The short names of the default layers (Ideogram 4's); any full name of models.layer_shapes (e.g. flux1.attn.q) is
# accepted too, and a case records the name it was asked by.
ALIASES = {"q": "ideogram4.attn.q", "w13": "ideogram4.ffn.w13", "w2": "ideogram4.ffn.w2"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON record to write")
    p.add_argument("--layers", nargs="+", default=list(ALIASES), metavar="LAYER",
                   help=f"{', '.join(ALIASES)} (Ideogram 4, the default) or full names of models.layer_shapes "
                        "(e.g. flux1.attn.q, pixart_sigma.ff.up)")
    p.add_argument("--ms", nargs="+", type=int, default=[4096, 512])
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--n-iter", type=int, default=20)
    p.add_argument("--configs", nargs="*", default=[], metavar="NAME:FIELD=VALUE,...",
                   help="extra tilings to time beside default_config")
    p.add_argument("--row-group", type=int, metavar="G",
                   help="also time default_config with the activations' exponents per row and group of G K values "
                        "(fp8_encoding.mxfp4_to_e4m3(group=G); the tiling 'default_row_groups')")
    args = p.parse_args(argv)
    try:
        extra = dict(_parse_config(spec) for spec in args.configs)
    except ValueError as err:
        p.error(str(err))
    from models.layer_shapes import PRESET_LABELS, preset_layer_shapes

    # only the presets that the layers name (each preset's model is built to read its shapes); all for an unknown one
    named = {ALIASES.get(name, name).split(".", 1)[0] for name in args.layers}
    shapes = preset_layer_shapes(*[label for label in PRESET_LABELS if label in named])
    unknown = [name for name in args.layers if ALIASES.get(name, name) not in shapes]
    if unknown:
        shapes = preset_layer_shapes()
        p.error(f"--layers: unknown {unknown} (known: {', '.join([*ALIASES, *shapes])})")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kroquant_jax import fp8_encoding as FE
    from kroquant_jax import timing
    from kroquant_jax.fileio import atomic_write_json
    from kroquant_jax.formats import MXFP4, quantize
    from pallas_kernels import fp8_gemm as G8
    from pallas_kernels import fp8_gemm_mgpu as F

    quant = jax.jit(lambda x: FE.mxfp4_to_e4m3(quantize(x, MXFP4()), order="even_odd"))

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one program per shape (op by op, each op compiles)
    def random_operands(key, m, n, k):
        """``w`` f32, ``L`` bf16, bias, and per input set ``(a f32 with outlier channels, h bf16)``."""
        keys = jax.random.split(key, 4)
        w = jax.random.normal(keys[0], (n, k)) / np.sqrt(k)
        left = (jax.random.normal(keys[1], (n, args.rank)) * 0.05).astype(jnp.bfloat16)
        bias = jax.random.normal(keys[2], (n,)) * 0.1
        activations = []
        for s in range(3):
            ka, kh = jax.random.split(jax.random.fold_in(keys[3], s))
            a = jax.random.normal(ka, (m, k)) * jnp.where(jnp.arange(k) % 97 == 0, 20.0, 1.0)
            activations.append((a, (jax.random.normal(kh, (m, args.rank)) * 0.5).astype(jnp.bfloat16)))
        return w, left, bias, activations

    quant_groups = jax.jit(lambda x: FE.mxfp4_to_e4m3(quantize(x, MXFP4()), order="even_odd", group=args.row_group))
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M"),
              "command": "python3 benchmarks/fp8_mgpu_bench.py " + " ".join(argv or sys.argv[1:]), "cases": []}
    for name in args.layers:
        n, k = shapes[ALIASES.get(name, name)]
        for m in args.ms:
            case = {"layer": name, "model_layer": ALIASES.get(name, name), "m": m, "n": n, "k": k, "rank": args.rank}
            try:
                w, left, bias, activations = random_operands(jax.random.key(m + n), m, n, k)
                w8 = quant(w)
                wb = w.astype(jnp.bfloat16)
                sets = [(quant(a), h, a.astype(jnp.bfloat16), quant_groups(a) if args.row_group else None)
                        for a, h in activations]
                xla = jax.jit(lambda s: G8.fp8_matmul(s[0], w8, lowrank=(s[1], left), bias=bias))
                bf16 = jax.jit(lambda s: jnp.dot(s[2], wb.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
                mirrors = {i: np.asarray(F.fp8_matmul_mgpu_reference(sets[0][i], w8, lowrank=(sets[0][1], left),
                                                                     bias=bias, out_dtype=jnp.bfloat16), np.float64)
                           for i in ((0, 3) if args.row_group else (0,))}
                y_xla = np.asarray(xla(sets[0]), np.float64)
                for label, fn in (("bf16", bf16), ("fp8_xla", xla)):
                    t = timing.device_time(fn, sets, n_iter=args.n_iter)
                    case[f"{label}_us"], case[f"{label}_method"] = t.us, t.method
                case["configs"] = {}
                default = F.default_config(m, n, k, args.rank)
                variants = {cname: (cfg, 0) for cname, cfg in {"default": default, **extra}.items()}
                if args.row_group:  # the same tiling, activations with one exponent per row and K group
                    variants["default_row_groups"] = (default, 3)
                for cname, (cfg, operand) in variants.items():
                    case["configs"][cname] = entry = {}
                    try:
                        cfg = cfg(default) if callable(cfg) else cfg
                        entry.update(config=str(cfg), smem_bytes=cfg.smem_bytes(args.rank))
                        fused = jax.jit(lambda s, cfg=cfg, i=operand: F.fp8_matmul_mgpu(
                            s[i], w8, lowrank=(s[1], left), bias=bias, config=cfg))
                        y = np.asarray(fused(sets[0]), np.float64)
                        mirror = mirrors[operand]
                        entry["rel_err_vs_mirror"] = float(np.linalg.norm(y - mirror) / np.linalg.norm(mirror))
                        entry["rel_err_vs_xla"] = float(np.linalg.norm(y - y_xla) / np.linalg.norm(y_xla))
                        entry["finite"] = bool(np.all(np.isfinite(y)))
                        t = timing.device_time(fused, sets, n_iter=args.n_iter)
                        entry.update(us=t.us, method=t.method, kernels_us=t.kernels_us,
                                     speedup_vs_bf16=case["bf16_us"] / t.us,
                                     speedup_vs_fp8_xla=case["fp8_xla_us"] / t.us, status="ok")
                    except Exception as err:  # noqa: BLE001 - recorded; the other tilings still run
                        entry["status"] = f"{type(err).__name__}: {str(err)[:400]}"
                ok = {c: e for c, e in case["configs"].items() if e.get("status") == "ok" and e["finite"]
                      and e["rel_err_vs_mirror"] < 1e-2}
                if ok:
                    best = min(ok, key=lambda c: ok[c]["us"])
                    case.update(best_config=best, fp8_mgpu_us=ok[best]["us"],
                                mgpu_speedup_vs_bf16=case["bf16_us"] / ok[best]["us"],
                                mgpu_speedup_vs_fp8_xla=case["fp8_xla_us"] / ok[best]["us"])
                case["status"] = "ok"
            except Exception as err:  # noqa: BLE001 - recorded; the other shapes still run
                case["status"] = f"{type(err).__name__}: {str(err)[:600]}"
                case["traceback"] = traceback.format_exc()[-3000:]
            record["cases"].append(case)
            atomic_write_json(args.out, record)
            print(json.dumps({k2: v for k2, v in case.items() if k2 != "traceback"}), flush=True)
    print("| layer | m | tiling | bf16 µs | FP8 XLA µs | FP8 fused µs | fused / bf16 | fused / XLA | rel err vs mirror |")
    for c in record["cases"]:
        for cname, e in c.get("configs", {}).items():
            if e.get("status") == "ok":
                print(f"| {c['layer']} | {c['m']} | {cname} | {c['bf16_us']:.1f} | {c['fp8_xla_us']:.1f} | "
                      f"{e['us']:.1f} | {e['speedup_vs_bf16']:.2f}x | {e['speedup_vs_fp8_xla']:.2f}x | "
                      f"{e['rel_err_vs_mirror']:.1e} |")
            else:
                print(f"| {c['layer']} | {c['m']} | {cname} | {e.get('status', c['status'])[:80]} |")
    return 0


def _parse_config(spec: str):
    """``"name:field=value,..."`` -> ``(name, Fp8MgpuConfig)``; ``"name:+field=value,..."`` -> ``(name, f)`` with
    ``f(default)`` the shape's default tiling with those fields changed. Values are ints, ``None`` or strings."""
    from pallas_kernels.fp8_gemm_mgpu import Fp8MgpuConfig

    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"--configs {spec!r}: expected NAME:FIELD=VALUE,... or NAME:+FIELD=VALUE,...")
    relative = body.startswith("+")
    body = body[1:] if relative else body
    fields = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--configs {spec!r}: {item!r} is not FIELD=VALUE")
        fields[key] = None if value == "None" else int(value) if value.lstrip("-").isdigit() else value
    try:
        config = Fp8MgpuConfig(**fields) if not relative else dataclasses.replace(Fp8MgpuConfig(), **fields)
    except (TypeError, ValueError) as err:
        if not (relative and isinstance(err, ValueError)):  # a relative change may be valid on the shapes' tilings
            raise ValueError(f"--configs {spec!r}: {err}") from None
    return name, (functools.partial(dataclasses.replace, **fields) if relative else config)


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/family_forward_w4a4.py on the CPU (tiny PixArt and FLUX.1 configs, the served strategy through its jnp
reference): the W4A4 forward runs every quantizable linear served, its output is near but not equal to bf16's, the
printed figures are the recorded ones, and bad block counts are refused with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args, xla_flags=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "family_forward_w4a4.py"), *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


# PixArt-Σ with its shared-input groups fused (--fuse-shared-inputs: q|k|v and the cross-attention's k|v as one W4A4
# layer each, 10 linears -> 7 layers, plus the bf16_fused baseline) served by fp8_mgpu, whose sampler compiles without
# XLA's command buffers; FLUX.1 per linear served by dequant (XLA's defaults) with the kernel breakdown.
@pytest.mark.parametrize("family, args, layers, groups, strategy, xla_options", [
    ("pixart", ["--double-blocks", 1, "--fuse-shared-inputs"], 7, 2, "fp8_mgpu",
     {"xla_gpu_enable_command_buffer": ""}),
    ("flux", ["--single-blocks", 1, "--kernels"], 17, 0, "dequant", {})])
def test_one_step_bf16_against_served_w4a4(family, args, layers, groups, strategy, xla_options, tmp_path):
    out = tmp_path / "f.json"
    # recorded: XLA flags change what a GPU run measures. These replace the suite's XLA_FLAGS, so they start from them
    # (conftest's CPU compile settings reach this run too), plus one host device and -O0 where the suite left XLA's
    # optimisation level alone (LLVM's optimiser is most of the tiny samplers' compile time)
    suite = os.environ.get("XLA_FLAGS", "")
    flags = " ".join([suite, "--xla_force_host_platform_device_count=1"] + (
        [] if "--xla_backend_optimization_level" in suite else ["--xla_backend_optimization_level=0"])).strip()
    run = _run(["--family", family, "--preset", "tiny", *args, "--strategies", f"simulate,{strategy}", "--repeats", 2,
                "--inner", 1, "--out", out], xla_flags=flags)
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["xla_flags"] == flags
    assert saved["quantized_layers"] == layers and saved["ranks"] == [64] and saved["latent_hw"] == [8, 8]
    assert saved["fused_groups"] == groups and f"({groups} of them fused shared-input groups)" in run.stdout
    systems = saved["systems"]
    assert sorted(systems) == sorted(["bf16", "simulate", strategy] + (["bf16_fused"] if groups else []))
    # each sampler compiled as kroquant generate compiles it: the served strategy's per-program XLA options
    assert [systems[s]["xla_options"] for s in ("bf16", "simulate", strategy)] == [{}, {}, xla_options]
    bf16, w4a4 = saved["systems"]["bf16"], saved["systems"][strategy]
    if groups:
        assert systems["bf16_fused"]["rel_l2_vs_bf16"] < 1e-2  # the same products, summed in another order
        assert w4a4["speedup_vs_bf16_fused"] == pytest.approx(systems["bf16_fused"]["median_ms"] / w4a4["median_ms"])
    assert bf16["finite"] and w4a4["finite"] and len(w4a4["samples_ms"]) == 2
    assert 0 < w4a4["rel_l2_vs_bf16"] < 0.5  # quantized, and not garbage
    assert w4a4["speedup_vs_bf16"] == pytest.approx(bf16["median_ms"] / w4a4["median_ms"])
    assert f"| `{strategy}` | {w4a4['median_ms']:.2f} |" in run.stdout
    if "--kernels" in args:  # no GPU kernels on the CPU: wall-clock sums, no cuDNN attention to take out
        assert w4a4["kernel_method"] == "wallclock" and w4a4["attention_kernel_ms"] is None
        assert "kernel_speedup_vs_bf16_without_attention" not in w4a4 and w4a4["kernel_speedup_vs_bf16"] > 0
        row = next(line for line in run.stdout.splitlines() if line.startswith(f"| `{strategy}` |"))
        assert row.count("|") == 12 and "| — | — |" in row
    # the served layers differ from the simulated ones by their bf16 activations only: nearer simulate than bf16
    assert 0 < w4a4["rel_l2_vs_simulate"] < w4a4["rel_l2_vs_bf16"]
    assert "rel_l2_vs_simulate" not in saved["systems"]["simulate"]


def test_refuses_block_counts_the_preset_lacks():
    for args, words in ((["--family", "pixart", "--single-blocks", 1], "only FLUX.1 has single blocks"),
                        (["--family", "flux", "--single-blocks", 3], "--single-blocks 3: the flux preset has 2"),
                        (["--family", "pixart", "--double-blocks", 9], "--double-blocks 9: the pixart preset has 2")):
        run = _run([*args, "--preset", "tiny"])
        assert run.returncode != 0 and words in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]

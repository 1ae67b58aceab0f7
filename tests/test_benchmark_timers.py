"""The benchmarks' device timer plumbing on the CPU: the per-kernel breakdown of CUPTI events, and the W4A4 layer
benchmark's ``--timer cupti`` path (on the CPU the profiler sees no GPU kernels, so it falls back to wall clock)."""

import json

import pytest

from benchmark_modules import load_benchmark  # tests/benchmark_modules.py


def test_per_call_breakdown_medians_and_sums_repeated_kernels():
    tqb = load_benchmark("transform_quantize_bench")
    events, t = [], 0
    for call, (gemm, dec1, dec2) in enumerate([(10_000, 2_000, 3_000), (12_000, 2_000, 1_000), (11_000, 4_000, 3_000)]):
        for duration, name in ((dec1, "decode_fusion"), (dec2, "decode_fusion"), (gemm, "sm90_xmma_gemm_bf16")):
            events.append((t, duration, name))
            t += 50_000
    got = tqb.per_call_breakdown(events, 3)
    assert got == pytest.approx({"decode_fusion": 5.0, "sm90_xmma_gemm_bf16": 11.0})  # µs: the two decodes summed
    assert tqb.per_call_breakdown(events[:-1], 3) == {}  # 8 events for 3 calls: no per-call split
    assert tqb.per_call_breakdown([], 3) == {}


def test_w4a4_bench_cupti_timer_records_method_and_breakdown(tmp_path):
    bench = load_benchmark("w4a4_bench")
    out = tmp_path / "w4a4.json"
    bench.main(["--tiny", "--interpret", "--no-sweep", "--no-epilogues", "--no-layer", "--variants", "bf16_xla",
                "--timer", "cupti", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["timer"] == "cupti" and "CUPTI" in result["method"]
    records = [v for c in result["cases"] for v in c["variants"]]
    assert len(records) == 4  # 2 tiny shapes x m in (40, 16)
    for rec in records:
        assert "error" not in rec, rec
        assert rec["timing"] == "wallclock" and rec["kernels_us"] == {}  # no GPU here
        assert rec["us"] > 0 and rec["rel_err"] < 1e-2

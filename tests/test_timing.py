"""kroquant_jax/timing.py on the CPU: the per-kernel breakdown of CUPTI events, the wall-clock fallback of the device
timer (the profiler sees no GPU kernels here), the jitted loop timer, and the compile-time accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import timing


def test_per_call_breakdown_medians_and_sums_repeated_kernels():
    events, t = [], 0
    for gemm, dec1, dec2 in [(10_000, 2_000, 3_000), (12_000, 2_000, 1_000), (11_000, 4_000, 3_000)]:
        for duration, name in ((dec1, "decode_fusion"), (dec2, "decode_fusion"), (gemm, "sm90_xmma_gemm_bf16")):
            events.append((t, duration, name))
            t += 50_000
    got = timing.per_call_breakdown(events, 3)
    assert got == pytest.approx({"decode_fusion": 5.0, "sm90_xmma_gemm_bf16": 11.0})  # µs: the two decodes summed
    assert timing.per_call_breakdown(events[:-1], 3) == {}  # 8 events for 3 calls: no per-call split
    assert timing.per_call_breakdown([], 3) == {}


def test_kernels_matching_sums_the_named_kernels_or_says_none():
    kernels = {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": 25.5,
               "fp8_gemm_fused_mosaic_gpu_kernel": 40.0, "flash_fprop_other": 1.5}
    assert timing.kernels_matching_us(kernels, timing.CUDNN_ATTENTION_KERNELS) == 27.0
    assert timing.kernels_matching_us(kernels, ("nvjet",)) is None
    assert timing.kernels_matching_us({}, timing.CUDNN_ATTENTION_KERNELS) is None


def test_device_time_falls_back_to_wall_clock_without_gpu_kernels():
    seen = []
    f = jax.jit(lambda a: a * 2.0)
    inputs = [jnp.full((8,), float(i)) for i in range(3)]

    def fn(a):
        seen.append(float(a[0]))
        return f(a)

    got = timing.device_time(fn, inputs, n_iter=4, warmup=2)
    assert got.method.startswith("wallclock") and got.us > 0
    assert got.kernels == () and got.kernels_us == {}
    # 2 warm-up calls, the profiled loop, then 5 wall-clock loops of 4 calls, each rotating over the inputs
    assert seen[:2] == [0.0, 1.0] and seen[2:6] == [0.0, 1.0, 2.0, 0.0] and len(seen) == 2 + 4 + 5 * 4
    with pytest.raises(ValueError, match="at least one input"):
        timing.device_time(fn, [])


def test_calls_device_time_splits_calls_only_when_each_has_the_same_kernels():
    """Ten calls of quantize (20 µs) + GEMM (100 µs): 120 µs a call. A lost GEMM launch or a GEMM never captured
    must not read as a faster call."""
    def trace(calls):
        events, t = [], 0
        for kernels in calls:
            for name, us in kernels:
                events.append((t, int(us * 1e3), name))
                t += int(us * 1e3) + 1000
        return events

    call = [("quantize", 20.0), ("gemm", 100.0)]
    full = timing.calls_device_time(trace([call] * 10), 10)
    assert (full.us, full.method, full.kernel_launches) == (120.0, "cupti(2 kernels/call)", {"quantize": 1, "gemm": 1})
    lost = timing.calls_device_time(trace([call] * 9 + [call[:1]]), 10)
    assert lost.method.startswith("cupti(total/n") and lost.us == 110.0
    # calls that differ though the count splits evenly (20 events, 2 a call): not split into calls
    shifted = trace([call] * 8 + [[("quantize", 20.0), ("quantize", 20.0)], [("gemm", 100.0), ("gemm", 100.0)]])
    got = timing.calls_device_time(shifted, 10)
    assert got.method.startswith("cupti(total/n") and got.us == 120.0
    never = timing.calls_device_time(trace([call[:1]] * 10), 10)
    assert never.method == "cupti(1 kernels/call)" and never.kernels == ("quantize",), "what a call ran is listed"
    with pytest.raises(ValueError, match="no kernel events"):
        timing.calls_device_time([], 10)


def test_loop_time_returns_the_first_sets_output_from_the_timed_loop():
    sets = [(jnp.full((4, 4), float(i)), jnp.eye(4)) for i in range(1, 4)]
    got = timing.loop_time(lambda a, b: a @ b + 1.0, sets, n_calls=6, repeats=3)
    assert got.median_s > 0 and len(got.samples_s) == 3 and got.median_s == sorted(got.samples_s)[1]
    np.testing.assert_array_equal(np.asarray(got.y0), np.full((4, 4), 2.0))


def test_loop_time_computes_every_sets_whole_output():
    """Sets after the first are not carried out of the timed loop; XLA must still compute their whole outputs, not
    just the element the loop sums (which timed an elementwise call at a quarter of its cost with 4 sets)."""
    import re

    def fn(x):
        return jnp.sin(x) * 1.0001 + jnp.cos(x)

    n, sets = 1 << 12, 4
    xs = tuple((jnp.full((n,), float(i)),) for i in range(sets))
    text = timing._timed_loop(fn, xs, 2).lower(xs).compile().as_text()
    full = len(re.findall(rf"_fusion\S* = f32\[{n}\]\S* fusion\(", text))  # full-size fused outputs
    assert full >= sets, f"{full} full-size computations for {sets} input sets"


def test_wall_times_and_summary():
    calls = []
    samples = timing.wall_times(lambda: calls.append(1) or jnp.ones(2), repeats=3, inner=4)
    assert len(samples) == 3 and len(calls) == 12 and all(s > 0 for s in samples)
    s = timing.summary_ms([0.001, 0.003, 0.002])
    assert s == {"median_ms": pytest.approx(2.0), "min_ms": pytest.approx(1.0), "max_ms": pytest.approx(3.0),
                 "samples_ms": pytest.approx([1.0, 3.0, 2.0])}


def test_compile_clock_merges_nested_spans_within_a_window():
    clock = timing.CompileClock.__new__(timing.CompileClock)  # no listeners: synthetic events only
    clock.spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]  # a trace nested in another, then a separate compile
    clock.backend, clock.cache_hits = [(2.5, 1.0, "jit(a)"), (6.0, 0.5, "jit(b)")], [5.5]
    assert clock.window(0.0, 10.0) == (pytest.approx(4.0), 2)
    assert clock.window(1.5, 5.5) == (pytest.approx(2.0), 1)  # clipped to the window
    assert clock.compilations(0.0, 10.0, "b") == ["jit(b)"] and clock.hits(5.0, 6.0) == 1
    assert clock.programs(0.0, 10.0, over=0.6) == [["jit(a)", 1.0]]


def test_recorded_compilations_watch_and_measure_see_real_compilations():
    def timing_probe_fn(a):
        return jnp.sin(a) * 3.0

    f = jax.jit(timing_probe_fn)
    watch = timing.CompileWatch()
    with timing.recorded_compilations("timing_probe_fn") as compiled:
        f(jnp.ones(5)).block_until_ready()
        assert compiled == []  # filled when the block ends
    assert compiled == ["jit(timing_probe_fn)"] and watch.compilations("timing_probe_fn") == compiled
    assert watch.seconds() > 0
    with timing.recorded_compilations("timing_probe_fn") as again:
        f(jnp.ones(5)).block_until_ready()  # cached: no compilation
    assert again == []
    out, record = timing.measure(lambda: np.asarray(f(jnp.ones(7))))  # a new shape compiles once more
    assert out.shape == (7,) and record["compiles"] >= 1 and 0 < record["compile_s"] <= record["wall_s"]
    assert timing.compile_clock() is timing.compile_clock()


def test_calls_for_sizes_a_loop_within_its_bounds():
    assert timing.calls_for(400e12 * 1e-3, 0.1, minimum=6) == 99  # 1 ms + 5 µs per call: 99 calls in 0.1 s
    assert timing.calls_for(400e12, 0.1, minimum=6) == 6  # one call alone is longer than the target
    assert timing.calls_for(1.0, 10.0, minimum=6) == 300  # tiny calls: capped
    stats = timing.device_memory_gib()
    assert set(stats) <= {"bytes_in_use", "peak_bytes_in_use", "bytes_limit"} and all(v >= 0 for v in stats.values())

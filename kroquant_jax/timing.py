"""Timing JAX work: device time from CUPTI, wall-clock loops, and compile-time accounting (one home for all timers).

* :func:`device_time`: the median device time of one call of ``fn`` over rotating inputs, from the CUPTI kernel
  events that the jax profiler records (``jax.profiler.trace``), after a warm-up; each call's kernels are summed
  (and broken down per kernel, :func:`per_call_breakdown`). Where the profiler sees no GPU kernels (the CPU, or a
  profiler failure) it falls back to wall-clock time over the same loop; :attr:`DeviceTime.method` says which.
* :func:`loop_time`: the median seconds per call of ``fn`` inside ONE jitted ``fori_loop`` over rotating input sets
  (no dispatch overhead between calls), returning the output of the first set from the timed loop itself.
* :func:`wall_times` / :func:`summary_ms`: seconds per call of an already compiled call, ``repeats`` samples of
  ``inner`` back-to-back calls each, and their median / min / max in ms; :func:`calls_for` sizes a timed loop,
  :func:`device_memory_gib` reads the device's memory counters.
* :class:`CompileClock` (one per process, :func:`compile_clock`): JAX's compile-event spans (``jax.monitoring``),
  to tell compilation from run time in a wall-clock window (:meth:`CompileClock.window`, :func:`measure`), to count
  the XLA compilations of a block (:func:`recorded_compilations`) and the compile seconds since a point
  (:class:`CompileWatch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp

__all__ = ["CUDNN_ATTENTION_KERNELS", "CompileClock", "CompileWatch", "DeviceTime", "LoopTime", "block", "calls_for",
           "calls_device_time",
           "compile_clock", "device_memory_gib", "device_time", "gpu_kernel_events", "kernels_matching_us", "loop_time",
           "measure", "per_call_breakdown", "recorded_compilations", "summary_ms", "wall_times"]


def block(tree: Any) -> None:
    """Wait for every array of a pytree."""
    jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, tree)


# ---------------------------------------------------------------------------------------------------------------------
# Device time (CUPTI via the jax profiler).
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceTime:
    """One :func:`device_time` measurement.

    Attributes:
      us: median microseconds per call.
      method: ``"cupti(N kernels/call)"`` (each call's N kernel durations summed, median over calls),
        ``"cupti(total/n: the calls' kernels differ)"`` (the events did not split into calls of the same kernels,
        e.g. some were not captured: their total over the number of calls, to be read with care) or
        ``"wallclock"`` (no GPU kernel events: the median of 5 wall-clock loops of ``n_iter`` calls).
      kernels: names (first 60 characters) of the kernels of one call.
      kernels_us: ``{kernel name: median µs per call}`` (:func:`per_call_breakdown`; empty without a per-call split).
      kernel_launches: ``{kernel name: launches per call}`` (same names; empty without a per-call split).
    """

    us: float
    method: str
    kernels: tuple[str, ...] = ()
    kernels_us: dict = dataclasses.field(default_factory=dict)
    kernel_launches: dict = dataclasses.field(default_factory=dict)


def gpu_kernel_events(trace_dir: str) -> list[tuple[int, int, str]]:
    """Sorted ``(start_ns, duration_ns, name)`` of the GPU kernels (no memcpy / memset) in a profiler trace folder."""
    from jax.profiler import ProfileData

    events = []
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if "stream" not in line.name.lower():
                    continue
                for ev in line.events:
                    if not ev.name.lower().startswith(("memcpy", "memset")):
                        events.append((ev.start_ns, ev.duration_ns, ev.name))
    events.sort()
    return events


def per_call_breakdown(events: Sequence[tuple[int, int, str]], n_calls: int) -> dict[str, float]:
    """``{kernel name: median µs per call}`` from the sorted ``events`` ``(start_ns, duration_ns, name)`` of
    ``n_calls`` identical calls (each call launches ``len(events) / n_calls`` kernels; a kernel launched several times
    in one call is summed). Empty when the events do not split evenly into calls."""
    if not events or len(events) % n_calls:
        return {}
    per = len(events) // n_calls
    calls = []
    for i in range(n_calls):
        sums: dict[str, float] = {}
        for _, duration_ns, name in events[i * per:(i + 1) * per]:
            sums[name[:80]] = sums.get(name[:80], 0.0) + duration_ns / 1e3
        calls.append(sums)
    names = sorted(set().union(*calls))
    return {n: statistics.median(c.get(n, 0.0) for c in calls) for n in names}


# Name parts of cuDNN's fused attention kernels (``cudnn_generated_fort_native_sdpa_sm90_flash_fprop_...``).
CUDNN_ATTENTION_KERNELS = ("sdpa", "flash_fprop", "flash_bprop")


def kernels_matching_us(kernels_us: dict[str, float], name_parts: Sequence[str]) -> Optional[float]:
    """The µs of the kernels of a :func:`per_call_breakdown` whose name contains any of ``name_parts`` (e.g.
    :data:`CUDNN_ATTENTION_KERNELS`), or ``None`` when none does (no breakdown, or no such kernel)."""
    hits = [us for name, us in kernels_us.items() if any(part in name for part in name_parts)]
    return sum(hits) if hits else None


def _profiled_events(fn: Callable, inputs: Sequence, n_iter: int) -> tuple[list, Optional[str]]:
    trace_dir = tempfile.mkdtemp(prefix="kroquant_timing_")
    try:
        with jax.profiler.trace(trace_dir):
            outs = None
            for i in range(n_iter):
                outs = fn(inputs[i % len(inputs)])
            jax.block_until_ready(outs)
        return gpu_kernel_events(trace_dir), None
    except Exception as err:  # noqa: BLE001 - the wall-clock fallback measures instead
        return [], f"{type(err).__name__}: {err}"
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def calls_device_time(events: Sequence[tuple[int, int, str]], n_calls: int) -> DeviceTime:
    """The :class:`DeviceTime` of ``n_calls`` calls of one function from their kernel ``events`` (sorted
    ``(start_ns, duration_ns, name)``, :func:`gpu_kernel_events`).

    The events are split into calls only when every call has the same kernels (names, with repeats): a count that
    splits evenly but with other kernels per call means some were not captured, and a median over such "calls" could
    read far too fast, so then (and when the count does not split) the method says so and the figure is the total
    over ``n_calls``."""
    if not events:
        raise ValueError("calls_device_time: no kernel events")
    per = len(events) // n_calls if len(events) % n_calls == 0 else 0
    if per:
        first = sorted(e[2] for e in events[:per])
        if any(sorted(e[2] for e in events[i * per:(i + 1) * per]) != first for i in range(1, n_calls)):
            per = 0
    if not per:
        return DeviceTime(sum(ev[1] for ev in events) / 1e3 / n_calls, "cupti(total/n: the calls' kernels differ)",
                          tuple(sorted({e[2][:60] for e in events})[:4]))
    sums = [sum(ev[1] for ev in events[i * per:(i + 1) * per]) / 1e3 for i in range(n_calls)]
    launches: dict[str, int] = {}
    for _, _, name in events[:per]:
        launches[name[:80]] = launches.get(name[:80], 0) + 1
    return DeviceTime(statistics.median(sums), f"cupti({per} kernels/call)",
                      tuple(sorted({ev[2][:60] for ev in events[:per]})), per_call_breakdown(events, n_calls), launches)


def device_time(fn: Callable, inputs: Sequence, *, n_iter: int = 60, warmup: int = 3) -> DeviceTime:
    """Median device time of one call ``fn(inputs[i % len(inputs)])`` (rotating inputs, so no call reuses the
    previous call's cache-resident operands), after ``warmup`` calls; see :class:`DeviceTime` for the methods."""
    if not inputs:
        raise ValueError("device_time: needs at least one input")
    for i in range(warmup):
        jax.block_until_ready(fn(inputs[i % len(inputs)]))
    events, failure = _profiled_events(fn, inputs, n_iter)
    if events:
        return calls_device_time(events, n_iter)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = None
        for i in range(n_iter):
            outs = fn(inputs[i % len(inputs)])
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / n_iter * 1e6)
    return DeviceTime(statistics.median(times), "wallclock" if failure is None else f"wallclock (profiler: "
                      f"{failure[:200]})")


# ---------------------------------------------------------------------------------------------------------------------
# Wall-clock loops.
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoopTime:
    """One :func:`loop_time` measurement: ``median_s`` per call, every repeat's ``samples_s``, and ``y0``, the output
    for the first input set from the timed loop itself (check it against a reference: each variant compiles once)."""

    median_s: float
    samples_s: tuple[float, ...]
    y0: Any


def _first_leaf(y: Any) -> jax.Array:
    leaf = jax.tree_util.tree_leaves(y)[0]
    return leaf.reshape(-1)[0].astype(jnp.float32)


def _timed_loop(fn: Callable, xs: tuple, n_iter: int) -> Callable:
    """The jitted program :func:`loop_time` times: ``n_iter`` iterations, each calling ``fn`` on every input set.

    Every set's output is carried out of the loop: an output that is not (every set's but the first, when only its
    first element was summed) let XLA compute just that element of the XLA ops that make it, and the loop timed less
    than the calls (an ``optimization_barrier`` on the output does not stop that: XLA removes barriers before it
    fuses)."""
    y_shape = jax.eval_shape(fn, *xs[0])

    def body(_, carry):
        acc, _, xs = carry
        xs, acc = jax.lax.optimization_barrier((xs, acc))
        ys = tuple(fn(*x) for x in xs)
        for y in ys:
            acc = acc + _first_leaf(y)
        return acc, ys, xs

    def run(xs):
        y_init = tuple(jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), y_shape) for _ in xs)
        acc, ys, _ = jax.lax.fori_loop(0, n_iter, body, (jnp.float32(0.0), y_init, xs))
        return acc, ys  # all of them: an output dropped here is a dead loop value, which XLA prunes

    return jax.jit(run)


def loop_time(fn: Callable, input_sets: Sequence[Sequence], *, n_calls: int, repeats: int = 5,
              warmup: int = 1) -> LoopTime:
    """Median seconds per call of ``fn(*inputs)`` over rotating ``input_sets`` inside one jitted ``fori_loop`` of
    about ``n_calls`` calls (an ``optimization_barrier`` per iteration keeps XLA from hoisting the calls)."""
    r_sets = len(input_sets)
    n_iter = max(1, n_calls // r_sets)
    xs = tuple(tuple(s) for s in input_sets)
    loop = _timed_loop(fn, xs, n_iter)
    y0 = None
    for _ in range(warmup):
        _, (y0, *_) = jax.block_until_ready(loop(xs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, (y, *_) = jax.block_until_ready(loop(xs))
        times.append((time.perf_counter() - t0) / (n_iter * r_sets))
        y0 = y if y0 is None else y0
    return LoopTime(statistics.median(times), tuple(times), y0)


def wall_times(call: Callable[[], Any], *, repeats: int, inner: int,
               sync: Callable[[Any], None] = block) -> list[float]:
    """Seconds per call of ``call``: ``repeats`` samples, each ``inner`` back-to-back calls then one ``sync`` of the
    last output (default :func:`block`; e.g. ``torch.cuda.synchronize`` for a PyTorch baseline). Warm the call up
    first: the samples include whatever it compiles."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = call()
        sync(out)
        samples.append((time.perf_counter() - start) / inner)
    return samples


def calls_for(flops: float, target_s: float, *, minimum: int, maximum: int = 300,
              peak_flops: float = 400e12, overhead_s: float = 5e-6) -> int:
    """Calls for a timed loop of about ``target_s`` seconds, estimating one call at ``flops / peak_flops +
    overhead_s``, clipped to ``[minimum, maximum]``."""
    return int(min(maximum, max(minimum, target_s / (flops / peak_flops + overhead_s))))


def device_memory_gib(device: Optional[Any] = None) -> dict[str, float]:
    """``{bytes_in_use, peak_bytes_in_use, bytes_limit}`` of ``device`` (None: the first local device) in GiB (what
    it reports; empty where the device keeps no statistics, e.g. the CPU)."""
    stats = (jax.local_devices()[0] if device is None else device).memory_stats() or {}
    return {key: stats[key] / 2**30 for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if key in stats}


def summary_ms(samples_s: Sequence[float]) -> dict[str, Any]:
    """``{median_ms, min_ms, max_ms, samples_ms}`` of samples in seconds."""
    return {"median_ms": 1e3 * statistics.median(samples_s), "min_ms": 1e3 * min(samples_s),
            "max_ms": 1e3 * max(samples_s), "samples_ms": [1e3 * s for s in samples_s]}


# ---------------------------------------------------------------------------------------------------------------------
# Compile time.
# ---------------------------------------------------------------------------------------------------------------------

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"  # an XLA compilation or a persistent-cache load
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileClock:
    """JAX's compile-event spans (wall-clock ``time.time()`` intervals) of this process, from ``jax.monitoring``
    listeners registered once (use :func:`compile_clock`, not a second instance).

    Nested spans (a jit traced inside another's trace) are merged: the compile time of a window is the length of the
    union of the spans inside it. ``on_compile(fun_name, seconds)`` is called after each XLA compilation.
    """

    def __init__(self):
        self.spans: list[tuple[float, float]] = []
        self.backend: list[tuple[float, float, str]] = []  # (end time, duration, function name)
        self.cache_hits: list[float] = []  # times of persistent-cache loads
        self.on_compile: Optional[Callable[[str, float], None]] = None
        self.use_spans = hasattr(jax.monitoring, "register_event_time_span_listener")
        if self.use_spans:
            jax.monitoring.register_event_time_span_listener(self._on_span)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event, **kw):
        if event == _CACHE_HIT_EVENT:
            self.cache_hits.append(time.time())

    def _on_span(self, event, start, end, **kw):
        if event in _COMPILE_EVENTS:
            self.spans.append((start, end))

    def _on_duration(self, event, duration, **kw):
        now = time.time()
        if not self.use_spans and event in _COMPILE_EVENTS:
            self.spans.append((now - duration, now))
        if event == _BACKEND_EVENT:
            name = str(kw.get("fun_name", "?"))
            self.backend.append((now, duration, name))
            if self.on_compile is not None:
                self.on_compile(name, duration)

    def compilations(self, t0: float, t1: float, name_part: str = "") -> list[str]:
        """Function names of the XLA compilations (or cache loads) that ended in ``[t0, t1]``, in order."""
        return [name for end, _, name in self.backend if t0 <= end <= t1 and name_part in name]

    def programs(self, t0: float, t1: float, over: float = 0.1) -> list:
        """``[[function name, seconds], ...]`` of the XLA compilations (or cache loads) over ``over`` s in
        ``[t0, t1]``."""
        return [[name, round(dur, 2)] for end, dur, name in self.backend if t0 <= end <= t1 and dur >= over]

    def hits(self, t0: float, t1: float) -> int:
        """Persistent compilation cache loads in ``[t0, t1]``."""
        return sum(1 for t in self.cache_hits if t0 <= t <= t1)

    def window(self, t0: float, t1: float) -> tuple[float, int]:
        """``(compile seconds, number of XLA compilations)`` within the wall-clock window ``[t0, t1]``."""
        spans = sorted((max(a, t0), min(b, t1)) for a, b in self.spans if b > t0 and a < t1)
        total, cur_a, cur_b = 0.0, None, None
        for a, b in spans:
            if cur_b is None or a > cur_b:
                if cur_b is not None:
                    total += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        if cur_b is not None:
            total += cur_b - cur_a
        return total, sum(1 for end, _, _ in self.backend if t0 <= end <= t1)


_CLOCK: Optional[CompileClock] = None


def compile_clock() -> CompileClock:
    """The process's :class:`CompileClock` (its listeners are registered at the first call)."""
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = CompileClock()
    return _CLOCK


class CompileWatch:
    """Compile time from now on: ``watch = CompileWatch(); ...; watch.seconds()``."""

    def __init__(self):
        self.clock = compile_clock()
        self.t0 = time.time()

    def seconds(self) -> float:
        """Seconds JAX spent tracing, lowering and compiling since the watch started (the union of the spans)."""
        return self.clock.window(self.t0, time.time())[0]

    def compilations(self, name_part: str = "") -> list[str]:
        """Function names of the XLA compilations since the watch started (whose name contains ``name_part``)."""
        return self.clock.compilations(self.t0, time.time(), name_part)


@contextlib.contextmanager
def recorded_compilations(name_part: str = "") -> Iterator[list[str]]:
    """Yields a list that receives, when the block ends, the ``fun_name`` of every XLA compilation (whose name
    contains ``name_part``) made inside the ``with`` block, e.g. ``["jit(_loraq_stacked)"]``."""
    watch = CompileWatch()
    compiled: list[str] = []
    try:
        yield compiled
    finally:
        compiled.extend(watch.compilations(name_part))


def measure(fn: Callable[[], Any], clock: Optional[CompileClock] = None) -> tuple[Any, dict]:
    """Runs ``fn()`` (which must return host data, so that its device work is done) and returns ``(result,
    {wall_s, compile_s, run_s, compiles, cache_hits, programs})``."""
    clock = compile_clock() if clock is None else clock
    t0w, t0 = time.time(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    t1w = time.time()
    comp, n = clock.window(t0w, t1w)
    comp = min(comp, wall)
    return out, {"wall_s": round(wall, 3), "compile_s": round(comp, 3), "run_s": round(wall - comp, 3),
                 "compiles": n, "cache_hits": clock.hits(t0w, t1w), "programs": clock.programs(t0w, t1w)}

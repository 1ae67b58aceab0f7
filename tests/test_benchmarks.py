"""Smoke runs of the benchmark mains on their tiny presets, as subprocesses (tests never import a benchmark module;
the runs are forked from one process that has imported jax, see `_main`): each must finish, write its JSON, and
record what it claims to (methods, finite outputs, flop counts). The forward benchmark of the quantized DiT has its
own run in tests/test_fused_hooks.py."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}

# ---------------------------------------------------------------------------------------------------------------------
# The mains run as subprocesses. A fresh interpreter spends a second or two importing jax, flax and this repository's
# packages before a main begins; so one server process (started with the runs' environment) imports them once,
# starting no JAX backend, and forks a child per run: the child runs the script as __main__ with its own argument
# list and output files, in the repository's root, and exits with the script's status (after `timeout` seconds it is
# killed). XLA reads XLA_FLAGS when a child starts its backend. KROQUANT_TESTS_NO_FORK_SERVER=1: a fresh interpreter
# per run instead.
# ---------------------------------------------------------------------------------------------------------------------

PRELOAD = ("jax", "jax.numpy", "numpy", "flax.nnx", "kroquant_jax.timing", "kroquant_jax.fp8_encoding",
           "kroquant_jax.transforms", "kroquant_jax.headline", "pallas_kernels.served", "pallas_kernels.fp8_gemm_mgpu",
           "pallas_kernels.w4a4_gemm_mgpu", "pallas_kernels.epilogues", "models.layer_shapes",
           "models.ideogram4_serving", "models.testbed.evaluation",
           "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")  # what Pallas imports on a first call
_SERVER = r"""
import importlib, json, os, runpy, sys, time
for name in sys.argv[1:]:
    importlib.import_module(name)
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized(), "the server must fork before any JAX backend starts"
sys.argv = sys.argv[:1]
print("ready", flush=True)
for line in sys.stdin:
    run = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the run: the script as __main__, then the interpreter's own exit with the script's status
        new = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, run["stdout"], new), (2, run["stderr"], new)):
            os.dup2(os.open(path, flags, 0o644), fd)
        sys.argv, sys.path[0] = [run["script"], *run["argv"]], os.path.dirname(run["script"])
        runpy.run_path(run["script"], run_name="__main__")  # an exception: its traceback, status 1
        sys.exit(0)
    deadline = time.monotonic() + run["timeout"]
    while not (status := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            status = os.waitpid(pid, 0)
            print("timeout", flush=True)
            break
        time.sleep(0.02)
    else:
        print(os.waitstatus_to_exitcode(status[1]), flush=True)
"""
_server: list = []  # the server's Popen, once started


@pytest.fixture(scope="module", autouse=True)
def _stop_fork_server():
    yield
    while _server:
        proc = _server.pop()
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.log.close()


def _main(script: str, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> argv...`` in the repository's root, with :data:`ENV`: its status and output."""
    path = str(REPO / "benchmarks" / script)
    if not hasattr(os, "fork") or os.environ.get("KROQUANT_TESTS_NO_FORK_SERVER"):
        return subprocess.run([sys.executable, path, *argv], cwd=REPO, env=ENV, capture_output=True, text=True,
                              timeout=timeout)
    if not _server:
        log = tempfile.TemporaryFile("w+")  # the server's own stderr
        _server.append(subprocess.Popen([sys.executable, "-c", _SERVER, *PRELOAD], cwd=REPO, env=ENV, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
        _server[0].log = log
        _reply(_server[0], "ready")
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        _server[0].stdin.write(json.dumps({"script": path, "argv": list(argv), "stdout": str(out), "stderr": str(err),
                                           "timeout": timeout}) + "\n")
        _server[0].stdin.flush()
        status = _reply(_server[0])
        if status == "timeout":
            raise subprocess.TimeoutExpired([path, *argv], timeout)
        return subprocess.CompletedProcess([path, *argv], int(status), out.read_text(), err.read_text())


def _reply(server: subprocess.Popen, expected: str | None = None) -> str:
    line = server.stdout.readline().strip()
    if not line or (expected and line != expected):
        server.log.seek(0)
        raise RuntimeError(f"the fork server stopped (status {server.poll()}):\n{server.log.read()[-3000:]}")
    return line


def _run(script: str, *argv: str) -> subprocess.CompletedProcess:
    run = _main(script, *argv)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_w4a4_bench_cupti_timer_records_method_and_breakdown(tmp_path):
    """``--timer cupti`` through kroquant_jax.timing.device_time: on the CPU the profiler sees no GPU kernels, so
    every record falls back to wall clock, with an empty per-kernel breakdown."""
    out = tmp_path / "w4a4.json"
    _run("w4a4_bench.py", "--tiny", "--interpret", "--no-sweep", "--no-epilogues", "--no-layer", "--variants",
         "bf16_xla", "--timer", "cupti", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["timer"] == "cupti" and "CUPTI" in result["method"]
    records = [v for c in result["cases"] for v in c["variants"]]
    assert len(records) == 4  # 2 tiny shapes x m in (40, 16)
    for rec in records:
        assert "error" not in rec, rec
        assert rec["timing"] == "wallclock" and rec["kernels_us"] == {}  # no GPU here
        assert rec["us"] > 0 and rec["rel_err"] < 1e-2


LAYER_RUNS = {  # one small real layer at m = 8, the cheapest variant: the shape each benchmark reads
    "w4a4_bench.py": ("--layers", "pixart_sigma.attn.q", "--ms", "8", "--variants", "bf16_xla", "--no-sweep",
                      "--no-epilogues", "--no-layer", "--interpret"),
    "fp8_bench.py": ("--layers", "pixart_sigma.attn.q", "--ms", "8", "--variants", "bf16_xla,fp8_w4a4,fp8_mgpu_w4a4",
                     "--no-accuracy",
                     "--interpret", "--calls", "1", "--check-rows", "8"),
    "fp8_mgpu_bench.py": ("--layers", "pixart_sigma.attn.q", "--ms", "8", "--n-iter", "1", "--configs",
                          "dr1:+delay_release=1", "--row-group", "64"),
}


@pytest.mark.parametrize("script", sorted(LAYER_RUNS))
def test_gpu_benchmarks_time_the_real_layer_shapes_of_models_layer_shapes(script, tmp_path):
    """The benchmarks read the real checkpoints' shapes from models.layer_shapes, under the same layer names."""
    from models import layer_shapes

    out = tmp_path / "bench.json"
    _run(script, *LAYER_RUNS[script], "--out", str(out))
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["n"], case["k"]) == layer_shapes.preset_layer_shapes("pixart_sigma")["pixart_sigma.attn.q"]
    if script == "fp8_mgpu_bench.py":
        assert case["layer"] == case["model_layer"] == "pixart_sigma.attn.q" and case["status"] == "ok"
        # "+field=value": the shape's default tiling with that field changed
        default, dr1 = case["configs"]["default"]["config"], case["configs"]["dr1"]["config"]
        assert case["configs"]["dr1"]["status"] == "ok" and dr1 == default.replace("delay_release=0", "delay_release=1")
        grouped = case["configs"]["default_row_groups"]  # activations with one exponent per row and 64 K values
        assert grouped["status"] == "ok" and grouped["config"] == default and grouped["rel_err_vs_mirror"] < 1e-6
    else:
        assert (case["model"], case["layer"]) == ("pixart_sigma", "attn.q")
    if script == "fp8_bench.py":
        # the whole layer on the fused kernel (its jnp mirror off the GPU) against the exact float64 product of the
        # same quantized operands, like the XLA FP8 layer
        mgpu, xla = case["variants"]["fp8_mgpu_w4a4"], case["variants"]["fp8_w4a4"]
        assert "error" not in mgpu and mgpu["finite"] and mgpu["us"] > 0 and mgpu["speedup_vs_bf16"] > 0
        assert mgpu["rel_err_vs_exact"] < 1e-2 and abs(mgpu["rel_err_vs_exact"] - xla["rel_err_vs_exact"]) < 1e-3


def test_fp8_mgpu_bench_keeps_the_short_ideogram4_names_and_rejects_unknown_layers(tmp_path):
    run = _main("fp8_mgpu_bench.py", "--layers", "q", "w13", "w2", "flux1.attn.q", "sd3.attn.q", "--out",
                str(tmp_path / "x.json"), timeout=300)
    assert run.returncode == 2 and "--layers: unknown ['sd3.attn.q'] (known: q, w13, w2, ideogram4.attn.q" in run.stderr
    assert not (tmp_path / "x.json").exists()


def test_lowrank_input_bench_compares_both_roundings(tmp_path):
    out = tmp_path / "lowrank.json"
    _run("lowrank_input_bench.py", "--shapes", "64:16", "--ms", "8", "--n-iter", "1", "--out", str(out))
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["m"], case["d"], case["r"]) == (8, 64, 16)
    # on the CPU the two programs may sum in different orders: at most one bf16 ulp apart, and the flag says so
    assert case["max_ulp_difference"] <= 1 and case["bit_equal"] == (case["differing_elements"] == 0)
    assert case["f32"]["us"] > 0 and case["bf16"]["us"] > 0 and case["f32"]["method"] == "wallclock"
    run = _main("lowrank_input_bench.py", "--shapes", "64x16", "--out", str(tmp_path / "x.json"), timeout=300)
    assert run.returncode == 2 and "'64x16' is not D:R" in run.stderr and not (tmp_path / "x.json").exists()


def test_ideogram4_serving_tiny_run(tmp_path):
    out = tmp_path / "bench.json"
    _run("ideogram4_serving.py", "--preset", "tiny", "--layouts", "packed", "--steps", "2", "--repeats", "1",
         "--inner", "1", "--matmul-size", "128", "--out", str(out))
    saved = json.loads(out.read_text())
    packed = saved["layouts"]["packed"]
    assert packed["errors"] == {} and packed["tokens"] == 6 + 16
    assert set(packed["timings"]) == {"forward", "cfg_step", "loop"} and packed["timings"]["loop"]["finite"]
    assert packed["timings"]["forward"]["median_ms"] > 0 and packed["flops"]["forward"]["total"] > 0


def test_ideogram4_serving_torch_baseline_times_diffusers_model(tmp_path):
    """``--torch-baseline`` builds diffusers' own Ideogram4Transformer2DModel (tiny config) and times it."""
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    out = tmp_path / "torch.json"
    _run("ideogram4_serving.py", "--preset", "tiny", "--torch-baseline", "--repeats", "1", "--inner", "1",
         "--out", str(out))
    saved = json.loads(out.read_text())
    assert saved["model"] == "diffusers.Ideogram4Transformer2DModel" and saved["errors"] == {}
    assert set(saved["timings_ms"]) == {"eager/padded", "eager/packed"}
    assert all(t["median_ms"] > 0 for t in saved["timings_ms"].values())


def test_cross_attention_rows_are_the_caption_projection_of_every_training_caption(tmp_path):
    """benchmarks/cross_attention_rows.py on the shipped testbed checkpoint and its prompt file: every attn2.to_k /
    to_v layer gets the same rows, one per distinct real token of the training captions plus the empty caption's, and
    those rows are what the model's caption projection gives (recomputed here for the first training caption)."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from kroquant_jax import layerset
    from models import families
    from models.testbed import data as testbed_data

    checkpoint = REPO / "checkpoints" / "emoji_pixart"
    _, model = families.PIXART.from_diffusers(str(checkpoint), "float32")
    source = {}
    for name in ("transformer_blocks.0.attn2.to_k", "transformer_blocks.0.attn2.to_v",
                 "transformer_blocks.0.attn1.to_q"):
        module = model
        for part in name.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        w = np.asarray(module.kernel[...], np.float32).T
        source[name] = (w, np.asarray(module.bias[...], np.float32), np.ones((4, w.shape[1]), np.float32))
    layerset.save_layer_set(str(tmp_path / "src.safetensors"), source)
    out = tmp_path / "xattn.safetensors"
    prompts = checkpoint / "testbed_prompts.npz"
    _run("cross_attention_rows.py", "--layer-set", str(tmp_path / "src.safetensors"), "--data", str(prompts),
         "--out", str(out))
    got = load_file(str(out))
    assert sorted({k.rsplit("/", 1)[0] for k in got}) == ["transformer_blocks.0.attn2.to_k",
                                                          "transformer_blocks.0.attn2.to_v"]
    rows = got["transformer_blocks.0.attn2.to_k/activations"]
    np.testing.assert_array_equal(rows, got["transformer_blocks.0.attn2.to_v/activations"])
    np.testing.assert_array_equal(got["transformer_blocks.0.attn2.to_k/weight"],
                                  source["transformer_blocks.0.attn2.to_k"][0])
    data = testbed_data.load_dataset(str(prompts))
    first = np.flatnonzero(~data.heldout)[0]
    expected = np.asarray(model.caption_projection(jnp.asarray(data.context[first:first + 1], jnp.float32), None))[0]
    expected = expected[np.asarray(data.context_mask[first]) > 0]
    distance = np.sqrt(((expected[:, None, :] - rows[None]) ** 2).sum(-1)).min(axis=1)
    assert distance.max() < 1e-5  # each of its real tokens is a row
    assert len(rows) == len(np.unique(rows, axis=0)) and len(rows) > len(expected)

    # --all-layers: the other layers are written too, unchanged; --rows: a subset of the same rows
    _run("cross_attention_rows.py", "--layer-set", str(tmp_path / "src.safetensors"), "--data", str(prompts),
         "--out", str(out), "--all-layers", "--rows", "50")
    everything = load_file(str(out))
    np.testing.assert_array_equal(everything["transformer_blocks.0.attn1.to_q/activations"],
                                  source["transformer_blocks.0.attn1.to_q"][2])
    subset = everything["transformer_blocks.0.attn2.to_v/activations"]
    assert subset.shape == (50, rows.shape[1])
    assert all((rows == row).all(axis=1).any() for row in subset)



def test_calibration_goals_reads_the_subset_choice_from_the_candidates(tmp_path):
    """calibration_goals.py: the smoothed KroQuant recipe with fewer starts is the safeguard's choice among that
    subset's candidates (lowest validation error), its test error is that candidate's, and the goal counts compare
    test errors per layer; a subset naming a start the run did not have is a one-line error."""
    starts = ["hadamard", "smoothquant_hadamard", "smoothquant"]

    def report(val, test):
        labels = [f"{k}{i}" for i in range(3) for k in ("init", "trained")]
        val, test = dict(zip(labels, val)), dict(zip(labels, test))
        chosen = min(val, key=lambda lab: (val[lab], lab))
        return {"chosen": chosen, "candidates": val, "candidates_test": test}

    record = {
        "errors": {"hadamard32": {"transformer_blocks.0.attn1.to_q": 0.20, "transformer_blocks.0.attn2.to_k": 0.20},
                   "smoothquant": {"transformer_blocks.0.attn1.to_q": 0.19, "transformer_blocks.0.attn2.to_k": 0.15},
                   "kroquant": {"transformer_blocks.0.attn1.to_q": 0.18, "transformer_blocks.0.attn2.to_k": 0.21},
                   "smoothed_kroquant": {"transformer_blocks.0.attn1.to_q": 0.17,
                                         "transformer_blocks.0.attn2.to_k": 0.14}},
        "reports": {"smoothed_kroquant": {
            # order: init0, trained0, init1, trained1, init2, trained2 (validation; then test)
            "transformer_blocks.0.attn1.to_q": report([0.2, 0.18, 0.19, 0.171, 0.19, 0.175],
                                                      [0.2, 0.18, 0.19, 0.17, 0.19, 0.176]),
            "transformer_blocks.0.attn2.to_k": report([0.2, 0.19, 0.15, 0.16, 0.15, 0.139],
                                                      [0.2, 0.19, 0.15, 0.155, 0.15, 0.14])}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(record))
    out = tmp_path / "goals.json"
    record["meta"] = {"device": "cpu", "jax_version": "0.10.2", "date_utc": "2026-12-05 11:46"}
    path.write_text(json.dumps(record))
    _run("calibration_goals.py", str(path), "--starts", *starts, "--subset", "hadamard", "smoothquant_hadamard",
         "--out", str(out), "--markdown", str(tmp_path / "goals.md"))
    summary = json.loads(out.read_text())
    sub = summary["errors"]["smoothed_kroquant [hadamard + smoothquant_hadamard]"]
    assert sub == {"transformer_blocks.0.attn1.to_q": 0.17, "transformer_blocks.0.attn2.to_k": 0.15}
    assert summary["chosen"]["transformer_blocks.0.attn2.to_k"] == {"all_starts": "trained2", "subset": "init1"}
    assert summary["wins"] == {"kroquant_beats_hadamard": 1, "smoothed_beats_both": 2,
                               "smoothed_subset_beats_both": 1, "smoothed_beats_smoothquant": 2,
                               "smoothed_ties_smoothquant": 0}
    assert summary["per_type"]["attn2.to_k"]["subset < both"] == 0
    assert "| **all** | 2 |" in (tmp_path / "goals.md").read_text()
    assert summary["fractions"]["kroquant_beats_hadamard"] == 0.5
    assert summary["fractions"]["smoothed_beats_both"] == 1.0
    bad = _main("calibration_goals.py", str(path), "--starts", "hadamard", "smoothquant_hadamard", "--subset",
                "smoothquant", timeout=300)
    assert bad.returncode == 2 and "not among the run's starts" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    outside = _main("calibration_goals.py", str(path), "--starts", *starts, "--subset", "hadamard", "--out",
                    str(out), "--headline", str(tmp_path / "headline.json"), timeout=300)
    assert outside.returncode == 2 and "--headline needs --out under benchmarks/results/" in outside.stderr
    assert not (tmp_path / "headline.json").exists()


def test_testbed_eval_headline_margin_over_the_baselines(tmp_path):
    """testbed_eval_headline.py: the best KroQuant-family recipe is the best learned transform *with* a low-rank branch
    (a higher-PSNR KroQuant without a branch does not count), its margin is taken over the better of SVDQuant and
    SmoothQuant + LoRaQ and, when the report has them, over the better GPTQ baseline; a report without a baseline is
    a one-line error."""
    def result(psnr, branch="LoRaQ r=32 (MXFP4)", lo=None, hi=None):
        return {"low_rank_branch": branch, "layer_error_mean": 0.1, "layer_error_max": 0.2,
                "groups": {"heldout": {"psnr_db": psnr, "psnr_sem_db": 0.5, "ssim": 0.8, "psnr_seed_std_db": 0.1,
                                       "psnr_seed_min_db": psnr - 0.2 if lo is None else lo,
                                       "psnr_seed_max_db": psnr + 0.2 if hi is None else hi,
                                       "psnr_per_caption_db": [psnr - 1.0, psnr + 1.0, psnr]}}}

    report = {"jax": "0.10.2", "device": "cpu", "date_utc": "2026-12-05T16:00", "seeds": [0, 1, 2], "results": {
        "svdquant": result(20.0, "SVD r=32 (16-bit)"), "smoothquant+loraq": result(20.5, hi=21.0),
        "kroquant": result(30.0, "none"), "kroquant+loraq": result(21.0),
        "smoothed_kroquant+gptq+loraq": result(22.0, lo=21.5),
        "svdquant+gptq": result(21.6, "SVD r=32 (16-bit)"), "smoothquant+gptq+loraq": result(21.2)}}
    # one evaluation in two parts (two device calls), joined; "kroquant" ran in both (the check), the first is used
    common = {"settings": "same", "caption_groups": {"heldout": {"records": [1, 2]}}, "args": {},
              "reference": {"heldout": result(11.6)["groups"]["heldout"]}}
    methods = list(report["results"])
    first = {**report, **common, "results": {m: report["results"][m] for m in methods[:3]}}
    second = {**report, **common, "date_utc": None,
              "results": {"kroquant": result(30.2, "none"), **{m: report["results"][m] for m in methods[3:]}}}
    paths = [tmp_path / "part1.json", tmp_path / "part2.json"]
    for path, part in zip(paths, (first, second)):
        path.write_text(json.dumps(part))
    out = tmp_path / "summary.json"
    _run("testbed_eval_headline.py", *map(str, paths), "--out", str(out), "--markdown", str(tmp_path / "t.md"))
    summary = json.loads(out.read_text())
    assert summary["best_kroquant_family"] == "smoothed_kroquant+gptq+loraq"
    assert summary["best_baseline"] == "smoothquant+loraq"
    assert summary["margin_db"] == pytest.approx(1.5)
    assert summary["margin_worst_seed_db"] == pytest.approx(0.5)  # 21.5 against the baseline's best seed, 21.0
    assert summary["best_gptq_baseline"] == "svdquant+gptq"
    assert summary["margin_vs_gptq_baselines_db"] == pytest.approx(0.4)
    # paired over captions: the same margin on each of the 3 captions, so no spread
    assert summary["margin_paired"]["captions_ahead"] == 3 == summary["margin_paired"]["captions"]
    assert summary["margin_paired"]["paired_sem_db"] == pytest.approx(0.0, abs=1e-9)
    assert summary["rows"]["kroquant"]["psnr_db"] == 30.0 and summary["date_utc"] == "2026-12-05T16:00"
    assert summary["repeated"]["kroquant"]["heldout"] == [30.0, 30.2]
    table = (tmp_path / "t.md").read_text()
    assert "+1.50 dB" in table and "kroquant in each part: 30.00 / 30.20 dB" in table
    second["settings"] = "other"
    paths[1].write_text(json.dumps(second))
    bad = _main("testbed_eval_headline.py", *map(str, paths), timeout=300)
    assert bad.returncode == 2 and "another 'settings'" in bad.stderr
    # --headline: the per-method keys are the evaluation's own (as the demo's), the margins beside them; the summary
    # must lie under benchmarks/results/ (the figures' source), so this one is removed afterwards
    report.update(wall_s=300.0, reference={"heldout": result(99.0)["groups"]["heldout"]})
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    inside = REPO / "benchmarks" / "results" / f"_test_testbed_eval_headline_{os.getpid()}.json"
    try:
        _run("testbed_eval_headline.py", str(path), "--out", str(inside), "--headline", str(tmp_path / "h.json"),
             "--prefix", "lr", "--device", "test machine", "--goal-keys")
        cited = json.loads(inside.read_text())
    finally:
        inside.unlink(missing_ok=True)
    figures = json.loads((tmp_path / "h.json").read_text())
    # every figure's value is in the file it cites (the per-method rows keep only a few fields)
    assert cited["headline_figures"] == {k: f["value"] for k, f in figures.items()}
    assert "lr_layer_error_max_smoothquant_loraq" in cited["headline_figures"]
    assert figures["lr_psnr_db_heldout_smoothed_kroquant_gptq_loraq"]["value"] == 22.0
    assert figures["lr_psnr_seed_max_db_heldout_smoothquant_loraq"]["value"] == 21.0
    assert figures["lr_best_kroquant_family_psnr_margin_db"]["value"] == 1.5
    assert figures["lr_best_kroquant_family_psnr_margin_vs_gptq_baselines_db"]["value"] == 0.4
    assert figures["testbed_best_kroquant_family_psnr_margin_db"]["value"] == 1.5  # issue 17's names: --goal-keys
    assert {f["device"] for f in figures.values()} == {"test machine"}
    assert {f["source"] for f in figures.values()} == {f"benchmarks/results/{inside.name}"}
    del report["results"]["svdquant"]
    path.write_text(json.dumps(report))
    bad = _main("testbed_eval_headline.py", str(path), timeout=300)
    assert bad.returncode == 2 and "no baseline ['svdquant']" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1

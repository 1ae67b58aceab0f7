"""The sharded Ideogram 4 QAD step (models.qad_sharded) on a tiny config: on 2 forced host devices it equals the
single-device step, its parameters and optimizer moments are really split over the devices, remat does not change it,
the hook-routed teacher equals the pipeline's guided velocity, and the benchmark main runs (subprocesses: the host
device count must be set before jax starts)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ideogram4 as ig
from models import ideogram4_sampling as sampling
from models import qad
from models import qad_sharded as qs

REPO = Path(__file__).resolve().parents[1]

# float32 everywhere, so that the only differences between device counts are the order of the sums
EXACT = dict(master_dtype="float32", compute_dtype="float32", teacher_dtype="float32")

_SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, {repo!r})
    from models import ideogram4 as ig, qad, qad_sharded as qs
    assert jax.local_device_count() == 2, jax.devices()
    W1 = "layers.feed_forward.w1"

    def config(remat):
        return qs.ShardedQADConfig(qad=qad.QADConfig(batch_size=4, warmup=1, lr=1e-3), num_blocks=2, text_tokens=6,
                                   grid=(4, 4), remat=remat, **{exact!r})

    base = ig.tiny_config()
    single = qs.build(base, config(True), qs.make_mesh(jax.devices()[:1]))
    state0, frozen0 = single.init(jax.random.key(0))
    batch0 = single.make_batch(jax.random.key(1))
    host = lambda tree: jax.tree.map(np.asarray, tree)
    start = host(state0)
    arrays, info = {{}}, {{}}
    for name, n, remat in (("1", 1, True), ("2_noremat", 2, False)):
        program = single if n == 1 else qs.build(base, config(remat), qs.make_mesh(jax.devices()[:n]))
        state = jax.device_put(start, program.state_shardings)
        frozen = jax.device_put(host(frozen0), program.frozen_shardings)
        batch = jax.device_put(host(batch0), program.batch_shardings)
        compiled = program.step.lower(state, frozen, batch).compile()
        hlo = compiled.as_text()
        metrics = []
        for _ in range(2):
            state, m = compiled(state, frozen, batch)
            metrics.append({{k: float(v) for k, v in m.items()}})
        weight = state["trainable"]["layers"][W1]["weight"]
        mu = state["opt_state"][1][0].mu["layers"][W1]["weight"]
        kernel = frozen["kernels"][W1]
        info[name] = {{"metrics": metrics,
                      "weight": [list(weight.sharding.spec), list(weight.addressable_shards[0].data.shape)],
                      "mu": [list(mu.sharding.spec), list(mu.addressable_shards[0].data.shape)],
                      "kernel": [list(kernel.sharding.spec), list(kernel.addressable_shards[0].data.shape)],
                      "devices": [len(weight.sharding.device_set), len(mu.sharding.device_set)],
                      "argument_bytes": compiled.memory_analysis().argument_size_in_bytes,
                      "all_gathers": hlo.count(" all-gather("), "while_loops": hlo.count(" while(")}}
        leaves = jax.tree_util.tree_flatten_with_path(host(state))[0]
        for path, leaf in leaves:
            arrays[name + "|" + jax.tree_util.keystr(path)] = leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(start)[0]:
        arrays["start|" + jax.tree_util.keystr(path)] = leaf
    np.savez(sys.argv[1], **arrays)
    print("RESULT" + json.dumps(info))
""")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """Two steps of one start state on 1 device (remat) and on 2 devices (no remat): one comparison checks both the
    sharding and remat, with one sharded program to compile."""
    out = tmp_path_factory.mktemp("qad_sharded") / "states.npz"
    # the device count added to the inherited XLA_FLAGS, not replacing them: on the CPU the suite's backend
    # optimisation level (tests/conftest.py) then holds here too, as in the benchmark's subprocess below
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT.format(repo=str(REPO), exact=EXACT), str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][0]
    info = json.loads(line[len("RESULT"):])
    with np.load(out) as stored:
        arrays = dict(stored)
    return info, arrays


def _state(arrays, name):
    return {k.split("|", 1)[1]: v for k, v in arrays.items() if k.startswith(name + "|")}


def test_sharded_step_equals_the_single_device_step(sharded_run):
    """Same losses at both steps; after two AdamW steps (the first at warm-up lr 0, the second a full step) the same
    parameters and moments, to the order of the sums; and training did move the state."""
    info, arrays = sharded_run
    single, start = _state(arrays, "1"), _state(arrays, "start")
    assert single.keys() == start.keys()
    moved = [k for k in single if "trainable" in k and single[k].size and not np.array_equal(single[k], start[k])]
    assert len(moved) > 20, moved  # the quantized weights and the 16-bit parameters moved
    for name in ("2_noremat",):
        for step_single, step_sharded in zip(info["1"]["metrics"], info[name]["metrics"]):
            for key in ("loss", "distill", "flow_matching", "grad_norm"):
                assert step_sharded[key] == pytest.approx(step_single[key], rel=2e-5, abs=1e-7), (name, key)
        sharded = _state(arrays, name)
        assert sharded.keys() == single.keys()
        for key, ref in single.items():
            got = sharded[key]
            if "mu" in key or "nu" in key:
                scale = float(np.abs(ref).max()) if ref.size else 0.0
                # second-step gradients at parameters that differ in the last bits: 3e-4 of the largest seen
                np.testing.assert_allclose(got, ref, rtol=1e-3, atol=2e-3 * scale + 1e-30, err_msg=f"{name} {key}")
            else:  # parameters: every element moved by about lr = 1e-3 (AdamW); 4e-6 apart at most seen
                np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5, err_msg=f"{name} {key}")
        assert not np.array_equal(sharded["['trainable']['layers']['layers.feed_forward.w1']['weight']"],
                                  start["['trainable']['layers']['layers.feed_forward.w1']['weight']"])


def test_parameters_and_moments_are_sharded(sharded_run):
    """w1's master weight (2, 96, 64) and its first moment are split along the 96 outputs, the teacher's kernel
    (2, 64, 96) along the same 96; over 2 devices each holds a half, on one device the whole."""
    info, _ = sharded_run
    two, one = info["2_noremat"], info["1"]
    assert two["weight"] == [[None, "fsdp", None], [2, 48, 64]]
    assert two["mu"] == [[None, "fsdp", None], [2, 48, 64]]
    assert two["kernel"] == [[None, None, "fsdp"], [2, 64, 48]]
    assert two["devices"] == [2, 2]
    assert one["weight"][1] == [2, 96, 64] and one["devices"] == [1, 1]
    # what each device holds of the step's inputs (state, teacher, batch) shrinks with the devices (FSDP), and the
    # sharded programs gather weights (the per-block all-gathers of the linear hooks); one device gathers nothing
    assert two["argument_bytes"] < 0.65 * one["argument_bytes"]
    assert two["all_gathers"] > 0 and one["all_gathers"] == 0


def test_fsdp_spec_rules():
    spec = qs.fsdp_spec
    axis = qs.MESH_AXIS
    assert spec((34, 4608, 12288), 2) == jax.sharding.PartitionSpec(None, None, axis)  # largest, not the layer axis
    assert spec((34, 12288, 4608), 4) == jax.sharding.PartitionSpec(None, axis, None)
    assert spec((34, 4608), 2) == jax.sharding.PartitionSpec(None, axis)  # a stacked vector: never the layer axis
    assert spec((4608,), 2) == jax.sharding.PartitionSpec(axis)
    assert spec((34, 4607), 2) == jax.sharding.PartitionSpec()  # nothing divisible but the layer axis: replicated
    assert spec((4608, 64), 1) == jax.sharding.PartitionSpec()  # one device
    assert spec((8, 8), 2) == jax.sharding.PartitionSpec()  # below min_elements
    assert spec((8, 8), 2, min_elements=0) == jax.sharding.PartitionSpec(None, axis)
    assert spec((), 2) == jax.sharding.PartitionSpec()


def test_config_and_build_validation():
    with pytest.raises(ValueError, match="master_dtype"):
        qs.ShardedQADConfig(master_dtype="float16")
    with pytest.raises(ValueError, match="num_blocks"):
        qs.ShardedQADConfig(num_blocks=0)
    with pytest.raises(ValueError, match="grid"):
        qs.ShardedQADConfig(grid=(0, 4))
    config = qs.ShardedQADConfig(num_blocks=1, text_tokens=2, grid=(2, 2), transform_block=5)
    with pytest.raises(ValueError, match="transform_block=5"):
        qs.build(ig.tiny_config(), config)
    with pytest.raises(ValueError, match="1-D"):
        qs.build(ig.tiny_config(), qs.ShardedQADConfig(num_blocks=1),
                 jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",)))


def test_model_configs_and_teacher_equal_the_pipeline():
    """The hook-routed teacher of the step (kernels in the hooks, zero-size placeholders in the graph) gives what
    models.ideogram4_sampling.guided_velocity gives for the plain model with the same weights; the fake-quant
    student at init is the teacher's conditional branch up to its quantization error."""
    config = qs.ShardedQADConfig(qad=qad.QADConfig(batch_size=2, schedule=qad.GuidanceSchedule(noisy=5.0, clean=5.0)),
                                 num_blocks=2, text_tokens=3, grid=(2, 4), **EXACT)
    teacher_cfg, student_cfg = qs.model_configs(ig.tiny_config(), config)
    assert teacher_cfg.scan_layers and teacher_cfg.num_layers == 2 and not teacher_cfg.remat
    assert student_cfg.remat and student_cfg.dtype == jnp.float32
    program = qs.build(ig.tiny_config(), config, qs.make_mesh(jax.devices()[:1]))
    state, frozen = program.init(jax.random.key(3))
    batch = program.make_batch(jax.random.key(4))
    key = jax.random.key(5)
    sigma, _, noisy = qad.noised_batch(key, batch["latents"], config.qad)

    plain = nnx.eval_shape(lambda: ig.Ideogram4Transformer(teacher_cfg, rngs=nnx.Rngs(0)))
    graph, _ = nnx.split(plain)
    flat = dict(nnx.to_flat_state(frozen["teacher"]))
    for name, kernel in frozen["kernels"].items():
        flat[tuple(int(p) if p.isdigit() else p for p in name.split(".")) + ("kernel",)] = nnx.Param(kernel)
    plain_state = nnx.from_flat_state(flat)
    arrays = (batch["position_ids"], None, batch["indicator"])

    @jax.jit  # jitted like the step (XLA's fused elementwise math differs from eager in the last bits)
    def pipeline(plain_state, noisy, sigma):
        model = nnx.merge(graph, plain_state)
        branches = sampling.prepare_branches(model, model, batch["text_features"], arrays, 3)
        cond = sampling.conditional_velocity(model, branches, noisy, 1.0 - sigma, 3)
        return sampling.guided_velocity(model, model, branches, noisy, 1.0 - sigma, 5.0, 3), cond  # (2, 8, C) x 2

    expected, cond = pipeline(plain_state, noisy, sigma)

    np.testing.assert_allclose(program.teacher_target(frozen, batch, noisy, sigma), expected, rtol=1e-5, atol=1e-6)

    # the student starts from the teacher's weights, W4A4 fake-quantized: next to the teacher's conditional branch,
    # much nearer it than to the guided target
    predicted = program.student_velocity(state["trainable"], frozen, batch, noisy, sigma)
    quantization_error = float(jnp.mean(jnp.square(predicted - cond)))
    assert 0 < quantization_error < 0.1 * float(jnp.mean(jnp.square(cond - expected)))


def test_benchmark_tiny_run(tmp_path):
    out = tmp_path / "qad_step.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "qad_step.py"), "--tiny", "--blocks", "1",
                          "--repeats", "1", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads(out.read_text())
    (trial,) = saved["trials"]
    assert trial["status"] == "ok", trial.get("error")
    assert trial["blocks"] == 1 and trial["step_s"] > 0 and trial["compile_s"] > 0
    assert all(np.isfinite(v) for v in trial["first_metrics"].values())
    assert trial["flops"]["total"] > trial["flops"]["teacher"] > 0
    assert trial["resident"]["total_gib"] > 0 and trial["step_peak_estimate_gib"] > trial["resident"]["total_gib"]
    assert saved["headline"]["ideogram4_qad_step_s_1gpu"] == trial["step_s"]
    assert saved["tokens"] == {"text": 6, "image": 16, "total": 22}


@pytest.mark.parametrize("scan_layers", [True, False])
def test_ideogram4_remat_gives_the_same_values_and_gradients(scan_layers):
    """``Ideogram4Config.remat`` (jax.checkpoint per block) changes what the backward keeps, not what it computes:
    the loss and the gradient of every parameter equal those without it, in both block layouts."""
    cfg = ig.tiny_config(scan_layers=scan_layers)
    layout = sampling.prepare_ids([3, 3], 2, 2, 3)
    position_ids, _, indicator = sampling.layout_arrays(layout)
    keys = jax.random.split(jax.random.key(0), 3)
    latents = jax.random.normal(keys[0], (2, 7, cfg.in_channels))
    features = jax.random.normal(keys[1], (2, 7, cfg.llm_features_dim))
    t = jnp.array([0.3, 0.8])

    def value_and_grad(remat):
        model = ig.new_model(dataclasses.replace(cfg, remat=remat))
        graph, state = nnx.split(model)

        def loss(state):
            out = nnx.merge(graph, state)(latents, t, features, position_ids, None, indicator)
            return jnp.mean(jnp.square(out))

        return jax.jit(jax.value_and_grad(loss))(state)

    (plain, plain_grads), (remat, remat_grads) = value_and_grad(False), value_and_grad(True)
    assert float(remat) == pytest.approx(float(plain), rel=1e-6)
    flat_plain, flat_remat = jax.tree.leaves(plain_grads), jax.tree.leaves(remat_grads)
    assert len(flat_plain) == len(flat_remat) > 10
    for a, b in zip(flat_plain, flat_remat):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    assert any(float(jnp.abs(g).max()) > 0 for g in flat_plain)

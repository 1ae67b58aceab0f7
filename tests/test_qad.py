"""QAD (models.qad) on a tiny PixArt: schedule, STE gradients, loss, resume, NaN stop, PTQ init, export, controls."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpr_checks import folded_leaves  # tests/jaxpr_checks.py
from kroquant_jax import formats
from kroquant_jax.qlinear import build_qlinear, qlinear_forward
from models import families, pixart, qad
from models.layers import linears
from models.testbed import model as testbed

TINY = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                           cross_attention_dim=32, sample_size=8, caption_channels=32)


@pytest.fixture(scope="module")
def setup():
    teacher = families.PIXART.build(TINY, jnp.float32, seed=1)
    student = families.PIXART.build(TINY, jnp.float32, seed=1)
    rng = np.random.default_rng(0)
    n, t = 4, 6
    data = {"images": jnp.asarray(rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)),
            "context": jnp.asarray(rng.standard_normal((n, t, 32)).astype(np.float16)),
            "context_mask": jnp.ones((n, t), jnp.uint8),
            "null_context": jnp.asarray(0.1 * rng.standard_normal((t, 32)).astype(np.float16)),
            "null_mask": jnp.asarray(np.r_[1, 1, 0, 0, 0, 0].astype(np.uint8))}
    return teacher, student, data


def test_guidance_schedule():
    constant = qad.GuidanceSchedule(3.0, 3.0)
    assert constant.constant
    np.testing.assert_array_equal(np.asarray(constant(jnp.linspace(0, 1, 11))), 3.0)
    s = qad.GuidanceSchedule(noisy=4.5, clean=1.5, sigma_clean=0.2, sigma_noisy=0.6)
    sig = jnp.linspace(0.0, 1.0, 101)
    w = np.asarray(s(sig))
    assert w[0] == pytest.approx(1.5) and w[20] == pytest.approx(1.5)  # clean end, up to sigma_clean
    assert w[60] == pytest.approx(4.5) and w[100] == pytest.approx(4.5)  # middle and noisy levels: the strong value
    assert np.all(np.diff(w) >= -1e-6) and 1.5 < w[40] < 4.5  # monotone ramp between
    with pytest.raises(ValueError, match="sigma_clean"):
        qad.GuidanceSchedule(3.0, 1.0, sigma_clean=0.5, sigma_noisy=0.4)
    with pytest.raises(ValueError, match="below 1"):
        qad.GuidanceSchedule(0.5, 1.0)


def test_guided_sample_equals_testbed_euler_for_constant_schedule_and_the_teacher_sampler_is_it(setup):
    teacher, _, data = setup
    # numpy's noise: an eager jax.random.normal of this shape alone compiles for seconds on the CPU
    noise = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 8, 8)), jnp.float32)
    args = (noise, data["context"][:2].astype(jnp.float32), data["context_mask"][:2].astype(jnp.float32),
            data["null_context"].astype(jnp.float32), data["null_mask"].astype(jnp.float32), 4)
    graph, state = nnx.split(teacher)

    @jax.jit  # the three samplers in one program (eager, each scan compiles on its own); the weights an argument
    def samples(state):
        fn = testbed.pixart_velocity_fn(nnx.merge(graph, state))
        return (qad.guided_sample(fn, *args, qad.GuidanceSchedule(3.0, 3.0)), testbed.euler_sample(fn, *args, 3.0),
                qad.guided_sample(fn, *args, qad.GuidanceSchedule(3.0, 1.0)))

    ours, reference, scheduled = samples(state)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(scheduled - reference))) > 1e-4  # the schedule changes the trajectory
    # the jitted teacher sampler (scripts/qad.py's reference images) samples the same, with the teacher's weights an
    # argument, not constants folded into its program (which the check does see in a closure over them)
    sample = qad.teacher_sampler(graph, *args[3:], qad.GuidanceSchedule(3.0, 1.0))
    np.testing.assert_allclose(np.asarray(sample(state, *args[:3])), np.asarray(scheduled), rtol=1e-5, atol=1e-5)
    assert folded_leaves(sample.lower(state, *args[:3]).as_text(), state) == []
    assert folded_leaves(jax.jit(lambda x: sample(state, x, *args[1:3])).lower(noise).as_text(), state)


# (format, STE rule) of the gradient tests: each rule once and each format at least once (pairwise, not all six:
# each case is the whole QAD loss's gradient); the clipped rule's elementwise behaviour is tested for MXFP4 below.
# "none" is the naive control (QADConfig.naive) with the identity rule.
GRADIENT_CASES = (("mxfp4", "identity"), ("nvfp4", "clipped"), ("mxfp4", "none"))


@pytest.fixture(scope="module")
def gradients(setup):
    """``{(fmt, ste): gradient}`` of the QAD loss (one batch of the four captions) at the student's init, for the STE
    and naive-control tests: all of GRADIENT_CASES in one jitted program, whose shared parts (the teacher, the loss,
    the cases' identical forward passes, kernels of the same shapes) XLA compiles once (measured back to back on the
    2-core CPU: 76 s for all three, 109 s one by one)."""
    teacher, student, data = setup
    layers, blocks = qad.student_from_model(student)
    t_graph, t_state = nnx.split(teacher)
    s_graph, s_state = nnx.split(student)

    def teacher_velocity_of(teacher_state):
        def teacher_velocity(x, timestep, context, mask):
            return nnx.merge(t_graph, teacher_state)(x, context, timestep, encoder_attention_mask=mask)

        return teacher_velocity

    def loss(trainable, teacher_state, config):
        return qad.qad_loss(trainable, blocks, s_graph, teacher_velocity_of(teacher_state), config, False,
                            testbed.images_to_pixels(data["images"]), data["context"].astype(jnp.float32),
                            data["context_mask"].astype(jnp.float32), data["null_context"].astype(jnp.float32),
                            data["null_mask"].astype(jnp.float32), jax.random.key(0))[0]

    configs = [qad.QADConfig(fmt=fmt, ste="identity" if ste == "none" else ste, naive=ste == "none", batch_size=4,
                             steps=2, chunk=2, save_every=2) for fmt, ste in GRADIENT_CASES]

    @jax.jit  # the teacher's weights an argument (closed over, XLA would fold them into the program as constants)
    def all_gradients(trainables, teacher_state):
        return [jax.grad(loss)(trainable, teacher_state, config) for trainable, config in zip(trainables, configs)]

    trainables = [qad.init_state(s_state, layers, config)["trainable"] for config in configs]
    return dict(zip(GRADIENT_CASES, all_gradients(trainables, t_state)))


@pytest.mark.parametrize(("fmt", "ste"), GRADIENT_CASES)
def test_ste_gradient_reaches_quantized_weights_only_with_ste(gradients, ste, fmt):
    grads = gradients[fmt, ste]
    weight_grads = [float(np.abs(np.asarray(g["weight"])).max()) for g in grads["layers"].values()]
    assert len(weight_grads) == 10 * TINY.num_layers
    if ste == "none":
        assert max(weight_grads) == 0.0  # naive distillation: nothing through the quantizer
    else:
        assert min(weight_grads) > 0.0  # every quantized linear's weight gets a gradient through the rounding
    bias_grads = [float(np.abs(np.asarray(g["bias"])).max()) for g in grads["layers"].values()]
    assert max(bias_grads) > 0.0  # biases sit after the quantizer: trained in every mode
    proj_out = float(jnp.abs(grads["model"]["proj_out"]["kernel"][...]).max())
    assert proj_out > 0.0  # the 16-bit output layer trains in every mode


def test_clipped_ste_zeroes_saturated_elements():
    # MXFP4 scales a block of absmax 1.75 by 2^-2: 1.75 -> 7 saturates (to 6), 1.0 -> 4 does not. Weight (0, 0) and
    # activation 0 saturate; weight (0, 1) and activation 1 do not; row 1 is all zero.
    fmt = formats.MXFP4()
    layer = {"weight": jnp.zeros((2, 32)).at[0, 0].set(1.75).at[0, 1].set(1.0), "bias": jnp.zeros(2),
             "left": jnp.zeros((2, 0)), "right": jnp.zeros((0, 32))}
    blocks = jnp.ones((32, 1, 1))
    x = jnp.linspace(-1.0, 1.0, 32)[None].at[0, 0].set(1.75)

    def out(layer, x, ste):
        return jnp.sum(qad.student_linear(layer, blocks, jnp.float32(1.0), x, fmt=fmt, ste=ste,
                                          lowrank_quantized=False))

    # both rules' gradients in one jitted program (eager, every primitive compiles on its own)
    (gw_plain, gx_plain), (gw_clip, gx_clip) = jax.jit(lambda layer, x: [
        jax.grad(out, argnums=(0, 1))(layer, x, ste) for ste in ("identity", "clipped")])(layer, x)
    gw_plain, gw_clip = np.asarray(gw_plain["weight"]), np.asarray(gw_clip["weight"])
    gx_plain, gx_clip = np.asarray(gx_plain), np.asarray(gx_clip)
    assert gw_plain[0, 0] != 0 and gw_clip[0, 0] == 0  # the saturated weight: plain passes, clipped zeroes
    assert gx_plain[0, 0] != 0 and gx_clip[0, 0] == 0  # the saturated activation likewise
    np.testing.assert_array_equal(gw_clip[:, 1:], gw_plain[:, 1:])  # every unsaturated weight keeps its gradient
    np.testing.assert_array_equal(gx_clip[:, 1:], gx_plain[:, 1:])
    assert gx_plain[0, 1] == 1.0  # activation 1 meets the unsaturated weight 1.0 (an exact MXFP4 value)


# The training settings of the loss, overfit, resume, refusal and NaN tests: one config, so one compiled chunk program
# (the data are its arguments: the overfit test's one-caption set has the shapes of the four captions) and one compiled
# evaluation; the tests that train fewer steps stop early (train's stop_after). The distillation term only: the
# flow-matching term of random images has a large irreducible part; CFG 6: the tiny random model's branches differ
# little, so a weak guidance leaves little to learn.
TRAIN = qad.QADConfig(batch_size=4, steps=40, chunk=2, save_every=2, lr=1e-3, warmup=1, fm_weight=0.0,
                      schedule=qad.GuidanceSchedule(6.0, 6.0))


@pytest.fixture(scope="module")
def training(setup):
    """``(chunk_of, state0, errors)``: ``chunk_of(data)`` is TRAIN's jitted chunk on a data set (one compilation for
    all), ``state0`` the initial training state; ``errors(trainable, data)`` at fixed noise (four noise levels from 0.1
    to 0.9, one per example): the training loss and the mean squared distances student-guided target (the loss, with
    fm_weight 0), student-conditional (the teacher's plain conditional prediction) and guided-conditional."""
    teacher, student, _ = setup
    layers, blocks = qad.student_from_model(student)
    t_graph, t_state = nnx.split(teacher)
    s_graph, s_state = nnx.split(student)

    def chunk_of(data):
        return qad.make_train_chunk(s_graph, t_graph, t_state, blocks, TRAIN, False, data)

    @jax.jit  # one program (eager, every primitive compiles on its own); the teacher's weights an argument
    def evaluate(trainable, teacher_state, data):
        teacher_fn = testbed.pixart_velocity_fn(nnx.merge(t_graph, teacher_state))
        pixels = testbed.images_to_pixels(data["images"])  # (n, 3, s, s)
        sigma = jnp.linspace(0.1, 0.9, pixels.shape[0])  # (n,)
        noise = jax.random.normal(jax.random.key(7), pixels.shape)
        noisy = (1 - sigma)[:, None, None, None] * pixels + sigma[:, None, None, None] * noise
        context, mask = data["context"].astype(jnp.float32), data["context_mask"].astype(jnp.float32)
        guided = qad.teacher_target(teacher_fn, noisy, sigma, context, mask, data["null_context"].astype(jnp.float32),
                                    data["null_mask"].astype(jnp.float32), TRAIN.schedule)
        timestep = sigma * testbed.TIMESTEP_SCALE
        conditional = teacher_fn(noisy, timestep, context, mask)
        student = qad.student_velocity(s_graph, trainable, blocks, TRAIN, False, noisy, timestep, context, mask)
        loss, parts = qad.distillation_loss(student, guided, noise - pixels, TRAIN.fm_weight)
        return {"loss": loss, "guided": parts["distill"], "conditional": jnp.mean(jnp.square(student - conditional)),
                "gap": jnp.mean(jnp.square(guided - conditional))}

    def errors(trainable, data):
        return {k: float(v) for k, v in evaluate(trainable, t_state, data).items()}

    return chunk_of, qad.init_state(s_state, layers, TRAIN), errors


def test_few_steps_reduce_the_loss(setup, training):
    chunk_of, state, errors = training
    _, _, data = setup
    chunk = chunk_of(data)
    before = errors(state["trainable"], data)["loss"]
    for _ in range(TRAIN.steps // TRAIN.chunk):
        state, metrics = chunk(state)
    after = errors(state["trainable"], data)["loss"]
    assert int(state["step"]) == 40
    assert after < 0.5 * before, (before, after)


def test_resume_after_a_stop_is_bit_identical(setup, training, tmp_path):
    chunk_of, state0, _ = training
    chunk, config = chunk_of(setup[2]), TRAIN
    full, _ = qad.train(tmp_path / "full", chunk, state0, config, {"init": "x"}, progress=False, stop_after=6)
    part, records = qad.train(tmp_path / "split", chunk, state0, config, {"init": "x"}, progress=False, stop_after=2)
    assert int(part["step"]) == 2 and len(records) == 1
    # a fresh call (as after a kill): only the checkpoint on disk survives, and a chunk logged after it is dropped
    (tmp_path / "split" / "log.jsonl").open("a").write(json.dumps({"step": 4, "loss": 1.0}) + "\n")
    resumed, records = qad.train(tmp_path / "split", chunk, state0, config, {"init": "x"}, progress=False,
                                 stop_after=6)
    assert [r["step"] for r in records] == [4, 6]
    log = [json.loads(line) for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6] and log[1]["loss"] != 1.0, "each step logged once, by this run"
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.any(a != b), full["trainable"], state0["trainable"]))
    assert any(bool(m) for m in moved)  # training changed something (the equality is not trivial)


def test_refuses_a_run_folder_made_with_other_settings(setup, training, tmp_path):
    chunk_of, state0, _ = training
    chunk, config = chunk_of(setup[2]), TRAIN
    qad.train(tmp_path, chunk, state0, config, {"init": "16-bit"}, progress=False, stop_after=2)
    with pytest.raises(ValueError, match="other settings.*init"):
        qad.train(tmp_path, chunk, state0, config, {"init": "svdquant"}, progress=False)
    other = dataclasses.replace(config, fm_weight=0.5)
    with pytest.raises(ValueError, match="other settings.*config"):
        qad.train(tmp_path, chunk, state0, other, {"init": "16-bit"}, progress=False)


def test_nan_stops_training_and_keeps_the_last_good_checkpoint(setup, training, tmp_path):
    chunk_of, state0, _ = training
    chunk, config = chunk_of(setup[2]), TRAIN
    good = {}

    def poisoned(state):
        # a real non-finite step: from step 4 on, the teacher-free loss sees a NaN weight
        if int(state["step"]) >= 4:
            layers = dict(state["trainable"]["layers"])
            first = next(iter(layers))
            layers[first] = {**layers[first], "weight": layers[first]["weight"].at[0, 0].set(jnp.nan)}
            state = {**state, "trainable": {**state["trainable"], "layers": layers}}
        else:
            good["state"] = state
        return chunk(state)

    with pytest.raises(qad.NonFiniteError, match=r"QAD step 5: .*not finite.*step_00000004"):
        qad.train(tmp_path, poisoned, state0, config, {"init": "x"}, progress=False)
    last = qad.latest_checkpoint(tmp_path / "checkpoints")
    assert last.name == "step_00000004"
    restored = qad.restore_checkpoint(last, state0)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(restored["trainable"]))
    expected, _ = chunk(good["state"])  # the state after steps 3-4, saved at step 4
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]


def test_saving_a_step_again_never_leaves_it_missing(tmp_path, monkeypatch):
    """A resumed run that stops where it started saves the same step again: the new checkpoint replaces the old one
    whole, and a save that fails half-way leaves the old one as it was (never a deleted or half-written step)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    first = {"step": np.int32(3), "w": np.arange(4, dtype=np.float32)}
    second = {"step": np.int32(3), "w": -np.arange(4, dtype=np.float32)}
    qad.save_checkpoint(tmp_path, first)
    qad.save_checkpoint(tmp_path, second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003"]  # no staging folder left
    np.testing.assert_array_equal(np.asarray(qad.restore_checkpoint(tmp_path / "step_00000003", first)["w"]),
                                  second["w"])

    def broken_save(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        qad.save_checkpoint(tmp_path, first)
    assert qad.latest_checkpoint(tmp_path).name == "step_00000003"
    np.testing.assert_array_equal(np.asarray(qad.restore_checkpoint(tmp_path / "step_00000003", first)["w"]),
                                  second["w"])


@pytest.mark.parametrize("transform,packed_branch", [("hadamard32", True), ("diagonal", False)])
def test_ptq_init_and_export_reproduce_the_calibrated_layers(setup, transform, packed_branch):
    """LoRaQ-like (Hadamard, MXFP4 branch) and SVDQuant-like (diagonal, 16-bit branch) PTQ layers: the student at
    init computes what the calibrated layer computes, also where the stored rounding is not round-to-nearest (as
    GPTQ's), and its export runs through qlinear_forward unchanged."""
    from kroquant_jax.qlinear import residual_weight

    _, student, _ = setup
    from models.layers import linears
    rng = np.random.default_rng(0)
    qlayers = {}
    for name, linear in linears(student, quantizable_only=True).items():
        w = np.asarray(linear.kernel[...]).T
        o, d = w.shape
        branch = (0.1 * rng.standard_normal((o, 32)).astype(np.float32),  # rank 32: a packed branch is quantized
                  rng.standard_normal((32, d)).astype(np.float32))  # along the rank, in blocks of 32
        params = None if transform != "diagonal" else {"log_gamma": jnp.asarray(0.3 * rng.standard_normal(d), jnp.float32)}
        kwargs = {} if params is None else {"transform_params": params}
        if name == "transformer_blocks.0.attn1.to_q":  # a rounding of its own: codes that re-rounding W~ would change
            residual = residual_weight(w, transform=transform, lowrank=branch, lowrank_quantized=packed_branch,
                                       **kwargs)
            kwargs["quantized_weight"] = formats.quantize(residual + 0.3 * jnp.std(residual) * jnp.asarray(
                rng.standard_normal(residual.shape), jnp.float32), formats.MXFP4())
            nearest = formats.fake_quant(residual, formats.MXFP4())
            assert bool(jnp.any(formats.dequantize(kwargs["quantized_weight"], jnp.float32) != nearest))
        qlayers[name] = build_qlinear(w, np.asarray(linear.bias[...]), transform=transform, lowrank=branch,
                                      lowrank_quantized=packed_branch, **kwargs)
    # refused, naming the layer: a store in another format than the student's, and a stored residual that its
    # format's fake quant would change (an NVFP4 tensor scale not its own)
    name = "transformer_blocks.0.attn2.to_k"
    mismatch = r"transformer_blocks\.0\.\S+: stored with MXFP4.* the student quantizes with NVFP4"
    with pytest.raises(ValueError, match=mismatch):
        qad.student_from_qlinears(student, qlayers, fmt=formats.NVFP4())
    stored = formats.dequantize(qlayers[name].weight, jnp.float32)
    odd = dataclasses.replace(qlayers[name], config=dataclasses.replace(qlayers[name].config, act_fmt=formats.NVFP4()),
                              weight=formats.quantize(stored, formats.NVFP4(),
                                                      tensor_scale=3.7 * formats.nvfp4_tensor_scale(stored)))
    with pytest.raises(ValueError, match=f"{name}: .* change when fake-quantized again"):
        qad.student_from_qlinears(student, {**qlayers, name: odd})
    layers, blocks, packed = qad.student_from_qlinears(student, qlayers, fmt=formats.MXFP4())
    assert packed is packed_branch
    config = qad.QADConfig()
    exported = qad.export_qlinears(layers, blocks, config, packed)
    x = jnp.asarray(rng.standard_normal((5, 32)).astype(np.float32))
    for name in ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn2.to_k"):
        ours = qad.student_linear(layers[name], blocks[name], jnp.float32(1.0), x, fmt=formats.MXFP4(),
                                  ste="identity", lowrank_quantized=packed)
        theirs = qlinear_forward(qlayers[name], x, "simulate")
        scale = float(jnp.abs(theirs).max())
        # the same quantized residual (the stored codes): equal up to the order of f32 operations
        assert float(jnp.abs(ours - theirs).max()) < 1e-4 * scale, name
        for path in ("simulate", "packed"):
            np.testing.assert_allclose(np.asarray(qlinear_forward(exported[name], x, path)), np.asarray(ours),
                                       rtol=1e-4, atol=1e-4 * scale)


def test_student_at_guidance_one_learns_the_guided_teacher(setup, training):
    """Overfit one caption: the one-branch student's prediction moves to the teacher's guided target (CFG 6),
    away from the teacher's plain conditional prediction it started next to."""
    chunk_of, state, errors = training
    _, _, data = setup
    # the first caption four times: the shapes of the four captions, so TRAIN's compiled chunk and evaluation run it
    one = {k: (jnp.repeat(v[:1], 4, 0) if k in ("images", "context", "context_mask") else v) for k, v in data.items()}
    chunk = chunk_of(one)
    before = errors(state["trainable"], one)
    assert before["conditional"] < 0.2 * before["gap"]  # at init the student is the (quantized) conditional teacher
    for _ in range(200 // TRAIN.chunk):
        state, _ = chunk(state)
    after = errors(state["trainable"], one)
    assert after["guided"] < 0.1 * before["guided"], (before, after)
    assert after["guided"] < 0.1 * after["conditional"]  # it predicts the guided velocity, not the conditional one


def test_colour_correction_matches_reference_statistics():
    rng = np.random.default_rng(0)
    reference = rng.integers(0, 256, (6, 16, 16, 3)).astype(np.uint8)
    grey = reference.mean(-1, keepdims=True)
    washed = np.clip(0.6 * reference + 0.4 * grey - 20, 0, 255).astype(np.uint8)  # desaturated and darker
    fixed = qad.colour_correct(washed, reference)
    from models import image_metrics
    before = image_metrics.color_ratios(washed / 255.0, reference / 255.0)["chroma_ratio"]
    after = image_metrics.color_ratios(fixed / 255.0, reference / 255.0)["chroma_ratio"]
    assert before < 0.8 and abs(after - 1.0) < 0.05 < abs(before - 1.0)
    assert abs(fixed.mean() - reference.mean()) < 3.0 < abs(washed.mean() - reference.mean())
    np.testing.assert_allclose(qad.colour_correct(reference, reference), reference, atol=1)


def test_config_validation():
    with pytest.raises(ValueError, match="fmt"):
        qad.QADConfig(fmt="int4")
    with pytest.raises(ValueError, match="ste"):
        qad.QADConfig(ste="soft")
    with pytest.raises(ValueError, match="multiples of chunk"):
        qad.QADConfig(steps=15, chunk=10)


def test_naive_control_freezes_the_quantized_weights_and_keeps_the_rest_of_the_gradient(gradients):
    """naive=True: zero gradient for the quantized weights, and for every other parameter exactly the gradient of the
    identity-STE student (the activation quantizers keep the STE, so the chain rule reaches the earlier layers)."""
    naive, ste = gradients["mxfp4", "none"], gradients["mxfp4", "identity"]
    for name in naive["layers"]:
        assert float(np.abs(np.asarray(naive["layers"][name]["weight"])).max()) == 0.0, name
        assert float(np.abs(np.asarray(ste["layers"][name]["weight"])).max()) > 0.0, name
        np.testing.assert_allclose(naive["layers"][name]["bias"], ste["layers"][name]["bias"], rtol=1e-5, atol=1e-8)
    first_bias = naive["layers"][sorted(naive["layers"])[0]]["bias"]
    assert float(jnp.abs(first_bias).max()) > 0.0  # an early layer is reached through the activation quantizers
    flat_naive = jax.tree_util.tree_leaves_with_path(naive["model"])
    flat_ste = dict(jax.tree_util.tree_leaves_with_path(ste["model"]))
    for path, leaf in flat_naive:
        np.testing.assert_allclose(leaf, flat_ste[path], rtol=1e-5, atol=1e-8, err_msg=jax.tree_util.keystr(path))


def test_naive_control_keeps_the_configured_activation_rule():
    """The naive control differs from QAD in the weight quantizers alone: with the clipped rule its activations'
    gradient is QAD's clipped one (zero where an element saturated), not the identity rule's."""
    rng = np.random.default_rng(0)
    layer = {"weight": jnp.asarray(rng.standard_normal((8, 64)), jnp.float32), "bias": jnp.zeros(8),
             "left": jnp.zeros((8, 0)), "right": jnp.zeros((0, 64))}
    blocks = jnp.broadcast_to(jnp.eye(32), (2, 32, 32))
    x = jnp.asarray(rng.standard_normal((4, 64)) * np.where(rng.random((4, 64)) < 0.1, 30.0, 1.0), jnp.float32)

    def input_gradient(config):
        forward, through = qad.student_forward(config, False)
        return np.asarray(jax.grad(lambda x: jnp.sum(forward(layer, blocks, through, x) ** 2))(x))

    naive = input_gradient(qad.QADConfig(ste="clipped", naive=True))
    clipped = input_gradient(qad.QADConfig(ste="clipped"))
    identity = input_gradient(qad.QADConfig(naive=True))
    np.testing.assert_array_equal(naive, clipped)
    assert (naive == 0).sum() > (identity == 0).sum(), "the clipped rule zeroes the saturated elements"
    assert float(qad.student_forward(qad.QADConfig(ste="clipped", naive=True), False)[1]) == 0.0


def test_warmup_zero_is_a_constant_learning_rate():
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.ones(3)}
    for warmup, first_moves in ((0, True), (2, False)):
        optimizer = qad.make_optimizer(qad.QADConfig(warmup=warmup, lr=1e-2))
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        assert bool(jnp.any(updates["w"] != 0)) == first_moves, warmup
    with pytest.raises(ValueError, match="warmup=-1"):
        qad.QADConfig(warmup=-1)


def test_unquantized_student_is_the_teacher_and_trains_every_weight(setup):
    """The ``distill_16bit`` control (no W4A4 layers): at init the student's velocity is the teacher's conditional
    velocity exactly, and the loss's gradient reaches the weights of the linears a W4A4 student would quantize."""
    teacher, student, data = setup
    t_graph, t_state = nnx.split(teacher)
    s_graph, s_state = nnx.split(student)
    config = dataclasses.replace(TRAIN, fm_weight=0.5)
    trainable = qad.init_state(s_state, {}, config)["trainable"]
    x = jax.random.normal(jax.random.key(3), (4, 3, 8, 8))
    timestep = jnp.linspace(100.0, 900.0, 4)
    context, mask = data["context"].astype(jnp.float32), data["context_mask"].astype(jnp.float32)
    pixels = testbed.images_to_pixels(data["images"])
    null_context, null_mask = data["null_context"].astype(jnp.float32), data["null_mask"].astype(jnp.float32)

    def loss(tr, teacher_state):
        def teacher_velocity(x, timestep, context, mask):
            return nnx.merge(t_graph, teacher_state)(x, context, timestep, encoder_attention_mask=mask)

        return qad.qad_loss(tr, {}, s_graph, teacher_velocity, config, False, pixels, context, mask, null_context,
                            null_mask, jax.random.key(0))[0]

    @jax.jit  # the two velocities and the gradient in one program (eager, every primitive compiles on its own)
    def velocities_and_gradient(tr, teacher_state):
        ours = qad.student_velocity(s_graph, tr, {}, config, False, x, timestep, context, mask)
        theirs = nnx.merge(t_graph, teacher_state)(x, context, timestep, encoder_attention_mask=mask)
        return ours, theirs, jax.grad(loss)(tr, teacher_state)

    ours, theirs, grads = velocities_and_gradient(trainable, t_state)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-6)
    quantizable = linears(student, quantizable_only=True)
    assert quantizable and grads["layers"] == {}
    for name in quantizable:  # e.g. transformer_blocks.0.attn1.to_q: its kernel is a plain trained weight here
        kernel = grads["model"]
        for part in name.split("."):
            kernel = kernel[int(part) if part.isdigit() else part]
        assert float(np.abs(np.asarray(kernel["kernel"][...])).max()) > 0.0, name


def test_unquantized_student_exports_as_a_16bit_checkpoint(setup, tmp_path):
    """``distill_16bit``'s export is a diffusers folder of the trained weights (every one, the linears a W4A4 student
    would quantize included) with its sampler (guidance 1) and the prompts beside it; re-exporting replaces it."""
    _, student, _ = setup
    graph, state = nnx.split(student)
    trained = jax.tree.map(lambda v: v + 0.01, state)  # stands in for training: every weight moved
    prompts = tmp_path / "prompts.npz"
    np.savez(prompts, context=np.ones((1, 2, 32), np.float32))
    folder = qad.export_unquantized_student(tmp_path / "student", graph, trained, prompts=prompts,
                                            extra={"variant": "distill_16bit", "step": 7})
    assert json.loads((folder / "distilled.json").read_text()) == {
        "solver": "flow_euler", "shift": 1.0, "guidance": 1.0, "branches": 1, "variant": "distill_16bit", "step": 7}
    assert (folder / "testbed_prompts.npz").read_bytes() == prompts.read_bytes()
    cfg, loaded = families.PIXART.from_diffusers(folder, jnp.float32)
    assert cfg == TINY
    ours = jax.tree_util.tree_leaves_with_path(nnx.state(nnx.merge(graph, trained), nnx.Param))
    theirs = dict(jax.tree_util.tree_leaves_with_path(nnx.state(loaded, nnx.Param)))
    assert len(ours) == len(theirs)
    for path, leaf in ours:
        np.testing.assert_array_equal(np.asarray(theirs[path]), np.asarray(leaf), err_msg=jax.tree_util.keystr(path))
    qad.export_unquantized_student(folder, graph, state)  # replaced: the untrained weights, no prompts given
    _, again = families.PIXART.from_diffusers(folder, jnp.float32)
    q = "transformer_blocks.0.attn1.to_q"
    np.testing.assert_array_equal(np.asarray(linears(again)[q].kernel[...]),
                                  np.asarray(linears(student)[q].kernel[...]))
    assert json.loads((folder / "distilled.json").read_text())["guidance"] == 1.0
    assert not (folder / "testbed_prompts.npz").exists()


def test_script_validates_its_ptq_stores_before_any_work(tmp_path):
    """`kroquant qad --ptq-store A B`: each folder must exist, the names (given or each folder's name without its
    hash) must be one per store and distinct; refused before the teacher is loaded and before --out is created."""
    from scripts import qad as qad_script

    a, b = tmp_path / "svdquant-0123", tmp_path / "x" / "svdquant-4567"
    a.mkdir()
    b.mkdir(parents=True)
    out = tmp_path / "out"
    common = ["--data", str(tmp_path / "none.npz"), "--out", str(out)]
    with pytest.raises(ValueError, match="--ptq-store .*missing: no such folder"):
        qad_script.main(common + ["--ptq-store", str(a), str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="one distinct name per --ptq-store"):
        qad_script.main(common + ["--ptq-store", str(a), str(b)])  # both default to "svdquant"
    with pytest.raises(ValueError, match="one distinct name per --ptq-store \\(2\\)"):
        qad_script.main(common + ["--ptq-store", str(a), str(b), "--ptq-name", "only_one"])
    with pytest.raises(ValueError, match=r"^--variants qad_ptq need --ptq-store"):
        qad_script.main(common + ["--variants", "qad_ptq"])
    with pytest.raises(ValueError, match=r"^--variants qad_ptq \(of the default variants\) need --ptq-store"):
        qad_script.main(common)
    with pytest.raises(ValueError, match="--curve-every 30 must be a multiple of --chunk 50"):
        qad_script.main(common + ["--curve-every", "30", "--chunk", "50"])
    with pytest.raises(ValueError, match="--steps 6 must be a multiple of --chunk 4"):
        qad_script.main(common + ["--steps", "6", "--chunk", "4", "--curve-every", "4"])
    with pytest.raises(ValueError, match="--save-every 500 must be a multiple of --chunk 3"):
        qad_script.main(common + ["--steps", "6", "--chunk", "3", "--curve-every", "3"])
    with pytest.raises(ValueError, match="--eval-captions 10000 \\+ --validation-captions 8: the prompts have only"):
        qad_script.main(common + ["--variants", "qad_16bit", "--eval-captions", "10000"])  # the shipped prompts
    with pytest.raises(ValueError, match="--student-init .*: not a diffusers folder"):
        qad_script.main(common + ["--variants", "qad_16bit", "--student-init", str(a)])
    assert not out.exists()
    # a student of another model is refused when the two configs are read, naming the fields (before the data)
    families.PIXART.to_diffusers(families.PIXART.build(TINY, jnp.float32, seed=1), tmp_path / "tiny")
    with pytest.raises(ValueError, match="--student-init .*tiny: not a model of --checkpoint .*num_layers"):
        qad_script.main(common + ["--variants", "qad_16bit", "--student-init", str(tmp_path / "tiny")])


def test_best_iterate_keeps_the_best_scored_iterate_across_resumes(tmp_path):
    """`kroquant qad --select-best`: the best-scoring trainable state is saved, survives a resumed run (a new
    BestIterate on the same folder restores it, bit for bit), and a folder selected by another measure is refused."""
    def trainable(value):
        return {"model": {"w": jnp.full((3, 4), value, jnp.float32)}, "layers": {"l": {"s": jnp.arange(5.0) * value}}}

    best = qad.BestIterate(tmp_path, "validation PSNR: captions 24..31")
    assert best.offer(0, trainable(0.0), 17.0)
    assert best.offer(100, trainable(1.0), 18.5)
    assert not best.offer(200, trainable(2.0), 18.5)  # a tie keeps the earlier iterate
    assert not best.offer(300, trainable(3.0), float("nan"))
    assert not best.offer(400, trainable(4.0), 18.0)
    assert (best.step, best.score) == (100, 18.5)
    resumed = qad.BestIterate(tmp_path, "validation PSNR: captions 24..31")
    assert (resumed.step, resumed.score) == (100, 18.5)
    got = resumed.trainable(trainable(9.0))
    np.testing.assert_array_equal(np.asarray(got["model"]["w"]), np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(np.asarray(got["layers"]["l"]["s"]), np.arange(5.0))
    assert not resumed.offer(500, trainable(5.0), 18.2)  # the stored score still counts after a resume
    with pytest.raises(ValueError, match="selected by 'validation PSNR: captions 24..31', this run selects by"):
        qad.BestIterate(tmp_path, "validation PSNR: captions 24..39")
    with pytest.raises(ValueError, match="no iterate was scored"):
        qad.BestIterate(tmp_path / "fresh", "x").trainable(trainable(0.0))


def test_select_best_refuses_a_run_folder_it_cannot_select_in_honestly(tmp_path):
    """`--select-best` on a run folder trained without it (its earlier iterates are gone), or whose best iterate was
    selected on other validation captions: a one-line refusal before any image is sampled."""
    from scripts import qad as qad_script

    out = tmp_path / "out"
    step = out / "runs" / "qad_16bit" / "checkpoints" / "step_00000100"
    step.mkdir(parents=True)
    (step / "paths.json").write_text("[]")
    common = ["--data", str(tmp_path / "none.npz"), "--out", str(out), "--variants", "qad_16bit", "--select-best"]
    with pytest.raises(ValueError, match="qad_16bit: trained without --select-best"):
        qad_script.main(common)
    qad.BestIterate(out / "runs" / "qad_16bit", "validation PSNR: held-out captions 24..31, seed 1000, 20 Euler "
                    "steps").offer(0, {"w": jnp.zeros(2)}, 17.0)
    with pytest.raises(ValueError, match="selected by .*24..31.*this run selects by .*24..27"):
        qad_script.main(common + ["--validation-captions", "4"])


def test_scanned_student_equals_the_block_loop_in_value_and_gradient():
    """student_velocity runs the blocks under one lax.scan: on a 2-block student with distinct per-block layers and
    transforms its velocity and its gradients (16-bit parameters and quantized layers) equal the Python loop's (2
    blocks: each block's slot of the stacked layers is checked; a third adds compile time, not a case)."""
    from models.layers import LinearHooks
    cfg = dataclasses.replace(TINY, num_layers=2)
    student = families.PIXART.build(cfg, jnp.float32, seed=2)
    layers, blocks = qad.student_from_model(student, rank=32, block=32)
    rng = np.random.default_rng(3)
    # float32 on the host (eager jnp would compile an add and a multiply per leaf shape)
    layers = jax.tree.map(lambda a: a + np.float32(0.02) * rng.standard_normal(a.shape).astype(np.float32), layers)
    blocks = {k: jnp.asarray(np.linalg.qr(rng.standard_normal(b.shape))[0], jnp.float32) for k, b in blocks.items()}
    graph, state = nnx.split(student)
    config = qad.QADConfig()
    x = jnp.asarray(rng.standard_normal((2, 3, 8, 8)), jnp.float32)
    context = jnp.asarray(rng.standard_normal((2, 6, 32)), jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 0, 0, 0], [1] * 6], jnp.float32)
    timestep = jnp.asarray([100.0, 700.0])

    def looped(trainable):
        forward, through = qad.student_forward(config, False)
        overrides = {name: jax.tree_util.Partial(forward, layer, blocks[name], through)
                     for name, layer in trainable["layers"].items()}
        return nnx.merge(graph, trainable["model"])(x, context, timestep, encoder_attention_mask=mask,
                                                    hooks=LinearHooks(overrides))

    def scanned(trainable):
        return qad.student_velocity(graph, trainable, blocks, config, False, x, timestep, context, mask)

    def velocity_and_grad(velocity, trainable):
        def objective(t):
            v = velocity(t)
            return jnp.sum(v ** 2), v

        (_, v), grad = jax.value_and_grad(objective, has_aux=True)(trainable)
        return v, grad

    # both sides' velocities and gradients in one jitted program (eager, every primitive compiles on its own; two
    # programs would compile the parts they share twice)
    both = jax.jit(lambda t: (velocity_and_grad(scanned, t), velocity_and_grad(looped, t)))
    (ours, grad_ours), (theirs, grad_theirs) = both({"model": state, "layers": layers})
    assert float(jnp.abs(theirs).max()) > 0.1
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)
    # per leaf, up to reassociation (leaves with a vanishing true gradient, e.g. a key bias, are rounding noise); on
    # the host: eager jnp would compile its subtraction, abs and max for every leaf shape
    grad_ours, grad_theirs = jax.tree.map(np.asarray, (grad_ours, grad_theirs))
    largest = max(float(np.abs(b).max()) for b in jax.tree.leaves(grad_theirs))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grad_ours), jax.tree.leaves(grad_theirs)):
        tolerance = 1e-4 * float(np.abs(b).max()) + 1e-6 * largest
        assert float(np.abs(a - b).max()) <= tolerance, jax.tree_util.keystr(path)
    # block 1's layer reaches block 1 (not block 0's slot): its gradient is its own
    name = "transformer_blocks.1.ff.net.2"
    assert float(np.abs(grad_ours["layers"][name]["weight"]).max()) > 0


def test_scanned_blocks_refuse_hooks_they_cannot_stack():
    """run_blocks_scanned says which override is at fault: a functools.partial (arrays hidden from the scan), a
    block that overrides other linears than block 0, another pytree structure, or a recorder."""
    import functools

    from models.layers import LinearHooks, run_blocks_scanned
    cfg = dataclasses.replace(TINY, num_layers=2)
    model = families.PIXART.build(cfg, jnp.float32, seed=0)
    blocks = list(model.transformer_blocks)
    x = jnp.zeros((1, 4, cfg.inner_dim))

    def identity(scale, h):  # never called: every case is refused before anything runs
        return h

    def run(overrides, recorder=None):
        hooks = LinearHooks(overrides, recorder=recorder)
        return run_blocks_scanned(blocks, x, hooks, lambda block, h, inner: block.ff(h, inner))

    name0, name1 = "transformer_blocks.0.ff.net.2", "transformer_blocks.1.ff.net.2"
    with pytest.raises(ValueError, match=rf"override of {name0} must be a jax.tree_util.Partial"):
        run({name0: functools.partial(identity, 1.0), name1: functools.partial(identity, 1.0)})
    with pytest.raises(ValueError, match=r"block 1 overrides \[\]"):
        run({name0: jax.tree_util.Partial(identity, 1.0)})
    with pytest.raises(ValueError, match=rf"override of {name1} has another function or pytree structure"):
        run({name0: jax.tree_util.Partial(identity, 1.0), name1: jax.tree_util.Partial(identity, (1.0, 2.0))})

    class Recorder:
        def wants(self, path):
            return True

        def record(self, path, x, token_mask=None):
            pass

    with pytest.raises(ValueError, match="a recorder or fused hooks cannot run under the scan"):
        run({}, recorder=Recorder())


def test_report_psnr_standard_error_is_over_captions_not_images():
    """`kroquant qad`'s tables: a caption's seeds are not independent samples, so the PSNR's standard error is over
    the captions' means across seeds (as `kroquant evaluate` reports it), not over every image of every seed (which
    understated it by up to sqrt(seeds) when the error level is the caption's)."""
    from scripts import qad as qad_script

    rng = np.random.default_rng(0)
    seeds, n = (1000, 2000), 12
    reference = {s: rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8) for s in seeds}
    level = rng.uniform(2, 40, (n, 1, 1, 1))  # each caption's error level, shared by its seeds
    got = {s: np.clip(reference[s] + rng.normal(0, 1, reference[s].shape) * level, 0, 255).astype(np.uint8)
           for s in seeds}
    metrics = qad_script.column_metrics(got, reference, seeds, slice(None))
    per_image = np.array(metrics["psnr_per_image_db"]).reshape(len(seeds), n)
    assert metrics["psnr_sem_db"] == pytest.approx(per_image.mean(0).std(ddof=1) / np.sqrt(n), rel=1e-3)
    assert metrics["psnr_sem_db"] > 1.3 * per_image.std(ddof=1) / np.sqrt(per_image.size)
    assert metrics["psnr_db_per_seed"] == pytest.approx(list(per_image.mean(1)), abs=1e-3)
    one = qad_script.column_metrics(got, reference, seeds[:1], slice(0, 6))
    assert one["psnr_db_per_seed"] == [one["psnr_db"]]

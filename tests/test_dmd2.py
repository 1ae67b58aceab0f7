"""DMD2 (models/dmd2.py) on Gaussians with analytic scores, and one cycle of the real PixArt wiring."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from kroquant_jax.timing import recorded_compilations
from models import dmd2, families, pixart
from models.testbed import model as testbed

D = 8  # data dimension; samples are (b, 1, 1, D)


def gaussian_x0(params, x, sigma):
    """E[x0 | x_sigma] for x0 ~ N(m, s^2 I) under x_sigma = (1 - sigma) x0 + sigma eps."""
    s2 = jnp.exp(2.0 * params["log_s"])
    sig = sigma[:, None, None, None]
    gain = (1.0 - sig) * s2 / ((1.0 - sig) ** 2 * s2 + sig ** 2)
    return params["m"] + gain * (x - (1.0 - sig) * params["m"])


def gaussian_apply(params, x, sigma, cond):
    del cond
    return (x - gaussian_x0(params, x, sigma)) / sigma[:, None, None, None]  # v = (x - x0) / sigma


def gaussian_features(params, x, sigma, cond):
    flat = x.reshape(x.shape[0], D, 1)
    return gaussian_apply(params, x, sigma, cond), jnp.concatenate([flat, flat ** 2, jnp.tanh(flat), 1 + 0 * flat], -1)


GAUSSIAN = dmd2.FlowModel(apply=gaussian_apply, uncond=lambda cond: jax.tree.map(jnp.zeros_like, cond),
                          apply_features=gaussian_features)


def gparams(mean, log_s=0.0):
    return {"m": jnp.full((D,), mean, jnp.float32), "log_s": jnp.asarray(log_s, jnp.float32)}


def gcond(b):
    return {"context": jnp.zeros((b, 1, 1), jnp.float32), "mask": jnp.ones((b, 1), jnp.float32)}


def test_velocity_conversions_and_score_match_the_gaussian_closed_form():
    key = jax.random.key(0)
    x0 = jax.random.normal(key, (5, 1, 1, D))
    eps = jax.random.normal(jax.random.fold_in(key, 1), x0.shape)
    sigma = jnp.array([0.1, 0.3, 0.5, 0.7, 0.95])
    s = sigma[:, None, None, None]
    x_t = (1 - s) * x0 + s * eps
    v = eps - x0
    np.testing.assert_allclose(dmd2.x0_from_velocity(x_t, v, sigma), x0, atol=1e-5)
    np.testing.assert_allclose(dmd2.eps_from_velocity(x_t, v, sigma), eps, atol=1e-5)
    # marginal of x_sigma for x0 ~ N(m, s^2): N((1 - sigma) m, (1 - sigma)^2 s^2 + sigma^2)
    p = gparams(1.5, math.log(0.7))
    variance = (1 - s) ** 2 * 0.49 + s ** 2
    analytic = -(x_t - (1 - s) * 1.5) / variance
    np.testing.assert_allclose(dmd2.score_from_velocity(x_t, gaussian_apply(p, x_t, sigma, None), sigma), analytic,
                               rtol=1e-4, atol=1e-4)


def test_dm_gradient_closed_form_sign_and_normalisation():
    """Real N(m_r, 1), fake N(m_f, 1): x0_real - x0_fake = c (m_r - m_f) with c = sigma^2 / ((1-sigma)^2 + sigma^2)
    whatever x_t, so DMD2's gradient is -c (m_r - m_f) / mean|x0 - x0_real|: it pushes samples towards m_r."""
    m_r, m_f, sigma = 2.0, -1.0, 0.4
    b = 6
    x_t = jax.random.normal(jax.random.key(1), (b, 1, 1, D))
    sig = jnp.full((b,), sigma)
    x0 = jnp.zeros((b, 1, 1, D))
    x0_real = dmd2.x0_from_velocity(x_t, gaussian_apply(gparams(m_r), x_t, sig, None), sig)
    x0_fake = dmd2.x0_from_velocity(x_t, gaussian_apply(gparams(m_f), x_t, sig, None), sig)
    c = sigma ** 2 / ((1 - sigma) ** 2 + sigma ** 2)
    np.testing.assert_allclose(x0_real - x0_fake, c * (m_r - m_f), rtol=1e-5)
    normaliser = jnp.mean(jnp.abs(x0 - x0_real), axis=(1, 2, 3), keepdims=True)
    np.testing.assert_allclose(dmd2.dm_gradient(x0, x0_real, x0_fake),
                               jnp.broadcast_to(-c * (m_r - m_f) / normaliser, x0.shape), rtol=1e-5)
    assert float(jnp.max(jnp.abs(dmd2.dm_gradient(x0, x0_real, x0_real)))) == 0.0
    assert float(jnp.max(jnp.abs(dmd2.dm_gradient(x0_real, x0_real, x0_fake)))) == 0.0  # zero normaliser -> 0

    # d dm_loss / d x0 = dm_gradient / numel: negative (towards m_r > 0) in every coordinate, one factor per sample
    config = dmd2.DMD2Config(guidance=1.0, dm_sigma_min=0.5, dm_sigma_max=0.5 + 1e-6)
    grad = jax.grad(lambda x: dmd2.dm_loss(GAUSSIAN, gparams(m_r), gparams(m_f), x, gcond(b), jax.random.key(2),
                                           config)[0])(x0)
    assert bool(jnp.all(grad < 0))
    per_sample = grad.reshape(b, -1)
    np.testing.assert_allclose(per_sample, per_sample[:, :1] * jnp.ones_like(per_sample), rtol=1e-5)
    # magnitude: numel * grad = -c(0.5) (m_r - m_f) / mean|x0 - x0_real| with dm_loss's own noise draw
    _, key_noise = jax.random.split(jax.random.key(2))
    x_half = 0.5 * x0 + 0.5 * jax.random.normal(key_noise, x0.shape)
    half = jnp.full((b,), 0.5)
    x0_real = dmd2.x0_from_velocity(x_half, gaussian_apply(gparams(m_r), x_half, half, None), half)
    normaliser = jnp.mean(jnp.abs(x0 - x0_real), axis=(1, 2, 3)).reshape(b, 1)
    np.testing.assert_allclose(per_sample * x0.size, -0.5 * (m_r - m_f) / normaliser * jnp.ones_like(per_sample),
                               rtol=1e-4)


def test_fake_score_update_reduces_its_flow_matching_loss():
    b = 256
    samples = 3.0 + 0.5 * jax.random.normal(jax.random.key(3), (b, 1, 1, D))
    fake = gparams(0.0)
    optimizer = optax.adam(0.1)
    opt = optimizer.init(fake)
    keys = jax.random.split(jax.random.key(4), 8)

    @jax.jit  # one program (eager, every primitive of the eight losses compiles on its own)
    def mean_loss(p):
        return jnp.mean(jnp.stack([dmd2.fake_score_loss(GAUSSIAN, p, samples, gcond(b), keys[i])
                                   for i in range(len(keys))]))

    before = float(mean_loss(fake))
    step = jax.jit(lambda p, o, k: _adam_step(optimizer, p, o, lambda q: dmd2.fake_score_loss(
        GAUSSIAN, q, samples, gcond(b), k)))
    for k in range(100):
        fake, opt = step(fake, opt, jax.random.key(100 + k))
    after = float(mean_loss(fake))
    assert after < 0.5 * before
    assert 2.0 < float(fake["m"].mean()) < 3.5  # the fake score moved to the samples' distribution


def _adam_step(optimizer, params, opt, loss):
    grads = jax.grad(loss)(params)
    updates, opt = optimizer.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt


def _gaussian_cycle(config, b=64, cycles=1, real_mean=2.0):
    def sample_batch(_, key):
        real = real_mean + jax.random.normal(key, (b, 1, 1, D))
        return gcond(b), real, gcond(b)

    head = dmd2.GanHead(4, rngs=nnx.Rngs(0))
    head_graphdef, head_params = nnx.split(head)
    run = dmd2.make_cycle(GAUSSIAN, config, head_graphdef, sample_batch, (b, 1, 1, D), cycles=cycles)
    state = dmd2.init_state(gparams(real_mean), head_params, config, seed=0)
    state = {**state, "generator": gparams(0.0), "critic": {**state["critic"], "fake": gparams(0.0)}}
    opt_g, opt_c = dmd2.make_optimizers(config)
    state["gen_opt"], state["critic_opt"] = opt_g.init(state["generator"]), opt_c.init(state["critic"])
    return run, state


def test_generator_step_moves_towards_the_teacher_and_training_converges():
    config = dmd2.DMD2Config(num_steps=1, guidance=1.0, fake_updates_per_generator=2, generator_lr=0.05,
                             fake_lr=0.05, weight_decay=0.0)
    run, state = _gaussian_cycle(config)
    teacher = gparams(2.0)
    new, metrics = run(state, teacher)
    assert metrics["finite"] == 1.0 and int(new["step"]) == 2  # two fake-score updates per cycle
    # fake == generator at the start, teacher at +2: the generator's mean goes up
    assert bool(jnp.all(new["generator"]["m"] > state["generator"]["m"]))
    final = new
    for _ in range(149):  # the same compiled cycle: 150 in all (a scan over cycles would be a second program)
        final, _ = run(final, teacher)
    np.testing.assert_allclose(np.asarray(final["generator"]["m"]), 2.0, atol=0.35)


def test_two_timescales_and_gan_losses():
    config = dmd2.DMD2Config(num_steps=1, guidance=1.0, fake_updates_per_generator=5, generator_lr=1e-3,
                             fake_lr=0.05, gan_generator_weight=0.1, gan_discriminator_weight=1.0,
                             weight_decay=0.0)
    run, state = _gaussian_cycle(config)
    teacher = gparams(2.0)
    new, metrics = run(state, teacher)
    assert int(new["step"]) == 5
    # the head's output layer starts at zero: logits 0, so softplus(0) terms
    np.testing.assert_allclose(float(metrics["gan_g"]), math.log(2.0), rtol=1e-5)
    assert float(metrics["gan_d"]) < 2 * math.log(2.0)  # the average over the 5 updates: the head learns
    assert not np.allclose(np.asarray(new["critic"]["head"]["out"]["kernel"]), 0.0)
    later, gan_d = state, []
    for _ in range(20):  # the same compiled cycle 20 times: their mean discriminator loss falls
        later, m = run(later, teacher)
        gan_d.append(float(m["gan_d"]))
    assert float(np.mean(gan_d)) < float(metrics["gan_d"])


def test_student_sampler_and_backward_simulation():
    np.testing.assert_allclose(dmd2.student_sigmas(4), [1.0, 0.75, 0.5, 0.25])
    p = gparams(1.0, math.log(0.5))
    b = 4
    for steps in (1, 2, 4, 8):
        x = dmd2.generate(GAUSSIAN, p, jax.random.key(steps), gcond(b), (b, 1, 1, D), steps)
        assert x.shape == (b, 1, 1, D) and bool(jnp.all(jnp.isfinite(x)))
    # 1 step from sigma 1 gives the mean; 2 steps re-noise it to sigma 0.5 with fresh noise and denoise again
    np.testing.assert_allclose(dmd2.generate(GAUSSIAN, p, jax.random.key(0), gcond(b), (b, 1, 1, D), 1), 1.0,
                               rtol=1e-6)
    keys = jax.random.split(jax.random.key(5), 2)
    fresh = jax.random.normal(keys[1], (b, 1, 1, D))
    x_half = 0.5 * 1.0 + 0.5 * fresh
    expected = gaussian_x0(p, x_half, jnp.full((b,), 0.5))
    np.testing.assert_allclose(dmd2.generate(GAUSSIAN, p, jax.random.key(5), gcond(b), (b, 1, 1, D), 2), expected,
                               rtol=1e-5, atol=1e-6)
    seen = set()
    # jitted: one program for the 40 draws (eager, each call's loop compiles again)
    simulate = jax.jit(lambda key: dmd2.backward_simulate(GAUSSIAN, p, key, gcond(b), (b, 1, 1, D), 4))
    for k in range(40):
        x, sigma = simulate(jax.random.key(k))
        assert x.shape == (b, 1, 1, D) and sigma.shape == (b,) and bool(jnp.all(sigma == sigma[0]))
        seen.add(round(float(sigma[0]), 4))
    assert seen == {1.0, 0.75, 0.5, 0.25}
    # no gradient flows through the simulated steps
    grad = jax.grad(lambda q: jnp.sum(dmd2.backward_simulate(GAUSSIAN, q, jax.random.key(3), gcond(b),
                                                             (b, 1, 1, D), 4)[0]))(p)
    assert float(jnp.abs(grad["m"]).max()) == 0.0
    assert dmd2.forward_passes_per_image(20, 3.0) == 40 and dmd2.forward_passes_per_image(4, 1.0) == 4


# The settings of the own-network, resume and NaN tests: one cycle program (2 cycles per call, backward simulation,
# CFG), compiled once for the three (fake_warmup is read by make_fake_warmup only, not by make_cycle's program).
PLAIN = dmd2.DMD2Config(num_steps=2, guidance=1.5, fake_updates_per_generator=2, generator_lr=0.01, fake_lr=0.01,
                        fake_warmup=3)
PLAIN_B = 16


def _plain_sample_batch(_, key):
    return gcond(PLAIN_B), None, None


def _plain_cycle(model=None):
    """``(run, state, teacher)``: PLAIN's 2-cycle program (no GAN head, generator N(0.5, 1), teacher N(2, 1));
    ``model``: the generator's own network (make_cycle's generator_model)."""
    run = dmd2.make_cycle(GAUSSIAN, PLAIN, None, _plain_sample_batch, (PLAIN_B, 1, 1, D), cycles=2,
                          generator_model=model)
    teacher = gparams(2.0)
    return run, dmd2.init_state(teacher, {}, PLAIN, seed=0, generator=gparams(0.5)), teacher


def test_a_generator_of_its_own_network_is_used_wherever_the_generator_runs():
    """``generator_model`` (the W4A4 generator's network) serves every generator forward of make_cycle and
    make_fake_warmup (backward simulation included) and nothing else: a generator whose parameters are wrapped in
    another structure, with a network that unwraps them, trains bit-identically to the plain one."""
    wrapped = dmd2.FlowModel(apply=lambda p, x, sigma, cond: gaussian_apply(p["inner"], x, sigma, cond),
                             uncond=GAUSSIAN.uncond)
    b, config, sample_batch = PLAIN_B, PLAIN, _plain_sample_batch
    _, plain, teacher = _plain_cycle()
    boxed = dmd2.init_state(teacher, {}, config, seed=0, generator={"inner": gparams(0.5)})
    results = []
    for model, state in ((None, plain), (wrapped, boxed)):
        # committed to its device as train commits it: the plain cycle below is then the program that the resume and
        # NaN tests call (one compilation for the three)
        state = jax.device_put(state, jax.tree.map(lambda leaf: leaf.sharding, state))
        warm, _ = dmd2.make_fake_warmup(GAUSSIAN, config, None, sample_batch, (b, 1, 1, D), generator_model=model)(
            state)
        new, metrics = _plain_cycle(model)[0](warm, teacher)
        assert float(metrics["finite"]) == 1.0
        results.append(new)
    assert not np.array_equal(np.asarray(results[0]["generator"]["m"]), np.asarray(plain["generator"]["m"]))
    np.testing.assert_array_equal(np.asarray(results[1]["generator"]["inner"]["m"]),
                                  np.asarray(results[0]["generator"]["m"]))
    np.testing.assert_array_equal(np.asarray(results[1]["critic"]["fake"]["m"]),
                                  np.asarray(results[0]["critic"]["fake"]["m"]))


def test_train_resume_is_bit_identical(tmp_path):
    run, state, teacher = _plain_cycle()
    straight, summary = dmd2.train(run, state, teacher, tmp_path / "a", 8, 2, save_every_calls=100, progress=False)
    assert summary["cycles"] == 8 and summary["fake_updates"] == 16 and summary["resumed_from"] is None
    dmd2.train(run, state, teacher, tmp_path / "b", 4, 2, save_every_calls=1, progress=False)
    resumed, summary = dmd2.train(run, state, teacher, tmp_path / "b", 8, 2, progress=False)
    assert summary["resumed_from"] == 4 and summary["cycles"] == 8
    for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    restored, cycles = dmd2.restore_state(tmp_path / "b", state)
    assert cycles == 8 and np.array_equal(np.asarray(restored["generator"]["m"]), np.asarray(resumed["generator"]["m"]))


def test_nan_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    run, state, teacher = _plain_cycle()
    # committed to its device as train commits it: the direct call below and train's calls are one program
    state = jax.device_put(state, jax.tree.map(lambda leaf: leaf.sharding, state))

    def poisoned(state, teacher):  # a generator parameter turns NaN: the cycle's own finiteness flag must catch it
        # (times NaN: the leaf keeps its dtype and placement, so the poisoned call is the same compiled program)
        return run({**state, "generator": {**state["generator"], "log_s": state["generator"]["log_s"] * jnp.nan}},
                   teacher)

    _, metrics = poisoned(state, teacher)
    assert float(metrics["finite"]) == 0.0
    good, _ = dmd2.train(run, state, teacher, tmp_path, 2, 2, save_every_calls=1, progress=False)
    with pytest.raises(dmd2.DMD2Divergence, match=r"cycles 3\.\.4.*last good checkpoint \(cycle 2\)"):
        dmd2.train(poisoned, state, teacher, tmp_path, 4, 2, save_every_calls=1, progress=False)
    restored, cycles = dmd2.restore_state(tmp_path, state)
    assert cycles == 2
    assert np.array_equal(np.asarray(restored["generator"]["m"]), np.asarray(good["generator"]["m"]))
    with pytest.raises(dmd2.DMD2Divergence, match="no checkpoint had been saved yet"):
        dmd2.train(poisoned, state, teacher, tmp_path / "fresh", 2, 2, progress=False)


def test_config_validation():
    with pytest.raises(ValueError, match="num_steps"):
        dmd2.DMD2Config(num_steps=0)
    with pytest.raises(ValueError, match="dm_sigma_min"):
        dmd2.DMD2Config(dm_sigma_min=0.5, dm_sigma_max=0.4)
    with pytest.raises(ValueError, match="fake_updates_per_generator"):
        dmd2.DMD2Config(fake_updates_per_generator=0)
    with pytest.raises(ValueError, match="guidance_sigma_range"):
        dmd2.DMD2Config(guidance_sigma_range=(0.8, 0.2))
    with pytest.raises(ValueError, match="fake_warmup"):
        dmd2.DMD2Config(fake_warmup=-1)
    with pytest.raises(ValueError, match="fake_sigma_sampling"):
        dmd2.DMD2Config(fake_sigma_sampling="beta")
    with pytest.raises(ValueError, match="multiple of cycles_per_call"):
        dmd2.train(None, {}, None, "unused", 5, 2)


def test_pixart_cycle_with_gan_and_guidance_interval():
    cfg = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                              attention_head_dim=16, cross_attention_dim=32, sample_size=8, caption_channels=12)
    model = families.PIXART.build(cfg, jnp.float32, seed=0)
    graphdef, teacher = nnx.split(model)
    b, t = 2, 4
    null_context, null_mask = jnp.zeros((t, 12)), jnp.array([1.0, 1.0, 0.0, 0.0])
    with pytest.raises(KeyError, match="no linear named 'nope'"):  # raised once the forward is traced
        jax.eval_shape(dmd2.pixart_flow_model(graphdef, null_context, null_mask, "nope").apply_features,
                       teacher, jnp.zeros((b, 3, 8, 8)), jnp.ones((b,)), {"context": jnp.zeros((b, t, 12)),
                                                                          "mask": jnp.ones((b, t))})
    flow = dmd2.pixart_flow_model(graphdef, null_context, null_mask, "transformer_blocks.0.ff.net.0.proj")
    context = jax.random.normal(jax.random.key(0), (b, t, 12))

    def sample_batch(context, key):
        cond = {"context": context, "mask": jnp.ones((b, t))}
        return cond, jax.random.uniform(key, (b, 3, 8, 8), minval=-1, maxval=1), cond

    config = dmd2.DMD2Config(num_steps=2, guidance=3.0, guidance_sigma_range=(0.2, 0.9), fake_updates_per_generator=1,
                             gan_generator_weight=0.01, gan_discriminator_weight=0.1,
                             gan_feature_layer="transformer_blocks.0.ff.net.0.proj", gan_max_sigma=0.3)
    head_graphdef, head_params = nnx.split(dmd2.GanHead(32, rngs=nnx.Rngs(0)))
    state = dmd2.init_state(teacher, head_params, config, seed=0)
    run = dmd2.make_cycle(flow, config, head_graphdef, sample_batch, (b, 3, 8, 8), data=context)
    new, metrics = run(state, teacher)
    assert metrics["finite"] == 1.0 and int(new["step"]) == 1
    assert all(np.isfinite(float(v)) for v in metrics.values())
    changed = [not np.array_equal(np.asarray(a), np.asarray(c)) for a, c in
               zip(jax.tree_util.tree_leaves(state["generator"]), jax.tree_util.tree_leaves(new["generator"]))]
    assert any(changed)
    # jitted: one program (eager, every primitive of the two forwards compiles on its own)
    x = jax.jit(lambda generator, key, cond: dmd2.generate(flow, generator, key, cond, (b, 3, 8, 8), 2))(
        new["generator"], jax.random.key(1), {"context": context, "mask": jnp.ones((b, t))})
    assert x.shape == (b, 3, 8, 8)


def test_the_prompt_set_is_an_argument_of_the_cycle_and_warmup_programs():
    """make_cycle and make_fake_warmup over scripts/dmd2.py's training batches (prompt_set, prompt_batches of the
    shipped prompt file): the prompts and images are arguments of the jitted programs, not constants folded into
    them (which the check does see in a sampler that closes over them)."""
    from pathlib import Path

    from jaxpr_checks import jit_constants  # tests/jaxpr_checks.py
    from models.testbed import data as testbed_data

    prompts = Path(__file__).resolve().parent.parent / "checkpoints" / "emoji_pixart" / "testbed_prompts.npz"
    dataset = testbed_data.load_dataset(prompts)
    cfg = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                              attention_head_dim=16, cross_attention_dim=32)
    model = families.PIXART.build(cfg, jnp.float32, seed=0)
    graphdef, teacher = nnx.split(model)
    layer = "transformer_blocks.0.ff.net.0.proj"
    flow = dmd2.pixart_flow_model(graphdef, jnp.asarray(dataset.null_context, jnp.float32),
                                  jnp.asarray(dataset.null_mask, jnp.float32), layer)
    config = dmd2.DMD2Config(num_steps=2, fake_updates_per_generator=2, gan_generator_weight=0.01,
                             gan_discriminator_weight=0.1, gan_feature_layer=layer, fake_warmup=2)
    head_graphdef, head_params = nnx.split(dmd2.GanHead(32, rngs=nnx.Rngs(0)))
    state = dmd2.init_state(teacher, head_params, config, seed=0)
    data, sample_batch = dmd2.prompt_set(dataset.split(heldout=False)), dmd2.prompt_batches(2)
    shape = (2, cfg.in_channels, cfg.sample_size, cfg.sample_size)

    def folded(constants):
        return sorted(name for name, array in data.items()
                      if any(np.shape(c) == array.shape and np.array_equal(np.asarray(c), np.asarray(array))
                             for c in constants))

    cycle = dmd2.make_cycle(flow, config, head_graphdef, sample_batch, shape, data=data)
    warmup = dmd2.make_fake_warmup(flow, config, head_graphdef, sample_batch, shape, data=data)
    assert folded(jit_constants(cycle, state, teacher)) == []
    assert folded(jit_constants(warmup, state)) == []
    closed = dmd2.make_cycle(flow, config, head_graphdef, lambda _, key: sample_batch(data, key), shape)
    assert folded(jit_constants(closed, state, teacher)) == ["context", "images", "mask"]


# --------------------------------------------------------------------------------------------------------------------
# The W4A4 generator from a calibrated PTQ store (the QAD student's forward)
# --------------------------------------------------------------------------------------------------------------------

W4A4_TINY = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                                attention_head_dim=16, cross_attention_dim=32, sample_size=8, caption_channels=12)


def write_ptq_store(model, folder, seed=0):
    """A LoRaQ-like calibrated store of every quantizable linear of ``model``: a random diagonal (SmoothQuant-style)
    transform and a packed MXFP4 rank-32 branch, written with QLinearStore as the calibration scripts do."""
    from kroquant_jax.qlinear import QLinearStore, build_qlinear
    from models.layers import linears

    rng = np.random.default_rng(seed)
    store = QLinearStore(str(folder))
    for name, linear in linears(model, quantizable_only=True).items():
        w = np.asarray(linear.kernel[...], np.float32).T  # (o, d)
        o, d = w.shape
        branch = (0.1 * rng.standard_normal((o, 32)).astype(np.float32),
                  rng.standard_normal((32, d)).astype(np.float32))
        params = {"log_gamma": jnp.asarray(0.3 * rng.standard_normal(d), jnp.float32)}
        store.save(name, build_qlinear(w, np.asarray(linear.bias[...]), transform="diagonal", transform_params=params,
                                       lowrank=branch, lowrank_quantized=True, name=name))
    return folder


@pytest.fixture(scope="module")
def w4a4_store(tmp_path_factory):
    """The tiny teacher and a calibrated store of it (written once per module)."""
    model = families.PIXART.build(W4A4_TINY, jnp.float32, seed=0)
    return model, write_ptq_store(model, tmp_path_factory.mktemp("w4a4") / "smoothquant_loraq-0")


def _w4a4_setup(w4a4_store):
    model, folder = w4a4_store
    graphdef, teacher = nnx.split(model)
    b, t = 2, 4
    null_context, null_mask = jnp.zeros((t, 12)), jnp.array([1.0, 1.0, 0.0, 0.0])
    cond = {"context": jax.random.normal(jax.random.key(0), (b, t, 12)), "mask": jnp.array([[1.0, 1.0, 1.0, 0.0]] * b)}
    return model, folder, graphdef, teacher, null_context, null_mask, cond


def test_w4a4_generator_is_the_qad_student_and_its_gradient_reaches_every_quantized_weight(w4a4_store):
    from kroquant_jax.qlinear import QLinearStore
    from models import qad

    model, folder, graphdef, teacher, null_context, null_mask, cond = _w4a4_setup(w4a4_store)
    store = dmd2.load_ptq_store(folder, model)
    assert store.w4a4.quant.fmt == "mxfp4" and store.w4a4.lowrank_quantized
    flow = dmd2.pixart_flow_model(graphdef, null_context, null_mask, w4a4=store.w4a4)
    x = jax.random.normal(jax.random.key(1), (2, 3, 8, 8))
    sigma = jnp.array([0.9, 0.3])

    sixteen_flow = dmd2.pixart_flow_model(graphdef, null_context, null_mask)
    # the QAD student on the same store, through models.qad alone
    layers, blocks, packed = qad.student_from_qlinears(model, QLinearStore(str(folder)).load_all())

    def loss(generator):
        velocity = flow.apply(generator, x, sigma, cond)
        return jnp.sum(jnp.square(velocity)), velocity

    @jax.jit  # the generator's gradient, the QAD student's and the 16-bit velocity in one program
    def generator_student_and_teacher(generator, trainable, teacher):
        (_, ours), grads = jax.value_and_grad(loss, has_aux=True)(generator)
        theirs = qad.student_velocity(graphdef, trainable, blocks, qad.QADConfig(fmt="mxfp4", ste="identity"), packed,
                                      x, sigma * testbed.TIMESTEP_SCALE, cond["context"], cond["mask"])
        return ours, grads, theirs, sixteen_flow.apply(teacher, x, sigma, cond)

    ours, grads, theirs, sixteen = generator_student_and_teacher(store.generator, {"model": teacher, "layers": layers},
                                                                 teacher)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(ours - sixteen).max()) > 1e-3  # the quantizers are on
    # the STE: every quantized weight and both packed branch factors get a non-zero gradient
    for name, layer in grads["layers"].items():
        for key in ("weight", "left", "right", "bias"):
            assert float(np.abs(np.asarray(layer[key])).max()) > 0.0, (name, key)
    assert all(float(np.abs(np.asarray(g)).max()) == 0.0 for g in  # the stored kernels of quantized linears are unused
               jax.tree_util.tree_leaves(grads["model"]["transformer_blocks"][0]["attn1"]["to_q"]))
    assert float(jnp.abs(grads["model"]["proj_out"]["kernel"][...]).max()) > 0.0  # the 16-bit rest trains


def test_a_run_folder_is_keyed_by_the_generators_ptq_store(w4a4_store, tmp_path):
    import shutil

    model, folder = w4a4_store
    other = write_ptq_store(model, tmp_path / "other-store", seed=1)
    store, second = dmd2.load_ptq_store(folder, model), dmd2.load_ptq_store(other, model)
    moved = dmd2.load_ptq_store(shutil.copytree(folder, tmp_path / "copy" / folder.name), model)
    assert store.sha256 != second.sha256 and store.sha256 == moved.sha256
    run = tmp_path / "run"
    dmd2.check_run_key(run, dmd2.generator_key(store), write=True)
    dmd2.check_run_key(run, dmd2.generator_key(moved), write=False)  # the same content, moved: accepted
    with pytest.raises(dmd2.RunKeyMismatch, match=r"initialised from --ptq-store .*smoothquant_loraq-0 .*this "
                                                  r"call's from --ptq-store .*other-store"):
        dmd2.check_run_key(run, dmd2.generator_key(second), write=False)
    with pytest.raises(dmd2.RunKeyMismatch, match=r"this call's from the 16-bit teacher \(no --ptq-store\)"):
        dmd2.check_run_key(run, dmd2.generator_key(None), write=False)
    legacy = tmp_path / "legacy"  # checkpoints made before runs were keyed: a teacher-initialised generator
    (legacy / "checkpoints" / "5").mkdir(parents=True)
    with pytest.raises(dmd2.RunKeyMismatch, match="initialised from the 16-bit teacher"):
        dmd2.check_run_key(legacy, dmd2.generator_key(store), write=True)
    dmd2.check_run_key(legacy, dmd2.generator_key(None), write=True)


def test_a_bad_ptq_store_is_refused_naming_the_file_layer_and_key(w4a4_store, tmp_path):
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    model, folder = w4a4_store
    files = {p.name.split("-")[0]: p for p in folder.glob("*.safetensors")}
    with pytest.raises(ValueError, match="--ptq-store .*nowhere: no such folder"):
        dmd2.load_ptq_store(tmp_path / "nowhere", model)

    def rewrite(path, change):
        with safe_open(str(path), framework="numpy") as f:
            metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        save_file(change(tensors), str(path), metadata=metadata)

    bad = {}
    for case in ("shape", "missing_key", "missing_layer", "foreign"):
        bad[case] = shutil.copytree(folder, tmp_path / f"bad_{case}")
    target = "transformer_blocks.0.ff.net.2"
    rewrite(bad["shape"] / files[target].name, lambda t: {**t, "bias": t["bias"][:5]})
    rewrite(bad["missing_key"] / files[target].name,
            lambda t: {k: v for k, v in t.items() if k != "lowrank_right.scales"})
    (bad["missing_layer"] / files["transformer_blocks.0.attn2.to_v"].name).unlink()
    (bad["foreign"] / "notes.safetensors").write_text("not a tensor file")
    with pytest.raises(ValueError, match=rf"file .*{files[target].name} \(layer {target}\): key 'bias' has shape "
                                         r"\(5,\), expected \(32,\)"):
        dmd2.load_ptq_store(bad["shape"], model)
    with pytest.raises(ValueError, match=rf"\(layer {target}\): key 'lowrank_right.scales' is missing"):
        dmd2.load_ptq_store(bad["missing_key"], model)
    with pytest.raises(ValueError, match=r"no layer file for 1 quantizable linear\(s\) of the teacher, e\.g\. "
                                         r"\['transformer_blocks\.0\.attn2\.to_v'\]"):
        dmd2.load_ptq_store(bad["missing_layer"], model)
    with pytest.raises(ValueError, match="notes.safetensors: not a readable safetensors layer"):
        dmd2.load_ptq_store(bad["foreign"], model)


def test_script_trains_resumes_and_evaluates_a_tiny_teacher(tmp_path):
    """`kroquant dmd2` end to end on a 1-block teacher and the shipped prompt file (smoke test of the wiring): a W4A4
    run from a PTQ store trained, resumed and evaluated (with the 16-bit and the PTQ controls), and its run key (the
    16-bit generator's script path differs only in the generator's FlowModel)."""
    import json
    from pathlib import Path

    from scripts import dmd2 as script

    prompts = Path(__file__).resolve().parent.parent / "checkpoints" / "emoji_pixart" / "testbed_prompts.npz"
    cfg = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                              attention_head_dim=16, cross_attention_dim=32)
    model = families.PIXART.build(cfg, jnp.float32, seed=0)
    families.PIXART.to_diffusers(model, tmp_path / "teacher")
    store = write_ptq_store(model, tmp_path / "smoothquant_loraq-0123")
    common = ["--data", str(prompts), "--teacher", str(tmp_path / "teacher"), "--num-steps", "1",
              "--gan-feature-layer", "transformer_blocks.0.ff.net.0.proj"]
    # one fake-score update per cycle (on the generator update's own samples): the cycle program then has no second,
    # gradient-free W4A4 generator forward (fresh samples) to compile; later updates' fresh samples through the
    # generator's own network are checked by test_a_generator_of_its_own_network_is_used_wherever_the_generator_runs
    train = ["train", *common, "--batch-size", "2", "--ratio", "1", "--cycles-per-call", "1", "--no-progress",
             "--gan-generator-weight", "0.01", "--gan-discriminator-weight", "0.1", "--compute-dtype", "float32"]
    w4a4 = ["--run", str(tmp_path / "w4a4"), "--ptq-store", str(store)]
    assert script.main([*train, *w4a4, "--cycles", "1"]) == 0
    assert script.main([*train, *w4a4, "--cycles", "2"]) == 0
    log = [json.loads(line) for line in (tmp_path / "w4a4" / "log.jsonl").read_text().splitlines()]
    assert [r["cycle"] for r in log if r["event"] == "start"] == [0, 1]
    assert log[0]["generator"]["sha256"] == json.loads((tmp_path / "w4a4" / "dmd2_run.json").read_text())[
        "generator"]["sha256"]
    # the generator trained is the W4A4 one: its quantized layers' master weights moved from the store's
    built = script.setup(script.parse_args([*train, *w4a4]), jnp.float32)
    trained, cycles = dmd2.restore_state(tmp_path / "w4a4", built.state, run_key=built.run_key)
    layer = "transformer_blocks.0.attn1.to_q"
    assert cycles == 2 and not np.array_equal(np.asarray(trained["generator"]["layers"][layer]["weight"]),
                                              np.asarray(built.store.generator["layers"][layer]["weight"]))
    # a run folder is not resumed or evaluated with another generator initialisation
    with pytest.raises(dmd2.RunKeyMismatch, match="initialised from --ptq-store .*this call's from the 16-bit teacher"):
        script.main([*train, *w4a4[:2], "--cycles", "3"])
    assert script.main(["reference", "--data", str(prompts), "--out", str(tmp_path / "ref.npz")]) == 0
    evaluate = ["evaluate", *common, "--reference", str(tmp_path / "ref.npz"), "--samples", "4", "--batch-size", "2",
                "--teacher-steps", "2", "--student-steps", "1", "--encoder-dir", str(tmp_path / "enc"),
                "--encoder-steps", "50", "--encoder-batch-size", "4", "--nearest", "2", "--grid-rows", "2"]
    with pytest.raises(dmd2.RunKeyMismatch, match="this call's from the 16-bit teacher"):
        script.main([*evaluate, *w4a4[:2], "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
    # --served: an unknown strategy and a 16-bit run are refused before anything loads
    with pytest.raises(ValueError, match="--served fp4_magic: not a served strategy"):
        script.main([*evaluate, *w4a4, "--out", str(tmp_path / "refused"), "--served", "fp4_magic"])
    with pytest.raises(ValueError, match="--served dequant: needs the W4A4 run's --ptq-store or --init-checkpoint"):
        script.main([*evaluate, *w4a4[:2], "--out", str(tmp_path / "refused"), "--served", "dequant"])
    assert not (tmp_path / "refused").exists()
    with recorded_compilations("student_sample") as compiled:
        assert script.main([*evaluate, *w4a4, "--out", str(tmp_path / "eval"), "--served", "dequant"]) == 0
    # one sampler per network at the one step count: the 16-bit control's, the W4A4 one that the PTQ control and the
    # restored student share (not compiled again for the checkpoint's committed arrays), and the served student's
    assert compiled == ["jit(student_sample)"] * 3
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    # the default --guidance is not 1, so the unguided teacher is evaluated as a control
    assert set(report["systems"]) == {"teacher", "teacher_unguided", "initial_w4a4_euler", "untrained@1",
                                      "untrained_w4a4@1", "student@1", "student_served@1"}
    assert report["settings"]["student_cycles"] == 2 and report["settings"]["generator"]["sha256"] == log[0][
        "generator"]["sha256"] and report["settings"]["generator_forward"].startswith("W4A4 mxfp4")
    assert report["systems"]["teacher"]["forward_passes_per_image"] == 4
    assert report["systems"]["teacher_unguided"]["forward_passes_per_image"] == 2
    assert report["systems"]["initial_w4a4_euler"]["forward_passes_per_image"] == 4  # the PTQ model with CFG
    assert report["systems"]["untrained_w4a4@1"]["forward_passes_per_image"] == 1
    assert report["systems"]["student@1"]["forward_passes_per_image"] == 1
    assert report["systems"]["teacher"]["fd_ratio_vs_teacher"] == 1.0
    # the PTQ control is not the 16-bit untrained student (its layers are quantized)
    assert report["systems"]["untrained_w4a4@1"]["fd_teacher"] != report["systems"]["untrained@1"]["fd_teacher"]
    # the PTQ model sampled like the teacher (same steps, CFG and start noise) lands near it, not on it
    assert 0 < report["systems"]["initial_w4a4_euler"]["fd_teacher"] < report["systems"]["untrained_w4a4@1"][
        "fd_teacher"]
    assert (tmp_path / "eval" / "grid.png").stat().st_size > 1000
    # the same student as it is served: exported, its layers run by the dequant strategy (the jnp reference on the
    # CPU), the fake-quant student's noise
    assert report["settings"]["served"]["strategy"] == "dequant" and report["settings"]["served"]["cycle"] == 2
    assert report["settings"]["served"]["xla_options"] == {}  # dequant's sampler compiles with XLA's defaults
    assert (tmp_path / "eval" / "served_checkpoint" / "config.json").exists()
    row, fake_quant = report["systems"]["student_served@1"], report["systems"]["student@1"]
    assert row["forward_passes_per_image"] == 1 and np.isfinite(row["fd_real"])
    # the served layers compute what the fake-quant ones do up to bf16 / rounding flips: close, not identical
    assert 20.0 < row["psnr_vs_fake_quant_db"] < 99.0, row["psnr_vs_fake_quant_db"]
    assert 0.0 <= row["identical_to_fake_quant_fraction"] < 1.0
    assert 20.0 < row["psnr_vs_fake_quant_pooled_db"] <= row["psnr_vs_fake_quant_db"] + 1e-9, "a pooled error is no " \
        "smaller than the mean image's"
    assert row["fd_teacher"] != fake_quant["fd_teacher"]


# --------------------------------------------------------------------------------------------------------------------
# Known-answer diagnostic: DMD2 through make_cycle on a conditional two-Gaussian toy with the exact teacher
# --------------------------------------------------------------------------------------------------------------------
# Data: class 0 ~ N((1, 0), 0.3^2 I), class 1 ~ N((-1, 0), 0.3^2 I) (a two-component mixture in 2-D, samples
# (b, 1, 1, 2)); the unconditional branch (the CFG negative, the cond's row 2) ~ N(0, I). The teacher is the exact
# flow-matching velocity of these Gaussians. One FlowModel serves all three networks: per class a mean m, a log-std
# log_s and a gain t, with the denoiser x0(x, sigma) = m + (k(sigma, s) + sigma t) (x - (1 - sigma) m), where k is the
# exact Gaussian posterior gain. t = 0 is the exact denoiser of N(m, s^2) (so the fake score can represent any
# Gaussian exactly); at sigma = 1 the denoiser is x0 = m + t eps, so a 1-step generator samples N(m, t^2). The
# generator starts as the teacher (t = 0): its 1-step samples are the class mean (std 0), its 4-step samples are
# under-dispersed (std 0.155) -- the untrained student's blur.

TOY_D, TOY_C = 2, 2
TOY_MU = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]], np.float32)  # (classes + null, D)
TOY_S = np.array([0.3, 0.3, 1.0], np.float32)


def toy_apply(params, x, sigma, cond):
    w = cond["context"][:, 0, :]  # (b, C + 1) one-hot
    m, s, t = w @ params["m"], jnp.exp(w @ params["log_s"]), w @ params["t"]  # (b, D) each
    sig = sigma[:, None]
    flat = x.reshape(x.shape[0], TOY_D)
    gain = (1 - sig) * s ** 2 / ((1 - sig) ** 2 * s ** 2 + sig ** 2) + sig * t
    x0 = m + gain * (flat - (1 - sig) * m)
    return ((flat - x0) / sig).reshape(x.shape)  # v = (x - x0) / sigma


def toy_cond(cls):
    return {"context": jax.nn.one_hot(cls, TOY_C + 1)[:, None, :], "mask": jnp.ones((cls.shape[0], 1))}


TOY = dmd2.FlowModel(apply=toy_apply, uncond=lambda cond: toy_cond(jnp.full((cond["mask"].shape[0],), TOY_C)))


def toy_teacher():
    return {"m": jnp.asarray(TOY_MU), "log_s": jnp.log(jnp.broadcast_to(jnp.asarray(TOY_S)[:, None], (3, TOY_D))),
            "t": jnp.zeros((3, TOY_D))}


def toy_train(config, chunks, b=256, chunk=50, state=None):
    """``chunks`` calls of ``chunk`` cycles on random classes -> (state, per-call metrics)."""
    def sample_batch(_, key):
        return toy_cond(jax.random.randint(key, (b,), 0, TOY_C)), None, None

    run = dmd2.make_cycle(TOY, config, None, sample_batch, (b, 1, 1, TOY_D), cycles=chunk)
    teacher = toy_teacher()
    state = dmd2.init_state(teacher, {}, config, seed=0) if state is None else state
    history = []
    for _ in range(chunks):
        state, metrics = run(state, teacher)
        assert float(metrics["finite"]) == 1.0
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def toy_moments(params, steps, n=4096):
    """Mean (D,) and std (D,) of class 0's ``steps``-step student samples."""
    x = dmd2.generate(TOY, params, jax.random.key(7), toy_cond(jnp.zeros((n,), jnp.int32)), (n, 1, 1, TOY_D), steps)
    x = np.asarray(x).reshape(n, TOY_D)
    return x.mean(0), x.std(0)


def toy_w2(mean, std, target_mean=(1.0, 0.0), target_std=0.3):
    """2-Wasserstein distance between N(mean, diag std^2) and class 0's N((1, 0), 0.3^2 I)."""
    return float(np.sqrt(np.sum((mean - np.asarray(target_mean)) ** 2) + np.sum((std - target_std) ** 2)))


def toy_guided_targets(guidance, sigma):
    """The per-level distribution the CFG real score describes for class 0 along the guided axis: the guided denoiser
    is linear, x0_g(x) = A + k_g x, the exact denoiser of N(M, S) iff k_g = (1-sigma) S / ((1-sigma)^2 S + sigma^2);
    returns (M, S) per sigma (S < 0: no distribution has this denoiser at that level)."""
    k_c = (1 - sigma) * 0.09 / ((1 - sigma) ** 2 * 0.09 + sigma ** 2)
    k_u = (1 - sigma) / ((1 - sigma) ** 2 + sigma ** 2)
    k_g = guidance * k_c + (1 - guidance) * k_u
    variance = sigma ** 2 * k_g / ((1 - sigma) * (1 - (1 - sigma) * k_g))
    mean = guidance * (1 - (1 - sigma) * k_c) / (1 - (1 - sigma) * k_g)
    return mean, variance


def test_toy_teacher_is_the_exact_flow_matching_velocity():
    """The toy's teacher is the Bayes-optimal velocity: its flow-matching loss equals the irreducible loss computed
    from the analytic posterior variance, and fake_score_loss feeds it sigma in the same units as dm_loss."""
    n = 4096
    cls = jnp.zeros((n,), jnp.int32)
    x0 = jnp.asarray(TOY_MU[0]) + 0.3 * jax.random.normal(jax.random.key(0), (n, 1, 1, TOY_D))
    key = jax.random.key(1)
    # jitted: one program for both parameter sets (eager, every primitive compiles on its own)
    loss_of = jax.jit(lambda params: dmd2.fake_score_loss(TOY, params, x0, toy_cond(cls), key, "uniform",
                                                          (0.5, 0.5 + 1e-7)))
    loss = loss_of(toy_teacher())
    # E|v - v*|^2 = Var(x0 | x_sigma) / sigma^2 per element; Var = s^2 sigma^2 / ((1-sigma)^2 s^2 + sigma^2)
    irreducible = 0.09 / (0.25 * 0.09 + 0.25)
    np.testing.assert_allclose(float(loss), irreducible, rtol=0.03)
    wrong = {**toy_teacher(), "m": toy_teacher()["m"] + 0.5}
    assert float(loss_of(wrong)) > 1.1 * irreducible


def test_dmd2_without_guidance_converges_to_the_data_distribution_and_the_fake_score_tracks():
    """The decisive check of the loss's sign, scale and the two-timescale wiring: guidance 1, the 1-step student
    starts at std 0 (the class mean) and must reach N(mu, 0.3^2); the 4-step student (backward simulation) starts
    under-dispersed and must move to the data too."""
    config = dmd2.DMD2Config(num_steps=1, guidance=1.0, generator_lr=0.05, fake_lr=0.05, weight_decay=0.0)
    before = toy_w2(*toy_moments(toy_teacher(), 1))
    state, history = toy_train(config, chunks=4)
    mean, std = toy_moments(state["generator"], 1)
    after = toy_w2(mean, std)
    assert before > 0.4 and after < 0.12, (before, after, mean, std)
    np.testing.assert_allclose(np.abs(np.asarray(state["generator"]["t"][:TOY_C])), 0.3, atol=0.08)
    # the fake score tracks the generator: its Gaussian is the generator's N(m, t^2)
    fake = state["critic"]["fake"]
    np.testing.assert_allclose(np.asarray(fake["m"][:TOY_C]), np.asarray(state["generator"]["m"][:TOY_C]), atol=0.1)
    np.testing.assert_allclose(np.exp(np.asarray(fake["log_s"][:TOY_C])),
                               np.abs(np.asarray(state["generator"]["t"][:TOY_C])), atol=0.08)

    config4 = dataclasses.replace(config, num_steps=4, generator_lr=0.02, fake_lr=0.02)
    mean0, std0 = toy_moments(toy_teacher(), 4)
    before4 = toy_w2(mean0, std0)
    state4, _ = toy_train(config4, chunks=4)
    mean4, std4 = toy_moments(state4["generator"], 4)
    assert float(std0.mean()) < 0.2 and before4 > 0.18
    assert toy_w2(mean4, std4) < 0.5 * before4, (before4, mean4, std4)


def test_dmd2_with_guidance_on_the_toy_interval_sharpens_full_range_extrapolates():
    """CFG 2 on the toy. The guided field describes a sharpened Gaussian only at low noise (S > 0 for sigma <= 0.2,
    S < 0 -- no distribution at all -- above 0.3). With guidance applied at sigma <= 0.2 the student converges to a
    sharpened class (std below the data's 0.3, above the low-noise target's, mean between 1 and the guided mean).
    With guidance at every level (the GPU runs' setting) the student's mean is extrapolated far beyond the data
    (into the range of the per-level guided means), its spread along the guidance axis is *not* sharpened, and the
    normalised DM gradient stays several times larger than without guidance: there is no distribution to converge to.
    """
    sigma = np.linspace(0.02, 0.98, 97)
    mean_g, var_g = toy_guided_targets(2.0, sigma)
    low = sigma <= 0.2
    assert np.all(var_g[low] > 0) and np.all(var_g[sigma >= 0.3] < 0)
    assert var_g[low].max() < 0.09 and mean_g[low].max() < 1.1  # sharpened, mean slightly pushed outwards

    base = dict(num_steps=1, guidance=2.0, generator_lr=0.05, fake_lr=0.05, weight_decay=0.0)
    interval, _ = toy_train(dmd2.DMD2Config(guidance_sigma_range=(0.0, 0.2), **base), chunks=4)
    mean, std = toy_moments(interval["generator"], 1)
    assert 0.97 < mean[0] < 1.12 and abs(mean[1]) < 0.08, mean
    assert np.all(std > np.sqrt(var_g[low].min()) - 0.02) and np.all(std < 0.3) and np.mean(std) < 0.28, std

    full, history = toy_train(dmd2.DMD2Config(**base), chunks=4)
    mean, std = toy_moments(full["generator"], 1)
    assert mean_g.min() + 0.2 < mean[0] < mean_g.max(), (mean, mean_g.min(), mean_g.max())
    assert std[0] > 0.35, std  # not sharpened along the guidance axis
    _, unguided = toy_train(dmd2.DMD2Config(**{**base, "guidance": 1.0}), chunks=4)
    assert np.mean([h["dm_grad_norm"] for h in history[2:]]) > 2.5 * np.mean([h["dm_grad_norm"]
                                                                              for h in unguided[2:]])


# --------------------------------------------------------------------------------------------------------------------
# The fake-score options: warm-up and sigma sampling
# --------------------------------------------------------------------------------------------------------------------


def _toy_sample_batch(b):
    return lambda _, key: (toy_cond(jax.random.randint(key, (b,), 0, TOY_C)), None, None)


def test_fake_warmup_fits_the_initial_generator_once_and_leaves_it_unchanged(tmp_path):
    import json

    b = 128
    config = dmd2.DMD2Config(num_steps=1, guidance=1.0, fake_updates_per_generator=2, generator_lr=0.01,
                             fake_lr=0.05, weight_decay=0.0, fake_warmup=40)
    teacher = toy_teacher()
    state = dmd2.init_state(teacher, {}, config, seed=0)
    # a generator away from the teacher: class means shifted by 0.5, 1-step std 0.3
    # float32, not a weakly typed array: a checkpoint restores it as float32, and the resumed train below then
    # calls the same compiled cycle as the fresh one
    state = {**state, "generator": {**teacher, "m": teacher["m"] + 0.5, "t": jnp.full((3, TOY_D), 0.3, jnp.float32)}}
    state = {**state, "gen_opt": dmd2.make_optimizers(config)[0].init(state["generator"])}
    # committed to its device as train commits it: the direct warm-up call and train's are one compiled program
    state = jax.device_put(state, jax.tree.map(lambda leaf: leaf.sharding, state))
    warmup = dmd2.make_fake_warmup(TOY, config, None, _toy_sample_batch(b), (b, 1, 1, TOY_D))
    warm, metrics = warmup(state)
    assert float(metrics["finite"]) == 1.0 and int(warm["step"]) == 40
    for before, after in zip(jax.tree_util.tree_leaves(state["generator"]),
                             jax.tree_util.tree_leaves(warm["generator"])):
        assert np.array_equal(np.asarray(before), np.asarray(after))
    shift = np.abs(np.asarray(warm["critic"]["fake"]["m"][:TOY_C] - state["generator"]["m"][:TOY_C]))
    assert float(shift.max()) < 0.25  # the fake score moved from the teacher (0.5 away) to the generator
    assert float(metrics["fake_loss_last"]) < float(metrics["fake_loss_first"])
    assert not np.array_equal(np.asarray(warm["key"]), np.asarray(state["key"]))
    with pytest.raises(ValueError, match="fake_warmup is 0"):
        dmd2.make_fake_warmup(TOY, dataclasses.replace(config, fake_warmup=0), None, _toy_sample_batch(b),
                              (b, 1, 1, TOY_D))

    # train() runs it once, before the first cycle of a fresh run, and not again on resume
    run = dmd2.make_cycle(TOY, config, None, _toy_sample_batch(b), (b, 1, 1, TOY_D), cycles=1)
    _, summary = dmd2.train(run, state, teacher, tmp_path, 2, 1, save_every_calls=1, progress=False, warmup=warmup)
    assert summary["fake_updates"] == 40 + 2 * 2
    _, summary = dmd2.train(run, state, teacher, tmp_path, 3, 1, progress=False, warmup=warmup)
    assert summary["resumed_from"] == 2 and summary["fake_updates"] == 40 + 3 * 2
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    warm_lines = [r for r in log if r["event"] == "warmup"]
    assert len(warm_lines) == 1 and warm_lines[0]["fake_updates"] == 40


def test_a_warmup_longer_than_the_time_budget_is_kept_and_not_run_again(tmp_path):
    """The warm-up is saved as cycle 0 as soon as it ends: a call whose budget it uses up resumes past it, so a run
    under a short ``--time-budget`` advances instead of warming up again at every call."""
    import time

    run, state, teacher = _plain_cycle()
    calls = []

    def slow_warmup(s):  # stands in for make_fake_warmup's program: any warm-up longer than the budget
        calls.append(1)
        time.sleep(0.3)
        return {**s, "step": s["step"] + 3}, {"fake_loss_first": 1.0, "fake_loss_last": 0.5, "gan_d": 0.0,
                                              "finite": 1.0}

    _, first = dmd2.train(run, state, teacher, tmp_path, 4, 2, time_budget=0.2, progress=False, warmup=slow_warmup)
    assert (first["cycles"], first["fake_updates"], len(calls)) == (0, 3, 1)
    _, second = dmd2.train(run, state, teacher, tmp_path, 4, 2, progress=False, warmup=slow_warmup)
    assert (second["resumed_from"], second["cycles"], len(calls)) == (0, 4, 1), "resumed past the warm-up"


def test_fake_sigma_sampling_uniform_stays_in_the_dm_range():
    """A velocity that is exact for x0 = 0 (v = x / sigma = eps) plus a penalty outside [0.4, 0.6]: the uniform
    fake-score loss over that range is exactly 0, the logit-normal one is not (it also checks that fake_score_loss
    hands the model sigma in [0, 1], the units of dm_loss and of pixart_flow_model)."""
    def apply(params, x, sigma, cond):
        outside = ((sigma < 0.4) | (sigma > 0.6)).astype(jnp.float32)[:, None, None, None]
        return x / sigma[:, None, None, None] + params["b"] * outside

    model = dmd2.FlowModel(apply=apply, uncond=lambda cond: cond)
    n = 512
    x0, cond, key = jnp.zeros((n, 1, 1, TOY_D)), toy_cond(jnp.zeros((n,), jnp.int32)), jax.random.key(0)
    params = {"b": jnp.asarray(10.0)}
    uniform, logit_normal = jax.jit(lambda params: (  # one program (eager, every primitive compiles on its own)
        dmd2.fake_score_loss(model, params, x0, cond, key, "uniform", (0.4, 0.6)),
        dmd2.fake_score_loss(model, params, x0, cond, key, "logit_normal")))(params)
    assert float(uniform) < 1e-8
    assert float(logit_normal) > 10.0
    with pytest.raises(ValueError, match="sigma_sampling"):
        dmd2.fake_score_loss(model, params, x0, cond, key, "beta")

    # through make_cycle: DMD2Config.fake_sigma_sampling="uniform" trains the fake score only inside the DM range, so
    # a parameter acting only outside it gets no gradient; with logit_normal it does
    def toy_plus(params, x, sigma, cond):
        return toy_apply(params, x, sigma, cond) + apply(params, x, sigma, cond) - x / sigma[:, None, None, None]

    model = dmd2.FlowModel(apply=toy_plus, uncond=TOY.uncond)
    b = 64
    teacher = {**toy_teacher(), "b": jnp.asarray(0.0)}
    moved = {}
    for sampling in dmd2.FAKE_SIGMA_SAMPLING:
        config = dmd2.DMD2Config(num_steps=1, guidance=1.0, fake_updates_per_generator=2, generator_lr=0.01,
                                 fake_lr=0.05, weight_decay=0.0, dm_sigma_min=0.4, dm_sigma_max=0.6,
                                 fake_sigma_sampling=sampling)
        run = dmd2.make_cycle(model, config, None, _toy_sample_batch(b), (b, 1, 1, TOY_D))
        new, _ = run(dmd2.init_state(teacher, {}, config, seed=0), teacher)
        moved[sampling] = float(new["critic"]["fake"]["b"])
    assert moved["uniform"] == 0.0 and moved["logit_normal"] != 0.0


def test_script_flags_reach_the_config(capsys):
    from scripts import dmd2 as script

    args = script.parse_args(["train", "--data", "d", "--run", "r", "--fake-warmup", "7",
                              "--fake-sigma-sampling", "uniform", "--dm-sigma-range", "0.1", "0.9"])
    config = script.config_from(args)
    assert config.fake_warmup == 7 and config.fake_sigma_sampling == "uniform"
    assert (config.dm_sigma_min, config.dm_sigma_max) == (0.1, 0.9)
    assert {"fake_warmup": 7, "fake_sigma_sampling": "uniform"}.items() <= dataclasses.asdict(config).items()
    default = script.config_from(script.parse_args(["train", "--data", "d", "--run", "r"]))
    assert default.fake_warmup == 0 and default.fake_sigma_sampling == "logit_normal"
    with pytest.raises(SystemExit):
        script.parse_args(["train", "--data", "d", "--run", "r", "--fake-sigma-sampling", "beta"])
    assert "argument --fake-sigma-sampling: invalid choice: 'beta'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.parse_args(["train", "--data", "d", "--run", "r", "--fake-warmup", "-1"])
    assert "argument --fake-warmup: must be >= 0, got -1" in capsys.readouterr().err


def test_pixart_scores_use_the_teachers_conventions():
    """The real score of dm_loss is the teacher's own CFG sampler velocity (same timestep scale, null caption and
    mask), and the fake score's loss is the teacher's training loss (same sigma convention) for the same key."""
    cfg = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                              attention_head_dim=16, cross_attention_dim=32, sample_size=8, caption_channels=12)
    model = families.PIXART.build(cfg, jnp.float32, seed=0)
    graphdef, teacher = nnx.split(model)
    b, t = 3, 4
    null_context = jax.random.normal(jax.random.key(9), (t, 12))
    null_mask = jnp.array([1.0, 1.0, 0.0, 0.0])
    flow = dmd2.pixart_flow_model(graphdef, null_context, null_mask)
    context = jax.random.normal(jax.random.key(0), (b, t, 12))
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]] * b)
    noise = jax.random.normal(jax.random.key(1), (b, 3, 8, 8))
    x0 = jax.random.uniform(jax.random.key(2), (b, 3, 8, 8), minval=-1, maxval=1)
    key = jax.random.key(3)

    @jax.jit  # one program for the four computations (eager, every primitive of the model compiles on its own)
    def both_conventions(teacher):
        velocity_fn = testbed.pixart_velocity_fn(nnx.merge(graphdef, teacher))
        # one Euler step from sigma 1 to 0 is noise - v_cfg(sigma = 1)
        euler = testbed.euler_sample(velocity_fn, noise, context, mask, null_context, null_mask, 1, 3.0)
        guided = dmd2.guided_velocity(flow, teacher, noise, jnp.ones((b,)), {"context": context, "mask": mask}, 3.0)
        ours = dmd2.fake_score_loss(flow, teacher, x0, {"context": context, "mask": mask}, key)
        theirs = testbed.flow_matching_loss(velocity_fn, x0, context, mask, key,
                                            testbed.FlowMatchingConfig(caption_dropout=0.0), null_context, null_mask)
        return euler, guided, ours, theirs

    euler, guided, ours, theirs = both_conventions(teacher)
    np.testing.assert_allclose(noise - guided, euler, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)


def test_evaluation_samples_random_training_records_not_a_prefix():
    """`kroquant dmd2 evaluate --samples N`: N training records drawn at random (seed 0), in record order; the
    records are in code-point order, so a prefix would be one corner of the distribution; no more than N: all."""
    from scripts import dmd2 as dmd2_script

    heldout = np.zeros(3000, bool)
    heldout[::20] = True
    chosen = dmd2_script.sampled_records(heldout, 100)
    assert chosen.size == 100 and np.all(np.diff(chosen) > 0) and not heldout[chosen].any()
    assert chosen.max() > 2000 and chosen.min() < 1000, "spread over the records"
    np.testing.assert_array_equal(chosen, dmd2_script.sampled_records(heldout, 100))
    np.testing.assert_array_equal(dmd2_script.sampled_records(heldout, 5000), np.flatnonzero(~heldout))

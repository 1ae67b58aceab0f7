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

    def mean_loss(p):
        return jnp.mean(jnp.stack([dmd2.fake_score_loss(GAUSSIAN, p, samples, gcond(b), k) for k in keys]))

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
    def sample_batch(key):
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
    for k in range(40):
        x, sigma = dmd2.backward_simulate(GAUSSIAN, p, jax.random.key(k), gcond(b), (b, 1, 1, D), 4)
        assert x.shape == (b, 1, 1, D) and sigma.shape == (b,) and bool(jnp.all(sigma == sigma[0]))
        seen.add(round(float(sigma[0]), 4))
    assert seen == {1.0, 0.75, 0.5, 0.25}
    # no gradient flows through the simulated steps
    grad = jax.grad(lambda q: jnp.sum(dmd2.backward_simulate(GAUSSIAN, q, jax.random.key(3), gcond(b),
                                                             (b, 1, 1, D), 4)[0]))(p)
    assert float(jnp.abs(grad["m"]).max()) == 0.0
    assert dmd2.forward_passes_per_image(20, 3.0) == 40 and dmd2.forward_passes_per_image(4, 1.0) == 4


def test_train_resume_is_bit_identical(tmp_path):
    config = dmd2.DMD2Config(num_steps=2, guidance=1.5, fake_updates_per_generator=2, generator_lr=0.01,
                             fake_lr=0.01)
    run, state = _gaussian_cycle(config, b=16, cycles=2)
    teacher = gparams(2.0)
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
    config = dmd2.DMD2Config(num_steps=1, guidance=1.0, fake_updates_per_generator=1, generator_lr=0.01,
                             fake_lr=0.01)
    run, state = _gaussian_cycle(config, b=8, cycles=1)
    teacher = gparams(2.0)

    def poisoned(state, teacher):  # a generator parameter turns NaN: the cycle's own finiteness flag must catch it
        return run({**state, "generator": {**state["generator"], "log_s": jnp.asarray(jnp.nan)}}, teacher)

    _, metrics = poisoned(state, teacher)
    assert float(metrics["finite"]) == 0.0
    good, _ = dmd2.train(run, state, teacher, tmp_path, 2, 1, save_every_calls=1, progress=False)
    with pytest.raises(dmd2.DMD2Divergence, match=r"cycles 3\.\.3.*last good checkpoint \(cycle 2\)"):
        dmd2.train(poisoned, state, teacher, tmp_path, 4, 1, save_every_calls=1, progress=False)
    restored, cycles = dmd2.restore_state(tmp_path, state)
    assert cycles == 2
    assert np.array_equal(np.asarray(restored["generator"]["m"]), np.asarray(good["generator"]["m"]))
    with pytest.raises(dmd2.DMD2Divergence, match="no checkpoint had been saved yet"):
        dmd2.train(poisoned, state, teacher, tmp_path / "fresh", 2, 1, progress=False)


def test_config_validation():
    with pytest.raises(ValueError, match="num_steps"):
        dmd2.DMD2Config(num_steps=0)
    with pytest.raises(ValueError, match="dm_sigma_min"):
        dmd2.DMD2Config(dm_sigma_min=0.5, dm_sigma_max=0.4)
    with pytest.raises(ValueError, match="fake_updates_per_generator"):
        dmd2.DMD2Config(fake_updates_per_generator=0)
    with pytest.raises(ValueError, match="guidance_sigma_range"):
        dmd2.DMD2Config(guidance_sigma_range=(0.8, 0.2))
    with pytest.raises(ValueError, match="multiple of cycles_per_call"):
        dmd2.train(None, {}, None, "unused", 5, 2)


def test_pixart_cycle_with_gan_and_guidance_interval():
    cfg = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                              attention_head_dim=16, cross_attention_dim=32, sample_size=8, caption_channels=12)
    model = families.PIXART.build(cfg, jnp.float32, seed=0)
    graphdef, teacher = nnx.split(model)
    b, t = 2, 4
    null_context, null_mask = jnp.zeros((t, 12)), jnp.array([1.0, 1.0, 0.0, 0.0])
    with pytest.raises(KeyError, match="no linear named 'nope'"):
        dmd2.pixart_flow_model(graphdef, null_context, null_mask, "nope").apply_features(
            teacher, jnp.zeros((b, 3, 8, 8)), jnp.ones((b,)), {"context": jnp.zeros((b, t, 12)),
                                                                "mask": jnp.ones((b, t))})
    flow = dmd2.pixart_flow_model(graphdef, null_context, null_mask, "transformer_blocks.0.ff.net.0.proj")
    context = jax.random.normal(jax.random.key(0), (b, t, 12))

    def sample_batch(key):
        cond = {"context": context, "mask": jnp.ones((b, t))}
        return cond, jax.random.uniform(key, (b, 3, 8, 8), minval=-1, maxval=1), cond

    config = dmd2.DMD2Config(num_steps=2, guidance=3.0, guidance_sigma_range=(0.2, 0.9), fake_updates_per_generator=1,
                             gan_generator_weight=0.01, gan_discriminator_weight=0.1,
                             gan_feature_layer="transformer_blocks.0.ff.net.0.proj", gan_max_sigma=0.3)
    head_graphdef, head_params = nnx.split(dmd2.GanHead(32, rngs=nnx.Rngs(0)))
    state = dmd2.init_state(teacher, head_params, config, seed=0)
    run = dmd2.make_cycle(flow, config, head_graphdef, sample_batch, (b, 3, 8, 8))
    new, metrics = run(state, teacher)
    assert metrics["finite"] == 1.0 and int(new["step"]) == 1
    assert all(np.isfinite(float(v)) for v in metrics.values())
    changed = [not np.array_equal(np.asarray(a), np.asarray(c)) for a, c in
               zip(jax.tree_util.tree_leaves(state["generator"]), jax.tree_util.tree_leaves(new["generator"]))]
    assert any(changed)
    x = dmd2.generate(flow, new["generator"], jax.random.key(1), {"context": context, "mask": jnp.ones((b, t))},
                      (b, 3, 8, 8), 2)
    assert x.shape == (b, 3, 8, 8)


def test_script_trains_resumes_and_evaluates_a_tiny_teacher(tmp_path):
    """`kroquant dmd2` end to end on a 1-block teacher and the shipped prompt file (smoke test of the wiring)."""
    import json
    from pathlib import Path

    from scripts import dmd2 as script

    prompts = Path(__file__).resolve().parent.parent / "checkpoints" / "emoji_pixart" / "testbed_prompts.npz"
    cfg = dataclasses.replace(testbed.TESTBED_PIXART_CONFIG, num_layers=1, num_attention_heads=2,
                              attention_head_dim=16, cross_attention_dim=32)
    families.PIXART.to_diffusers(families.PIXART.build(cfg, jnp.float32, seed=0), tmp_path / "teacher")
    common = ["--data", str(prompts), "--teacher", str(tmp_path / "teacher"), "--run", str(tmp_path / "run"),
              "--num-steps", "2", "--gan-feature-layer", "transformer_blocks.0.ff.net.0.proj"]
    train = ["train", *common, "--batch-size", "2", "--ratio", "2", "--cycles-per-call", "1", "--no-progress",
             "--gan-generator-weight", "0.01", "--gan-discriminator-weight", "0.1", "--compute-dtype", "float32"]
    assert script.main([*train, "--cycles", "1"]) == 0
    assert script.main([*train, "--cycles", "2"]) == 0
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["cycle"] for r in log if r["event"] == "start"] == [0, 1]
    assert script.main(["reference", "--data", str(prompts), "--out", str(tmp_path / "ref.npz")]) == 0
    assert script.main(["evaluate", *common, "--reference", str(tmp_path / "ref.npz"), "--out",
                        str(tmp_path / "eval"), "--samples", "4", "--batch-size", "2", "--teacher-steps", "2",
                        "--student-steps", "1", "2", "--encoder-dir", str(tmp_path / "enc"), "--encoder-steps", "50",
                        "--encoder-batch-size", "4", "--nearest", "2", "--grid-rows", "2"]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert set(report["systems"]) == {"teacher", "untrained@2", "student@1", "student@2"}
    assert report["settings"]["student_cycles"] == 2
    assert report["systems"]["teacher"]["forward_passes_per_image"] == 4
    assert report["systems"]["student@2"]["forward_passes_per_image"] == 2
    assert report["systems"]["teacher"]["fd_ratio_vs_teacher"] == 1.0
    assert (tmp_path / "eval" / "grid.png").stat().st_size > 1000

"""Samplers: schedules and loops against diffusers' schedulers, CFG, jitted end-to-end runs on tiny models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from models import families, flux, pixart, sampling, sana  # noqa: E402

PIXART_SIGMA_SCHEDULER = dict(algorithm_type="dpmsolver++", beta_end=0.02, beta_schedule="linear",
                              beta_start=0.0001, lower_order_final=True, num_train_timesteps=1000,
                              prediction_type="epsilon", solver_order=2, solver_type="midpoint", steps_offset=0,
                              timestep_spacing="linspace", use_karras_sigmas=False)


def _fake_eps(x, t):
    sin = jnp.sin if isinstance(x, jax.Array) else np.sin
    return 0.3 * x + 0.05 * sin(t / 150.0) + 0.02 * x * x / (1.0 + x * x)


@pytest.mark.parametrize("num_steps", [1, 2, 5, 20])
def test_dpm_solver_matches_diffusers(num_steps):
    scheduler = diffusers.DPMSolverMultistepScheduler(**PIXART_SIGMA_SCHEDULER)
    scheduler.set_timesteps(num_steps)
    schedule = sampling.dpm_solver_schedule(num_steps)
    np.testing.assert_array_equal(schedule.timesteps, scheduler.timesteps.numpy())
    np.testing.assert_allclose(schedule.sigmas, scheduler.sigmas.numpy(), rtol=1e-5)

    noise = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    x = torch.from_numpy(noise) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        x = scheduler.step(torch.from_numpy(_fake_eps(x.numpy(), float(t))), t, x).prev_sample
    denoise = lambda params, x, t, step: (_fake_eps(x, t), {})  # noqa: E731
    ours, _ = jax.jit(lambda n: sampling.dpm_solver_pp_2m(denoise, None, n, schedule))(jnp.asarray(noise))
    np.testing.assert_allclose(np.asarray(ours), x.numpy(), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("shift,num_steps", [(1.0, 4), (3.0, 10)])
def test_flow_euler_matches_diffusers(shift, num_steps):
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps))
    sigmas = sampling.flow_sigmas(num_steps, shift)
    np.testing.assert_allclose(sigmas, scheduler.sigmas.numpy(), rtol=1e-6, atol=1e-7)
    noise = np.random.default_rng(1).standard_normal((1, 2, 4, 4)).astype(np.float32)
    x = torch.from_numpy(noise)
    for t in scheduler.timesteps:
        x = scheduler.step(torch.from_numpy(_fake_eps(x.numpy(), float(t))), t, x).prev_sample
    denoise = lambda params, x, t, step: (_fake_eps(x, t), {})  # noqa: E731
    ours, _ = jax.jit(lambda n: sampling.flow_euler(denoise, None, n, sigmas))(jnp.asarray(noise))
    np.testing.assert_allclose(np.asarray(ours), x.numpy(), rtol=1e-5, atol=1e-6)


def _tiny_pixart():
    cfg = pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                              num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=6,
                              use_additional_conditions=False)
    return cfg, families.PIXART.build(cfg, seed=3)


def test_pixart_cfg_sampling_is_jitted_seeded_and_guided():
    cfg, model = _tiny_pixart()
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    params = {"model": state, "context": jnp.asarray(rng.standard_normal((2, 5, 6)), jnp.float32),
              "mask": jnp.ones((2, 5)), "uncond_context": jnp.zeros((2, 5, 6)), "uncond_mask": jnp.ones((2, 5))}
    schedule = sampling.dpm_solver_schedule(4)

    denoise = sampling.pixart_denoiser(graphdef, 4.5, latent_channels=4)
    sample = jax.jit(lambda p, n: sampling.dpm_solver_pp_2m(denoise, p, n, schedule)[0])
    noise = lambda seed: jax.random.normal(jax.random.key(seed), (2, 4, 8, 8))  # noqa: E731
    a, b, c = sample(params, noise(0)), sample(params, noise(0)), sample(params, noise(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.shape == (2, 4, 8, 8) and bool(jnp.isfinite(a).all())
    assert float(jnp.abs(a - c).max()) > 1e-3

    # one denoiser call equals the hand-made guidance combination of two separate model calls
    x = jax.random.normal(jax.random.key(5), (2, 4, 8, 8))

    @jax.jit  # one program for the three calls (eager, every primitive of the model compiles on its own)
    def denoiser_and_branches(params, x):
        guided, _ = sampling.pixart_denoiser(graphdef, 3.0, 4)(params, x, jnp.float32(500.0), jnp.int32(0))
        t = jnp.full((2,), 500.0)
        model = nnx.merge(graphdef, params["model"])
        cond = model(x, params["context"], t, params["mask"])[:, :4]
        uncond = model(x, params["uncond_context"], t, params["uncond_mask"])[:, :4]
        return guided, cond, uncond

    guided, cond, uncond = denoiser_and_branches(params, x)
    np.testing.assert_allclose(np.asarray(guided), np.asarray(uncond + 3.0 * (cond - uncond)), rtol=1e-5,
                               atol=1e-5)


def test_sana_and_flux_sampling_run_jitted():
    sana_cfg = sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                               num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                               cross_attention_dim=16, caption_channels=6, mlp_ratio=2.0, sample_size=8)
    graphdef, state = nnx.split(families.SANA.build(sana_cfg))
    params = {"model": state, "context": jnp.ones((1, 3, 6)), "mask": jnp.ones((1, 3)),
              "uncond_context": jnp.zeros((1, 3, 6)), "uncond_mask": jnp.ones((1, 3))}
    denoise = sampling.sana_denoiser(graphdef, 4.5)
    sigmas = sampling.flow_sigmas(3, shift=3.0)
    out, aux = jax.jit(lambda p, n: sampling.flow_euler(denoise, p, n, sigmas))(params, jnp.ones((1, 4, 8, 8)))
    assert out.shape == (1, 4, 8, 8) and bool(jnp.isfinite(out).all()) and aux == {}
    # the steps moved the noise, and the jitted sampler is the eager one
    assert float(jnp.max(jnp.abs(out - 1.0))) > 1e-3
    eager, _ = sampling.flow_euler(denoise, params, jnp.ones((1, 4, 8, 8)), sigmas)
    np.testing.assert_allclose(np.asarray(out), np.asarray(eager), rtol=1e-5, atol=1e-5)

    flux_cfg = flux.FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                               num_attention_heads=2, joint_attention_dim=6, pooled_projection_dim=4,
                               axes_dims_rope=(2, 2, 4))
    graphdef, state = nnx.split(families.FLUX.build(flux_cfg))
    params = {"model": state, "context": jnp.ones((1, 3, 6)), "pooled": jnp.ones((1, 4)),
              "img_ids": jnp.asarray(flux.image_ids(8, 8)), "txt_ids": jnp.zeros((3, 3))}
    noise = flux.pack_latents(jax.random.normal(jax.random.key(0), (1, 4, 8, 8)))
    out, _ = jax.jit(lambda p, n: sampling.flow_euler(sampling.flux_denoiser(graphdef), p, n,
                                                      sampling.flow_sigmas(4), timestep_scale=1.0))(params, noise)
    assert flux.unpack_latents(out, 8, 8).shape == (1, 4, 8, 8) and bool(jnp.isfinite(out).all())
    assert float(jnp.max(jnp.abs(out - noise))) > 1e-3
    eager, _ = sampling.flow_euler(sampling.flux_denoiser(graphdef), params, noise, sampling.flow_sigmas(4),
                                   timestep_scale=1.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_guidance_below_one_is_refused_as_diffusers_gives_it_no_meaning():
    graphdef, _ = nnx.split(_tiny_pixart()[1])
    for guidance in (0.5, 0.0, float("nan")):
        with pytest.raises(ValueError, match=r"pixart: guidance_scale=.* must be a number >= 1"):
            sampling.pixart_denoiser(graphdef, guidance, 4)


def test_sana_sampler_applies_the_config_timestep_scale():
    """diffusers' SanaPipeline feeds the transformer ``timestep * config.timestep_scale``: a checkpoint with
    timestep_scale 2 is sampled as the plain sampler with model timesteps 2000 sigma."""
    import dataclasses

    base = sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                           num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
                           caption_channels=6, mlp_ratio=2.0, sample_size=8)
    scaled = dataclasses.replace(base, timestep_scale=2.0)
    graphdef, state = nnx.split(families.SANA.build(scaled))
    params = {"model": state, "context": jnp.ones((1, 3, 6)), "mask": jnp.ones((1, 3)),
              "uncond_context": jnp.zeros((1, 3, 6)), "uncond_mask": jnp.ones((1, 3))}
    sample = sampling.make_sampler("sana", graphdef, scaled, num_steps=3, guidance_scale=4.5, latent_hw=(8, 8))
    out, _ = sample(params, jax.random.key(0))
    noise = jax.random.normal(jax.random.key(0), out.shape)
    sigmas = sampling.flow_sigmas(3, shift=3.0)
    want, _ = sampling.flow_euler(sampling.sana_denoiser(graphdef, 4.5), params, noise, sigmas, timestep_scale=2000.0)
    unscaled, _ = sampling.flow_euler(sampling.sana_denoiser(graphdef, 4.5), params, noise, sigmas)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(out - unscaled))) > 1e-4


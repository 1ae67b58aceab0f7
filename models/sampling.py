"""Jitted denoising loops: DPM-Solver++ (2M) for PixArt-Σ, flow-matching Euler for SANA and FLUX, with CFG.

A **denoiser** is a pure function ``denoise(params, x, t, step) -> (prediction, aux)``: ``params`` is any pytree
(model state, text embeddings, ...), ``x`` the current latents, ``t`` the scalar model timestep of this step,
``step`` the step index (an int32 scalar), ``aux`` any pytree the caller wants per step (``models.capture`` uses it
to return recorded activations; ``{}`` otherwise). The samplers run ``lax.scan`` over the steps and return
``(x_0, aux stacked over steps)``. The family denoisers below batch the unconditional and conditional branches
together, as diffusers' pipelines do, and combine them with classifier-free guidance.

Schedules are computed on the host in numpy with the same arithmetic as diffusers' schedulers (tests compare them
step by step with ``DPMSolverMultistepScheduler`` and ``FlowMatchEulerDiscreteScheduler``).

Choices (documented in docs/models.md): SANA is sampled with flow-matching Euler (its pipeline ships a flow
DPM-Solver; Euler on the same shifted sigmas is the documented equivalent here), FLUX.1-schnell with Euler on
``linspace(1, 1/n, n)`` sigmas (shift 1), PixArt-Σ with DPM-Solver++ 2M (midpoint, lower-order first and last step,
final sigma 0: diffusers' defaults for the PixArt-Σ scheduler config).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.flux import image_ids, pack_latents, unpack_latents
from models.layers import LinearHooks

__all__ = ["DPMSolverSchedule", "cfg_combine", "dpm_solver_schedule", "flow_euler", "flow_sigmas",
           "dpm_solver_pp_2m", "flux_denoiser", "make_sampler", "pixart_denoiser", "recorded", "resolve_sampler",
           "sana_denoiser", "step_hooks"]

Denoiser = Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]
HooksFactory = Callable[[Any, jax.Array], LinearHooks]


# ----------------------------------------------------------------------------------------------------------------
# schedules
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DPMSolverSchedule:
    """DPM-Solver++ (2M) as per-step linear coefficients: ``x <- a x + c0 x0_now + c1 x0_prev``.

    Attributes (numpy, one entry per step, all (n,)): timesteps (the model's integer timesteps), sigmas (n + 1,
    diffusers' sigma = sqrt((1 - ᾱ) / ᾱ), the last one 0), alpha_t/sigma_t of each step's *input*, a, c0, c1.
    """

    timesteps: np.ndarray
    sigmas: np.ndarray
    alpha_in: np.ndarray
    sigma_in: np.ndarray
    a: np.ndarray
    c0: np.ndarray
    c1: np.ndarray


def dpm_solver_schedule(num_steps: int, num_train_timesteps: int = 1000, beta_start: float = 1e-4,
                        beta_end: float = 0.02, beta_schedule: str = "linear", timestep_spacing: str = "linspace",
                        steps_offset: int = 0, lower_order_final: bool = True) -> DPMSolverSchedule:
    """diffusers DPMSolverMultistepScheduler(algorithm_type='dpmsolver++', solver_order=2, solver_type='midpoint',
    final_sigmas_type='zero').set_timesteps(num_steps), as coefficient arrays. Defaults = PixArt-Σ's scheduler."""
    if num_steps < 1:
        raise ValueError(f"{num_steps=} must be >= 1")
    if beta_schedule == "linear":
        betas = np.linspace(beta_start, beta_end, num_train_timesteps, dtype=np.float32)
    elif beta_schedule == "scaled_linear":
        betas = np.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=np.float32) ** 2
    else:
        raise NotImplementedError(f"{beta_schedule=} is not ported (linear, scaled_linear)")
    alphas_cumprod = np.cumprod(1.0 - betas, dtype=np.float32)
    train_sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5
    if timestep_spacing == "linspace":
        timesteps = np.linspace(0, num_train_timesteps - 1, num_steps + 1).round()[::-1][:-1].astype(np.int64)
    elif timestep_spacing == "leading":
        ratio = num_train_timesteps // (num_steps + 1)
        timesteps = (np.arange(0, num_steps + 1) * ratio).round()[::-1][:-1].astype(np.int64) + steps_offset
    elif timestep_spacing == "trailing":
        ratio = num_train_timesteps / num_steps
        timesteps = np.arange(num_train_timesteps, 0, -ratio).round().astype(np.int64) - 1
    else:
        raise ValueError(f"unknown {timestep_spacing=}")
    sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
    sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)  # (n + 1,)
    s64 = sigmas.astype(np.float64)
    alpha = 1.0 / np.sqrt(s64 ** 2 + 1.0)  # (n + 1,)
    sigma = s64 * alpha  # (n + 1,)
    with np.errstate(divide="ignore"):
        lam = np.log(alpha) - np.log(sigma)  # (n + 1,), +inf at the end
    a = np.zeros(num_steps)
    c0 = np.zeros(num_steps)
    c1 = np.zeros(num_steps)
    for i in range(num_steps):
        h = lam[i + 1] - lam[i]
        a[i] = sigma[i + 1] / sigma[i]
        b = -alpha[i + 1] * np.expm1(-h)  # first-order coefficient of x0
        first_order = i == 0 or (i == num_steps - 1 and (lower_order_final or sigmas[-1] == 0))
        if first_order:
            c0[i] = b
        else:
            r0 = (lam[i] - lam[i - 1]) / h
            c0[i] = b * (1 + 0.5 / r0)
            c1[i] = -b * 0.5 / r0
    return DPMSolverSchedule(timesteps, sigmas, alpha[:-1].astype(np.float32), sigma[:-1].astype(np.float32),
                             a.astype(np.float32), c0.astype(np.float32), c1.astype(np.float32))


def flow_sigmas(num_steps: int, shift: float = 1.0, sigmas: np.ndarray | None = None) -> np.ndarray:
    """FlowMatchEulerDiscreteScheduler sigmas (n + 1,): ``linspace(1, 1/n, n)`` (or the given ``sigmas``), shifted
    ``s' = shift s / (1 + (shift - 1) s)``, then a terminal 0."""
    base = np.linspace(1.0, 1.0 / num_steps, num_steps) if sigmas is None else np.asarray(sigmas, np.float64)
    shifted = shift * base / (1 + (shift - 1) * base)
    return np.concatenate([shifted, [0.0]]).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# loops
# ----------------------------------------------------------------------------------------------------------------

def dpm_solver_pp_2m(denoise: Denoiser, params: Any, noise: jax.Array, schedule: DPMSolverSchedule
                     ) -> tuple[jax.Array, Any]:
    """DPM-Solver++ (2M) with an epsilon-predicting denoiser. noise (b, ...) (already scaled by sigma_max: the
    DPM-Solver init noise sigma is 1) -> (x_0, aux stacked over steps). Call under jit."""
    per_step = tuple(jnp.asarray(v) for v in (schedule.timesteps.astype(np.float32), schedule.alpha_in,
                                               schedule.sigma_in, schedule.a, schedule.c0, schedule.c1))

    def step(carry, inputs):
        x, x0_prev = carry
        index, (t, alpha_t, sigma_t, a, c0, c1) = inputs
        eps, aux = denoise(params, x, t, index)  # (b, ...)
        x0 = (x.astype(jnp.float32) - sigma_t * eps.astype(jnp.float32)) / alpha_t  # (b, ...)
        x_next = a * x.astype(jnp.float32) + c0 * x0 + c1 * x0_prev  # (b, ...)
        return (x_next.astype(x.dtype), x0), aux

    steps = jnp.arange(len(schedule.timesteps), dtype=jnp.int32)
    (x, _), aux = jax.lax.scan(step, (noise, jnp.zeros(noise.shape, jnp.float32)), (steps, per_step))
    return x, aux


def flow_euler(denoise: Denoiser, params: Any, noise: jax.Array, sigmas: np.ndarray, timestep_scale: float = 1000.0
               ) -> tuple[jax.Array, Any]:
    """Flow-matching Euler: ``x <- x + (sigma_next - sigma) v`` with ``v = denoise(params, x, sigma * scale, i)``.

    noise (b, ...), sigmas (n + 1,) from :func:`flow_sigmas` -> (x_0, aux stacked over steps). Call under jit.
    """
    sigmas = np.asarray(sigmas, np.float32)
    deltas = jnp.asarray(sigmas[1:] - sigmas[:-1])  # (n,)
    model_t = jnp.asarray(sigmas[:-1] * timestep_scale)  # (n,)

    def step(x, inputs):
        index, t, delta = inputs
        velocity, aux = denoise(params, x, t, index)  # (b, ...)
        return (x.astype(jnp.float32) + delta * velocity.astype(jnp.float32)).astype(x.dtype), aux

    steps = jnp.arange(len(sigmas) - 1, dtype=jnp.int32)
    return jax.lax.scan(step, noise, (steps, model_t, deltas))


def cfg_combine(prediction: jax.Array, guidance_scale: float) -> jax.Array:
    """prediction (2b, ...) = [uncond; cond] -> uncond + g (cond - uncond) (b, ...)."""
    uncond, cond = jnp.split(prediction, 2, axis=0)
    return uncond + guidance_scale * (cond - uncond)


def step_hooks(params: Mapping[str, Any], hooks_factory: HooksFactory | None, step: jax.Array) -> LinearHooks | None:
    """The hooks of one denoising step: ``hooks_factory(params, step)`` when given, else LinearHooks of
    ``params["overrides"]`` (if any), else None."""
    if hooks_factory is not None:
        return hooks_factory(params, step)
    overrides = params.get("overrides")
    return LinearHooks(overrides) if overrides else None


def _masks(params: Mapping[str, Any], use_cfg: bool) -> jax.Array | None:
    if params.get("mask") is None:
        return None
    return jnp.concatenate([params["uncond_mask"], params["mask"]]) if use_cfg else params["mask"]


def recorded(hooks: LinearHooks | None) -> Any:
    """The per-step aux of a denoiser: what the hooks' recorder holds (``{}`` without one)."""
    recorder = getattr(hooks, "recorder", None)
    return recorder.result() if recorder is not None else {}


def _cfg_batch(params: Mapping[str, Any], x: jax.Array, use_cfg: bool):
    """The model inputs of one denoising step: with CFG, ``[uncond; cond]`` stacked on the batch axis."""
    context = jnp.concatenate([params["uncond_context"], params["context"]]) if use_cfg else params["context"]
    x_in = jnp.concatenate([x, x]) if use_cfg else x  # (2b, c, H, W)
    return x_in, context, _masks(params, use_cfg)


def _uses_cfg(guidance_scale: float, family: str) -> bool:
    """Whether a step runs both CFG branches: ``guidance_scale > 1``, as diffusers' PixArt-Σ and SANA pipelines
    decide. Below 1 those pipelines run the conditional branch alone whatever the value (0.5 and 0 give the same
    image), so such a value is refused here rather than given another meaning."""
    if not math.isfinite(guidance_scale) or guidance_scale < 1.0:
        raise ValueError(f"{family}: guidance_scale={guidance_scale} must be a number >= 1 (1: the conditional "
                         "branch alone, which diffusers' pipelines also run for any value below 1)")
    return guidance_scale > 1.0


def pixart_denoiser(graphdef: nnx.GraphDef, guidance_scale: float, latent_channels: int,
                    hooks_factory: HooksFactory | None = None) -> Denoiser:
    """PixArt epsilon denoiser with CFG. params = {"model": nnx state, "context": (b, t, c), "mask": (b, t),
    "uncond_context": (b, t, c), "uncond_mask": (b, t), optional "overrides": {path: pytree callable}}.
    Learned-sigma models (out_channels = 2 * latent channels) keep the first ``latent_channels`` channels."""

    use_cfg = _uses_cfg(guidance_scale, "pixart")

    def denoise(params, x, t, step):
        model = nnx.merge(graphdef, params["model"])
        hooks = step_hooks(params, hooks_factory, step)
        x_in, context, mask = _cfg_batch(params, x, use_cfg)  # (2b, c, H, W), (2b, t, c), (2b, t)
        out = model(x_in, context, jnp.full((x_in.shape[0],), t), mask, hooks=hooks)  # (2b, out, H, W)
        out = cfg_combine(out, guidance_scale) if use_cfg else out  # (b, out, H, W)
        return out[:, :latent_channels], recorded(hooks)

    return denoise


def sana_denoiser(graphdef: nnx.GraphDef, guidance_scale: float, hooks_factory: HooksFactory | None = None
                  ) -> Denoiser:
    """SANA velocity denoiser with CFG; params as :func:`pixart_denoiser` (+ optional "guidance" (b,) for
    guidance-embedding models)."""

    use_cfg = _uses_cfg(guidance_scale, "sana")

    def denoise(params, x, t, step):
        model = nnx.merge(graphdef, params["model"])
        hooks = step_hooks(params, hooks_factory, step)
        x_in, context, mask = _cfg_batch(params, x, use_cfg)  # (2b, c, H, W), (2b, t, c), (2b, t)
        guidance = params.get("guidance")
        if guidance is not None and use_cfg:
            guidance = jnp.concatenate([guidance, guidance])  # (2b,)
        out = model(x_in, context, jnp.full((x_in.shape[0],), t), mask, guidance, hooks=hooks)  # (2b, c, H, W)
        return (cfg_combine(out, guidance_scale) if use_cfg else out), recorded(hooks)

    return denoise


def flux_denoiser(graphdef: nnx.GraphDef, hooks_factory: HooksFactory | None = None) -> Denoiser:
    """FLUX velocity denoiser on packed tokens (no CFG: schnell is guidance-distilled, dev takes "guidance").
    params = {"model", "context" (b, t, 4096), "pooled" (b, 768), "img_ids" (n, 3), "txt_ids" (t, 3),
    optional "guidance" (b,), "overrides"}; ``t`` is sigma (use ``flow_euler(..., timestep_scale=1.0)``)."""

    def denoise(params, x, t, step):
        model = nnx.merge(graphdef, params["model"])
        hooks = step_hooks(params, hooks_factory, step)
        out = model(x, params["context"], params["pooled"], jnp.full((x.shape[0],), t), params["img_ids"],
                    params["txt_ids"], params.get("guidance"), hooks=hooks)  # (b, n, c)
        return out, recorded(hooks)

    return denoise


def resolve_sampler(family: str, solver: str | None = None, shift: float | None = None) -> tuple[str, float | None]:
    """The ``(solver, shift)`` :func:`make_sampler` actually uses for ``family`` given the caller's choices (``None``:
    the family default); ``shift`` is ``None`` for DPM-Solver++ (no sigma shift)."""
    if solver not in (None, "dpm_solver_pp_2m", "flow_euler"):
        raise ValueError(f"unknown {solver=} (dpm_solver_pp_2m, flow_euler)")
    if family not in ("pixart", "sana", "flux", "ideogram4"):
        raise ValueError(f"unknown family {family!r} (pixart, sana, flux, ideogram4)")
    if family == "ideogram4":  # its resolution-aware flow schedule (models.ideogram4_sampling.flow_schedule)
        if shift is not None or solver not in (None, "flow_euler"):
            raise ValueError(f"ideogram4: uses its resolution-aware flow schedule; shift={shift}, solver={solver!r} "
                             "are not options")
        return "flow_euler", None
    if family == "pixart":
        if solver == "flow_euler":
            return "flow_euler", 1.0 if shift is None else shift
        return "dpm_solver_pp_2m", None
    if solver == "dpm_solver_pp_2m":
        raise ValueError(f"{family}: only flow_euler is implemented")
    return "flow_euler", (3.0 if family == "sana" else 1.0) if shift is None else shift


def make_sampler(family: str, graphdef: nnx.GraphDef, cfg: Any, *, num_steps: int, guidance_scale: float,
                 latent_hw: tuple[int, int], shift: float | None = None, solver: str | None = None,
                 hooks_factory: HooksFactory | None = None) -> Callable[[Any, jax.Array], tuple[jax.Array, Any]]:
    """The whole sampling run of one family as ``sample(params, key) -> (latents (b, c, H, W), aux per step)``.

    Draws the initial noise from ``key`` (fixed seed -> fixed image), builds the family's denoiser and loop:
    ``"pixart"``: DPM-Solver++ 2M on PixArt-Σ's schedule, CFG; ``"sana"``: flow Euler with ``shift`` (default 3.0,
    SANA's flow_shift), CFG; ``"flux"``: flow Euler on packed latents, shift (default 1.0, schnell), no CFG.
    ``solver="flow_euler"`` samples a PixArt-architecture model trained with flow matching (velocity output, model
    timestep 1000 sigma, shift default 1.0: the emoji testbed's sampler).
    ``params`` holds ``"model"`` (the nnx state) and the text inputs the family's denoiser documents; the batch size
    is ``params["context"].shape[0]``. Wrap in ``jax.jit``.
    """
    height, width = latent_hw
    solver, shift = resolve_sampler(family, solver, shift)
    if family == "pixart":
        channels = cfg.in_channels
        denoise = pixart_denoiser(graphdef, guidance_scale, channels, hooks_factory)
        if solver == "flow_euler":
            sigmas = flow_sigmas(num_steps, shift)
            loop = lambda params, noise: flow_euler(denoise, params, noise, sigmas)  # noqa: E731
        else:
            schedule = dpm_solver_schedule(num_steps)
            loop = lambda params, noise: dpm_solver_pp_2m(denoise, params, noise, schedule)  # noqa: E731
    elif family == "sana":
        channels = cfg.in_channels
        sigmas = flow_sigmas(num_steps, shift)
        denoise = sana_denoiser(graphdef, guidance_scale, hooks_factory)
        # diffusers' SanaPipeline multiplies the scheduler's timestep (1000 sigma) by the config's timestep_scale
        model_scale = 1000.0 * cfg.timestep_scale
        loop = lambda params, noise: flow_euler(denoise, params, noise, sigmas,  # noqa: E731
                                                timestep_scale=model_scale)
    else:  # flux
        if cfg.in_channels % 4:
            raise ValueError(f"FLUX in_channels={cfg.in_channels} must be 4 x latent channels")
        channels = cfg.in_channels // 4
        sigmas = flow_sigmas(num_steps, shift)
        denoise = flux_denoiser(graphdef, hooks_factory)
        img_ids = jnp.asarray(image_ids(height, width))

        def loop(params, noise):
            params = dict(params, img_ids=img_ids, txt_ids=jnp.zeros((params["context"].shape[1], 3)))
            tokens, aux = flow_euler(denoise, params, pack_latents(noise), sigmas, timestep_scale=1.0)
            return unpack_latents(tokens, height, width), aux

    def sample(params, key):
        batch = params["context"].shape[0]
        noise = jax.random.normal(key, (batch, channels, height, width), jnp.float32)  # (b, c, H, W)
        return loop(params, noise.astype(params["context"].dtype))

    return sample


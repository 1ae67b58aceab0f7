"""Ideogram 4 sampler: schedule, layout and guided Euler steps against diffusers' Ideogram4Pipeline (CPU, fp32)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import families
from models import ideogram4 as ig
from models import ideogram4_sampling as sampling

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline, Ideogram4Transformer2DModel  # noqa: E402
from diffusers.pipelines.ideogram4 import pipeline_ideogram4 as reference  # noqa: E402

IG4 = families.IDEOGRAM4

TINY = dict(in_channels=8, num_layers=2, attention_head_dim=32, num_attention_heads=2, intermediate_size=64,
            adaln_dim=16, llm_features_dim=24, rope_theta=5_000_000, mrope_section=(4, 3, 3))


@pytest.mark.parametrize("height,width,steps", [(1024, 1024, 48), (2048, 2048, 48), (768, 1344, 30), (512, 512, 7)])
def test_schedule_matches_pipeline_and_scheduler(height, width, steps):
    mu = reference._resolution_aware_mu(height=height, width=width, base_mu=0.0)
    assert sampling.resolution_aware_mu(height, width, 0.0) == mu
    expected_sigmas = reference._logit_normal_sigmas(steps, mu, std=1.5).numpy()
    np.testing.assert_array_equal(sampling.logit_normal_sigmas(steps, mu, std=1.5), expected_sigmas)
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(sigmas=expected_sigmas.tolist())
    schedule = sampling.flow_schedule(height, width, steps, guidance_schedule=None, guidance_scale=4.0)
    np.testing.assert_array_equal(schedule.sigmas, scheduler.sigmas.numpy())
    np.testing.assert_array_equal(schedule.timesteps, scheduler.timesteps.numpy())
    model_times = (1.0 - scheduler.timesteps.float() / scheduler.config.num_train_timesteps).numpy()
    np.testing.assert_array_equal(schedule.model_times, model_times)
    assert schedule.sigmas[0] > 0.99 and schedule.sigmas[-1] == 0.0 and np.all(np.diff(schedule.sigmas) < 0)


def test_default_guidance_schedule_and_errors():
    schedule = sampling.flow_schedule(1024, 1024)
    assert schedule.num_steps == 48
    np.testing.assert_array_equal(schedule.guidance, [7.0] * 45 + [3.0] * 3)
    with pytest.raises(ValueError, match="exactly one"):
        sampling.flow_schedule(1024, 1024, guidance_scale=3.0)
    with pytest.raises(ValueError, match="48"):
        sampling.flow_schedule(1024, 1024, guidance_schedule=(7.0,) * 47)
    with pytest.raises(ValueError, match="multiples of 16"):
        sampling.flow_schedule(1000, 1024)


def test_prepare_ids_matches_pipeline():
    layout = sampling.prepare_ids([5, 11, 0], 3, 4, 13)
    position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids([5, 11, 0], 3, 4, 13, torch.device("cpu"))
    np.testing.assert_array_equal(layout.position_ids, position_ids.numpy())
    np.testing.assert_array_equal(layout.segment_ids, segment_ids.numpy())
    np.testing.assert_array_equal(layout.indicator, indicator.numpy())
    assert not layout.single_segment
    assert sampling.prepare_ids([7], 2, 2, 7).single_segment
    with pytest.raises(ValueError, match="text_lengths"):
        sampling.prepare_ids([9], 2, 2, 8)


def _pipeline_and_models(seed: int = 0, vae=None):
    torch.manual_seed(seed)
    cond_torch = Ideogram4Transformer2DModel(**TINY).eval()
    uncond_torch = Ideogram4Transformer2DModel(**TINY).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random norm weights and biases too
        for model in (cond_torch, uncond_torch):
            for name, param in model.named_parameters():
                if param.ndim == 1:
                    param.add_(0.1 * torch.randn(param.shape, generator=generator))
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                             tokenizer=None, transformer=cond_torch, unconditional_transformer=uncond_torch)
    cfg = ig.Ideogram4Config(**TINY)
    state = lambda m: {k: v.numpy() for k, v in m.state_dict().items()}  # noqa: E731
    return pipe, IG4.from_diffusers_state(state(cond_torch), cfg), IG4.from_diffusers_state(state(uncond_torch), cfg)


def _run_pipeline(pipe, text_features, text_lengths, height, width, max_text, noise, guidance, steps,
                  output_type="latent"):
    """Ideogram4Pipeline.__call__ with its text encoder replaced by precomputed features (see the docstring below)."""
    grid_h, grid_w = height // 16, width // 16

    def encode_prompt(prompt, grid_h, grid_w, max_sequence_length, device):
        position_ids, segment_ids, indicator = pipe._prepare_ids(text_lengths, grid_h, grid_w, max_sequence_length,
                                                                 device)
        padding = torch.zeros(len(text_lengths), grid_h * grid_w, text_features.shape[-1])
        return torch.cat([text_features, padding], 1), position_ids, segment_ids, indicator

    pipe.encode_prompt = encode_prompt
    out = pipe(prompt=["p"] * len(text_lengths), height=height, width=width, num_inference_steps=steps,
               guidance_schedule=list(guidance), max_sequence_length=max_text, latents=noise, output_type=output_type,
               return_dict=False)[0]
    if output_type == "latent":
        assert out.shape == (len(text_lengths), grid_h * grid_w, TINY["in_channels"])
        return out.numpy()
    return out


def test_sampler_matches_pipeline_steps():
    """The whole denoising loop of Ideogram4Pipeline (4 steps, a guidance change, two prompts of different lengths,
    padding) against the jitted JAX sampler and against the step-by-step stepper.

    The pipeline is diffusers' own class with tiny random transformers and its real scheduler; only its text encoder
    and tokenizer are replaced (no Qwen3-VL tokenizer can be built offline): ``encode_prompt`` returns precomputed
    features with the layout from the pipeline's own ``_prepare_ids``. ``output_type="latent"`` skips the VAE.
    """
    pipe, cond, uncond = _pipeline_and_models()
    height, width, max_text, steps = 64, 80, 9, 4
    text_lengths = [4, 9]
    generator = torch.Generator().manual_seed(1)
    text_features = torch.randn(2, max_text, TINY["llm_features_dim"], generator=generator)
    text_features[0, : max_text - 4] = 0.0  # left padding carries zero features, as encode_prompt builds them
    noise = torch.randn(2, (height // 16) * (width // 16), TINY["in_channels"], generator=generator)
    guidance = (5.0, 5.0, 5.0, 2.0)
    expected = _run_pipeline(pipe, text_features, text_lengths, height, width, max_text, noise, guidance, steps)

    layout = sampling.prepare_ids(text_lengths, height // 16, width // 16, max_text)
    schedule = sampling.flow_schedule(height, width, steps, guidance_schedule=guidance)
    features = jnp.asarray(text_features.numpy())
    got = np.asarray(sampling.sample(cond, uncond, jnp.asarray(noise.numpy()), features, layout, schedule))
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < 1e-4, f"sampler vs pipeline relative error {rel:.3g}"
    moved = np.linalg.norm(expected - noise.numpy()) / np.linalg.norm(noise.numpy())
    assert moved > 0.1  # the loop really changed the latents

    stepper = sampling.CFGStepper(cond, uncond, features, layout)
    latents = jnp.asarray(noise.numpy())
    for step in range(steps):
        latents = stepper(latents, schedule, step)
    np.testing.assert_allclose(np.asarray(latents), got, rtol=1e-5, atol=1e-5)


def test_packed_single_prompt_equals_padded_and_default_schedule_runs():
    """One prompt: the layout with only the real text tokens (no mask) gives the padded layout's latents; the default
    48-step 7.0/3.0 schedule runs jitted."""
    _, cond, uncond = _pipeline_and_models(seed=3)
    height = width = 48
    n_text, max_text = 5, 12
    key = jax.random.split(jax.random.key(0), 2)
    real_features = jax.random.normal(key[0], (1, n_text, TINY["llm_features_dim"]))
    padded_features = jnp.concatenate([jnp.zeros((1, max_text - n_text, TINY["llm_features_dim"])), real_features], 1)
    noise = jax.random.normal(key[1], (1, 9, TINY["in_channels"]))
    schedule = sampling.flow_schedule(height, width, 3, guidance_schedule=(7.0, 7.0, 3.0))
    padded = sampling.sample(cond, uncond, noise, padded_features, sampling.prepare_ids([n_text], 3, 3, max_text),
                             schedule)
    packed_layout = sampling.prepare_ids([n_text], 3, 3, n_text)
    packed = sampling.sample(cond, uncond, noise, real_features, packed_layout, schedule)
    trimmed_features, trimmed_layout = sampling.trim_text_padding(
        padded_features, sampling.prepare_ids([n_text], 3, 3, max_text))
    assert trimmed_layout.single_segment and trimmed_layout.num_text_slots == n_text
    np.testing.assert_array_equal(np.asarray(trimmed_features), np.asarray(real_features))
    np.testing.assert_array_equal(trimmed_layout.position_ids, packed_layout.position_ids)
    np.testing.assert_allclose(np.asarray(packed), np.asarray(padded), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="single-segment"):
        sampling.sample(cond, uncond, noise, padded_features, sampling.prepare_ids([n_text], 3, 3, max_text),
                        schedule, use_mask=False)
    with pytest.raises(ValueError, match="noise"):
        sampling.sample(cond, uncond, noise[:, :4], real_features, packed_layout, schedule)
    full = sampling.sample(cond, uncond, noise, real_features, packed_layout, sampling.flow_schedule(height, width))
    assert np.all(np.isfinite(np.asarray(full)))


def _tiny_text_encoder_and_tokenizer(hidden: int):
    """A random 36-layer Qwen3-VL of width ``hidden`` (the pipeline taps layers 0, 3, ..., 33, 35) and a word-level
    tokenizer with a chat template, both built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLModel

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "a", "cat", "red", "dog", "sits", "on"]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", pad_token="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {% for c in m['content'] %}{{ c['text'] }} {% endfor %}"
        "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}")
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=16, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=36,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                           deepstack_visual_indexes=[]))
    return Qwen3VLModel(config).eval(), tokenizer


def test_end_to_end_with_pipeline_text_encoder_and_vae():
    """The whole Ideogram4Pipeline (tiny random Qwen3-VL + tokenizer, transformers, VAE with random batch-norm
    statistics; nothing replaced) against encode_prompt_with_pipeline -> JAX sample -> decode_latents_with_pipeline,
    from the same noise: the same images."""
    from diffusers import AutoencoderKLFlux2

    hidden = 8
    text_encoder, tokenizer = _tiny_text_encoder_and_tokenizer(hidden)
    torch.manual_seed(7)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), latent_channels=2, norm_num_groups=4,
                             layers_per_block=1, sample_size=64).eval()
    vae.bn.running_mean.copy_(0.3 * torch.randn(8))
    vae.bn.running_var.copy_(0.5 + torch.rand(8))
    config = {**TINY, "llm_features_dim": 13 * hidden}
    cond_torch, uncond_torch = (Ideogram4Transformer2DModel(**config).eval() for _ in range(2))
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=cond_torch, unconditional_transformer=uncond_torch)
    prompts, height, width, max_text, guidance = ["a cat", "a red dog sits on a cat"], 32, 48, 24, (4.0, 2.0)
    noise = torch.randn(2, 6, TINY["in_channels"], generator=torch.Generator().manual_seed(2))
    expected = pipe(prompt=prompts, height=height, width=width, num_inference_steps=2, guidance_schedule=list(guidance),
                    max_sequence_length=max_text, latents=noise, output_type="np", return_dict=False)[0]

    features, layout = sampling.encode_prompt_with_pipeline(pipe, prompts, height, width, max_text)
    assert features.shape == (2, max_text, 13 * hidden) and not layout.single_segment
    np.testing.assert_array_equal(layout.indicator, sampling.prepare_ids(
        [int((row == ig.LLM_TOKEN_INDICATOR).sum()) for row in layout.indicator], 2, 3, max_text).indicator)
    cfg = ig.Ideogram4Config(**config)
    state = lambda m: {k: v.numpy() for k, v in m.state_dict().items()}  # noqa: E731
    cond, uncond = IG4.from_diffusers_state(state(cond_torch), cfg), IG4.from_diffusers_state(state(uncond_torch), cfg)
    latents = sampling.sample(cond, uncond, jnp.asarray(noise.numpy()), jnp.asarray(features), layout,
                              sampling.flow_schedule(height, width, 2, guidance_schedule=guidance))
    images = sampling.decode_latents_with_pipeline(pipe, np.asarray(latents), height, width)
    assert images.shape == expected.shape == (2, height, width, 3)
    np.testing.assert_allclose(images, expected, atol=2e-4)
    assert images.std() > 1e-3
    # Trimming the unused text slots (24 -> the longer prompt's length) gives the same images.
    trimmed_features, trimmed_layout = sampling.trim_text_padding(features, layout)
    assert trimmed_layout.num_text_slots < max_text
    trimmed = sampling.sample(cond, uncond, jnp.asarray(noise.numpy()), jnp.asarray(trimmed_features), trimmed_layout,
                              sampling.flow_schedule(height, width, 2, guidance_schedule=guidance))
    np.testing.assert_allclose(np.asarray(trimmed), np.asarray(latents), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layout"):
        sampling.trim_text_padding(features, dataclasses.replace(layout, indicator=layout.indicator[::-1]))

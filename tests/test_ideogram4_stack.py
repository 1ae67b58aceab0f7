"""The one-branch Ideogram 4 sampler (``models.ideogram4_sampling.unguided_denoise_loop``), the served W4A4 blocks of
``models.ideogram4_serving``, and ``benchmarks/ideogram4_stack.py`` end to end on its tiny preset (a subprocess, as
every benchmark smoke run: tests load no benchmark module)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ideogram4 as ig
from models import ideogram4_sampling as sampling
from models import ideogram4_serving as serving
from models.layers import FusedLinearHooks

REPO = Path(__file__).resolve().parents[1]
GRID = (2, 3)


@pytest.fixture(scope="module")
def models():
    """Two tiny transformers (conditional, unconditional) with stacked blocks under ``lax.scan``."""
    graphdef, states, _ = serving.random_states(ig.tiny_config(scan_layers=True), (0, 1))
    return [nnx.merge(graphdef, state) for state in states]


def _inputs(cfg, text_lengths, num_text_slots):
    layout = sampling.prepare_ids(text_lengths, *GRID, num_text_slots)
    keys = jax.random.split(jax.random.key(3), 2)
    text = (layout.indicator[:, :num_text_slots] == ig.LLM_TOKEN_INDICATOR)[..., None]  # (B, T, 1): zero padding
    features = jax.random.normal(keys[0], (len(text_lengths), num_text_slots, cfg.llm_features_dim)) * text
    noise = jax.random.normal(keys[1], (len(text_lengths), layout.num_image_tokens, cfg.in_channels))
    return layout, features, noise


def test_unguided_loop_is_the_two_branch_loop_at_guidance_one(models):
    """``1 v_cond + 0 v_uncond`` is ``v_cond``: the one-branch loop gives the pipeline loop's latents at guidance 1
    (padded prompts, so with the attention mask), and not at another guidance (the comparison can fail)."""
    cond, uncond = models
    layout, features, noise = _inputs(cond.config, [3, 1], 3)
    guidance_one = sampling.flow_schedule(32, 48, 2, guidance_schedule=None, guidance_scale=1.0)
    one = sampling.unguided_denoise_loop(cond, noise, features, sampling.layout_arrays(layout),
                                         jnp.asarray(guidance_one.sigmas), jnp.asarray(guidance_one.model_times),
                                         num_text_slots=3)
    assert one.shape == noise.shape and one.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(one)))
    two = sampling.sample(cond, uncond, noise, features, layout, guidance_one)
    np.testing.assert_allclose(np.asarray(one), np.asarray(two), rtol=1e-5, atol=1e-6)
    guided = sampling.sample(cond, uncond, noise, features, layout,
                             sampling.flow_schedule(32, 48, 2, guidance_schedule=None, guidance_scale=3.0))
    assert float(jnp.max(jnp.abs(guided - one))) > 1e-2
    with pytest.raises(ValueError, match=r"sigmas \(3,\) must be \(steps \+ 1,\)"):
        sampling.unguided_denoise_loop(cond, noise, features, sampling.layout_arrays(layout),
                                       jnp.asarray(guidance_one.sigmas), jnp.asarray(guidance_one.model_times[:1]),
                                       num_text_slots=3)


def _negated_dense(kernel, x):
    # A stand-in replacement of one linear: (..., o). Negated, as the block's sandwich norm hides a scale.
    return -(x @ kernel.astype(x.dtype))


def _euler_by_hand(model, noise, features, layout, schedule, entries):
    """The Euler loop over the conditional transformer written out: text projection once, then per step the whole
    packed sequence through the model and ``x <- x - (sigma_{i+1} - sigma_i) v`` on the image tokens."""
    position_ids, segment_ids, indicator = sampling.layout_arrays(layout)
    num_text = layout.num_text_slots
    embeddings = jnp.concatenate([model.embed_text(features, indicator[:, :num_text]),
                                  model.embed_text(None, indicator[:, num_text:])], axis=1)  # (B, L, hidden)
    batch, _, channels = noise.shape
    x = noise
    for i in range(schedule.num_steps):
        t = jnp.full((batch,), schedule.model_times[i], jnp.float32)
        sequence = jnp.concatenate([jnp.zeros((batch, num_text, channels)), x], axis=1)  # (B, L, C)
        hooks = FusedLinearHooks.from_entries(entries, stacked=True)
        v = model(sequence, t, None, position_ids, segment_ids, indicator, text_embeddings=embeddings,
                  hooks=hooks)[:, num_text:]  # (B, N, C)
        x = x - (schedule.sigmas[i + 1] - schedule.sigmas[i]) * v
    return x


def test_unguided_loop_with_stacked_hooks_is_the_euler_loop_by_hand(models):
    """Hooks reach every block of every step: a stacked replacement of ``w2`` gives the hand-written loop's latents
    with the same replacement, and latents unlike the plain loop's."""
    model = models[0]
    layout, features, noise = _inputs(model.config, [3], 3)
    schedule = sampling.flow_schedule(32, 48, 2, guidance_schedule=None, guidance_scale=1.0)
    kernel = model.layers.feed_forward.w2.kernel[...]  # (num_layers, intermediate, hidden)
    entries = FusedLinearHooks({"layers.feed_forward.w2": jax.tree_util.Partial(_negated_dense, kernel)},
                               stacked=True).entries()

    @jax.jit
    def loop(state, entries_):
        hooks = None if entries_ is None else FusedLinearHooks.from_entries(entries_, stacked=True)
        return sampling.unguided_denoise_loop(nnx.merge(nnx.graphdef(model), state), noise, features,
                                              sampling.layout_arrays(layout), jnp.asarray(schedule.sigmas),
                                              jnp.asarray(schedule.model_times), num_text_slots=3, hooks=hooks)

    hooked = loop(nnx.state(model), entries)
    # the hand-written loop traced into one program (run op by op, every primitive would compile on its own)
    by_hand = nnx.jit(lambda m, e: _euler_by_hand(m, noise, features, layout, schedule, e))(model, entries)
    np.testing.assert_allclose(np.asarray(hooked), np.asarray(by_hand), rtol=1e-4, atol=1e-5)
    plain = loop(nnx.state(model), None)
    assert float(jnp.max(jnp.abs(hooked - plain))) > 1e-2


def test_served_block_helpers_name_what_they_need():
    list_model = nnx.eval_shape(lambda: ig.Ideogram4Transformer(ig.tiny_config(), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="scan_layers=True model, got scan_layers=False"):
        serving.build_block_qlinears(list_model, jax.random.key(0), 8)
    with pytest.raises(ValueError, match=r"no served layer for \['layers.attention.to_k'"):
        serving.block_served_hooks({p: None for p in (*serving.BLOCK_PLAIN, serving.BLOCK_NORMED[0],
                                                      serving.BLOCK_GATE)})


def test_stack_benchmark_tiny_run(tmp_path):
    """Each code path of the main once, at batch 2: the two-branch baseline, the one-branch bf16 reference, a W4A4
    system with the fused q | k | v layer (it runs the ``fp8_mgpu`` strategy's other layers, as
    ``w4a4_fp8_mgpu_4x1`` would), and the optional one within --budget-s. ``w4a4_fp8_4x1`` and
    ``w4a4_fp8_mgpu_4x1`` differ from these only by the strategy's name; those strategies' forwards of the same
    scanned model are checked by dit_forward_w4a4.py's runs in tests/test_fused_hooks.py."""
    out = tmp_path / "stack.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    systems = ["bf16_48x2", "bf16_4x1", "w4a4_fp8_mgpu_fused_qkv_4x1", "w4a4_dequant_4x1"]
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ideogram4_stack.py"), "--preset", "tiny",
                          "--interpret", "--systems", ",".join(systems), "--repeats", "2", "--batch-size", "2",
                          "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["systems"] == systems and saved["errors"] == {}
    assert saved["batch_size"] == 2 and saved["tokens"] == 3 + 4
    assert saved["vae"] == "VAE decode not included (not ported)"
    assert saved["finite"] == dict.fromkeys(systems, True)
    assert saved["forward_passes_per_image"] == {"bf16_48x2": 96, **dict.fromkeys(systems[1:], 4)}
    assert saved["schedules"]["bf16_48x2"]["guidance"] == [7.0] * 45 + [3.0] * 3
    times = {name: saved["timings_ms"][name]["median_ms"] for name in systems}
    assert all(t > 0 for t in times.values()) and all(saved["compile_s"][name] > 0 for name in systems)
    assert all(len(saved["timings_ms"][name]["samples_ms"]) == 2 for name in systems)
    assert saved["ms_per_image"] == pytest.approx({name: times[name] / 2 for name in systems})
    for name in systems:
        speedup = times["bf16_48x2"] / times[name]
        assert saved["speedup_per_image"][name] == pytest.approx(speedup)
        assert saved["per_forward_ratio"][name] == pytest.approx(speedup * saved["forward_passes_per_image"][name]
                                                                 / 96)
    fastest = min(systems[2:], key=times.get)
    assert saved["fastest_stack"] == fastest
    assert saved["ideogram4_stack_speedup_per_image"] == pytest.approx(times["bf16_48x2"] / times[fastest])
    assert saved["goal_met"] == (saved["ideogram4_stack_speedup_per_image"] >= 30.0)
    # The served layers change the latents (wired in), by a quantization-sized amount (not garbage).
    for name in systems[2:]:
        assert 1e-3 < saved["checks"][f"{name} vs bf16_4x1 final latents rel err"] < 0.3
    assert "ideogram4_stack_speedup_per_image" in run.stdout and "VAE decode not included" in run.stdout

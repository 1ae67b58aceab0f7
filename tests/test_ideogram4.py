"""Ideogram 4 port: parameter count, conversion, and parity with diffusers' Ideogram4Transformer2DModel (CPU, fp32)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import convert, families
from models import ideogram4 as ig

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from diffusers import Ideogram4Pipeline, Ideogram4Transformer2DModel  # noqa: E402
from diffusers.models.transformers.transformer_ideogram4 import Ideogram4MRoPE  # noqa: E402

IG4 = families.IDEOGRAM4

TINY_CONFIGS = {
    "base": dict(in_channels=8, num_layers=2, attention_head_dim=32, num_attention_heads=2, intermediate_size=96,
                 adaln_dim=16, llm_features_dim=24, rope_theta=10_000, mrope_section=(4, 3, 3)),
    "odd_heads_wide_rope": dict(in_channels=12, num_layers=3, attention_head_dim=64, num_attention_heads=3,
                                intermediate_size=80, adaln_dim=24, llm_features_dim=40, rope_theta=5_000_000,
                                mrope_section=(8, 10, 10)),
    "one_head_deep": dict(in_channels=4, num_layers=4, attention_head_dim=16, num_attention_heads=1,
                          intermediate_size=40, adaln_dim=8, llm_features_dim=12, rope_theta=1000,
                          mrope_section=(2, 2, 2), norm_eps=1e-6),
}


def _random_diffusers_model(diffusers_config: dict, seed: int) -> Ideogram4Transformer2DModel:
    """A tiny diffusers model with EVERY parameter random (norm weights and biases too), so no key can hide."""
    torch.manual_seed(seed)
    model = Ideogram4Transformer2DModel(**diffusers_config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or "norm" in name.split(".")[-2]:
                param.copy_(1.0 + 0.2 * noise)  # norm weights around 1
            else:
                param.copy_(noise * (0.5 / max(param.shape[-1], 1) ** 0.5) if param.ndim == 2 else 0.1 * noise)
    return model


def _state_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def _pipeline_layout(text_lengths: list[int], grid: tuple[int, int], max_text: int):
    position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids(text_lengths, grid[0], grid[1], max_text,
                                                                         torch.device("cpu"))
    return position_ids, segment_ids, indicator


@nnx.jit
def _forward(model, inputs: dict, text_embeddings=None):
    """The model's forward pass, jitted (eager op-by-op dispatch is several times slower on the CPU)."""
    return model(**inputs, text_embeddings=text_embeddings)


def _call(model, hidden_states, timestep, encoder_hidden_states, position_ids, segment_ids, indicator,
          text_embeddings=None):
    inputs = dict(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                  position_ids=position_ids, segment_ids=segment_ids, indicator=indicator)
    return _forward(model, inputs, text_embeddings)


def _compare(torch_model, jax_model, inputs: dict, rtol: float = 2e-4):
    with torch.no_grad():
        expected = torch_model(**inputs, return_dict=False)[0].numpy()
    got = _forward(jax_model, {k: jnp.asarray(v.numpy()) for k, v in inputs.items()})
    got = np.asarray(got)
    assert got.shape == expected.shape
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < rtol, f"relative error {rel:.3g}"
    return got, expected


def _inputs(cfg: ig.Ideogram4Config, position_ids, segment_ids, indicator, seed: int, per_token_t: bool = False):
    generator = torch.Generator().manual_seed(seed)
    batch, length = indicator.shape
    timestep = torch.rand((batch, length) if per_token_t else (batch,), generator=generator)
    return dict(hidden_states=torch.randn(batch, length, cfg.in_channels, generator=generator),
                timestep=timestep,
                encoder_hidden_states=torch.randn(batch, length, cfg.llm_features_dim, generator=generator),
                position_ids=position_ids, segment_ids=segment_ids, indicator=indicator)


def test_full_size_param_count_matches_diffusers():
    with torch.device("meta"):
        reference = Ideogram4Transformer2DModel()
    expected = sum(p.numel() for p in reference.parameters())
    assert ig.count_params(ig.IDEOGRAM4) == expected == 9_279_288_448
    assert ig.count_params(dataclasses.replace(ig.IDEOGRAM4, scan_layers=True)) == expected
    assert ig.IDEOGRAM4.to_diffusers_config() | {"_class_name": None} == \
        {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in reference.config.items()
            if not k.startswith("_")}, "_class_name": None}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_parity_with_diffusers_pipeline_layout(name):
    """The pipeline's own packed layout (left padding, text, image at the 65536 offset), two text lengths."""
    diffusers_config = TINY_CONFIGS[name]
    torch_model = _random_diffusers_model(diffusers_config, seed=len(name))
    cfg = ig.Ideogram4Config(**diffusers_config)
    model = IG4.from_diffusers_state(_state_numpy(torch_model), cfg)
    position_ids, segment_ids, indicator = _pipeline_layout([5, 9], (3, 4), max_text=11)
    assert int(position_ids.max()) >= ig.IMAGE_POSITION_OFFSET
    _compare(torch_model, model, _inputs(cfg, position_ids, segment_ids, indicator, seed=3))
    # The unconditional branch: image tokens only, zero text features.
    uncond = _inputs(cfg, position_ids[:, 11:], segment_ids[:, 11:], indicator[:, 11:], seed=4)
    uncond["encoder_hidden_states"] = torch.zeros_like(uncond["encoder_hidden_states"])
    _compare(torch_model, model, uncond)


def test_parity_several_segments_and_per_token_timesteps():
    """Rows packing several samples (segment ids 0, 1, 2 and padding), shuffled roles, per-token timesteps."""
    diffusers_config = TINY_CONFIGS["odd_heads_wide_rope"]
    torch_model = _random_diffusers_model(diffusers_config, seed=11)
    cfg = ig.Ideogram4Config(**diffusers_config)
    model = IG4.from_diffusers_state(_state_numpy(torch_model), cfg)
    rng = np.random.default_rng(0)
    batch, length = 2, 23
    segment_ids = np.sort(rng.integers(-1, 3, size=(batch, length)), axis=1)
    indicator = rng.choice([ig.LLM_TOKEN_INDICATOR, ig.OUTPUT_IMAGE_INDICATOR, 0], size=(batch, length))
    position_ids = rng.integers(0, 40, size=(batch, length, 3)) + \
        np.where(indicator == ig.OUTPUT_IMAGE_INDICATOR, ig.IMAGE_POSITION_OFFSET, 0)[..., None]
    inputs = _inputs(cfg, torch.from_numpy(position_ids), torch.from_numpy(segment_ids),
                     torch.from_numpy(indicator), seed=5, per_token_t=True)
    got, _ = _compare(torch_model, model, inputs)
    # Segment isolation: changing every token of segment 2 leaves the other segments' outputs unchanged.
    changed = {k: v.clone() for k, v in inputs.items()}
    in_segment_2 = torch.from_numpy(segment_ids == 2)
    changed["hidden_states"][in_segment_2] += 3.0
    changed["encoder_hidden_states"][in_segment_2] -= 2.0
    got_changed = np.asarray(_forward(model, {k: jnp.asarray(v.numpy()) for k, v in changed.items()}))
    outside = segment_ids != 2
    np.testing.assert_allclose(got_changed[outside], got[outside], rtol=1e-5, atol=1e-5)
    assert np.abs(got_changed[~outside] - got[~outside]).max() > 1e-2


def test_mrope_fp32_at_image_offset_matches_diffusers():
    """Real head_dim/theta/sections; image rows/columns near 65536 must stay distinct (no bf16 collapse)."""
    cfg = ig.IDEOGRAM4
    reference = Ideogram4MRoPE(cfg.attention_head_dim, cfg.rope_theta, cfg.mrope_section)
    grid = np.stack(np.meshgrid(np.arange(64), np.arange(64), indexing="ij"), -1).reshape(-1, 2)
    positions = np.concatenate([np.zeros((grid.shape[0], 1), np.int64), grid], 1) + ig.IMAGE_POSITION_OFFSET
    text = np.repeat(np.arange(40)[:, None], 3, 1)
    position_ids = np.concatenate([text, positions])[None]  # (1, 40 + 4096, 3)
    with torch.no_grad():
        cos_ref, sin_ref = (t.numpy() for t in reference(torch.from_numpy(position_ids)))
    cos, sin = ig.mrope_cos_sin(jnp.asarray(position_ids, jnp.int32), cfg.attention_head_dim, cfg.rope_theta,
                                cfg.mrope_section)
    assert cos.dtype == jnp.float32
    # float32 angles near 65536 carry ~4e-3 rad of rounding in both implementations; one inverse frequency differs
    # by one ulp between torch's and XLA's pow, which moves angles by < 1e-4.
    np.testing.assert_allclose(np.asarray(cos), cos_ref, atol=2e-4)
    np.testing.assert_allclose(np.asarray(sin), sin_ref, atol=2e-4)
    image_cos = np.asarray(cos)[0, 40:]
    assert len(np.unique(image_cos.round(6), axis=0)) == 64 * 64


def test_scan_layout_matches_list_layout_and_text_cache():
    cfg = ig.tiny_config(num_layers=3)
    model = ig.Ideogram4Transformer(cfg, rngs=nnx.Rngs(1))
    params = {k: np.asarray(v) for k, v in convert.flat_state_dict(model).items()}
    scan_cfg = dataclasses.replace(cfg, scan_layers=True)
    scan_model = convert.merge_flat_state(lambda: ig.Ideogram4Transformer(scan_cfg, rngs=nnx.Rngs(0)),
                                          ig.stack_layer_params(params, cfg.num_layers))
    position_ids, segment_ids, indicator = (jnp.asarray(t.numpy()) for t in _pipeline_layout([3, 6], (2, 3), 7))
    key = jax.random.split(jax.random.key(0), 3)
    latents = jax.random.normal(key[0], (*indicator.shape, cfg.in_channels))
    features = jax.random.normal(key[1], (*indicator.shape, cfg.llm_features_dim))
    timestep = jnp.array([0.2, 0.9])
    out = _call(model, latents, timestep, features, position_ids, segment_ids, indicator)
    out_scan = _call(scan_model, latents, timestep, features, position_ids, segment_ids, indicator)
    np.testing.assert_allclose(np.asarray(out_scan), np.asarray(out), rtol=1e-5, atol=1e-5)
    text = model.embed_text(features, indicator)
    out_cached = _call(model, latents, timestep, None, position_ids, segment_ids, indicator, text)
    np.testing.assert_allclose(np.asarray(out_cached), np.asarray(out), rtol=1e-6, atol=1e-6)
    # encoder_hidden_states=None is exactly all-zero features (the unconditional branch's cheap path).
    zeros = _call(model, latents, timestep, jnp.zeros_like(features), position_ids, segment_ids, indicator)
    none = _call(model, latents, timestep, None, position_ids, segment_ids, indicator)
    np.testing.assert_allclose(np.asarray(none), np.asarray(zeros), rtol=1e-6, atol=1e-6)
    # segment_ids=None (no mask) equals one segment everywhere.
    one_segment = _call(model, latents, timestep, features, position_ids, jnp.ones_like(segment_ids), indicator)
    no_mask = _call(model, latents, timestep, features, position_ids, None, indicator)
    np.testing.assert_allclose(np.asarray(no_mask), np.asarray(one_segment), rtol=1e-5, atol=1e-6)
    assert ig.unstack_layer_params(ig.stack_layer_params(params, 3), 3).keys() == params.keys()


def test_packed_text_equals_padded_text_on_image_tokens():
    """The pipeline's 2048-padded layout and a layout with only the real text tokens give the same image velocity."""
    cfg = ig.tiny_config()
    model = ig.Ideogram4Transformer(cfg, rngs=nnx.Rngs(2))
    n_text, grid, max_text = 4, (2, 3), 9
    padded = [jnp.asarray(t.numpy()) for t in _pipeline_layout([n_text], grid, max_text)]
    packed = [jnp.asarray(t.numpy()) for t in _pipeline_layout([n_text], grid, n_text)]
    key = jax.random.split(jax.random.key(1), 2)
    latents = jax.random.normal(key[0], (1, max_text + 6, cfg.in_channels))
    features = jax.random.normal(key[1], (1, max_text + 6, cfg.llm_features_dim))
    t = jnp.array([0.4])
    out_padded = _call(model, latents, t, features, padded[0], padded[1], padded[2])
    skip = max_text - n_text
    out_packed = _call(model, latents[:, skip:], t, features[:, skip:], packed[0], None, packed[2])
    np.testing.assert_allclose(np.asarray(out_packed)[:, n_text:], np.asarray(out_padded)[:, max_text:],
                               rtol=1e-5, atol=1e-5)


def test_conversion_errors_name_keys(tmp_path):
    cfg = ig.Ideogram4Config(**TINY_CONFIGS["base"])
    state = _state_numpy(_random_diffusers_model(TINY_CONFIGS["base"], seed=0))
    broken = dict(state)
    del broken["layers.1.feed_forward.w3.weight"]
    broken["layers.0.attention.to_q.bias"] = np.zeros((64,), np.float32)
    broken["final_layer.linear.weight"] = np.zeros((7, 64), np.float32)
    with pytest.raises(convert.ConversionError) as err:
        IG4.from_diffusers_state(broken, cfg)
    message = str(err.value)
    for needle in ("layers.1.feed_forward.w3.weight", "layers.0.attention.to_q.bias", "final_layer.linear.weight"):
        assert needle in message
    # A state of a model with one more layer than the config: every extra key is named.
    deeper = _state_numpy(_random_diffusers_model({**TINY_CONFIGS["base"], "num_layers": 3}, seed=0))
    with pytest.raises(convert.ConversionError, match=r"layers\.2\.attention\.to_q"):
        IG4.from_diffusers_state(deeper, cfg)
    model = IG4.from_diffusers_state(state, cfg)
    with pytest.raises(ValueError, match="in_channels"):
        model(jnp.zeros((1, 3, 5)), jnp.zeros((1,)), None, jnp.zeros((1, 3, 3), jnp.int32), None,
              jnp.zeros((1, 3), jnp.int32))


def test_pipeline_dir_load_export_orbax_round_trip(tmp_path):
    """Both transformers of a pipeline directory (one sharded), export back to diffusers, orbax save/load."""
    base = TINY_CONFIGS["base"]
    cond, uncond = _random_diffusers_model(base, seed=1), _random_diffusers_model(base, seed=2)
    cond.save_pretrained(tmp_path / "pipe" / "transformer")
    uncond.save_pretrained(tmp_path / "pipe" / "unconditional_transformer", max_shard_size="20KB")
    assert (tmp_path / "pipe" / "unconditional_transformer" / convert.WEIGHTS_INDEX_NAME).exists()
    model_c, model_u = families.load_pipeline_transformers(str(tmp_path / "pipe"), "transformer",
                                                           "unconditional_transformer")
    position_ids, segment_ids, indicator = _pipeline_layout([4, 2], (2, 2), 6)
    cfg = model_c.config
    inputs = _inputs(cfg, position_ids, segment_ids, indicator, seed=9)
    _compare(cond, model_c, inputs)
    _compare(uncond, model_u, inputs)
    # Export back: exact state, loadable by diffusers.
    exported = IG4.to_diffusers_state(model_u)
    original = _state_numpy(uncond)
    assert exported.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(exported[key], original[key])
    IG4.to_diffusers(model_c, str(tmp_path / "export"))
    reloaded = Ideogram4Transformer2DModel.from_pretrained(tmp_path / "export").eval()
    for key, value in _state_numpy(cond).items():
        np.testing.assert_array_equal(_state_numpy(reloaded)[key], value)
    # orbax, saved in list layout, loaded in scan layout and in bf16.
    ig.save(model_c, str(tmp_path / "orbax"))
    back = ig.load(str(tmp_path / "orbax"))
    for key, value in convert.flat_state_dict(model_c).items():
        np.testing.assert_array_equal(np.asarray(convert.flat_state_dict(back)[key]), np.asarray(value))
    scan_bf16 = ig.load(str(tmp_path / "orbax"), scan_layers=True, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    assert scan_bf16.config.scan_layers
    assert convert.flat_state_dict(scan_bf16)["layers.attention.to_q.kernel"].dtype == jnp.bfloat16


def test_bf16_forward_close_to_diffusers_bf16():
    """bf16 weights and activations on both sides (fp32 norms statistics and rotary tables), against the fp32 model
    with the same bf16-rounded weights: the JAX bf16 error is no larger than diffusers' own bf16 error."""
    diffusers_config = TINY_CONFIGS["odd_heads_wide_rope"]
    torch_model = _random_diffusers_model(diffusers_config, seed=21).to(torch.bfloat16)
    # `.to(bf16)` also rounds the non-persistent inv_freq buffer; from_pretrained(torch_dtype=bf16), which the
    # pipeline uses, keeps it float32. Restore it, as the real pipeline has it.
    inv_freq_fp32 = Ideogram4MRoPE(torch_model.config.attention_head_dim, torch_model.config.rope_theta,
                                   torch_model.config.mrope_section).inv_freq
    torch_model.rotary_emb.inv_freq = inv_freq_fp32
    state = {k: v.float().numpy() for k, v in torch_model.state_dict().items()}
    reference_fp32 = IG4.from_diffusers_state(state, ig.Ideogram4Config(**diffusers_config))
    model = IG4.from_diffusers_state(state, ig.Ideogram4Config(**diffusers_config, dtype=jnp.bfloat16,
                                                               param_dtype=jnp.bfloat16))
    position_ids, segment_ids, indicator = _pipeline_layout([3, 7], (3, 3), 8)
    inputs = _inputs(model.config, position_ids, segment_ids, indicator, seed=2)
    inputs = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in inputs.items()}
    with torch.no_grad():
        torch_bf16 = torch_model(**inputs, return_dict=False)[0].float().numpy()
    jax_inputs = {k: jnp.asarray(v.float().numpy()) if v.is_floating_point() else jnp.asarray(v.numpy())
                  for k, v in inputs.items()}
    exact = np.asarray(_forward(reference_fp32, jax_inputs))
    jax_bf16 = np.asarray(_forward(model, {k: (v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v)
                                           for k, v in jax_inputs.items()}).astype(jnp.float32))
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    assert rel(torch_bf16, exact) < 3e-2
    assert rel(jax_bf16, exact) < 1.5 * rel(torch_bf16, exact) + 1e-3
    assert rel(jax_bf16, torch_bf16) < 3e-2


def test_config_validation_and_round_trip():
    with pytest.raises(ValueError, match="mrope_section"):
        ig.Ideogram4Config(attention_head_dim=32, mrope_section=(4, 6, 3))
    with pytest.raises(ValueError, match="attention_impl"):
        ig.tiny_config(attention_impl="flash")
    with pytest.raises(ValueError, match="unknown Ideogram4Transformer2DModel config key"):
        ig.Ideogram4Config.from_diffusers_config({"in_channels": 8, "patch_size": 2})
    cfg = ig.tiny_config()
    assert ig.Ideogram4Config.from_diffusers_config(cfg.to_diffusers_config()) == cfg


def test_quantizable_linears_and_hooks():
    """Block linears are the shared models.layers.Linear, named by their diffusers key prefix and hookable."""
    from models.layers import LinearHooks, linears

    cfg = ig.tiny_config()
    model = ig.Ideogram4Transformer(cfg, rngs=nnx.Rngs(3))
    quantizable = linears(model, quantizable_only=True)
    expected = {f"layers.{i}.{name}" for i in range(cfg.num_layers)
                for name in ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                             "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    assert set(quantizable) == expected
    assert all(layer.path == path for path, layer in quantizable.items())
    position_ids, segment_ids, indicator = (jnp.asarray(t.numpy()) for t in _pipeline_layout([2], (2, 2), 3))
    latents = jax.random.normal(jax.random.key(4), (*indicator.shape, cfg.in_channels))
    args = (latents, jnp.array([0.5]), None, position_ids, segment_ids, indicator)

    def run(hooks):
        return nnx.jit(lambda m, a: m(*a, hooks=hooks))(model, args)

    plain = run(None)
    same = run(LinearHooks({"layers.1.feed_forward.w2": quantizable["layers.1.feed_forward.w2"].dense}))
    np.testing.assert_allclose(np.asarray(same), np.asarray(plain), rtol=1e-6, atol=1e-6)
    zeroed = run(LinearHooks({"layers.1.feed_forward.w2": lambda x: jnp.zeros(x.shape[:-1] + (cfg.hidden_size,),
                                                                               x.dtype)}))
    assert np.abs(np.asarray(zeroed) - np.asarray(plain)).max() > 1e-3
    scan_model = nnx.eval_shape(lambda: ig.Ideogram4Transformer(dataclasses.replace(cfg, scan_layers=True),
                                                                rngs=nnx.Rngs(3)))
    with pytest.raises(ValueError, match="list layout"):
        scan_model(*args, hooks=LinearHooks({}))

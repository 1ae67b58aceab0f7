"""The torch/diffusers loader of a quantized checkpoint folder (models.torch_w4a4): its FP4 math is bit for bit
kroquant_jax.formats, its W4A4 layers compute kroquant_jax.qlinear's simulated forward, and the diffusers model it
builds (tiny random PixArt-Σ, SANA, FLUX.1, Ideogram 4) gives the JAX W4A4 forward of the same folder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from kroquant_jax import calibrate, formats, qlinear  # noqa: E402
from models import convert, families, flux, ideogram4, pixart, sana, torch_w4a4  # noqa: E402
from models.layers import LinearHooks, linears  # noqa: E402
from models.quantized_checkpoint import load_quantized_checkpoint, save_quantized_checkpoint  # noqa: E402

TINY = {
    "pixart": pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                  num_layers=1, cross_attention_dim=32, sample_size=8, patch_size=2,
                                  caption_channels=8, use_additional_conditions=False),
    "sana": sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                            num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
                            caption_channels=8, mlp_ratio=2.0, sample_size=8),
    "flux": flux.FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=4,
                            axes_dims_rope=(4, 4, 8)),
    "ideogram4": ideogram4.tiny_config(num_layers=1),
}
FORMATS = [formats.MXFP4(), formats.MXFP4(scale_mode="ceil"), formats.MXFP4(scale_mode="even"),
           formats.MXFP4(scale_mode="rceil"), formats.NVFP4()]


def _hard_values(rng, shape) -> np.ndarray:
    """Random values across many magnitudes with exact E2M1 ties, zero blocks, subnormals, NaN and Inf."""
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-20, 20, shape[:-1] + (1,)))
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    x[0, :8] = ties * 2.0 ** -3  # a block whose amax 6 * 2**-3 makes the ties exact in units of the scale
    x[0, 8:32] = 0.0
    x[1, :32] = 0.0  # an all-zero block
    x[2, :4] = np.float32(1e-40)  # subnormals
    x[3, 5], x[4, 33] = np.nan, np.inf
    return x


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{getattr(f, 'scale_mode', '')}")
def test_fake_quant_and_dequantize_are_bit_for_bit_the_jax_formats(fmt):
    rng = np.random.default_rng(0)
    x = _hard_values(rng, (6, 64))
    fmt_json = fmt.to_json()
    expected = np.asarray(formats.fake_quant(jnp.asarray(x), fmt))
    got = torch_w4a4.fake_quant(torch.from_numpy(x), fmt_json).numpy()
    np.testing.assert_array_equal(got.view(np.int32)[np.isfinite(expected)],
                                  expected.view(np.int32)[np.isfinite(expected)])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert np.isnan(expected).sum() == 2 * fmt.block_size  # the NaN and the Inf block
    finite = np.where(np.isfinite(x), x, 0.0)
    q = formats.quantize(jnp.asarray(finite), fmt)
    scales = np.asarray(q.scales)
    stored = scales.view(np.uint8) if scales.dtype != np.uint8 else scales
    back = torch_w4a4.dequantize(np.asarray(q.codes), stored, float(q.tensor_scale), fmt_json).numpy()
    np.testing.assert_array_equal(back.view(np.int32), np.asarray(formats.dequantize(q, jnp.float32)).view(np.int32))
    empty = torch_w4a4.fake_quant(torch.zeros((0, 64)), fmt_json)
    assert tuple(empty.shape) == (0, 64)
    bf16 = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(
        torch_w4a4.fake_quant(torch.from_numpy(bf16).to(torch.bfloat16), fmt_json).numpy(),
        np.asarray(formats.fake_quant(jnp.asarray(bf16, jnp.bfloat16).astype(jnp.float32), fmt)))
    with pytest.raises(ValueError, match="width 40 is not a multiple of the block"):
        torch_w4a4.fake_quant(torch.zeros((2, 40)), fmt_json)


def _quantize_tiny(name: str):
    """A tiny random model of family ``name`` and W4A4 layers of every kind for five of its linears (d % 32 == 0):
    Hadamard-32 MXFP4; a random KroQuant transform with a packed (LoRaQ) rank-32 branch; NVFP4 with an f32
    (SVDQuant) rank-4 branch; identity with MXFP4 RCEIL activations and EVEN weights."""
    family = families.get(name)
    model = family.build(TINY[name], seed=1)
    key = jax.random.key(0)
    qlayers = {}
    eligible = [(p, l) for p, l in linears(model, quantizable_only=True).items() if l.in_features % 32 == 0]
    for i, (path, linear) in enumerate(eligible[:3] + eligible[-2:]):  # 5 layers (SANA: both 1x1 convs) keep it fast
        w = np.asarray(linear.kernel[...], np.float32).T  # (o, d)
        o, d = w.shape
        b = None if linear.bias is None else np.asarray(linear.bias[...], np.float32)
        key, k1, k2, k3 = jax.random.split(key, 4)
        kind = i % 4
        if kind == 1 and min(o, d) < 32:
            kind = 0
        if kind == 0:
            layer = qlinear.build_qlinear(w, b, transform="hadamard32", name=path)
        elif kind == 1:
            params = qlinear.random_kron_params(k1, d)
            left = 0.05 * jax.random.normal(k2, (o, 32))
            right = 0.05 * jax.random.normal(k3, (32, d))
            layer = qlinear.build_qlinear(w, b, transform="kron_lu", transform_params=params, lowrank=(left, right),
                                          name=path)
        elif kind == 2:
            left, right = 0.05 * jax.random.normal(k2, (o, 4)), 0.05 * jax.random.normal(k3, (4, d))
            layer = qlinear.build_qlinear(w, b, transform="hadamard32", lowrank=(left, right), lowrank_quantized=False,
                                          weight_fmt=formats.NVFP4(), act_fmt=formats.NVFP4(), name=path)
        else:
            layer = qlinear.build_qlinear(w, b, weight_fmt=formats.MXFP4(scale_mode="even"),
                                          act_fmt=formats.MXFP4(scale_mode="rceil"), name=path)
        qlayers[path] = layer
    return family, model, qlayers


def _save(tmp_path, name):
    family, model, qlayers = _quantize_tiny(name)
    folder = tmp_path / f"q-{name}"
    save_quantized_checkpoint(folder, model, qlayers, recipe_name="mixed", recipe=calibrate.get_recipe("hadamard32"))
    return family, qlayers, folder


def _inputs(name: str, cfg, rng) -> tuple[dict, dict]:
    """(JAX keyword inputs, torch keyword inputs) of one forward pass of a tiny model, batch 2."""
    if name in ("pixart", "sana"):
        x = rng.standard_normal((2, cfg.in_channels, 8, 8)).astype(np.float32)
        context = rng.standard_normal((2, 5, cfg.caption_channels)).astype(np.float32)
        timestep = np.array([3.0, 871.0], np.float32)
        mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int64)
        arrays = dict(hidden_states=x, encoder_hidden_states=context, timestep=timestep,
                      encoder_attention_mask=mask)
        return arrays, {k: torch.from_numpy(v) for k, v in arrays.items()}
    if name == "flux":
        latents = rng.standard_normal((2, cfg.in_channels // 4, 4, 6)).astype(np.float32)
        arrays = dict(hidden_states=np.array(flux.pack_latents(jnp.asarray(latents))),
                      encoder_hidden_states=rng.standard_normal((2, 5, cfg.joint_attention_dim)).astype(np.float32),
                      pooled_projections=rng.standard_normal((2, cfg.pooled_projection_dim)).astype(np.float32),
                      timestep=np.array([1.0, 0.25], np.float32), img_ids=np.asarray(flux.image_ids(4, 6)),
                      txt_ids=np.zeros((5, 3), np.float32))
        return arrays, {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}
    position_ids, segment_ids, indicator = diffusers.Ideogram4Pipeline._prepare_ids([3, 5], 2, 3, 6,
                                                                                   torch.device("cpu"))
    batch, length = indicator.shape
    inputs = dict(hidden_states=torch.from_numpy(rng.standard_normal((batch, length, cfg.in_channels))
                                                 .astype(np.float32)),
                  timestep=torch.tensor([0.3, 0.8]), position_ids=position_ids, segment_ids=segment_ids,
                  indicator=indicator,
                  encoder_hidden_states=torch.from_numpy(rng.standard_normal((batch, length, cfg.llm_features_dim))
                                                         .astype(np.float32)))
    return {k: v.numpy() for k, v in inputs.items()}, inputs


@pytest.mark.parametrize("name", sorted(TINY))
def test_torch_w4a4_forward_matches_the_jax_w4a4_forward(tmp_path, name):
    family, qlayers, folder = _save(tmp_path, name)
    transformer = torch_w4a4.load_w4a4_transformer(folder)
    assert type(transformer).__name__ == family.class_name
    replaced = {n: m for n, m in transformer.named_modules() if isinstance(m, torch_w4a4.W4A4Linear)}
    assert sorted(replaced) == sorted(qlayers) and len(qlayers) == 5
    assert {m.conv1x1 for m in replaced.values()} == ({False, True} if name == "sana" else {False})

    rng = np.random.default_rng(0)
    kinds = {}
    for path, layer in qlayers.items():  # one layer of each kind (transform, formats, branch)
        kinds.setdefault((layer.config.transform, layer.config.act_fmt, layer.lowrank_quantized, layer.config.rank),
                         path)
    assert len(kinds) == 4
    for path in kinds.values():  # eq. 11's simulated path
        layer = qlayers[path]
        x = rng.standard_normal((3, 5, layer.config.in_features)).astype(np.float32)
        expected = np.asarray(qlinear.qlinear_forward(layer, jnp.asarray(x)))
        got = replaced[path].linear(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=path)

    loaded = load_quantized_checkpoint(folder)
    arrays, torch_inputs = _inputs(name, loaded.cfg, rng)
    graphdef, state = nnx.split(loaded.model)
    forward = jax.jit(lambda s, overrides, inputs: nnx.merge(graphdef, s)(**inputs, hooks=LinearHooks(overrides)))
    expected = np.asarray(forward(state, loaded.overrides(), {k: jnp.asarray(v) for k, v in arrays.items()}))
    with torch.no_grad():
        got = transformer(**torch_inputs, return_dict=False)[0].numpy()
    assert got.shape == expected.shape and np.isfinite(expected).all()
    err = float(np.abs(got - expected).max() / np.abs(expected).max())
    assert err < 1e-4, err


def test_w4a4_buffers_stay_exact_under_dtype_casts(tmp_path):
    _, qlayers, folder = _save(tmp_path, "pixart")
    transformer = torch_w4a4.load_w4a4_transformer(folder, dtype=torch.bfloat16)
    name = next(iter(qlayers))
    layer = transformer.get_submodule(name)
    expected = np.asarray(formats.dequantize(qlayers[name].weight, jnp.float32))
    np.testing.assert_array_equal(layer.weight.view(torch.float32).numpy(), expected)
    assert transformer.proj_out.weight.dtype == torch.bfloat16
    transformer.half()
    np.testing.assert_array_equal(layer.weight.view(torch.float32).numpy(), expected)
    x = torch.randn(2, layer.in_features, dtype=torch.float16)
    assert layer(x).dtype == torch.float16


def _rewrite(path, edit):
    tensors = convert.read_safetensors(path)
    edit(tensors)
    convert.write_safetensors(path, tensors)


def test_bad_folders_raise_naming_the_key_or_file(tmp_path):
    family, qlayers, folder = _save(tmp_path, "pixart")
    name = next(iter(qlayers))

    def load_after(file, edit):
        import shutil

        broken = tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folder, broken)
        _rewrite(broken / file, edit)
        return lambda: torch_w4a4.load_w4a4_transformer(broken)

    with pytest.raises(ValueError, match="missing key proj_out.bias"):
        load_after("model.safetensors", lambda t: t.pop("proj_out.bias"))()
    with pytest.raises(ValueError, match=r"mis-shaped key proj_out.bias: stored \(3,\), PixArtTransformer2DModel has"):
        load_after("model.safetensors", lambda t: t.__setitem__("proj_out.bias", np.zeros(3, np.float32)))()
    with pytest.raises(ValueError, match="unexpected key extra.weight"):
        load_after("model.safetensors", lambda t: t.__setitem__("extra.weight", np.zeros(3, np.float32)))()
    with pytest.raises(ValueError, match=f"layer '{name}' lacks the array {name}/weight.codes"):
        load_after("quantized.safetensors", lambda t: t.pop(f"{name}/weight.codes"))()
    with pytest.raises(ValueError, match=f"layer '{name}'.*scales of shape"):
        load_after("quantized.safetensors",
                   lambda t: t.__setitem__(f"{name}/weight.scales", t[f"{name}/weight.scales"][:, :-1].copy()))()

    diffusers_dir = tmp_path / "plain"
    family.to_diffusers(family.build(TINY["pixart"]), diffusers_dir)
    with pytest.raises(ValueError, match="no model.safetensors: not a quantized checkpoint folder written by kroquant "
                                         "quantize-checkpoint \\(a diffusers checkpoint: load it with the class's "
                                         "from_pretrained\\)"):
        torch_w4a4.load_w4a4_transformer(diffusers_dir)
    with pytest.raises(ValueError, match="no such folder"):
        torch_w4a4.load_w4a4_transformer(tmp_path / "missing")


def test_padded_layer_from_state_matches_jax():
    """A linear of width 80 padded to 96 (``--unaligned pad``) as stored, run in torch on width-80 inputs."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((24, 80)) * 0.1).astype(np.float32)
    w_pad, _, pad = qlinear.pad_to_block(w, None, 32)
    layer = qlinear.with_input_pad(qlinear.build_qlinear(w_pad, np.ones(24, np.float32), transform="hadamard32"),
                                   pad)
    state, meta = qlinear.to_state(layer)
    module = torch_w4a4.w4a4_layer_from_state("ff", {k: torch.from_numpy(np.array(v)) for k, v in state.items()},
                                              meta)
    assert module.input_pad == 16 and module.input_width == 80 and "input_pad=16" in repr(module)
    x = rng.standard_normal((2, 3, 80)).astype(np.float32)
    expected = np.asarray(qlinear.qlinear_forward(layer, jnp.asarray(x)))
    np.testing.assert_allclose(module(torch.from_numpy(x)).numpy(), expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
    with pytest.raises(ValueError, match="does not match its width 80 \\(in_features=96, input_pad=16\\)"):
        module(torch.zeros(2, 96))

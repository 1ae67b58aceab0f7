"""The self-contained quantized checkpoint folder round-trips on tiny random PixArt-Σ, SANA and FLUX.1 models: the
loaded model with its W4A4 layers samples exactly what the original model with the same layers samples."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kroquant_jax import calibrate
from models import families, flux, pixart, quantize_model, sampling, sana
from models.layers import linears
from models.quantized_checkpoint import load_quantized_checkpoint, save_quantized_checkpoint

pytestmark = pytest.mark.slow

MODELS = {
    "pixart": (families.PIXART, pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                           out_channels=8, num_layers=1, cross_attention_dim=32, sample_size=8,
                                           patch_size=2, caption_channels=8, use_additional_conditions=False)),
    "sana": (families.SANA, sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                   num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                   cross_attention_dim=32, caption_channels=8, mlp_ratio=2.0, sample_size=8)),
    "flux": (families.FLUX, flux.FluxConfig(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=4,
                                   axes_dims_rope=(4, 4, 8))),
}
RECIPE = calibrate.get_recipe("hadamard32", run=calibrate.RunConfig(num_rows=24, num_validation=8, num_test=8))


def _prompts(family):
    if family == "flux":
        return {"context": jnp.ones((1, 3, 8)) * 0.3, "pooled": jnp.ones((1, 4)) * 0.2}
    return {"context": jnp.linspace(-1, 1, 24).reshape(1, 3, 8), "mask": jnp.ones((1, 3)),
            "uncond_context": jnp.zeros((1, 3, 8)), "uncond_mask": jnp.ones((1, 3))}


@pytest.mark.parametrize("family", list(MODELS))
def test_round_trip_samples_the_same(family, tmp_path):
    module, cfg = MODELS[family]
    model = module.build(cfg, seed=1)
    rng = np.random.default_rng(0)
    layer_set = {}
    for name, layer in linears(model, quantizable_only=True).items():
        w = np.asarray(layer.kernel[...], np.float32).T
        b = None if layer.bias is None else np.asarray(layer.bias[...], np.float32)
        layer_set[name] = (w, b, rng.standard_normal((40, w.shape[1])).astype(np.float32))
    qlayers, reports = calibrate.quantize_layer_set(layer_set, RECIPE)
    folder = tmp_path / "q"
    save_quantized_checkpoint(folder, model, qlayers, recipe_name="hadamard32", recipe=RECIPE, reports=reports,
                              left_16bit={"x": "test"}, extra={"solver": "flow_euler"})
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors",
                                                        "quantization_config.json", "quantized.safetensors"]
    qconfig = json.loads((folder / "quantization_config.json").read_text())
    assert qconfig["recipe"] == "hadamard32" and qconfig["weight_format"] == "MXFP4"
    assert qconfig["settings"]["transform"] == "hadamard32" and qconfig["left_16bit"] == {"x": "test"}
    assert set(qconfig["layers"]) == set(qlayers)
    assert all(qconfig["layers"][n]["heldout_error"] == pytest.approx(reports[n]["heldout_error"]) for n in qlayers)
    from kroquant_jax import provenance  # the weight files' digests, what keys a generate run on the folder
    assert qconfig["files_sha256"] == {name: provenance.file_digest(folder / name)
                                       for name in ("model.safetensors", "quantized.safetensors")}

    loaded = load_quantized_checkpoint(folder)
    assert loaded.family == family and loaded.cfg == cfg and sorted(loaded.qlayers) == sorted(qlayers)
    for name, layer in qlayers.items():
        back = loaded.qlayers[name]
        np.testing.assert_array_equal(np.asarray(back.weight.codes), np.asarray(layer.weight.codes))
        np.testing.assert_array_equal(np.asarray(back.weight.scales), np.asarray(layer.weight.scales))
        np.testing.assert_array_equal(np.asarray(back.blocks), np.asarray(layer.blocks))
        assert float(jnp.abs(linears(loaded.model)[name].kernel[...]).max()) == 0.0  # a placeholder, never used
    outputs = []
    for m, overrides in ((model, quantize_model.qlinear_overrides(qlayers)), (loaded.model, loaded.overrides())):
        graphdef, state = nnx.split(m)
        sample = jax.jit(sampling.make_sampler(family, graphdef, m.cfg, num_steps=1, guidance_scale=3.0,
                                               latent_hw=(8, 8)))
        outputs.append(np.asarray(sample({"model": state, **_prompts(family), "overrides": overrides},
                                         jax.random.key(0))[0]))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert np.isfinite(outputs[0]).all() and np.abs(outputs[0]).max() > 0


def test_a_spoiled_quantized_folder_is_refused_naming_the_layer_and_key(tmp_path):
    """Packed arrays of another shape or dtype, a missing or extra array, an array of no layer: refused at load,
    naming quantized.safetensors, the layer and the key (they loaded and failed in the forward with no name, or loaded
    silently); a bf16 folder loads in bf16 by default (``np.issubdtype`` does not call bfloat16 floating)."""
    from models import convert

    module, cfg = MODELS["pixart"]
    model = module.build(cfg, jnp.bfloat16, seed=1)
    rng = np.random.default_rng(0)
    layer_set = {n: (np.asarray(l.kernel[...], np.float32).T, None if l.bias is None else np.asarray(l.bias[...],
                     np.float32), rng.standard_normal((40, l.kernel.shape[0])).astype(np.float32))
                 for n, l in linears(model, quantizable_only=True).items()}
    qlayers, reports = calibrate.quantize_layer_set(layer_set, RECIPE)
    folder = tmp_path / "q"
    save_quantized_checkpoint(folder, model, qlayers, recipe_name="hadamard32", recipe=RECIPE, reports=reports)
    assert jax.tree.leaves(nnx.state(load_quantized_checkpoint(folder).model, nnx.Param))[0].dtype == jnp.bfloat16
    good = dict(convert.read_safetensors(folder / "quantized.safetensors"))
    name = sorted(qlayers)[0]
    codes = good[f"{name}/weight.codes"]
    spoils = {
        "cut codes": ({f"{name}/weight.codes": codes[:, : codes.shape[1] // 2]}, "weight: codes"),
        "int32 codes": ({f"{name}/weight.codes": codes.astype(np.int32)}, "weight.codes: expected uint8"),
        "short bias": ({f"{name}/bias": good[f"{name}/bias"][:3]}, "bias: shape \\(3,\\)"),
        "missing scales": ({f"{name}/weight.scales": None}, "missing \\['weight.scales'\\]"),
        "extra array": ({f"{name}/lowrank_left": np.zeros((2, 2), np.float32)}, "unknown \\['lowrank_left'\\]"),
        "no layer": ({"transformer_blocks.0.nothing/bias": np.zeros(2, np.float32)}, "arrays of no layer"),
    }
    for what, (change, message) in spoils.items():
        arrays = {k: v for k, v in {**good, **change}.items() if v is not None}
        convert.write_safetensors(folder / "quantized.safetensors", arrays)
        with pytest.raises(ValueError, match=message) as refused:
            load_quantized_checkpoint(folder)
        assert "quantized.safetensors" in str(refused.value), what
        if what != "no layer":
            assert repr(name) in str(refused.value), what


def test_load_names_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no model.safetensors \\(not a quantized checkpoint folder"):
        load_quantized_checkpoint(tmp_path)


def test_generate_runs_a_served_strategy(tmp_path, monkeypatch):
    """`kroquant generate --strategy dequant` and `--strategy fp8` (pallas_kernels.served, their jnp references on the
    CPU) sample close to the simulated path; bad --strategy / --impl choices are one-line errors."""
    from scripts import generate
    from scripts.common_args import UserError

    module, cfg = MODELS["pixart"]
    model = module.build(cfg, seed=2)
    rng = np.random.default_rng(1)
    layer_set = {}
    for name, layer in list(linears(model, quantizable_only=True).items())[:4]:
        w = np.asarray(layer.kernel[...], np.float32).T
        b = None if layer.bias is None else np.asarray(layer.bias[...], np.float32)
        layer_set[name] = (w, b, rng.standard_normal((40, w.shape[1])).astype(np.float32))
    qlayers, _ = calibrate.quantize_layer_set(layer_set, RECIPE)
    folder = tmp_path / "q"
    save_quantized_checkpoint(folder, model, qlayers, recipe_name="hadamard32", recipe=RECIPE,
                              extra={"solver": "flow_euler", "steps": 2, "latent_hw": [8, 8]})
    prompts = tmp_path / "p.npz"
    np.savez(prompts, **{k: np.asarray(v) for k, v in _prompts("pixart").items()})
    common = ["--checkpoint", str(folder), "--prompts", str(prompts), "--quiet"]
    simulated = generate.main([*common, "--out", str(tmp_path / "sim")])
    caches = []  # --compile-cache turns on JAX's process-wide cache: recorded here, not turned on in the test process
    monkeypatch.setattr(calibrate, "enable_compile_cache", caches.append)
    dequant = generate.main([*common, "--out", str(tmp_path / "deq"), "--strategy", "dequant", "--compile-cache",
                             str(tmp_path / "cc")])
    assert caches == [str(tmp_path / "cc")]
    assert (simulated["strategy"], dequant["strategy"]) == ("simulate", "dequant")
    with np.load(tmp_path / "sim" / "latents.npz") as a, np.load(tmp_path / "deq" / "latents.npz") as b:
        sim, deq = a["latents"], b["latents"]
    assert np.isfinite(deq).all() and not np.array_equal(sim, deq)  # served: bf16 activations, another path
    assert np.linalg.norm(deq - sim) / np.linalg.norm(sim) < 0.05
    # the sampler is compiled with the strategy's per-program XLA options (fp8 has none: given one here, it must
    # reach jax.jit, which accepts this GPU option on the CPU too)
    from pallas_kernels import fp8_gemm
    monkeypatch.setattr(fp8_gemm.Fp8Strategy, "program_xla_options", {"xla_gpu_enable_command_buffer": ""})
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    fp8 = generate.main([*common, "--out", str(tmp_path / "fp8"), "--strategy", "fp8"])
    assert fp8["strategy"] == "fp8" and fp8["xla_options"] == {"xla_gpu_enable_command_buffer": ""}
    assert simulated["xla_options"] == {} and dequant["xla_options"] == {}
    # ... and they reach the compile: an option XLA does not know fails there
    monkeypatch.setattr(fp8_gemm.Fp8Strategy, "program_xla_options", {"xla_no_such_option": ""})
    with pytest.raises(Exception, match="No such compile option: 'xla_no_such_option'"):
        generate.main([*common, "--out", str(tmp_path / "fp8x"), "--strategy", "fp8"])
    with np.load(tmp_path / "fp8" / "latents.npz") as c:
        assert np.isfinite(c["latents"]).all()
        assert np.linalg.norm(c["latents"] - sim) / np.linalg.norm(sim) < 0.05
    with pytest.raises(UserError, match="--strategy foo: not simulate or a served strategy \\(dequant"):
        generate.main([*common, "--out", str(tmp_path / "x"), "--strategy", "foo"])
    with pytest.raises(UserError, match="--impl reference applies to served strategies"):
        generate.main([*common, "--out", str(tmp_path / "x"), "--impl", "reference"])
    with pytest.raises(UserError, match="--attention cudnn needs an NVIDIA GPU \\(the backend is cpu\\)"):
        generate.main([*common, "--out", str(tmp_path / "x"), "--attention", "cudnn"])


@pytest.fixture(scope="module")
def stand_in_pixarts():
    """``{num_layers: (cfg, model, qlayers)}`` for 1 and 3 blocks: a PixArt whose block linears have stand-in W4A4
    layers, built once for both strategies' trace counts (building them is the cost; tracing is what is counted)."""
    import dataclasses

    from kroquant_jax.qlinear import random_qlinear

    module, base = MODELS["pixart"]
    built = {}
    for num_layers in (1, 3):
        cfg = dataclasses.replace(base, num_layers=num_layers)
        model = module.build(cfg, seed=2)
        keys = iter(jax.random.split(jax.random.key(0), 64))
        layers = {name: layer for name, layer in linears(model, quantizable_only=True).items()
                  if name.startswith("transformer_blocks.") and layer.kernel.shape[0] % 32 == 0}  # kernel (d, o)
        built[num_layers] = cfg, model, {name: random_qlinear(np.asarray(layer.kernel[...], np.float32).T,
                                                              next(keys), 32) for name, layer in layers.items()}
    return built


def _count_layer_traces(monkeypatch, strategy, built):
    """(layer forwards traced, W4A4 layers) for one trace of a PixArt sampler (``built``: one entry of
    ``stand_in_pixarts``) whose block linears run W4A4 through ``strategy``'s overrides (jax's caches cleared first)."""
    from kroquant_jax import qlinear
    from models.quantized_checkpoint import QuantizedCheckpoint
    from pallas_kernels import served

    module, _ = MODELS["pixart"]
    cfg, model, qlayers = built
    checkpoint = QuantizedCheckpoint(family="pixart", cfg=cfg, model=model, qlayers=qlayers, config={})
    traced = []
    if strategy == "simulate":
        inner = qlinear.qlinear_forward
        monkeypatch.setattr(qlinear, "qlinear_forward", lambda *a, **k: traced.append(1) or inner(*a, **k))
        overrides = checkpoint.overrides()
    else:
        inner = served.forward
        monkeypatch.setattr(served, "forward", lambda *a, **k: traced.append(1) or inner(*a, **k))
        overrides = checkpoint.served_overrides(served.ServeOptions(strategy=strategy))
    graphdef, state = nnx.split(model)
    sample = module.make_sampler(graphdef, cfg, num_steps=1, guidance_scale=1.0, latent_hw=(8, 8))
    jax.clear_caches()
    jax.jit(sample).trace({"model": state, **_prompts("pixart"), "overrides": overrides}, jax.random.key(0))
    monkeypatch.undo()
    return len(traced), len(qlayers)


@pytest.mark.parametrize("strategy", ["simulate", "dequant"])
def test_a_layer_shape_is_traced_once_per_model(monkeypatch, strategy, stand_in_pixarts):
    """The overrides compile each layer's forward as a unit, so 3 blocks trace (and lower) as many layer forwards as
    1 block, one per distinct layer signature, not one per layer: what keeps a 28-block PixArt-Σ program's compile
    short."""
    one, one_layers = _count_layer_traces(monkeypatch, strategy, stand_in_pixarts[1])
    three, three_layers = _count_layer_traces(monkeypatch, strategy, stand_in_pixarts[3])
    assert three_layers == 3 * one_layers and 0 < one < one_layers
    assert three == one

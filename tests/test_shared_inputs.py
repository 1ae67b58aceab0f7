"""Shared-input groups: the families' declared groups really read one input, and a fused layer set calibrates as one
linear per group whose output splits into the members' (kroquant_jax.shared_inputs)."""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kroquant_jax import calibrate, qlinear, shared_inputs
from kroquant_jax.layerset import LayerData, RunConfig
from models import families
from models.layers import LinearHooks, linears
from tests.test_capture import _ListRecorder
from tests.test_families import TINY

#: latent (H, W) of one sampling run of each tiny config
_LATENT_HW = {"pixart": (8, 8), "sana": (8, 8), "flux": (4, 4), "ideogram4": (2, 2)}


class _InputRecorder(_ListRecorder):
    """Records the whole input (and token mask, None where the model gives none) of every linear at every step, as
    the sampler's per-step output."""

    def result(self):
        return dict(self.seen)


def _prompts(family, cfg, batch=2, tokens=3):
    """Random text inputs of ``family`` (the second caption's first token masked, where there is a mask)."""
    rng = np.random.default_rng(0)
    widths = family.prompt_widths(cfg)
    out = {}
    for key in family.prompt_inputs:
        if key not in widths:  # a mask
            mask = np.ones((batch, tokens), np.float32)
            mask[1, 0] = 0.0
            out[key] = jnp.asarray(mask)
        elif key == "pooled":
            out[key] = jnp.asarray(rng.standard_normal((batch, widths[key])), jnp.float32)
        else:
            out[key] = jnp.asarray(rng.standard_normal((batch, tokens, widths[key])), jnp.float32)
    return out


@pytest.mark.parametrize("name", sorted(TINY))
def test_each_declared_group_reads_one_input_and_holds_quantizable_linears(name):
    family = families.get(name)
    cfg = TINY[name]
    model = family.build(cfg, seed=4)
    groups = shared_inputs.check_groups(family.shared_inputs(model))  # no linear in two groups
    quantizable = set(family.linear_sites(model))
    assert groups and all(member in quantizable for group in groups for member in group)
    graphdef, state = nnx.split(model)
    guidance = 1.0 if name in ("flux", "ideogram4") else 3.0
    sample = jax.jit(family.make_sampler(graphdef, cfg, num_steps=2, guidance_scale=guidance,
                                         latent_hw=_LATENT_HW[name],
                                         hooks_factory=lambda params, step: LinearHooks(recorder=_InputRecorder())))
    _, seen = sample({"model": state, **_prompts(family, cfg)}, jax.random.key(1))
    for group in groups:
        x0, mask0 = seen[group[0]]
        for member in group[1:]:
            x, mask = seen[member]
            np.testing.assert_array_equal(np.asarray(x), np.asarray(x0), err_msg=f"{member} vs {group[0]}")
            assert (mask is None) == (mask0 is None), member
            if mask is not None:
                np.testing.assert_array_equal(np.asarray(mask), np.asarray(mask0), err_msg=member)
    # the linears left out of every group read something else than each group (e.g. PixArt's attn2.to_q: the image)
    grouped = {member for group in groups for member in group}
    for other in quantizable - grouped:
        x = np.asarray(seen[other][0])
        assert not any(x.shape == np.shape(seen[g[0]][0]) and np.array_equal(x, np.asarray(seen[g[0]][0]))
                       for g in groups), other


def test_the_declared_groups_of_each_family():
    pixart = families.PIXART.build(TINY["pixart"])
    assert families.PIXART.shared_inputs(pixart) == (
        tuple(f"transformer_blocks.0.attn1.to_{x}" for x in "qkv"),
        ("transformer_blocks.0.attn2.to_k", "transformer_blocks.0.attn2.to_v"))
    flux_groups = families.FLUX.shared_inputs(families.FLUX.build(TINY["flux"]))
    assert flux_groups[-1] == ("single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k",
                               "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp")
    ideogram = families.IDEOGRAM4.build(TINY["ideogram4"])
    groups = families.IDEOGRAM4.shared_inputs(ideogram)
    assert ("layers.1.feed_forward.w1", "layers.1.feed_forward.w3") in groups and len(groups) == 4
    # scanned blocks share their paths: one group of each kind, of linears the scanned model has
    scanned_cfg = dataclasses.replace(TINY["ideogram4"], scan_layers=True)
    scanned = nnx.eval_shape(lambda: families.IDEOGRAM4.construct(scanned_cfg))
    scanned_groups = families.IDEOGRAM4.shared_inputs(scanned)
    assert len(scanned_groups) == 2
    assert {m for g in scanned_groups for m in g} <= set(families.IDEOGRAM4.linear_sites(scanned))


def _layer(rng, o, d, n=96, bias=True):
    return LayerData(rng.standard_normal((o, d)).astype(np.float32),
                     rng.standard_normal(o).astype(np.float32) if bias else None,
                     rng.standard_normal((n, d)).astype(np.float32))


def _qkv_layer_set(rng):
    return {"b.q": _layer(rng, 32, 64), "b.k": _layer(rng, 32, 64, bias=False), "b.v": _layer(rng, 64, 64),
            "b.out": _layer(rng, 64, 32), "b.k2": _layer(rng, 32, 32, bias=False), "b.v2": _layer(rng, 32, 32,
                                                                                                bias=False)}


def test_fuse_shared_inputs_stacks_weights_and_biases_and_keeps_the_first_members_rows():
    layers = _qkv_layer_set(np.random.default_rng(0))
    groups = [("b.q", "b.k", "b.v"), ("b.k2", "b.v2")]
    fused = shared_inputs.fuse_shared_inputs(layers, groups)
    assert list(fused) == ["b.q|b.k|b.v", "b.out", "b.k2|b.v2"]
    qkv = fused["b.q|b.k|b.v"]
    np.testing.assert_array_equal(qkv.weight, np.concatenate([layers[n].weight for n in ("b.q", "b.k", "b.v")]))
    np.testing.assert_array_equal(qkv.bias, np.concatenate([layers["b.q"].bias, np.zeros(32), layers["b.v"].bias]))
    np.testing.assert_array_equal(qkv.activations, layers["b.q"].activations)
    assert fused["b.k2|b.v2"].bias is None  # no member has a bias
    np.testing.assert_array_equal(fused["b.out"].weight, layers["b.out"].weight)
    assert shared_inputs.members_of("b.k2|b.v2") == ("b.k2", "b.v2")
    assert shared_inputs.output_slices(layers, groups[0]) == {"b.q": slice(0, 32), "b.k": slice(32, 64),
                                                              "b.v": slice(64, 128)}
    # the fused layer takes the place of its earliest member in the layer set's order, whatever the group's order
    assert list(shared_inputs.fuse_shared_inputs(layers, [("b.v2", "b.k2")])) == ["b.q", "b.k", "b.v", "b.out",
                                                                                  "b.v2|b.k2"]


def test_fuse_shared_inputs_refuses_bad_groups():
    layers = _qkv_layer_set(np.random.default_rng(1))
    cases = [([("b.q", "b.missing")], r"\['b.missing'\] not in the layer set"),
             ([("b.q", "b.k2")], "different widths"),
             ([("b.q", "b.k"), ("b.k", "b.v")], r"layer 'b.k' is also in the group \('b.q', 'b.k'\)"),
             ([("b.q", "b.q")], "twice in this group"),
             ([("b.q",)], "at least two linears"),
             ([("b.q", "b|k")], "holds '|'")]
    for groups, match in cases:
        with pytest.raises(ValueError, match=match):
            shared_inputs.fuse_shared_inputs(layers, groups)
    clash = {**layers, "b.k2|b.v2": layers["b.out"]}
    with pytest.raises(ValueError, match="already holds a layer named 'b.k2|b.v2'"):
        shared_inputs.fuse_shared_inputs(clash, [("b.k2", "b.v2")])
    with pytest.raises(ValueError, match="has 128 output features"):
        shared_inputs.split_output(np.zeros((2, 127)), layers, ("b.q", "b.k", "b.v"))


def test_a_fused_layer_calibrates_as_one_and_splits_into_its_members_outputs():
    rng = np.random.default_rng(2)
    layers = _qkv_layer_set(rng)
    groups = [("b.q", "b.k", "b.v")]
    fused = shared_inputs.fuse_shared_inputs({n: layers[n] for n in groups[0]}, groups)
    run = RunConfig(num_rows=48, num_validation=16, num_test=16, shard=False)
    recipe = calibrate.get_recipe("kroquant+gptq", run=run, calibration=calibrate.CalibrationConfig(
        transform=None, steps=4, select_every=2))
    qlayers, reports = calibrate.quantize_layer_set(fused, recipe)
    name = "b.q|b.k|b.v"
    assert list(qlayers) == [name] and qlayers[name].config.out_features == 128  # one transform, one quantized weight
    # the 16-bit fused layer is exactly the members side by side
    a = layers["b.q"].activations
    y = a @ fused[name].weight.T + fused[name].bias
    for member, part in shared_inputs.split_output(y, layers, groups[0]).items():
        ref = a @ layers[member].weight.T + (0 if layers[member].bias is None else layers[member].bias)
        np.testing.assert_allclose(part, ref, rtol=1e-5, atol=1e-4)
    # each member's error from the fused quantized layer, on the fused layer's test rows
    rows = shared_inputs.fused_test_rows(fused, groups, run)
    errors = shared_inputs.member_errors(layers, groups, qlayers, rows)
    assert list(errors) == list(groups[0]) and all(0 < e < 1 for e in errors.values())
    # the members' errors combine to the fused layer's reported held-out error (same rows, same reference)
    refs = {m: rows[name].astype(np.float64) @ layers[m].weight.T.astype(np.float64) for m in groups[0]}
    combined = np.sqrt(sum((errors[m] * np.linalg.norm(refs[m])) ** 2 for m in groups[0])
                       / sum(np.linalg.norm(refs[m]) ** 2 for m in groups[0]))
    np.testing.assert_allclose(combined, reports[name]["heldout_error"], rtol=1e-4)
    # and the member's slice of the quantized forward is what member_errors measured
    out = np.asarray(qlinear.qlinear_forward(qlayers[name], jnp.asarray(rows[name])), np.float64)
    part = out[:, 32:64] - np.asarray(qlayers[name].bias)[32:64]
    np.testing.assert_allclose(np.linalg.norm(part - refs["b.k"]) / np.linalg.norm(refs["b.k"]), errors["b.k"],
                               rtol=1e-5)
    with pytest.raises(ValueError, match="qlayers has no fused layer 'b.k2|b.v2'"):
        shared_inputs.member_errors(layers, [("b.k2", "b.v2")], qlayers, rows)


@pytest.mark.slow
def test_the_testbed_measurement_tiny_run(tmp_path):
    """benchmarks/calibrate_shared_inputs.py on the shipped testbed cut to its first block (its real weights and
    prompts; the measurement's wiring is the same at any depth), a tiny capture: both arms measure each member on the
    same held-out rows, so a fixed transform (Hadamard-32, round to nearest: nothing depends on the rows) gives every
    member exactly its per-linear error fused; the capture is written, then read back (the same errors), and refused
    for other capture options."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_benchmarks import REPO, _run
    from tests.test_testbed import write_first_blocks

    out = tmp_path / "r.json"
    checkpoint = write_first_blocks(tmp_path / "first_block", 1)
    argv = ["--checkpoint", str(checkpoint), "--layer-set", str(tmp_path / "ls.safetensors"), "--calib-captions", "2",
            "--batch-size", "2", "--steps", "2", "--rows-per-layer", "64", "--calib-steps", "2", "--calib-rows", "24",
            "--calib-validation", "8", "--calib-test", "8", "--blocks", "1", "--heldout", "8", "--out-json", str(out),
            "--out-md", str(tmp_path / "r.md"), "--compile-cache", str(tmp_path / "jax-cache")]
    _run("calibrate_shared_inputs.py", *argv, "--methods", "hadamard32")
    result = json.loads(out.read_text())
    assert result["groups"] == [[f"transformer_blocks.0.attn1.to_{x}" for x in "qkv"],
                                ["transformer_blocks.0.attn2.to_k", "transformer_blocks.0.attn2.to_v"]]
    errors = result["methods"]["hadamard32"]["errors"]
    assert len(errors) == 5 and all(e["fused"] == e["per_linear"] and 0 < e["fused"] < 1 for e in errors.values())
    assert result["methods"]["hadamard32"]["summary"][-1]["worse_fused"] == 0
    assert "| hadamard32 | **all** | 5 |" in (tmp_path / "r.md").read_text()
    _run("calibrate_shared_inputs.py", "--render", str(out), "--out-png", str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    # reads the capture of the first run, with the first run's method: its programs are in the compile cache by now,
    # so the check (the capture's reuse) compiles nothing, and the capture read back gives the same errors
    _run("calibrate_shared_inputs.py", *argv, "--methods", "hadamard32")
    again = json.loads(out.read_text())
    assert "read" in again["description"] and again["methods"]["hadamard32"]["errors"] == errors
    other = list(argv)
    other[other.index("--steps") + 1] = "3"
    refused = subprocess.run([sys.executable, str(REPO / "benchmarks" / "calibrate_shared_inputs.py"), *other,
                              "--methods", "hadamard32"], cwd=REPO, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    assert refused.returncode != 0 and "captured with other options than these (['steps']" in refused.stderr


@pytest.mark.slow
def test_quantize_checkpoint_fuses_the_groups_and_its_folder_loads_per_linear_overrides(tmp_path, capsys):
    """`kroquant quantize-checkpoint --fuse-shared-inputs` on a one-block PixArt: q|k|v and k|v are one stored layer
    each (own store and outputs, RECIPE-fused), the loaded folder gives every linear its override, and with round to
    nearest (no transform: stacking rows changes no code or scale) the fused model samples what the per-linear one
    does; a rerun resumes the fused store."""
    from models.quantized_checkpoint import load_quantized_checkpoint
    from scripts import quantize_checkpoint
    from tests.test_quantize_checkpoint import PIXART as ONE_BLOCK, TINY as ARGS

    families.PIXART.to_diffusers(families.PIXART.build(ONE_BLOCK, seed=4), tmp_path / "ckpt")
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), *ARGS]
    per_linear = quantize_checkpoint.main(argv)
    fused = quantize_checkpoint.main([*argv, "--fuse-shared-inputs"])
    qkv = "|".join(f"transformer_blocks.0.attn1.to_{x}" for x in "qkv")
    kv = "transformer_blocks.0.attn2.to_k|transformer_blocks.0.attn2.to_v"
    assert fused["fused"] == {qkv: qkv.split("|"), kv: kv.split("|")} and fused["not_fused"] == {}
    assert (per_linear["layers"], fused["layers"]) == (10, 7) and set(fused["heldout_error"]) >= {qkv, kv}
    assert "reused the layer set captured with the same settings" in capsys.readouterr().err  # fusion after capture
    loaded = load_quantized_checkpoint(tmp_path / "out" / "quantized-rtn-fused")
    assert set(loaded.qlayers) >= {qkv, kv} and loaded.config["layers"][kv]["members"] == kv.split("|")
    assert sorted(loaded.overrides()) == sorted(families.PIXART.linear_sites(loaded.model))
    with np.load(tmp_path / "out" / "samples-rtn.npz") as a, np.load(tmp_path / "out" / "samples-rtn-fused.npz") as b:
        np.testing.assert_allclose(b["latents_w4a4"], a["latents_w4a4"], rtol=1e-5, atol=1e-5)
    again = quantize_checkpoint.main([*argv, "--fuse-shared-inputs"])
    assert again["layers_resumed"] == 7
    if importlib.util.find_spec("torch") and importlib.util.find_spec("diffusers"):  # the torch loader refuses it
        from models import torch_w4a4

        with pytest.raises(ValueError, match="is a fused shared-input layer of 3 linears"):
            torch_w4a4.load_w4a4_transformer(tmp_path / "out" / "quantized-rtn-fused")


def test_unequal_members_are_fused_and_split_at_their_widths():
    """FLUX.1's single-block q|k|v|proj_mlp has members of unequal output widths: quantize-checkpoint fuses it like
    the equal groups, and a stored fused layer of it gives each member its own width of the fused output (one
    layer held once in the overrides); a member that is no linear of the model is refused by name."""
    from models.quantized_checkpoint import QuantizedCheckpoint, layer_members, member_widths
    from scripts import quantize_checkpoint

    cfg = dataclasses.replace(TINY["flux"], attention_head_dim=32, axes_dims_rope=(8, 8, 16))  # d = 32: one MXFP4 block
    model = families.FLUX.build(cfg)
    by_path = linears(model, quantizable_only=True)
    weights = {name: (np.asarray(layer.kernel[...]).T, None) for name, layer in by_path.items()}
    groups, not_fused = quantize_checkpoint.plan_fusion(families.FLUX, model, weights)
    single = families.FLUX.shared_inputs(model)[-1]
    assert len(groups) == 3 and not_fused == {} and tuple(single) in groups
    name = shared_inputs.fused_name(single)
    assert layer_members(name, model) == tuple(single)
    widths = member_widths(tuple(single), model)
    assert len(set(widths)) == 2 and widths[-1] == 4 * widths[0]  # q, k, v of d; proj_mlp of 4 d
    w = np.concatenate([weights[m][0] for m in single])  # (sum o, d)
    layer = qlinear.build_qlinear(w, None, transform="hadamard32")
    checkpoint = QuantizedCheckpoint(family="flux", cfg=cfg, model=model, qlayers={name: layer}, config={})
    overrides = checkpoint.overrides()
    assert sorted(overrides) == sorted(single) and len(overrides.layers) == 1
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, w.shape[1])), jnp.float32)
    full = np.asarray(qlinear.qlinear_forward(layer, x))
    parts = [np.asarray(overrides[m](x)) for m in single]
    assert [p.shape[-1] for p in parts] == widths
    np.testing.assert_array_equal(np.concatenate(parts, axis=-1), full)
    with pytest.raises(ValueError, match="member 'x.to_q' of fused layer 'x.to_q|x.to_k' is not a linear"):
        layer_members("x.to_q|x.to_k", model)


def test_layer_errors_is_member_errors_measure_for_plain_layers():
    """layer_errors (per-linear layers) and member_errors (fused) use one measure: a layer fused with itself only
    in name (a one-member split) gives the same error both ways, and a missing layer is named."""
    rng = np.random.default_rng(3)
    layers = _qkv_layer_set(rng)
    q = qlinear.build_qlinear(layers["b.q"].weight, layers["b.q"].bias, transform="hadamard32")
    rows = rng.standard_normal((40, 64)).astype(np.float32)
    err = shared_inputs.layer_errors(layers, {"b.q": q}, {"b.q": rows})["b.q"]
    y = np.asarray(qlinear.qlinear_forward(q, jnp.asarray(rows)), np.float64) - layers["b.q"].bias
    ref = rows.astype(np.float64) @ layers["b.q"].weight.T.astype(np.float64)
    assert err == pytest.approx(np.linalg.norm(y - ref) / np.linalg.norm(ref), rel=1e-6) and 0 < err < 0.5
    with pytest.raises(ValueError, match="no quantized layer or layer-set entry 'b.k'"):
        shared_inputs.layer_errors(layers, {"b.q": q}, {"b.k": rows})

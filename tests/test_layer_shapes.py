"""models.layer_shapes: the GEMM shapes of the real presets (what the GPU benchmarks time), derived from the configs;
tiny configs scale them, the built model agrees, unknown families / presets / unnamed linears raise."""

import dataclasses

import pytest

from models import families, flux, ideogram4, layer_shapes, pixart, sana
from models.layers import linears

# The figures of the real checkpoints (diffusers config.json of each preset), in the benchmarks' priority order.
REAL = {
    "ideogram4.attn.q": (4608, 4608), "ideogram4.ffn.w13": (24576, 4608), "ideogram4.ffn.w2": (4608, 12288),
    "flux1.attn.q": (3072, 3072), "flux1.ff.up": (12288, 3072), "flux1.ff.down": (3072, 12288),
    "flux1.single.proj_out": (3072, 15360),
    "pixart_sigma.attn.q": (1152, 1152), "pixart_sigma.ff.up": (4608, 1152), "pixart_sigma.ff.down": (1152, 4608),
    "sana_1600m.attn.q": (2240, 2240), "sana_1600m.glumb.inverted": (11200, 2240),
    "sana_1600m.glumb.point": (2240, 5600),
}

TINY = {
    # dim 2 x 16 = 32: ff 4 dim, single proj_out reads [attn | mlp] = 5 dim
    "flux": (flux.FluxConfig(in_channels=16, num_layers=2, num_single_layers=1, attention_head_dim=16,
                             num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=4,
                             axes_dims_rope=(4, 4, 8)),
             {"flux.attn.q": (32, 32), "flux.ff.up": (128, 32), "flux.ff.down": (32, 128),
              "flux.single.proj_out": (32, 160)}),
    # hidden 2 x 32 = 64, intermediate 96: w1|w3 fused to 192 outputs
    "ideogram4": (ideogram4.tiny_config(),
                  {"ideogram4.attn.q": (64, 64), "ideogram4.ffn.w13": (192, 64), "ideogram4.ffn.w2": (64, 96)}),
    # dim 2 x 8 = 16, ff 4 dim; the caption projection makes the cross-attention keys read the hidden width
    "pixart": (pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                   num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2,
                                   caption_channels=8, use_additional_conditions=False),
               {"pixart.attn.q": (16, 16), "pixart.ff.up": (64, 16), "pixart.ff.down": (16, 64)}),
    # dim 16, mlp_ratio 2: GLU inverted conv 2 x 32 outputs, point conv 32 -> 16
    "sana": (sana.SanaConfig(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                             num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                             cross_attention_dim=16, caption_channels=8, mlp_ratio=2.0, sample_size=8),
             {"sana.attn.q": (16, 16), "sana.glumb.inverted": (64, 16), "sana.glumb.point": (16, 32)}),
}


def test_real_presets_give_the_known_shapes_in_priority_order():
    shapes = layer_shapes.preset_layer_shapes()
    assert shapes == REAL and list(shapes) == list(REAL)
    assert layer_shapes.layer_shapes("flux") == layer_shapes.layer_shapes(families.FLUX, "FLUX.1-schnell") == {
        k: v for k, v in REAL.items() if k.startswith("flux1.")}
    assert list(layer_shapes.preset_layer_shapes("pixart_sigma", "ideogram4")) == [
        k for k in REAL if k.startswith("pixart_sigma.")] + [k for k in REAL if k.startswith("ideogram4.")]
    assert layer_shapes.shape_table({"flux1.single.proj_out": (3072, 15360)}) == [
        ("flux1", "single.proj_out", 3072, 15360)]


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_configs_scale_the_shapes_and_match_the_built_model(name):
    cfg, expected = TINY[name]
    family = families.get(name)
    shapes = layer_shapes.layer_shapes(name, cfg)
    assert shapes == expected
    # Every quantizable linear of the real (built) model has one of these GEMM shapes, and each shape is used;
    # Ideogram 4's w1 and w3 run as the one fused w1|w3 GEMM.
    built = set()
    for path, linear in linears(family.build(cfg), quantizable_only=True).items():
        k, n = linear.kernel.shape
        if name == "ideogram4" and path.endswith(("feed_forward.w1", "feed_forward.w3")):
            n = 2 * cfg.intermediate_size
        built.add((n, k))
    assert built == set(shapes.values())


def test_scanned_ideogram4_layout_gives_the_list_layout_shapes():
    cfg, expected = TINY["ideogram4"]
    assert layer_shapes.layer_shapes("ideogram4", dataclasses.replace(cfg, scan_layers=True)) == expected


def test_unknown_family_preset_label_or_config_raise_naming_it():
    with pytest.raises(ValueError, match="unknown model family 'sd3'"):
        layer_shapes.layer_shapes("sd3")
    with pytest.raises(ValueError, match=r"unknown flux preset 'FLUX.1-dev' \(known: FLUX.1-schnell\)"):
        layer_shapes.layer_shapes("flux", "FLUX.1-dev")
    with pytest.raises(ValueError, match=r"unknown preset label\(s\) \['sd3'\]"):
        layer_shapes.preset_layer_shapes("flux1", "sd3")
    with pytest.raises(ValueError, match="flux: a preset name or a FluxConfig, not PixArtConfig"):
        layer_shapes.layer_shapes("flux", TINY["pixart"][0])


def test_a_quantizable_linear_without_a_role_raises(monkeypatch):
    roles = {k: v for k, v in layer_shapes.ROLES["flux"].items() if not k.endswith("proj_out")}
    monkeypatch.setitem(layer_shapes.ROLES, "flux", roles)
    cfg = TINY["flux"][0]
    with pytest.raises(ValueError, match=r"single_transformer_blocks\.0\.proj_out .* has no role"):
        layer_shapes.layer_shapes("flux", dataclasses.replace(cfg, num_single_layers=2))


"""The conversion engine: safetensors I/O, key tables, named transforms, clear errors, orbax round trip."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models import convert, families, pixart
from models.convert import CheckpointError, ConversionError, KeyTable, linear_rules, rule

TINY = pixart.PixArtConfig(num_attention_heads=2, attention_head_dim=8, in_channels=3, out_channels=None,
                           num_layers=2, cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=6,
                           use_additional_conditions=False)


def _tiny_checkpoint(tmp_path, max_shard_bytes=None):
    model = families.PIXART.build(TINY, seed=1)
    families.PIXART.to_diffusers(model, tmp_path, max_shard_bytes=max_shard_bytes)
    return model


def test_safetensors_round_trip_all_dtypes(tmp_path):
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64),
               "c": np.linspace(-2, 2, 6).astype(ml_dtypes.bfloat16), "d": np.ones((2, 1, 3), np.float16),
               "e": np.zeros((0, 4), np.float32)}
    convert.write_safetensors(tmp_path / "x.safetensors", tensors)
    back = convert.read_safetensors(tmp_path / "x.safetensors")
    assert sorted(back) == sorted(tensors)
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        assert np.array_equal(back[key].view(np.uint8), value.view(np.uint8))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_safetensors_readable_by_the_reference_library(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {"w": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)}
    convert.write_safetensors(tmp_path / "x.safetensors", tensors)
    np.testing.assert_array_equal(safetensors_numpy.load_file(tmp_path / "x.safetensors")["w"], tensors["w"])
    safetensors_numpy.save_file({"v": np.ones(3, np.float16)}, tmp_path / "y.safetensors")
    np.testing.assert_array_equal(convert.read_safetensors(tmp_path / "y.safetensors")["v"], np.ones(3, np.float16))


def test_truncated_file_names_the_file(tmp_path):
    _tiny_checkpoint(tmp_path)
    path = tmp_path / convert.WEIGHTS_NAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors.*truncated"):
        families.PIXART.from_diffusers(tmp_path)
    path.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors"):
        families.PIXART.from_diffusers(tmp_path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(CheckpointError, match="corrupt"):
        families.PIXART.from_diffusers(tmp_path)


def test_truncated_shard_names_the_shard(tmp_path):
    _tiny_checkpoint(tmp_path, max_shard_bytes=2048)
    shards = sorted(tmp_path.glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) > 2
    victim = shards[1]
    victim.write_bytes(victim.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=victim.name):
        families.PIXART.from_diffusers(tmp_path)


def test_a_shard_holding_tensors_its_index_puts_elsewhere_is_refused(tmp_path):
    """A shard may hold only what the index assigns to it: a tensor also held by a later shard replaced the listed one
    silently (the shards were read in sorted order)."""
    _tiny_checkpoint(tmp_path, max_shard_bytes=2048)
    index = json.loads((tmp_path / convert.WEIGHTS_INDEX_NAME).read_text())["weight_map"]
    key, home = sorted(index.items())[0]
    other = next(s for s in sorted(set(index.values())) if s != home)
    tensors = dict(convert.read_safetensors(tmp_path / other))
    tensors[key] = np.full_like(convert.read_safetensors(tmp_path / home)[key], 7.0)
    convert.write_safetensors(tmp_path / other, tensors)
    with pytest.raises(CheckpointError, match=f"{other}: holds tensors \\['{key}'\\] that .* does not assign"):
        families.PIXART.from_diffusers(tmp_path)
    (tmp_path / convert.WEIGHTS_INDEX_NAME).write_text(json.dumps({"weight_map": []}))
    with pytest.raises(CheckpointError, match="corrupt index \\(weight_map must map"):
        families.PIXART.from_diffusers(tmp_path)


def test_a_header_entry_without_offsets_names_the_file(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [1]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(CheckpointError, match="x.safetensors: corrupt safetensors header \\(an entry without"):
        convert.read_safetensors(path)


def test_config_values_of_another_kind_are_refused_naming_the_key():
    """``"num_layers": "2"`` failed in Python's own TypeError naming neither key nor file; an integral float where an
    integer is due (a theta written as 5000000.0) is taken as that integer."""
    cfg = pixart.PixArtConfig(num_layers=2)
    config = convert.dataclass_to_config(cfg, "PixArtTransformer2DModel")
    with pytest.raises(ValueError, match="num_layers='2' \\(expected an integer\\); norm_eps='1e-6' \\(expected a"):
        families.PIXART.config_from_diffusers(dict(config, num_layers="2", norm_eps="1e-6"))
    assert families.PIXART.config_from_diffusers(dict(config, num_layers=2.0)).num_layers == 2


def test_an_integer_weight_is_refused_naming_the_key(tmp_path):
    _tiny_checkpoint(tmp_path)
    config, state = convert.read_diffusers_dir(tmp_path)
    state = dict(state)
    state["proj_out.weight"] = state["proj_out.weight"].astype(np.int32)
    convert.write_diffusers_dir(tmp_path, config, state)
    with pytest.raises(ConversionError, match="proj_out.weight: gives .* of dtype int32"):
        families.PIXART.from_diffusers(tmp_path)


def test_missing_unexpected_and_misshaped_keys_reported_together(tmp_path):
    _tiny_checkpoint(tmp_path)
    config, state = convert.read_diffusers_dir(tmp_path)
    state = dict(state)
    del state["transformer_blocks.1.attn2.to_k.weight"]
    del state["proj_out.bias"]
    state["transformer_blocks.0.attn1.extra.weight"] = np.zeros((3, 3), np.float32)
    state["transformer_blocks.0.ff.net.2.weight"] = np.zeros((16, 7), np.float32)
    convert.write_diffusers_dir(tmp_path, config, state)
    with pytest.raises(ConversionError) as info:
        families.PIXART.from_diffusers(tmp_path)
    message = str(info.value)
    assert "2 missing, 1 unexpected, 1 mis-shaped" in message
    assert "transformer_blocks.1.attn2.to_k.weight" in message and "proj_out.bias" in message
    assert "transformer_blocks.0.attn1.extra.weight" in message
    assert "transformer_blocks.0.ff.net.2.weight" in message and "(7, 16)" in message
    assert sorted(info.value.missing)[0].startswith("proj_out.bias")


def test_config_mismatch_is_a_shape_error(tmp_path):
    _tiny_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"transformer_blocks\.2\.attn1\.to_q\.weight"):
        families.PIXART.from_diffusers(tmp_path)


def test_rewriting_a_directory_removes_the_other_layout(tmp_path):
    model = _tiny_checkpoint(tmp_path, max_shard_bytes=2048)
    families.PIXART.to_diffusers(model, tmp_path)  # single file over a sharded export
    assert not (tmp_path / convert.WEIGHTS_INDEX_NAME).exists()
    assert not list(tmp_path.glob("diffusion_pytorch_model-*"))
    families.PIXART.to_diffusers(model, tmp_path, max_shard_bytes=4096)  # and back
    assert not (tmp_path / convert.WEIGHTS_NAME).exists()
    _, reloaded = families.PIXART.from_diffusers(tmp_path)
    np.testing.assert_array_equal(np.asarray(reloaded.proj_out.kernel[...]), np.asarray(model.proj_out.kernel[...]))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        convert.read_diffusers_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="neither"):
        convert.read_diffusers_dir(tmp_path)


def test_fuse_and_split_transforms_round_trip():
    rng = np.random.default_rng(0)
    source = {f"b.{i}.{n}.weight": rng.standard_normal((4, 6)).astype(np.float32) for i in range(2) for n in "qkv"}
    source.update({f"b.{i}.qkv.weight": rng.standard_normal((12, 6)).astype(np.float32) for i in range(2)})
    source.update({f"b.{i}.qkv.bias": rng.standard_normal(12).astype(np.float32) for i in range(2)})
    table = KeyTable([
        rule(("b.{i}.q.weight", "b.{i}.k.weight", "b.{i}.v.weight"), "f.{i}.qkv.kernel", "fuse_linear"),
        rule("b.{i}.qkv.weight", ("s.{i}.q.kernel", "s.{i}.k.kernel", "s.{i}.v.kernel"), "split_linear"),
        rule("b.{i}.qkv.bias", ("s.{i}.q.bias", "s.{i}.k.bias", "s.{i}.v.bias"), "split_bias"),
    ])
    shapes = {f"f.{i}.qkv.kernel": (6, 12) for i in range(2)}
    shapes.update({f"s.{i}.{n}.kernel": (6, 4) for i in range(2) for n in "qkv"})
    shapes.update({f"s.{i}.{n}.bias": (4,) for i in range(2) for n in "qkv"})
    flax_state = table.to_flax(source, shapes)
    np.testing.assert_array_equal(flax_state["f.1.qkv.kernel"][:, 4:8], source["b.1.k.weight"].T)
    np.testing.assert_array_equal(flax_state["s.0.v.kernel"], source["b.0.qkv.weight"][8:].T)
    back = table.to_diffusers(flax_state)
    assert sorted(back) == sorted(source)
    for key in source:
        np.testing.assert_array_equal(back[key], source[key])
    partial = {k: v for k, v in source.items() if k != "b.1.k.weight"}
    with pytest.raises(ConversionError, match=r"b\.1\.k\.weight"):
        table.to_flax(partial, shapes)


def test_conv_layouts_round_trip():
    rng = np.random.default_rng(1)
    source = {"c.weight": rng.standard_normal((8, 3, 2, 2)).astype(np.float32),
              "p.weight": rng.standard_normal((8, 5, 1, 1)).astype(np.float32),
              "dw.weight": rng.standard_normal((6, 1, 3, 3)).astype(np.float32)}
    table = KeyTable([rule("c.weight", "c.kernel", "conv"), *linear_rules("p", bias=False, transform="conv1x1"),
                      rule("dw.weight", "dw.kernel", "conv")])
    state = table.to_flax(source, {"c.kernel": (2, 2, 3, 8), "p.kernel": (5, 8), "dw.kernel": (3, 3, 1, 6)})
    np.testing.assert_array_equal(state["c.kernel"][1, 0, 2], source["c.weight"][:, 2, 1, 0])
    back = table.to_diffusers(state)
    for key in source:
        np.testing.assert_array_equal(back[key], source[key])


def test_key_rule_validation():
    with pytest.raises(ValueError, match="unknown transform"):
        rule("a", "b", "no_such_transform")
    with pytest.raises(ValueError, match="same placeholders"):
        rule("a.{i}.w", "b.{j}.w")
    with pytest.raises(ValueError, match="unsupported dtype"):
        convert.resolve_dtype("int4")


def test_dtype_choice(tmp_path):
    _tiny_checkpoint(tmp_path)
    for name, dtype in (("fp16", jnp.float16), ("bfloat16", jnp.bfloat16), ("float32", jnp.float32)):
        _, model = families.PIXART.from_diffusers(tmp_path, dtype=name)
        assert model.proj_out.kernel[...].dtype == dtype
        assert model.transformer_blocks[1].scale_shift_table[...].dtype == dtype


def test_orbax_save_load_round_trip_and_atomic_replace(tmp_path):
    model = _tiny_checkpoint(tmp_path / "hf")
    params = {k: np.asarray(v) for k, v in convert.flat_state_dict(model).items()}
    target = tmp_path / "ckpt"
    convert.save_flax_state(target, params, TINY.to_diffusers_config())
    convert.save_flax_state(target, params, TINY.to_diffusers_config())  # replaces a whole checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]
    config, loaded = convert.load_flax_state(target)
    assert pixart.PixArtConfig.from_diffusers_config(config) == TINY
    assert sorted(loaded) == sorted(params)
    for key in params:
        np.testing.assert_array_equal(loaded[key], params[key])
    rebuilt = convert.merge_flat_state(lambda: families.PIXART.construct(TINY), loaded)
    x, context, t = jnp.ones((1, 3, 8, 8)), jnp.ones((1, 3, 6)), jnp.array([7.0])
    np.testing.assert_array_equal(np.asarray(rebuilt(x, context, t)), np.asarray(model(x, context, t)))
    with pytest.raises(CheckpointError, match="not a complete"):
        convert.load_flax_state(tmp_path / "hf")


def test_merge_flat_state_reports_bad_keys():
    model = families.PIXART.build(TINY)
    params = {k: np.asarray(v) for k, v in convert.flat_state_dict(model).items()}
    params.pop("proj_out.bias")
    params["proj_out.kernel"] = np.zeros((3, 3), np.float32)
    params["nonsense"] = np.zeros(1, np.float32)
    with pytest.raises(ConversionError, match=r"proj_out\.bias[\s\S]*nonsense[\s\S]*proj_out\.kernel"):
        convert.merge_flat_state(lambda: families.PIXART.construct(TINY), params)


def test_written_files_are_world_readable(tmp_path):
    """Atomic writers create 0600 temporaries; the published files must get the usual 0644."""
    import stat

    from kroquant_jax.fileio import atomic_write_bytes
    from models.convert import write_safetensors

    write_safetensors(tmp_path / "w.safetensors", {"a": np.ones((2, 3), np.float32)})
    atomic_write_bytes(str(tmp_path / "x.bin"), b"abc")
    for name in ("w.safetensors", "x.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name

"""The ``shared_input`` fused sites of PixArt-Σ and SANA (models.layers.Attention): q | k | v of the self-attention
and k | v of the cross-attention as one linear each, their output split among the members; the sites agree with the
families' declared shared-input groups; entries that name no site raise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import families
from models.layers import FusedLinearHooks, linears
from tests.test_families import TINY


def _inputs(cfg):
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (2, cfg.in_channels, cfg.sample_size, cfg.sample_size), jnp.float32)
    context = jax.random.normal(keys[1], (2, 3, cfg.caption_channels), jnp.float32)
    mask = jnp.asarray([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    return x, context, jnp.asarray([500.0, 20.0]), mask


def _dense_entry(members):
    """One shared_input entry computing the members' own dense projections at once (their outputs concatenated)."""
    return lambda x: jnp.concatenate([m.dense(x) for m in members], axis=-1)


@pytest.mark.parametrize("name", ["pixart", "sana"])
def test_fused_q_k_v_and_k_v_reproduce_the_model_exactly(name):
    family = families.get(name)
    model = family.build(TINY[name], seed=3)
    _, _, sites = model.fused_sites()
    # the model's sites are the family's declared shared-input groups (one home for which linears share an input)
    assert sorted(sites.values()) == sorted(family.shared_inputs(model))
    by_path = linears(model)
    hooks = FusedLinearHooks(shared_input={first: _dense_entry([by_path[p] for p in members])
                                           for first, members in sites.items()})
    x, context, t, mask = _inputs(TINY[name])
    reference = model(x, context, t, encoder_attention_mask=mask)
    np.testing.assert_allclose(np.asarray(model(x, context, t, encoder_attention_mask=mask, hooks=hooks)),
                               np.asarray(reference), rtol=1e-6, atol=1e-6)
    # an entry whose output is permuted (k | v swapped) is not silently right
    kv = next(first for first, members in sites.items() if len(members) == 2)
    swapped = FusedLinearHooks(shared_input={kv: lambda y: jnp.roll(_dense_entry(
        [by_path[p] for p in sites[kv]])(y), by_path[kv].out_features, axis=-1)})
    assert not np.allclose(np.asarray(model(x, context, t, encoder_attention_mask=mask, hooks=swapped)),
                           np.asarray(reference), atol=1e-4)


def test_entries_that_name_no_site_or_replace_a_linear_twice_raise():
    model = families.PIXART.build(TINY["pixart"], seed=3)
    x, context, t, mask = _inputs(TINY["pixart"])
    f = lambda y: y  # noqa: E731
    prefix = "transformer_blocks.0"
    bad = [({f"{prefix}.attn2.to_q": f}, "names no shared_input site"),  # q reads the image, k / v the caption
           ({f"{prefix}.attn1.to_k": f}, "names no shared_input site"),
           ({f"{prefix}.attn1.to_q.typo": f}, "to_q.typo")]
    for table, message in bad:
        with pytest.raises(ValueError, match=message):
            model(x, context, t, encoder_attention_mask=mask, hooks=FusedLinearHooks(shared_input=table))
    with pytest.raises(ValueError, match="also have per-linear overrides"):
        model(x, context, t, encoder_attention_mask=mask, hooks=FusedLinearHooks(
            {f"{prefix}.attn1.to_v": f}, shared_input={f"{prefix}.attn1.to_q": f}))
    wrong_width = FusedLinearHooks(shared_input={f"{prefix}.attn1.to_q": f})  # dim wide, not 3 x inner
    with pytest.raises(ValueError, match=f"shared_input entry {prefix}.attn1.to_q: returned shape"):
        model(x, context, t, encoder_attention_mask=mask, hooks=wrong_width)


@pytest.mark.parametrize("strategy", ["simulate", "dequant", "fp8_mgpu"])
def test_split_overrides_of_a_fused_layer_compile_to_one_forward(strategy):
    """A fused layer's members served as per-linear slices (models.quantize_model.split_qlinear_overrides, the path
    of a fused quantized checkpoint in a model without that fused site): XLA merges the members' identical calls, so
    the program of all three members has the GEMMs and kernels of one (checked on the H200 too:
    benchmarks/results/split_overrides_cse_2026-12-04.json), also when the overrides are an argument of the program
    (SharedOverrides holds the layer once; a dict of per-member Partials would not merge)."""
    import functools

    from kroquant_jax.qlinear import random_qlinear
    from models.quantize_model import split_qlinear_overrides
    from pallas_kernels import served as S

    layer = random_qlinear(jax.random.normal(jax.random.key(0), (3 * 64, 64)) / 8, jax.random.key(1), 32)
    x = jax.random.normal(jax.random.key(2), (32, 64)).astype(jnp.bfloat16)
    if strategy == "simulate":
        overrides = split_qlinear_overrides(layer, ["a", "b", "c"])
    else:
        options = S.ServeOptions(strategy=strategy, impl="reference")
        overrides = split_qlinear_overrides(S.serve(layer, strategy=strategy), ["a", "b", "c"],
                                            functools.partial(lambda l, y, o: S.forward(l, y, options=o), o=options))

    def ops(keys, passed=None):
        if passed is None:  # the overrides closed over: the layer's arrays are constants of the program
            text = jax.jit(lambda y: [overrides[k](y) for k in keys]).lower(x).compile().as_text()
        else:  # an argument of the program, as the samplers take params["overrides"]
            text = jax.jit(lambda o, y: [o[k](y) for k in keys]).lower(passed, x).compile().as_text()
        return text.count(" dot("), text.count("custom-call(")

    assert ops("a")[0] > 0 and ops("abc") == ops("a")
    assert ops("abc", overrides) == ops("a", overrides) == ops("a")  # the layer is one set of traced arguments
    assert len(jax.tree_util.tree_leaves(overrides)) == len(jax.tree_util.tree_leaves(overrides["a"]))
    # a plain dict of the members' overrides hands the program one copy of the layer per member: no merging
    assert ops("abc", {k: overrides[k] for k in "abc"})[0] == 3 * ops("a")[0]
    full = overrides["a"].func.keywords["forward"](overrides["a"].args[0], x)  # the whole fused output
    np.testing.assert_array_equal(np.concatenate([np.asarray(overrides[k](x)) for k in "abc"], -1), np.asarray(full))


def test_split_overrides_take_unequal_widths_and_refuse_ones_that_do_not_add_up():
    """A fused output of unequal members (FLUX.1's q | k | v | proj_mlp) splits at the members' own widths; widths
    that do not add up to the layer's outputs raise instead of slicing the wrong rows."""
    from kroquant_jax.qlinear import random_qlinear
    from models.quantize_model import split_qlinear_overrides

    layer = random_qlinear(jax.random.normal(jax.random.key(0), (32 + 32 + 64, 64)) / 8, jax.random.key(1), 32)
    x = jax.random.normal(jax.random.key(2), (8, 64)).astype(jnp.bfloat16)
    overrides = split_qlinear_overrides(layer, ["q", "k", "mlp"], widths=[32, 32, 64])
    assert [overrides[k](x).shape[-1] for k in ("q", "k", "mlp")] == [32, 32, 64]
    full = overrides["q"].func.keywords["forward"](overrides["q"].args[0], x)
    np.testing.assert_array_equal(np.asarray(overrides["mlp"](x)), np.asarray(full[..., 64:]))
    for widths in ([32, 32, 32], [64, 32], [0, 64, 64]):
        with pytest.raises(ValueError, match="do not split out_features=128"):
            split_qlinear_overrides(layer, ["q", "k", "mlp"][:len(widths)], widths=widths)


def test_a_fused_checkpoint_hands_the_sampler_each_layer_once():
    """QuantizedCheckpoint.overrides / served_overrides of a fused layer q|k|v: three linears routed, one copy of the
    layer's arrays in the pytree the sampler takes as params["overrides"]."""
    import dataclasses

    from kroquant_jax.qlinear import random_qlinear
    from kroquant_jax.shared_inputs import fused_name
    from models.quantized_checkpoint import QuantizedCheckpoint
    from pallas_kernels import served as S

    family = families.get("pixart")
    cfg = dataclasses.replace(TINY["pixart"], attention_head_dim=16, cross_attention_dim=32)  # d = 32: one block
    model = family.build(cfg, seed=3)
    group = family.shared_inputs(model)[0]
    by_path = linears(model)
    w = jnp.concatenate([by_path[p].kernel[...].T for p in group]).astype(jnp.float32)  # (3 o, d)
    layer = random_qlinear(w, jax.random.key(0), 32)
    checkpoint = QuantizedCheckpoint(family="pixart", cfg=cfg, model=model,
                                     qlayers={fused_name(group): layer}, config={})
    prepared = S.serve(layer, strategy="dequant")
    for overrides, one in ((checkpoint.overrides(), None),
                           (checkpoint.served_overrides(S.ServeOptions(strategy="dequant", impl="reference")),
                            prepared)):
        assert sorted(overrides) == sorted(group) and len(overrides.layers) == 1
        leaves = jax.tree_util.tree_leaves(overrides)
        assert len(leaves) == len(jax.tree_util.tree_leaves(overrides[group[0]]))
        if one is not None:
            assert len(leaves) == len(jax.tree_util.tree_leaves(one))


def test_hooks_keep_shared_overrides_as_they_are():
    """LinearHooks / FusedLinearHooks keep a SharedOverrides (not a dict of its Partials): their entries, the pytree a
    stacked forward takes as an argument, hold a fused layer once."""
    from models.layers import LinearHooks
    from models.quantize_model import SharedOverrides, split_qlinear_overrides, whole_layer_overrides

    layer = _random_qlinear_small()
    plain = _random_qlinear_small(seed=5, rows=64)
    overrides = SharedOverrides.merged(split_qlinear_overrides(layer, ["a", "b", "c"]),
                                       whole_layer_overrides(plain, "d"))
    assert sorted(overrides) == ["a", "b", "c", "d"] and sorted(overrides.layers) == ["a|b|c", "d"]
    assert LinearHooks(overrides).overrides is overrides
    entries = FusedLinearHooks(overrides).entries()
    assert entries["overrides"] is overrides
    assert len(jax.tree_util.tree_leaves(entries["overrides"])) == (len(jax.tree_util.tree_leaves(overrides["a"]))
                                                                    + len(jax.tree_util.tree_leaves(overrides["d"])))
    assert isinstance(FusedLinearHooks.from_entries(entries).overrides, SharedOverrides)
    with pytest.raises(ValueError, match=r"\['d'\] given twice"):
        SharedOverrides.merged(overrides, whole_layer_overrides(plain, "d"))


def _random_qlinear_small(seed: int = 0, rows: int = 3 * 64):
    from kroquant_jax.qlinear import random_qlinear

    return random_qlinear(jax.random.normal(jax.random.key(seed), (rows, 64)) / 8, jax.random.key(seed + 1), 32)


def test_scanned_blocks_run_a_fused_layer_once_per_block():
    """run_blocks_scanned (QAD's scan of the blocks) takes a SharedOverrides and keeps it one: each step
    gets the block's fused q|k|v once, so the scanned program has the GEMMs of one member's call for all three; the
    output equals the Python loop's. A fused layer whose members span two blocks, or blocks routed through layers of
    different structures, are refused."""
    import dataclasses

    from kroquant_jax.qlinear import random_qlinear
    from models.layers import LinearHooks, SharedOverrides, run_blocks_scanned
    from models.quantize_model import split_qlinear_overrides, whole_layer_overrides

    cfg = dataclasses.replace(TINY["pixart"], num_layers=2, attention_head_dim=16,
                              cross_attention_dim=32)  # width 32: one transform block
    model = families.PIXART.build(cfg, seed=0)
    blocks, dim = list(model.transformer_blocks), cfg.inner_dim
    x = jax.random.normal(jax.random.key(1), (1, 4, dim))

    def fused(i):
        layer = random_qlinear(jax.random.normal(jax.random.key(10 + i), (3 * dim, dim)) / 8, jax.random.key(i), 32)
        return split_qlinear_overrides(layer, [f"transformer_blocks.{i}.attn1.to_{p}" for p in "qkv"])

    shared = SharedOverrides.merged(fused(0), fused(1))

    def self_attention(block, h, hooks):  # the block's q|k|v members, each through its override
        return block.attn1.to_q(h, hooks) + block.attn1.to_k(h, hooks) + block.attn1.to_v(h, hooks)

    def scanned(overrides, h):
        return run_blocks_scanned(blocks, h, LinearHooks(overrides), self_attention)

    def looped(overrides, h):
        for block in blocks:
            h = self_attention(block, h, LinearHooks(overrides))
        return h

    np.testing.assert_allclose(np.asarray(scanned(shared, x)), np.asarray(looped(shared, x)), rtol=1e-5, atol=1e-5)

    def dots(members):  # GEMMs in the scanned program when each block calls these members of its q|k|v
        def run(overrides, h):
            return run_blocks_scanned(blocks, h, LinearHooks(overrides),
                                      lambda block, y, hooks: sum(getattr(block.attn1, f"to_{p}")(y, hooks)
                                                                  for p in members))
        return jax.jit(run).lower(shared, x).compile().as_text().count(" dot(")

    assert dots("qkv") == dots("q") > 0  # three members, one forward of the fused layer

    spanning = split_qlinear_overrides(random_qlinear(jnp.ones((2 * dim, dim)) / 8, jax.random.key(3), 32),
                                       ["transformer_blocks.0.attn1.to_q", "transformer_blocks.1.attn1.to_q"])
    with pytest.raises(ValueError, match=r"also serves \['transformer_blocks.1.attn1.to_q'\], outside block 0"):
        scanned(spanning, x)
    separate = [whole_layer_overrides(random_qlinear(jnp.ones((dim, dim)) / 8, jax.random.key(4), 32),
                                      f"transformer_blocks.1.attn1.to_{p}") for p in "qkv"]
    uneven = SharedOverrides.merged(fused(0), *separate)  # block 0 fused, block 1 one layer per linear
    with pytest.raises(ValueError, match="block 1 routes .* through layers of another structure"):
        scanned(uneven, x)

"""models/ideogram4_serving.py: the analytic FLOP count of a forward and the random states built on the device."""

import jax
import numpy as np
from flax import nnx

from models import ideogram4 as ig
from models import ideogram4_serving as serving


def test_forward_flops_match_the_roofline_figures():
    flops = serving.forward_flops(ig.IDEOGRAM4, 6144, 6144)
    # ~106 TFLOP in linears (incl. the text projection) + ~24 TFLOP attention at 6144 tokens.
    assert 105e12 < flops["linears"] + flops["text_projection"] < 112e12
    assert 23e12 < flops["attention"] < 24.5e12
    assert flops["total"] == flops["linears"] + flops["text_projection"] + flops["attention"]
    cached = serving.forward_flops(ig.IDEOGRAM4, 6144, 0)
    assert cached["text_projection"] == 0 and cached["linears"] == flops["linears"]


def test_random_states_differ_per_seed_and_merge_into_the_model():
    cfg = ig.tiny_config()
    graphdef, (a, b), seconds = serving.random_states(cfg, (0, 1))
    assert seconds > 0
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b) and any(not np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))
    assert isinstance(nnx.merge(graphdef, a), ig.Ideogram4Transformer)

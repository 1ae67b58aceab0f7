"""The synthetic DiT-like benchmark: the expected ordering KroQuant < Hadamard-32 < RTN, and LoRaQ helps each."""

import jax.numpy as jnp
import numpy as np
import pytest

from kroquant_jax import calibrate, lowrank, qlinear, synthetic, transforms


def test_generator_is_deterministic_and_dit_like():
    a1 = synthetic.synthetic_layer("blk.0.q", 64, 128, 500, seed=3)
    a2 = synthetic.synthetic_layer("blk.0.q", 64, 128, 500, seed=3)
    np.testing.assert_array_equal(a1.activations, a2.activations)
    act = a1.activations
    channel_max = np.abs(act).max(0)
    assert np.sort(channel_max)[-1] > 8 * np.median(channel_max)  # a few large-magnitude channels
    token_norm = np.linalg.norm(act, axis=1)
    assert token_norm.max() > 4 * np.median(token_norm)  # heavy-tailed tokens
    s = np.linalg.svd(a1.weight, compute_uv=False)
    assert s[0] > 5 * s[len(s) // 2]  # decaying spectrum
    shapes = synthetic.pixart_sigma_shapes(num_blocks=2)
    assert len(shapes) == 20 and shapes["transformer_blocks.1.ff.net.0.proj"] == (4608, 1152)
    assert shapes["transformer_blocks.0.attn2.to_k"] == (1152, 1152)


@pytest.mark.slow
def test_ordering_kroquant_hadamard_rtn_and_loraq_helps_each():
    ls = synthetic.synthetic_layer_set({"blk.0.attn": (256, 256), "blk.0.ff": (256, 256)}, n=1536)
    cal = calibrate.CalibrationConfig(steps=40)
    run = calibrate.RunConfig()
    lq_cfg = lowrank.LoRaQConfig(rank=32, steps=60, rotation_steps=20)
    errors = {}
    for method in ("identity", "hadamard32", "kron_lu"):
        res = calibrate.calibrate_layers(ls, calibrate.CalibrationConfig(**{**cal.__dict__, "transform": method}),
                                         run=run)
        p = transforms.get(method)
        w_t = {n: np.asarray(transforms.apply_to_weights(jnp.asarray(ls[n].weight), p.inverse_blocks(r.params)))
               for n, r in res.items()}
        branches = lowrank.loraq_layers(w_t, lq_cfg)
        for n, layer in ls.items():
            a_held = calibrate.layer_rows(n, layer, run).test
            ref = a_held @ layer.weight.T
            for with_lr in (False, True):
                lr = (branches[n].left, branches[n].right) if with_lr else None
                q = qlinear.build_qlinear(layer.weight, None, transform=method, transform_params=res[n].params,
                                          lowrank=lr)
                y = np.asarray(qlinear.qlinear_forward(q, jnp.asarray(a_held)))
                errors[(method, with_lr, n)] = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    for n in ls:
        rtn, had, kro = (errors[(m, False, n)] for m in ("identity", "hadamard32", "kron_lu"))
        assert kro < had < rtn, (n, kro, had, rtn)
        for m in ("identity", "hadamard32", "kron_lu"):
            assert errors[(m, True, n)] < errors[(m, False, n)], (n, m)

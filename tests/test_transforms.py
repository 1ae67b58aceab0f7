"""Block-transform parameterizations: inverses, determinants, Hadamard init, Kronecker order, layer invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from kroquant_jax import transforms as T
from kroquant_jax.transforms import kron_lu


def _perturbed(p, d, key, scale=0.3):
    """Random (non-initial) parameters of the same structure; keeps Kronecker-LU's `a` away from zero.

    Dense GL(32) blocks get a smaller perturbation of their (entries ~0.18) Hadamard init to stay well conditioned."""
    params = p.init(d)
    if p.name == "dense32":
        scale = 0.02
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    noisy = [leaf + scale * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, noisy)


ALL = sorted(T.REGISTRY)


@pytest.mark.parametrize("name", ALL)
def test_blocks_times_inverse_is_identity(name):
    p = T.get(name)
    d = 64
    params = _perturbed(p, d, jax.random.key(0))
    b, bi = p.blocks(params), p.inverse_blocks(params)
    nb, n, _ = b.shape
    assert nb * n == d and bi.shape == b.shape
    eye = np.broadcast_to(np.eye(n), b.shape)
    np.testing.assert_allclose(np.asarray(jnp.einsum("bij,bjk->bik", b, bi, precision="highest")), eye, atol=2e-5)


@pytest.mark.parametrize("name", ALL)
def test_layer_output_invariant(name):
    """(A T)(W T^{-T})^T = A W^T for every parameterization, with random parameters."""
    p = T.get(name)
    d = 128
    params = _perturbed(p, d, jax.random.key(1))
    a = jax.random.normal(jax.random.key(2), (9, d))
    w = jax.random.normal(jax.random.key(3), (17, d))
    at = T.apply_to_activations(a, p.blocks(params))
    wt = T.apply_to_weights(w, p.inverse_blocks(params))
    ref = np.asarray(a, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(at @ wt.T, np.float64)
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-5
    # and the dense matrix agrees with the blockwise application
    dense = np.asarray(T.dense_matrix(p.blocks(params)))
    np.testing.assert_allclose(np.asarray(at), np.asarray(a) @ dense, rtol=1e-4, atol=1e-4)


def test_kron_lu_unit_determinant():
    params = _perturbed(T.KRON_LU, 256, jax.random.key(4), scale=0.5)
    for g in np.asarray(kron_lu.lu_factors(params["a"], params["b"], params["c"])).reshape(-1, 2, 2):
        assert abs(np.linalg.det(g) + 1.0) < 1e-5  # det G_k = -1 exactly by construction
    sign, logdet = np.linalg.slogdet(np.asarray(T.KRON_LU.blocks(params), np.float64))
    np.testing.assert_allclose(np.abs(sign * np.exp(logdet)), 1.0, atol=1e-4)


def test_hadamard_init_equals_scipy():
    h = scipy.linalg.hadamard(32) / np.sqrt(32)
    for name in ("kron_lu", "smoothed_kron", "kron_lu_shared", "dense32", "cayley32", "hadamard32"):
        p = T.get(name)
        np.testing.assert_allclose(np.asarray(p.blocks(p.init(96))), np.broadcast_to(h, (3, 32, 32)), atol=1e-6,
                                   err_msg=name)


def test_kronecker_order_and_bit_index_formula():
    rng = np.random.default_rng(0)
    a, b, c = (rng.normal(size=5) + 1.5), rng.normal(size=5), rng.normal(size=5)
    g = [np.array([[1, 0], [c[k], 1]]) @ np.array([[a[k], b[k]], [0, -1 / a[k]]]) for k in range(5)]
    ref_kron = g[0]
    for gk in g[1:]:
        ref_kron = np.kron(ref_kron, gk)
    # Appendix B: K[r, c] = prod_k G_k[bit_{5-k}(r), bit_{5-k}(c)], G_1 on the most significant bit.
    idx = np.arange(32)
    bit_formula = np.ones((32, 32))
    for k in range(1, 6):
        shift = 5 - k
        bit_formula *= g[k - 1][(idx[:, None] >> shift) & 1, (idx[None, :] >> shift) & 1]
    np.testing.assert_allclose(bit_formula, ref_kron, rtol=1e-12)
    ours = np.asarray(T.KRON_LU.blocks({"a": jnp.asarray(a[None], jnp.float32), "b": jnp.asarray(b[None], jnp.float32),
                                        "c": jnp.asarray(c[None], jnp.float32)}))[0]
    np.testing.assert_allclose(ours, ref_kron, rtol=1e-4, atol=1e-5)
    # a reversed chain is a different matrix: the test above would catch a wrong order
    rev = g[4]
    for gk in g[3::-1]:
        rev = np.kron(rev, gk)
    assert np.max(np.abs(rev - ref_kron)) > 1e-2


def test_parameter_counts():
    for d in (1152, 4608, 3072):
        n = T.KRON_LU.num_params(d)
        assert n == 15 * d // 32 < d / 2
        leaves = jax.tree_util.tree_leaves(T.KRON_LU.init(d))
        assert sum(x.size for x in leaves) == n
        assert T.SMOOTHED_KRON.num_params(d) == n + d
        assert T.HADAMARD32.num_params(d) == 0 and T.DIAGONAL.num_params(d) == d


def test_bad_widths_raise_clear_errors():
    with pytest.raises(ValueError, match=r"kron_lu: d=100 must be a positive multiple of block=32"):
        T.KRON_LU.init(100)
    with pytest.raises(ValueError, match=r"d=1152"):
        T.FWHT.init(1152)
    with pytest.raises(ValueError, match=r"do not match a transform of width 64"):
        T.apply_to_activations(jnp.ones((2, 96)), T.HADAMARD32.blocks(T.HADAMARD32.init(64)))
    with pytest.raises(KeyError, match="unknown transform"):
        T.get("nope")


def test_fwht_matches_sylvester_and_is_orthogonal():
    p = T.FWHT
    b = np.asarray(p.blocks(p.init(256)))[0]
    np.testing.assert_allclose(b, scipy.linalg.hadamard(256) / 16.0, atol=1e-7)


def test_stacked_params_vmap():
    """Layers of one width stack along a leading axis; blocks() vmaps over it (the calibration engine's layout)."""
    params = jax.vmap(lambda k: _perturbed(T.KRON_LU, 64, k))(jax.random.split(jax.random.key(5), 3))
    stacked = jax.vmap(T.KRON_LU.blocks)(params)
    assert stacked.shape == (3, 2, 32, 32)
    single = T.KRON_LU.blocks(jax.tree_util.tree_map(lambda x: x[1], params))
    np.testing.assert_allclose(np.asarray(stacked[1]), np.asarray(single), rtol=1e-6)
    fixed = jax.vmap(lambda _: T.HADAMARD32.blocks(T.HADAMARD32.init(64)))(jnp.arange(2))
    assert fixed.shape == (2, 2, 32, 32)


def test_sign_diagonal_start_quantizes_as_the_identity():
    """kron_lu.sign_diagonal_init: blocks diag(±1), its own inverse, and the W4A4 output of the identity exactly
    (MXFP4 is sign-symmetric and the weight side flips the same columns)."""
    from kroquant_jax.formats import MXFP4, fake_quant
    d = 96
    params = T.kron_lu.sign_diagonal_init(d)
    k = np.asarray(T.KRON_LU.blocks(params))
    assert k.shape == (d // 32, 32, 32)
    diag = np.einsum("bii->bi", k)
    assert np.array_equal(np.abs(diag), np.ones_like(diag)) and np.count_nonzero(k) == d
    assert (diag < 0).any()  # the flips are real: det G_k = -1 rules out the identity itself
    np.testing.assert_array_equal(np.asarray(T.KRON_LU.inverse_blocks(params)), k)
    a = jax.random.normal(jax.random.key(5), (40, d)) * jnp.exp(jax.random.normal(jax.random.key(6), (d,)))
    w = jax.random.normal(jax.random.key(7), (24, d))
    at = T.apply_to_activations(a, T.KRON_LU.blocks(params))
    wt = T.apply_to_weights(w, T.KRON_LU.inverse_blocks(params))
    np.testing.assert_array_equal(np.asarray(fake_quant(at, MXFP4()) @ fake_quant(wt, MXFP4()).T),
                                  np.asarray(fake_quant(a, MXFP4()) @ fake_quant(w, MXFP4()).T))


def test_smoothed_kron_starts():
    """smoothed_kron.start: the 'smoothquant' start quantizes exactly as SmoothQuant's diag(1/γ); the Hadamard starts
    are the documented ones; unknown names, a missing or mis-shaped γ raise."""
    from kroquant_jax.formats import MXFP4, fake_quant
    sk = T.smoothed_kron
    d = 64
    gamma = jnp.exp(0.4 * jax.random.normal(jax.random.key(8), (d,)))
    a = jax.random.normal(jax.random.key(9), (33, d)) * gamma * 3.0
    w = jax.random.normal(jax.random.key(10), (20, d)) / gamma

    def output(p, params):
        at = T.apply_to_activations(a, p.blocks(params))
        wt = T.apply_to_weights(w, p.inverse_blocks(params))
        return np.asarray(fake_quant(at, MXFP4()) @ fake_quant(wt, MXFP4()).T)

    diagonal = T.get("diagonal")
    np.testing.assert_allclose(output(T.SMOOTHED_KRON, sk.start("smoothquant", d, gamma)),
                               output(diagonal, T.diagonal.from_scales(gamma)), rtol=1e-6, atol=1e-6)
    hadamard = sk.start("smoothquant_hadamard", d, gamma)
    np.testing.assert_allclose(np.asarray(T.KRON_LU.blocks(hadamard["kron"])),
                               np.asarray(T.KRON_LU.blocks(T.KRON_LU.init(d))))
    np.testing.assert_allclose(np.exp(hadamard["log_gamma"]), gamma, rtol=1e-6)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), sk.start("hadamard", d), sk.init(d)))
    with pytest.raises(ValueError, match="unknown smoothed_kron start 'rotated'"):
        sk.start("rotated", d, gamma)
    with pytest.raises(ValueError, match="needs the SmoothQuant search's gamma"):
        sk.start("smoothquant", d)
    with pytest.raises(ValueError, match=r"gamma has shape \(32,\), expected \(64,\)"):
        sk.start("smoothquant", d, gamma[:32])

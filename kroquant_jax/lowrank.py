"""Low-rank weight correction: LoRaQ (paper §3.4, D.3; arXiv 2604.18117) and the SVDQuant branch (D.4).

Both split a (transformed) weight ``W~ (o, d)`` into a 4-bit residual and a rank-``r`` branch ``L (o, r) R (r, d)``::

    W~ ≈ Q(W~ - B) + B,      B = L R   (or Q(L) Q(R) when the branch itself is stored in MXFP4)

and the layer computes eq. 11, ``Q(A T) Q(W~ - B)^T + (A T) B^T``. All functions are pure and ``vmap``-able; the
``*_layers`` drivers stack layers of one shape and run them in one program (sharded like the calibration engine).

**LoRaQ** (data-free), with the choices where the papers are silent (all configurable in :class:`LoRaQConfig`):

1. *Initialisation* (``init``): ``"svd_error"``: the balanced rank-``r`` truncated SVD of the weight's own
   quantization error ``W~ - Q(W~)`` (``L = U_r S_r^{1/2}``, ``R = S_r^{1/2} V_r^T``): the branch starts as the best
   rank-``r`` fit of what the 4-bit residual loses. ``"svd_weight"``: the SVD of ``W~`` itself (SVDQuant's start,
   still data-free). ``"best"`` (default): both, keeping the one with the lower reconstruction error. (On weights
   with a strongly decaying spectrum ``svd_weight`` wins by far; on flat spectra ``svd_error``.)
2. *Fit* (Adam, lr 1e-3, 500 steps): minimise the weight reconstruction error
   ``E(L, R) = ||W~ - Q(W~ - B) - B||_F^2 / ||W~||_F^2`` with ``B = L R`` (16-bit factors; ``fit_quantized_branch``
   fits ``B = Q(L) Q(R)`` through the STE instead). Through the *residual's* quantizer the identity STE would give
   ``dE/dB = 2 e (1 - 1) = 0`` exactly, so the residual's rounding is held constant within a step (``stop_gradient``;
   re-evaluated every step): the gradient is ``-2 e`` (the data-free target of "fit L R to the quantization error").
   The best iterate (lowest ``E``, the initialisation included) is kept.
3. *Rotation* (Cayley SGD, lr 0.5, 500 steps): ``B = Q(L O) Q(O^T R)`` with ``O`` orthogonal (``L R`` unchanged in
   exact arithmetic), ``O`` learned to minimise the same ``E`` with the branch quantized in MXFP4 (STE through the
   branch quantizers), so the stored factors quantize well. The update is Li et al.'s Cayley SGD with momentum
   (ICLR 2020, Alg. 2; step clipped to ``α = min(lr, 2q / ||W||)``) with the exact Cayley retraction
   ``(I - α/2 W)^{-1} (I + α/2 W) O``. The best iterate (``O = I`` included) is kept.
4. The branch is stored as ``Q(L O)``, ``Q(O^T R)`` (MXFP4 along ``r`` and along ``d``) and the residual is computed
   against the branch as stored (:func:`kroquant_jax.qlinear.build_qlinear`).

**SVDQuant branch**: the rank-``r`` (32) truncated SVD of the smoothed weight, kept in 16 bits; optionally the
iterative refinement ``L_{k+1} = SVD_r(W - Q(W - L_k))`` over up to ``refine_steps`` candidates, returning the first
local minimum of the layer's output error on the calibration rows (D.4).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kroquant_jax.formats import MXFP4, QuantFormat, check_finite, fake_quant
from kroquant_jax.layerset import RunConfig, engine_jit, group_by_shape, program_config, run_groups

__all__ = ["LoRaQConfig", "LowRank", "SVDQuantConfig", "branch", "check_rank", "loraq_fit", "loraq_layers",
           "loraq_program", "low_rank_svd", "resolve_rank", "svdquant_fit", "svdquant_layers", "weight_error"]

SvdMethod = Literal["exact", "randomized"]


class LowRank(NamedTuple):
    """A fitted branch: ``left (o, r)``, ``right (r, d)`` (f32, before storage quantization) and diagnostics.

    Attributes:
      left, right: the factors.
      error_init: relative weight error of the initialisation, with the branch as the fit scores it (LoRaQ: 16-bit
        unless ``fit_quantized_branch``, so it can be below ``error_final``, whose branch is quantized as stored:
        not the error of a stored layer).
      error_fit: after the Adam fit (LoRaQ) / the chosen refinement candidate (SVDQuant).
      error_final: after the rotation (LoRaQ); same as ``error_fit`` otherwise: the branch as stored.
    """

    left: jax.Array
    right: jax.Array
    error_init: jax.Array
    error_fit: jax.Array
    error_final: jax.Array


def low_rank_svd(w: jax.Array, rank: int, method: SvdMethod = "randomized", oversample: int = 16,
                 power_iters: int = 4, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Balanced rank-``rank`` truncated SVD ``w ≈ L R`` with ``L = U S^{1/2}``, ``R = S^{1/2} V^T``.

    Args:
      w: ``(o, d)``.
      rank: ``r <= min(o, d)``.
      method: ``"exact"`` (full SVD) or ``"randomized"`` (Halko et al.: a Gaussian sketch of ``r + oversample``
        columns, ``power_iters`` power iterations re-orthonormalised by Cholesky-QR2, then the eigendecomposition of
        the small ``k x k`` Gram matrix of the projection; a fixed ``seed``, so deterministic). The randomized one
        costs a few ``(o, d) x (d, r)`` products instead of a full SVD. The power iterations and the two
        Cholesky-QR passes are ``fori_loop`` s, so the compiled program holds one copy of each body.

    Returns:
      ``L (o, r)``, ``R (r, d)`` (f32).
    """
    w = w.astype(jnp.float32)
    o, d = w.shape
    if rank > min(o, d):
        raise ValueError(f"low_rank_svd: rank={rank} exceeds min(o, d) of the weight {w.shape}")
    hi = jax.lax.Precision.HIGHEST
    if method == "exact" or rank + oversample >= min(o, d):
        u, s, vt = jnp.linalg.svd(w, full_matrices=False)
        u, s, vt = u[:, :rank], s[:rank], vt[:rank]
    elif method == "randomized":
        k = rank + oversample
        omega = jax.random.normal(jax.random.key(seed), (d, k), jnp.float32)
        q = _orthonormalize(jnp.matmul(w, omega, precision=hi))  # (o, k)

        def power_iteration(_, q):  # a loop, not unrolled: one copy of the body in the compiled program
            z = _orthonormalize(jnp.matmul(w.T, q, precision=hi))  # (d, k)
            return _orthonormalize(jnp.matmul(w, z, precision=hi))  # (o, k)

        q = jax.lax.fori_loop(0, power_iters, power_iteration, q)
        b = jnp.matmul(q.T, w, precision=hi)  # (k, d)
        evals, evecs = jnp.linalg.eigh(jnp.matmul(b, b.T, precision=hi))  # ascending, (k,), (k, k)
        evals, evecs = evals[::-1][:rank], evecs[:, ::-1][:, :rank]
        s = jnp.sqrt(jnp.maximum(evals, 0.0))
        u = jnp.matmul(q, evecs, precision=hi)  # (o, r)
        safe = jnp.where(s > 0, s, 1.0)
        vt = jnp.where(s[:, None] > 0, jnp.matmul(evecs.T, b, precision=hi) / safe[:, None], 0.0)  # (r, d)
    else:
        raise ValueError(f"low_rank_svd: method={method!r} must be 'exact' or 'randomized'")
    root = jnp.sqrt(s)
    return u * root[None, :], root[:, None] * vt


def _orthonormalize(y: jax.Array) -> jax.Array:
    """Orthonormal basis of the columns of ``y (n, k)`` by shifted Cholesky-QR, twice (CholeskyQR2).

    Only matrix products, a ``k x k`` Cholesky and triangular solves: unlike Householder QR these batch well under
    ``vmap`` (XLA:CPU's and cuSOLVER's QR of tall ``(o, k)`` matrices were the slow part of the randomized SVD).

    Where ``y`` is numerically rank-deficient in float32 (a weight whose singular values fall off fast, e.g. by
    half per direction), rounding leaves the Gram matrix of the first pass's result indefinite by more than that
    small shift, its Cholesky is NaN, and so would every factor after it. Such a ``y`` takes shifted Cholesky-QR3
    instead (Fukaya et al., 2020: a first pass shifted by ``11 (n k + k (k + 1)) u ||y||_F^2``, then two passes
    shifted by ``k u`` times the Gram matrix's trace), whose basis spans the same leading directions; every other
    ``y`` gets CholeskyQR2's result, bit for bit as before.
    """
    hi = jax.lax.Precision.HIGHEST
    n, k = y.shape
    eps = jnp.finfo(jnp.float32).eps

    def cholesky_qr(y, shift_of):  # one pass: y R^{-1} with R^T R = y^T y + shift_of(y^T y) I
        g = jnp.matmul(y.T, y, precision=hi)  # (k, k)
        shift = shift_of(g) + jnp.finfo(jnp.float32).tiny
        r = jnp.linalg.cholesky(g + shift * jnp.eye(k, dtype=g.dtype)).T  # upper, (k, k)
        return jax.scipy.linalg.solve_triangular(r, y.T, trans="T", lower=False).T  # (n, k)

    def cholesky_qr3(y):
        y = cholesky_qr(y, lambda g: 11.0 * (n * k + k * (k + 1)) * eps * jnp.trace(g))
        return jax.lax.fori_loop(0, 2, lambda _, y: cholesky_qr(y, lambda g: k * eps * jnp.trace(g)), y)

    q = jax.lax.fori_loop(0, 2, lambda _, y: cholesky_qr(y, lambda g: 1e-6 * jnp.trace(g) / k), y)
    return jax.lax.cond(jnp.all(jnp.isfinite(q)), lambda: q, lambda: cholesky_qr3(y))


def branch(left: jax.Array, right: jax.Array, fmt: Optional[QuantFormat], ste: str = "identity") -> jax.Array:
    """``B = L R`` (``fmt=None``) or ``Q(L) Q(R)`` (quantized along ``r`` and along ``d``; STE backward)."""
    if fmt is not None:
        left, right = fake_quant(left, fmt, ste=ste), fake_quant(right, fmt, ste=ste)
    return jnp.matmul(left, right, precision=jax.lax.Precision.HIGHEST)


def _reconstruction_error(w: jax.Array, b: jax.Array, fmt: QuantFormat, ste: str) -> jax.Array:
    """``||W - Q(W - B) - B||^2 / ||W||^2``; the residual's rounding is held constant (see the module docstring)."""
    resid_q = jax.lax.stop_gradient(fake_quant(w - b, fmt, ste=ste))
    e = w - resid_q - b
    return jnp.sum(jnp.square(e)) / jnp.maximum(jnp.sum(jnp.square(w)), jnp.finfo(jnp.float32).tiny)


def weight_error(w: jax.Array, left: Optional[jax.Array], right: Optional[jax.Array],
                 weight_fmt: QuantFormat = MXFP4(), branch_fmt: Optional[QuantFormat] = None) -> jax.Array:
    """Relative weight error ``||W - (Q(W - B) + B)||_F / ||W||_F`` of a (possibly absent) branch as stored."""
    b = jnp.zeros_like(w) if left is None else branch(left, right, branch_fmt)
    return jnp.sqrt(_reconstruction_error(w.astype(jnp.float32), b, weight_fmt, "identity"))


# ---------------------------------------------------------------------------------------------------------------------
# LoRaQ
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoRaQConfig:
    """LoRaQ settings (defaults: the paper's D.3 values; see the module docstring for each choice).

    Attributes:
      rank: branch rank ``r``: an ``int`` (the paper's 128, chosen for layers 1152 and more wide; a multiple of the
        branch format's block when ``quantize_branch``), or a ``float`` in (0, 1]: that fraction of each layer's
        ``min(o, d)`` (:func:`resolve_rank`; e.g. 1/9, the paper's 128 of 1152, is 128 on a 1152-wide layer, 32 on a
        256-wide one).
      steps, learning_rate: Adam fit of ``L, R``.
      rotation_steps, rotation_lr: Cayley SGD of the rotation ``O``; ``rotation_steps=0`` skips it.
      rotation_momentum, rotation_q: Cayley SGD momentum and step-clipping constant ``q``.
      init: ``"best"``, ``"svd_error"`` or ``"svd_weight"``.
      quantize_branch: store the branch in ``fmt`` (the rotation then targets it); else 16-bit, no rotation.
      fit_quantized_branch: fit ``Q(L) Q(R)`` (STE) already in the Adam stage.
      fmt: format of the residual and of the branch (MXFP4).
      ste: STE rule of the branch quantizers.
      svd_method: SVD of the initialisation.
      max_layers_per_program: at most this many stacked layers per compiled program (memory bound).
    """

    rank: int | float = 128
    steps: int = 500
    learning_rate: float = 1e-3
    rotation_steps: int = 500
    rotation_lr: float = 0.5
    rotation_momentum: float = 0.9
    rotation_q: float = 0.5
    init: Literal["best", "svd_error", "svd_weight"] = "best"
    quantize_branch: bool = True
    fit_quantized_branch: bool = False
    fmt: QuantFormat = MXFP4()
    ste: Literal["identity", "clipped"] = "identity"
    svd_method: SvdMethod = "randomized"
    max_layers_per_program: int = 64


def resolve_rank(rank: int | float, shape: tuple, block: Optional[int] = None, name: Optional[str] = None) -> int:
    """The branch rank of a weight of ``shape (o, d)``: ``rank`` itself when it is an ``int``; for a ``float`` in
    (0, 1], ``rank * min(o, d)`` rounded to the nearest multiple of ``block`` (halves up; at least one block, at most
    ``min(o, d)`` rounded down to a block), or to the nearest integer >= 1 when ``block`` is ``None``."""
    where = f"layer {name!r}: " if name is not None else ""
    if isinstance(rank, (int, np.integer)) and not isinstance(rank, bool):
        return int(rank)
    if not isinstance(rank, (float, np.floating)) or not 0.0 < rank <= 1.0:
        raise ValueError(f"{where}rank={rank!r} must be an int or a fraction of min(o, d) in (0, 1]")
    width = min(shape[-2:])
    if block is None:
        return max(1, int(np.floor(rank * width + 0.5)))
    return int(min(max(1, int(np.floor(rank * width / block + 0.5))), max(1, width // block)) * block)


def _skew(m):
    return m - m.T


def loraq_fit(w: jax.Array, cfg: LoRaQConfig = LoRaQConfig()) -> LowRank:
    """LoRaQ for one transformed weight ``w = W~ (o, d)`` (pure; ``jit``/``vmap``-able). Returns the rotated factors
    ``L O``, ``O^T R`` (unquantized; quantize them with ``cfg.fmt`` to store)."""
    w = w.astype(jnp.float32)
    fmt, ste = cfg.fmt, cfg.ste
    rank = resolve_rank(cfg.rank, w.shape, fmt.block_size if cfg.quantize_branch else None)
    if cfg.init not in ("best", "svd_error", "svd_weight"):
        raise ValueError(f"LoRaQConfig.init={cfg.init!r} must be 'best', 'svd_error' or 'svd_weight'")
    fit_fmt = fmt if (cfg.quantize_branch and cfg.fit_quantized_branch) else None
    store_fmt = fmt if cfg.quantize_branch else None

    def fit_loss(p):
        return _reconstruction_error(w, branch(p[0], p[1], fit_fmt, ste), fmt, ste)

    def candidate(target):  # the balanced truncated SVD of ``target (o, d)`` and its fit loss
        left_right = low_rank_svd(target, rank, cfg.svd_method)
        return left_right, fit_loss(left_right)

    if cfg.init == "best":
        # Both candidates through one copy of the decomposition (lax.map runs it twice, one after the other): half
        # the compiled program of two separate decompositions. (Sequential also on purpose: on XLA:CPU, jax 0.10.2,
        # two independent batched QR/SVD custom calls in one program were seen to hang.)
        error = w - fake_quant(w, fmt)
        (lefts, rights), losses = jax.lax.map(lambda k: candidate(jnp.where(k == 0, error, w)), jnp.arange(2))
        use_second = losses[1] < losses[0]  # (2, o, r), (2, r, d), (2,): svd_error first, svd_weight second
        params = (jnp.where(use_second, lefts[1], lefts[0]), jnp.where(use_second, rights[1], rights[0]))
        err_init = jnp.where(use_second, losses[1], losses[0])
    else:
        params, err_init = candidate(w - fake_quant(w, fmt) if cfg.init == "svd_error" else w)
    if cfg.steps:
        opt = optax.adam(cfg.learning_rate)

        def step(carry, _):
            p, state, best_p, best_l = carry
            loss, g = jax.value_and_grad(fit_loss)(p)
            better = loss < best_l
            best_p = jax.tree.map(lambda a, b: jnp.where(better, a, b), p, best_p)
            best_l = jnp.minimum(loss, best_l)
            upd, state = opt.update(g, state, p)
            return (optax.apply_updates(p, upd), state, best_p, best_l), loss

        carry = (params, opt.init(params), params, jnp.asarray(jnp.inf, jnp.float32))
        # steps + 1 evaluations: the last one scores the final iterate (its update is dropped), so the loss is
        # compiled once, inside the loop, instead of once more after it.
        (_, _, params, err_fit), _ = jax.lax.scan(step, carry, None, length=cfg.steps + 1)
    else:
        err_fit = err_init
    left, right = params

    if not (cfg.quantize_branch and cfg.rotation_steps):
        err_fit_stored = (err_fit if fit_fmt == store_fmt
                          else _reconstruction_error(w, branch(left, right, store_fmt, ste), fmt, ste))
        return LowRank(left, right, jnp.sqrt(err_init), jnp.sqrt(err_fit), jnp.sqrt(err_fit_stored))

    eye = jnp.eye(rank, dtype=jnp.float32)

    def rot_loss(o_mat):
        lo = jnp.matmul(left, o_mat, precision=jax.lax.Precision.HIGHEST)
        ro = jnp.matmul(o_mat.T, right, precision=jax.lax.Precision.HIGHEST)
        return _reconstruction_error(w, branch(lo, ro, fmt, ste), fmt, ste)

    def rot_step(carry, _):
        x, m, best_x, best_l = carry
        loss, g = jax.value_and_grad(rot_loss)(x)
        better = loss < best_l
        best_x = jnp.where(better, x, best_x)
        best_l = jnp.minimum(loss, best_l)
        m = cfg.rotation_momentum * m - g  # (r, r)
        # Explicit HIGHEST: f32 matmuls at the default precision may run as TF32 on NVIDIA GPUs.
        hi = jax.lax.Precision.HIGHEST
        w_hat = (jnp.matmul(m, x.T, precision=hi)
                 - jnp.matmul(0.5 * x, jnp.matmul(jnp.matmul(x.T, m, precision=hi), x.T, precision=hi),
                              precision=hi))  # M X^T - X (X^T M X^T) / 2, (r, r)
        skew = _skew(w_hat)
        m = jnp.matmul(skew, x, precision=hi)
        alpha = jnp.minimum(cfg.rotation_lr, 2.0 * cfg.rotation_q / (jnp.linalg.norm(skew) + 1e-8))
        x = jnp.linalg.solve(eye - 0.5 * alpha * skew, jnp.matmul(eye + 0.5 * alpha * skew, x, precision=hi))
        return (x, m, best_x, best_l), loss

    carry = (eye, jnp.zeros_like(eye), eye, jnp.asarray(jnp.inf, jnp.float32))
    # rotation_steps + 1 evaluations, as in the fit; the first scores O = I, i.e. the fitted branch as stored.
    (_, _, x, err_final), rot_losses = jax.lax.scan(rot_step, carry, None, length=cfg.rotation_steps + 1)
    err_fit_stored = rot_losses[0]
    left_r = jnp.matmul(left, x, precision=jax.lax.Precision.HIGHEST)
    right_r = jnp.matmul(x.T, right, precision=jax.lax.Precision.HIGHEST)
    return LowRank(left_r, right_r, jnp.sqrt(err_init), jnp.sqrt(err_fit_stored), jnp.sqrt(err_final))


@functools.partial(engine_jit, static_argnames="cfg")
def loraq_program(w, cfg):
    return jax.vmap(lambda x: loraq_fit(x, cfg))(w)


def check_rank(name: str, shape: tuple, rank: int, fmt: Optional[QuantFormat]) -> None:
    """Raises a ``ValueError`` naming layer ``name`` if a branch of ``rank`` does not fit a weight of ``shape (o, d)``
    (``rank < 1``, ``rank > min(o, d)``, or not a multiple of the block of ``fmt``, the branch's storage format, if
    given)."""
    if rank < 1:
        raise ValueError(f"layer {name!r}: rank={rank} must be >= 1")
    if rank > min(shape):
        raise ValueError(f"layer {name!r}: rank={rank} exceeds min(o, d) of the weight {shape}")
    if fmt is not None and rank % fmt.block_size:
        raise ValueError(f"layer {name!r}: rank={rank} must be a multiple of the branch format's block "
                         f"{fmt.block_size} to store the branch quantized")


def loraq_layers(weights: Mapping[str, np.ndarray], cfg: LoRaQConfig = LoRaQConfig(), *,
                 run: RunConfig = RunConfig(), pad_to: int = 1) -> dict[str, LowRank]:
    """LoRaQ for every transformed weight ``{name: W~ (o, d)}``: layers of one shape are stacked, ``vmap``-ed and
    sharded over the local devices (``run.shard``); every program is sized for at least
    ``min(pad_to, cfg.max_layers_per_program)`` layers (:func:`kroquant_jax.layerset.run_stacked_padded`). Returns
    ``{name: LowRank}`` (host numpy)."""
    for name, w in weights.items():
        check_finite(w, f"layer {name!r} transformed weight")
        fmt = cfg.fmt if cfg.quantize_branch else None
        check_rank(name, np.shape(w), resolve_rank(cfg.rank, np.shape(w), fmt and fmt.block_size, name), fmt)
    out = run_groups(functools.partial(loraq_program, cfg=program_config(cfg)), group_by_shape(weights),
                     lambda names: [_stack(weights, names)], max_per_program=cfg.max_layers_per_program, run=run,
                     pad_to=pad_to, desc="LoRaQ")
    return {n: LowRank(*out[n]) for n in weights}


def _stack(arrays: Mapping[str, np.ndarray], names) -> np.ndarray:
    """``(len(names), ...)`` f32: the arrays of ``names`` stacked (one program's inputs)."""
    return np.stack([np.asarray(arrays[n], np.float32) for n in names])


# ---------------------------------------------------------------------------------------------------------------------
# SVDQuant
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SVDQuantConfig:
    """SVDQuant's branch (D.4).

    Attributes:
      rank: 32 in the paper; the branch stays 16-bit. An ``int``, or a ``float`` in (0, 1]: that fraction of each
        layer's ``min(o, d)`` (:func:`resolve_rank`, rounded to an integer).
      refine_steps: number of refinement candidates ``L_{k+1} = SVD_r(W - Q(W - L_k))`` (0: plain SVD; the paper
        evaluates up to 100 and returns the first local minimum of the output error on the calibration rows).
      fmt: format of the residual and of the activations.
      svd_method: see :func:`low_rank_svd`.
      max_layers_per_program: at most this many stacked layers per compiled program (memory bound).
    """

    rank: int | float = 32
    refine_steps: int = 0
    fmt: QuantFormat = MXFP4()
    svd_method: SvdMethod = "randomized"
    max_layers_per_program: int = 64


def _output_mse(a_s, w_s, left, right, fmt, ref):
    b = branch(left, right, None)
    hi = jax.lax.Precision.HIGHEST
    out = (jnp.matmul(fake_quant(a_s, fmt), fake_quant(w_s - b, fmt).T, precision=hi)
           + jnp.matmul(jnp.matmul(a_s, right.T, precision=hi), left.T, precision=hi))
    return jnp.mean(jnp.square(out - ref))


def svdquant_fit(w_s: jax.Array, a_s: Optional[jax.Array] = None, cfg: SVDQuantConfig = SVDQuantConfig()) -> LowRank:
    """SVDQuant's rank-``r`` 16-bit branch for one smoothed weight ``w_s (o, d)`` (pure).

    With ``cfg.refine_steps > 0``, ``a_s (m, d)`` (the smoothed calibration activations) rank the candidates
    ``L_0 = SVD_r(W)``, ``L_{k+1} = SVD_r(W - Q(W - L_k))`` by output error; the first local minimum is returned.
    """
    w_s = w_s.astype(jnp.float32)
    rank = resolve_rank(cfg.rank, w_s.shape)
    left, right = low_rank_svd(w_s, rank, cfg.svd_method)
    err0 = jnp.sqrt(_reconstruction_error(w_s, branch(left, right, None), cfg.fmt, "identity"))
    if cfg.refine_steps == 0:
        return LowRank(left, right, err0, err0, err0)
    if a_s is None:
        raise ValueError("svdquant_fit: refine_steps > 0 needs the calibration activations a_s")
    a_s = a_s.astype(jnp.float32)
    ref = jnp.matmul(a_s, w_s.T, precision=jax.lax.Precision.HIGHEST)

    def step(lr, _):
        l_k, r_k = lr
        nxt = low_rank_svd(w_s - fake_quant(w_s - branch(l_k, r_k, None), cfg.fmt), rank, cfg.svd_method)
        return nxt, (nxt, _output_mse(a_s, w_s, nxt[0], nxt[1], cfg.fmt, ref))

    _, ((lefts, rights), errs) = jax.lax.scan(step, (left, right), None, length=cfg.refine_steps)
    lefts = jnp.concatenate([left[None], lefts])
    rights = jnp.concatenate([right[None], rights])
    errs = jnp.concatenate([_output_mse(a_s, w_s, left, right, cfg.fmt, ref)[None], errs])  # (K+1,)
    rising = errs[1:] > errs[:-1]  # candidate k is a local minimum when k+1 is worse
    idx = jnp.where(jnp.any(rising), jnp.argmax(rising), errs.shape[0] - 1)
    l_best, r_best = lefts[idx], rights[idx]
    err = jnp.sqrt(_reconstruction_error(w_s, branch(l_best, r_best, None), cfg.fmt, "identity"))
    return LowRank(l_best, r_best, err0, err, err)


@functools.partial(engine_jit, static_argnames="cfg")
def _svdquant_stacked(w, a, cfg):
    return jax.vmap(lambda x, y: svdquant_fit(x, y, cfg))(w, a)


def svdquant_layers(weights: Mapping[str, np.ndarray], activations: Optional[Mapping[str, np.ndarray]] = None,
                    cfg: SVDQuantConfig = SVDQuantConfig(), *, run: RunConfig = RunConfig(), pad_to: int = 1
                    ) -> dict[str, LowRank]:
    """:func:`svdquant_fit` for every smoothed weight ``{name: W_s}`` (with ``{name: A_s (m, d)}`` calibration rows
    when refining), stacked by shape (programs sized as in :func:`loraq_layers`). Returns ``{name: LowRank}``."""
    for name, w in weights.items():
        check_finite(w, f"layer {name!r} smoothed weight")
        check_rank(name, np.shape(w), resolve_rank(cfg.rank, np.shape(w), None, name), None)
    if cfg.refine_steps and activations is None:
        raise ValueError("svdquant_layers: refine_steps > 0 needs the calibration activations of every layer")
    groups: dict[tuple, list[str]] = {}
    for n, w in weights.items():
        a_shape = np.shape(activations[n]) if cfg.refine_steps else ()
        groups.setdefault((np.shape(w), a_shape), []).append(n)

    def stack(names):
        w = _stack(weights, names)
        a = _stack(activations, names) if cfg.refine_steps else np.zeros((len(names), 1, w.shape[-1]), np.float32)
        return [w, a]

    out = run_groups(functools.partial(_svdquant_stacked, cfg=program_config(cfg)), groups, stack,
                     max_per_program=cfg.max_layers_per_program, run=run, pad_to=pad_to, desc="SVDQuant")
    return {n: LowRank(*out[n]) for n in weights}



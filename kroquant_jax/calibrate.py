"""The calibration engine: per-layer transform optimisation for all layers at once (paper §3.3, SPEC.md §3).

``calibrate_layers(layer_set, CalibrationConfig(...))`` returns one :class:`LayerCalibration` per layer:

1. **Rows.** Each layer's activation rows are split (:func:`kroquant_jax.layerset.split_rows`) into a bounded
   calibration slice (``num_rows``, default 1024: the paper's 128 samples are whole activation matrices, and 128 rows
   overfit 15 parameters x d/32 blocks) and a disjoint held-out slice (``num_heldout``). The draw depends only on the
   seed and the layer's name, so every method sees the same rows.
2. **Jobs.** Every (layer, initial transform) pair is a job. The initial transforms are the parameterization's
   ``init(d)`` (Hadamard for KroQuant) unless ``inits={name: [params, ...]}`` gives others (e.g. smoothed KroQuant
   starts from both γ = 1 and the SmoothQuant γ).
3. **Programs.** Jobs of the same shapes (``o, d``, rows, parameter tree) are stacked along a leading *layer axis*
   and optimised by one ``jax.jit`` program: ``vmap`` over the layer axis of (λ auto-scaling at the initial transform,
   then ``lax.scan`` over ``steps`` of Adam on ``L = L_out + λ_A L_A + λ_W L_W``). Large groups are cut into chunks of
   ``max_layers_per_program`` (memory bound); every chunk of a group is padded to the same size so it compiles once
   (and, with ``pad_to``, to the size of the caller's other batches).
   The layer axis is sharded over a 1-D ``jax.sharding.Mesh`` of all local devices (``shard=True``); layers are
   independent, so the program runs without communication and the result equals the single-device run.
   Fixed (non-trainable) parameterizations are evaluated, not optimised.
4. **Safeguard.** For each layer, the relative output error ``||Q(AT)Q(WT^{-T})^T - AW^T|| / ||AW^T||`` on the
   held-out rows is computed for every initial transform and every trained result; the best one is kept
   (``safeguard=True``), so a learned transform is never worse on held-out rows than the fixed one it started from.

The engine is deterministic for a given seed (no random state besides the row draw).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kroquant_jax import objectives, transforms
from kroquant_jax.layerset import (LayerData, LayerSet, as_layer_set, make_mesh, progress_bar, run_stacked,
                                   split_rows, stack_trees, take_tree)
from kroquant_jax.lowrank import run_stacked_padded

__all__ = ["CalibrationConfig", "LayerCalibration", "calibrate_layers", "enable_compile_cache", "layer_rows",
           "make_mesh", "run_stacked"]


def enable_compile_cache(directory: str, min_compile_seconds: Optional[float] = 0.0) -> str:
    """Turns on JAX's persistent compilation cache in ``directory`` for this process (created if missing); returns its
    absolute path.

    Process-wide JAX configuration: the library never calls this by itself; the entry points call it for an explicit
    ``--compile-cache DIR`` option (setting the ``JAX_COMPILATION_CACHE_DIR`` environment variable does the same for
    any script, with JAX's 1 s threshold below). Call it before the programs to be cached are compiled. A later process
    that compiles the same programs (same shapes, settings, jax version and device) loads them instead of compiling
    them again. Programs that compile faster than ``min_compile_seconds`` are not written; the default 0 writes every
    one (many small programs add up: on the CPU, a ``kroquant calibrate`` run went from 27 s to 12 s with JAX's 1 s
    threshold and to 9 s with 0; its 57 entries took 1.1 MB); ``None`` keeps JAX's setting
    (``jax_persistent_cache_min_compile_time_secs``). On GPU, jax also keeps XLA's per-fusion autotuning results
    there. Only use a folder that no untrusted user can write to (a cache entry is executable code).
    """
    path = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compile cache {directory!r} exists and is not a folder")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    if min_compile_seconds is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    return path


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    """Settings of :func:`calibrate_layers` (defaults: the paper's Adam lr 1e-2, 100 steps).

    Attributes:
      transform: registered parameterization name (``transforms.REGISTRY``).
      steps: Adam steps per layer (ignored for fixed transforms).
      learning_rate: Adam learning rate.
      num_rows: calibration rows drawn per layer.
      num_heldout: held-out rows drawn per layer (disjoint from the calibration rows).
      seed: seed of the row draw.
      objective: quantizer / STE / matmul precision of the loss.
      safeguard: keep the best of {initial transforms, trained results} on the held-out rows; if ``False`` the
        trained result of the first initial transform is kept.
      max_layers_per_program: at most this many stacked jobs per compiled program (memory bound).
      shard: shard the stacked layer axis over all local devices.
      progress: show a tqdm progress bar over jobs.
    """

    transform: str = "kron_lu"
    steps: int = 100
    learning_rate: float = 1e-2
    num_rows: int = 1024
    num_heldout: int = 256
    seed: int = 0
    objective: objectives.ObjectiveConfig = objectives.ObjectiveConfig()
    safeguard: bool = True
    max_layers_per_program: int = 64
    shard: bool = True
    progress: bool = False

    def __post_init__(self):
        transforms.get(self.transform)  # raises on an unknown name
        if self.steps < 0:
            raise ValueError(f"CalibrationConfig.steps={self.steps} must be >= 0")
        if self.max_layers_per_program < 1:
            raise ValueError(f"CalibrationConfig.max_layers_per_program={self.max_layers_per_program} must be >= 1")


@dataclasses.dataclass
class LayerCalibration:
    """The calibrated transform of one layer (host numpy leaves).

    Attributes:
      name: layer name.
      transform: parameterization name.
      params: the kept parameters.
      chosen: which candidate was kept: ``"init{k}"`` or ``"trained{k}"`` (``k`` indexes the initial transforms).
      heldout_errors: relative output error on the held-out rows of every candidate, ``{label: float}``.
      losses: ``(num_inits, steps)`` training loss curves (empty for fixed transforms).
      lambdas: ``(num_inits, 2)`` the ``(λ_A, λ_W)`` of each run.
    """

    name: str
    transform: str
    params: Any
    chosen: str
    heldout_errors: dict
    losses: np.ndarray
    lambdas: np.ndarray

    @property
    def heldout_error(self) -> float:
        """Held-out relative output error of the kept transform."""
        return self.heldout_errors[self.chosen]


def layer_rows(name: str, layer: LayerData, num_rows: int, num_heldout: int, seed: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(calibration rows, held-out rows)`` of a layer, both ``(·, d)`` float32 (see :func:`split_rows`)."""
    split = split_rows(name, layer.activations.shape[0], num_rows, num_heldout, seed)
    return layer.activations[split.calibration], layer.activations[split.heldout]


# ---------------------------------------------------------------------------------------------------------------------
# The per-layer program (pure), vmapped over the stacked layer axis.
# ---------------------------------------------------------------------------------------------------------------------


def _train_one(params0, a_cal, w, *, parameterization, steps, learning_rate, obj_cfg):
    """Optimises one layer's transform. Returns ``(params, losses (steps,), lambdas (2,))``."""
    ref = objectives.reference_output(a_cal, w, obj_cfg)
    lambdas = objectives.auto_lambdas(objectives.loss_terms(params0, parameterization, a_cal, w, ref, obj_cfg))
    if not parameterization.trainable or steps == 0:
        return params0, jnp.zeros((steps,), jnp.float32), jnp.stack(lambdas)
    opt = optax.adam(learning_rate)

    def loss_fn(p):
        return objectives.total_loss(p, parameterization, a_cal, w, lambdas, ref, obj_cfg)

    def step(carry, _):
        p, state = carry
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, state = opt.update(grads, state, p)
        return (optax.apply_updates(p, updates), state), loss

    (params, _), losses = jax.lax.scan(step, (params0, opt.init(params0)), None, length=steps)
    return params, losses, jnp.stack(lambdas)


def _heldout_error(params, a_held, w, *, parameterization, obj_cfg):
    return objectives.relative_output_error(params, parameterization, a_held, w, obj_cfg)


def _program(params0, a_cal, a_held, w, *, parameterization, steps, learning_rate, obj_cfg):
    """Stacked program: train every job, evaluate initial and trained transforms on held-out rows."""
    train = jax.vmap(lambda p, a, ww: _train_one(p, a, ww, parameterization=parameterization, steps=steps,
                                                 learning_rate=learning_rate, obj_cfg=obj_cfg))
    evaluate = jax.vmap(lambda p, a, ww: _heldout_error(p, a, ww, parameterization=parameterization,
                                                        obj_cfg=obj_cfg))
    params, losses, lambdas = train(params0, a_cal, w)
    if not parameterization.trainable or steps == 0:
        err = evaluate(params0, a_held, w)
        return params, losses, lambdas, err, err
    # Initial and trained transforms through one copy of the evaluation (lax.map runs it twice): a smaller program.
    both = jax.tree.map(lambda x0, x1: jnp.stack([x0, x1]), params0, params)  # leaves (2, L, ...)
    err = jax.lax.map(lambda p: evaluate(p, a_held, w), both)  # (2, L)
    return params, losses, lambdas, err[0], err[1]


_program_jit = jax.jit(_program, static_argnames=("parameterization", "steps", "learning_rate", "obj_cfg"))


def calibrate_layers(layer_set: LayerSet, config: CalibrationConfig = CalibrationConfig(),
                     inits: Optional[Mapping[str, Sequence[Any]]] = None, *, pad_to: int = 1
                     ) -> dict[str, LayerCalibration]:
    """Calibrates the transform of every layer of ``layer_set`` (see the module docstring).

    Args:
      layer_set: ``{name: (W (o, d), bias | None, A_rows (n, d))}``; validated (finite, shapes, d % 32 == 0).
      config: :class:`CalibrationConfig`.
      inits: optional ``{name: [params, ...]}`` initial transforms per layer (default ``[parameterization.init(d)]``);
        all initial transforms of a run must share the parameter tree structure.
      pad_to: size every program for at least this many layers (times their initial transforms; at most
        ``max_layers_per_program`` jobs): a caller running several batches of one shape passes its batch size, so
        that a smaller last batch reuses the compiled program (padding jobs are computed and dropped).

    Returns:
      ``{name: LayerCalibration}`` in the layer set's order.
    """
    layers = as_layer_set(layer_set)
    parameterization = transforms.get(config.transform)
    jobs = []  # (name, k, params0)
    rows = {}
    for name, layer in layers.items():
        d = layer.weight.shape[1]
        if inits is not None and name in inits:
            candidates = list(inits[name])
            if not candidates:
                raise ValueError(f"layer {name!r}: inits lists no initial transform")
        else:
            try:
                candidates = [parameterization.init(d)]
            except ValueError as e:
                raise ValueError(f"layer {name!r} (weight {layer.weight.shape}): {e}") from None
        for k, p in enumerate(candidates):
            nb_n = [x.shape for x in jax.tree.leaves(p)]
            try:
                b = jax.eval_shape(parameterization.blocks, p)
            except Exception as e:  # noqa: BLE001 - re-raised with the layer's name
                raise ValueError(f"layer {name!r}: initial transform {k} does not fit {config.transform!r} "
                                 f"(leaf shapes {nb_n}): {e}") from None
            if b.shape[0] * b.shape[1] != d:
                raise ValueError(f"layer {name!r}: initial transform {k} has width {b.shape[0] * b.shape[1]}, the "
                                 f"layer has d={d}")
            jobs.append((name, k, p))
        rows[name] = layer_rows(name, layer, config.num_rows, config.num_heldout, config.seed)

    groups: dict[tuple, list] = {}
    for job in jobs:
        name, _, p = job
        a_cal, a_held = rows[name]
        leaves, treedef = jax.tree.flatten(p)
        key = (layers[name].weight.shape, a_cal.shape, a_held.shape, treedef, tuple(np.shape(x) for x in leaves))
        groups.setdefault(key, []).append(job)

    steps = config.steps if parameterization.trainable else 0
    fn = functools.partial(_program_jit, parameterization=parameterization, steps=steps,
                               learning_rate=config.learning_rate, obj_cfg=config.objective)
    bar = progress_bar(len(jobs), config.progress, f"calibrate {config.transform}")
    per_job = {}
    try:
        for group in groups.values():
            params0 = stack_trees([p for _, _, p in group])
            a_cal = np.stack([rows[n][0] for n, _, _ in group])
            a_held = np.stack([rows[n][1] for n, _, _ in group])
            w = np.stack([layers[n].weight for n, _, _ in group])
            jobs_per_layer = len(group) / len({n for n, _, _ in group})
            out = run_stacked_padded(fn, [params0, a_cal, a_held, w], len(group),
                                     pad_to=math.ceil(pad_to * jobs_per_layer),
                                     max_per_program=config.max_layers_per_program, shard=config.shard, progress=bar)
            params, losses, lambdas, err_init, err_trained = out
            for i, (name, k, p) in enumerate(group):
                per_job[(name, k)] = (p, take_tree(params, i), losses[i], lambdas[i], float(err_init[i]),
                                      float(err_trained[i]))
    finally:
        if bar is not None:
            bar.close()

    results = {}
    for name in layers:
        ks = sorted(k for (n, k) in per_job if n == name)
        errors, candidates = {}, {}
        for k in ks:
            p0, p, _, _, e0, e1 = per_job[(name, k)]
            errors[f"init{k}"], candidates[f"init{k}"] = e0, p0
            if steps:
                errors[f"trained{k}"], candidates[f"trained{k}"] = e1, p
        if config.safeguard:
            finite = {lab: e for lab, e in errors.items() if np.isfinite(e)}
            if not finite:
                raise ValueError(f"layer {name!r}: every candidate transform gives a non-finite held-out error")
            chosen = min(finite, key=lambda lab: (finite[lab], lab))
        else:
            chosen = "trained0" if steps else "init0"
        results[name] = LayerCalibration(
            name=name, transform=config.transform,
            params=jax.tree.map(np.asarray, candidates[chosen]), chosen=chosen, heldout_errors=errors,
            losses=np.stack([per_job[(name, k)][2] for k in ks]),
            lambdas=np.stack([per_job[(name, k)][3] for k in ks]))
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Recipes: a transform (+ SmoothQuant init) (+ low-rank branch) -> {name: QuantizedLinear}, resumable.
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A whole per-layer quantization method.

    Attributes:
      transform: parameterization of ``T``.
      train: optimise ``T`` with the calibration engine (ignored for fixed transforms).
      smooth_init: run the SmoothQuant (α, β) search first and start from its γ: for ``"diagonal"`` as the transform
        itself (SmoothQuant / SVDQuant's smoothing), for ``"smoothed_kron"`` as a second initial transform beside
        (γ = 1, Hadamard).
      lowrank: ``None``, ``"loraq"`` (LoRaQ, branch in MXFP4) or ``"svd"`` (SVDQuant's 16-bit SVD branch).
      smooth_svd_rank: rank of the 16-bit SVD branch inside the SmoothQuant search; ``None`` (default): the paper's 32
        when the recipe has a low-rank branch (the search then models the deployed layer), 0 without one (plain
        SmoothQuant, searched for the plain 4-bit weight).
      calibration, smoothquant, loraq, svdquant: the stages' settings (``calibration.transform`` is overridden by
        ``transform``; its row settings are used everywhere).
    """

    transform: str = "kron_lu"
    train: bool = True
    smooth_init: bool = False
    lowrank: Optional[str] = None
    smooth_svd_rank: Optional[int] = None
    calibration: CalibrationConfig = CalibrationConfig()
    smoothquant: Any = None
    loraq: Any = None
    svdquant: Any = None

    def __post_init__(self):
        transforms.get(self.transform)
        if self.lowrank not in (None, "loraq", "svd"):
            raise ValueError(f"Recipe.lowrank={self.lowrank!r} must be None, 'loraq' or 'svd'")
        if self.smooth_init and self.transform not in ("diagonal", "smoothed_kron"):
            raise ValueError(f"Recipe.smooth_init needs transform 'diagonal' or 'smoothed_kron', got "
                             f"{self.transform!r}")


#: The methods of the paper's comparison (add ``+loraq`` to any name for the LoRaQ branch).
RECIPES = {
    "rtn": Recipe(transform="identity", train=False),
    "smoothquant": Recipe(transform="diagonal", train=False, smooth_init=True),
    "hadamard32": Recipe(transform="hadamard32", train=False),
    "kroquant": Recipe(transform="kron_lu"),
    "smoothed_kroquant": Recipe(transform="smoothed_kron", smooth_init=True),
    "svdquant": Recipe(transform="diagonal", train=False, smooth_init=True, lowrank="svd"),
}


def get_recipe(name: str, **overrides) -> Recipe:
    """``RECIPES[name]`` (``"<name>+loraq"`` adds the LoRaQ branch) with field ``overrides``."""
    base, plus, extra = name.partition("+")
    if base not in RECIPES or (plus and extra != "loraq"):
        raise KeyError(f"unknown recipe {name!r}; available: {sorted(RECIPES)} (each also as '<name>+loraq')")
    r = RECIPES[base]
    if plus:
        r = dataclasses.replace(r, lowrank="loraq")
    return dataclasses.replace(r, **overrides)


def _relative_error(y, ref) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), np.finfo(np.float32).tiny))


def _quantize_batch(layers: dict[str, LayerData], recipe: Recipe, pad_to: int = 1) -> tuple[dict, dict]:
    """All stages for a batch of layers (any shapes; programs sized for ``pad_to`` layers). Returns
    ``({name: QuantizedLinear}, {name: report})``."""
    from kroquant_jax import lowrank, qlinear, smoothquant

    cal = dataclasses.replace(recipe.calibration, transform=recipe.transform,  # one bar: quantize_layer_set's
                              steps=recipe.calibration.steps if recipe.train else 0, progress=False)
    reports = {n: {"transform": recipe.transform} for n in layers}
    inits = None
    if recipe.smooth_init:
        sq_cfg = recipe.smoothquant or smoothquant.SmoothQuantConfig()
        svd_rank = recipe.smooth_svd_rank
        if svd_rank is None:
            svd_rank = 32 if recipe.lowrank else 0
        sq_cfg = dataclasses.replace(sq_cfg, num_rows=cal.num_rows, num_heldout=cal.num_heldout, seed=cal.seed,
                                     shard=cal.shard, svd_rank=svd_rank)
        sq = smoothquant.smoothquant_layers(layers, sq_cfg, pad_to=pad_to)
        inits = {}
        for n, res in sq.items():
            reports[n].update(alpha=res.alpha, beta=res.beta)
            if recipe.transform == "diagonal":
                inits[n] = [transforms.diagonal.from_scales(res.gamma)]
            else:
                inits[n] = [transforms.get(recipe.transform).init(layers[n].weight.shape[1]),
                            transforms.smoothed_kron.init_from_scales(res.gamma)]
    calib = calibrate_layers(layers, cal, inits=inits, pad_to=pad_to)
    param = transforms.get(recipe.transform)
    w_t, a_cal_t, a_held = {}, {}, {}
    for n, layer in layers.items():
        c = calib[n]
        reports[n].update(chosen=c.chosen, transform_heldout_error=c.heldout_error,
                          candidates={k: float(v) for k, v in c.heldout_errors.items()})
        w_t[n] = np.asarray(transforms.apply_to_weights(jnp.asarray(layer.weight), param.inverse_blocks(c.params)))
        a_cal, a_held[n] = layer_rows(n, layer, cal.num_rows, cal.num_heldout, cal.seed)
        if recipe.lowrank == "svd":
            a_cal_t[n] = np.asarray(transforms.apply_to_activations(jnp.asarray(a_cal), param.blocks(c.params)))
    branches, quantized_branch = {}, False
    if recipe.lowrank == "loraq":
        lq_cfg = recipe.loraq or lowrank.LoRaQConfig()
        lq_cfg = dataclasses.replace(lq_cfg, shard=cal.shard)
        branches = lowrank.loraq_layers(w_t, lq_cfg, pad_to=pad_to)
        quantized_branch = lq_cfg.quantize_branch
    elif recipe.lowrank == "svd":
        sv_cfg = recipe.svdquant or lowrank.SVDQuantConfig()
        sv_cfg = dataclasses.replace(sv_cfg, shard=cal.shard)
        branches = lowrank.svdquant_layers(w_t, a_cal_t, sv_cfg, pad_to=pad_to)
    out = {}
    forward = jax.jit(qlinear.qlinear_forward, static_argnames="path")
    for n, layer in layers.items():
        lr = None
        if n in branches:
            lr = (branches[n].left, branches[n].right)
            reports[n].update(weight_error_init=float(branches[n].error_init),
                              weight_error_final=float(branches[n].error_final))
        q = qlinear.build_qlinear(layer.weight, layer.bias, transform=recipe.transform,
                                  transform_params=calib[n].params, lowrank=lr, lowrank_quantized=quantized_branch,
                                  weight_fmt=cal.objective.fmt, act_fmt=cal.objective.fmt, name=n)
        y = np.asarray(forward(q, jnp.asarray(a_held[n])))
        if layer.bias is not None:
            y = y - layer.bias
        ref = a_held[n].astype(np.float64) @ layer.weight.T.astype(np.float64)
        reports[n]["heldout_error"] = _relative_error(y, ref)
        reports[n]["weight_error"] = float(lowrank.weight_error(jnp.asarray(w_t[n]), None, None, cal.objective.fmt)
                                           if lr is None else np.float32(reports[n]["weight_error_final"]))
        out[n] = q
    return out, reports


def quantize_layer_set(layer_set: LayerSet, recipe: Recipe | str = "kroquant", store=None,
                       on_batch_done=None, overwrite: bool = False) -> tuple[dict, dict]:
    """Quantizes every layer with ``recipe``; resumable through ``store``.

    Layers are processed in batches of one shape: at most ``recipe.calibration.max_layers_per_program`` per batch,
    the batches of a shape equal in size but for a smaller last one, whose programs are padded to the others' size
    (so each shape compiles its programs once). Each finished layer is written to ``store`` (a
    :class:`kroquant_jax.qlinear.QLinearStore` or a folder path) atomically with the fingerprint of its inputs
    (:func:`kroquant_jax.provenance.layer_fingerprint`: weight, bias, activation rows, recipe settings, numerics
    version). Layers already in the store are loaded instead of recomputed when their fingerprint matches, so a run
    interrupted midway restarts from the finished layers; a stored layer computed from other inputs raises (before
    any computation) unless ``overwrite``.

    Args:
      layer_set: ``{name: (W, bias, A_rows)}``.
      recipe: a :class:`Recipe` or a name for :func:`get_recipe`.
      store: ``None``, a folder path, or a ``QLinearStore``.
      on_batch_done: optional ``callback(list_of_names)`` after each batch is stored (progress hooks, tests).
      overwrite: recompute every layer and replace what the store holds.

    Returns:
      ``({name: QuantizedLinear}, {name: report dict})``; a report holds ``heldout_error`` (relative output error
      of the final layer on the held-out rows), ``transform_heldout_error``, ``chosen``, ``candidates`` and, where
      they apply, ``alpha``/``beta`` and the weight errors; ``resumed`` is ``True`` for layers loaded from the store.

    Raises:
      kroquant_jax.provenance.StaleResultError: a stored layer's fingerprint differs (names the layer and what
        changed: weight, bias, activations, ``recipe setting X: old -> new``, numerics version).
    """
    from kroquant_jax import provenance, qlinear

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    layers = as_layer_set(layer_set)
    if isinstance(store, str):
        store = qlinear.QLinearStore(store)
    fingerprints = {n: provenance.layer_fingerprint(layer.weight, layer.bias, layer.activations, recipe)
                    for n, layer in layers.items()} if store is not None else {}
    if store is not None and not overwrite:
        store.verify(fingerprints)  # every stale layer is refused before any work
    done_layers, reports = {}, {}
    todo = []
    for n in layers:
        if store is not None and not overwrite and n in store:
            done_layers[n], rep = store.load(n)
            reports[n] = {k: v for k, v in rep.items() if k not in ("name", "fingerprint")}
            reports[n]["resumed"] = True
        else:
            todo.append(n)
    by_shape: dict[tuple, list[str]] = {}
    for n in todo:
        by_shape.setdefault(layers[n].weight.shape, []).append(n)
    batches = []  # (names, layers per program)
    for names in by_shape.values():
        per_batch = math.ceil(len(names) / math.ceil(len(names) / recipe.calibration.max_layers_per_program))
        batches += [(names[i:i + per_batch], per_batch) for i in range(0, len(names), per_batch)]
    bar = progress_bar(len(todo), recipe.calibration.progress, "quantize")
    try:
        for batch, per_batch in batches:
            q, rep = _quantize_batch({n: layers[n] for n in batch}, recipe, pad_to=per_batch)
            for n in batch:
                rep[n]["resumed"] = False
                if store is not None:
                    store.save(n, q[n], {k: v for k, v in rep[n].items() if k != "resumed"},
                               fingerprint=fingerprints[n])
            done_layers.update(q)
            reports.update(rep)
            if bar is not None:
                bar.update(len(batch))
            if on_batch_done is not None:
                on_batch_done(list(batch))
    finally:
        if bar is not None:
            bar.close()
    return {n: done_layers[n] for n in layers}, {n: reports[n] for n in layers}

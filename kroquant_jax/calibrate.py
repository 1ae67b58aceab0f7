"""The calibration engine: per-layer transform optimisation for all layers at once (paper §3.3), and the recipes.

``calibrate_layers(layer_set, CalibrationConfig(...), run=RunConfig(...))`` returns one :class:`LayerCalibration`
per layer:

1. **Rows.** Each layer's activation rows are split by the run's :class:`kroquant_jax.layerset.RunConfig` into three
   disjoint slices: calibration (``num_rows``, default 1024: the paper's 128 samples are whole activation matrices,
   and 128 rows overfit 15 parameters x d/32 blocks), validation (``num_validation``: the best iterate and the
   safeguard choose on it) and test (``num_test``: reported only). The draw depends only on the seed and the layer's
   name, so every method sees the same rows.
2. **Jobs.** Every (layer, initial transform) pair is a job. The initial transforms are the parameterization's
   ``init(d)`` (Hadamard for KroQuant) unless ``inits={name: [params, ...]}`` gives others (e.g. smoothed KroQuant
   starts from both γ = 1 and the SmoothQuant γ).
3. **Programs.** Jobs of the same shapes (``o, d``, rows, parameter tree) are stacked along a leading *layer axis*
   and optimised by one ``jax.jit`` program (:data:`calibration_program`): ``vmap`` over the layer axis of (λ
   auto-scaling at the initial transform, then ``lax.scan`` over ``steps`` of Adam on
   ``L = L_out + λ_A L_A + λ_W L_W`` with a cosine-decayed learning rate, scoring the iterate on the validation rows
   every ``select_every`` steps and keeping the best). Large groups are cut into chunks of
   ``max_layers_per_program`` (memory bound); every chunk of a group is padded to the same size so it compiles once
   (and, with ``pad_to``, to the size of the caller's other batches). The layer axis is sharded over a 1-D
   ``jax.sharding.Mesh`` of all local devices (``run.shard``); layers are independent, so the program runs without
   communication and the result equals the single-device run. Fixed (non-trainable) parameterizations are
   evaluated, not optimised.
4. **Safeguard.** For each layer, the relative output error ``||Q(AT)Q(WT^{-T})^T - AW^T|| / ||AW^T||`` on the
   validation rows is computed for every initial transform and every trained result; the best one is kept
   (``safeguard=True``), so a learned transform is never worse on validation rows than the fixed one it started
   from. The test rows give the reported error.

A :class:`Recipe` is a whole method (SmoothQuant search, transform, low-rank branch, weight rounding: to nearest or
GPTQ; typed stage configs and one
:class:`RunConfig` that every stage reads); :func:`get_recipe` names them, :func:`add_recipe_arguments` and
:func:`recipe_from_args` build them from a command line, :func:`quantize_layer_set` runs one, resumably.

The engine is deterministic for a given seed (no random state besides the row draw).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kroquant_jax import formats, gptq, lowrank, objectives, smoothquant, transforms
from kroquant_jax.gptq import GPTQConfig
from kroquant_jax.layerset import (LayerData, LayerSet, RunConfig, as_layer_set, engine_jit, program_config,
                                   progress_bar, run_stacked_padded, stack_trees, take_tree)
from kroquant_jax.lowrank import LoRaQConfig, SVDQuantConfig
from kroquant_jax.smoothquant import SmoothQuantConfig

__all__ = ["CalibrationConfig", "GPTQConfig", "LayerCalibration", "LayerRows", "PAPER_LITERAL", "RECIPES", "Recipe", "RunConfig",
           "add_recipe_arguments", "calibrate_layers", "calibration_program", "enable_compile_cache",
           "fallback_split_layers", "get_recipe", "layer_rows", "parse_rank", "quantize_layer_set", "recipe_from_args", "unused_stage_arguments"]


def enable_compile_cache(directory: str, min_compile_seconds: Optional[float] = 0.0) -> str:
    """Turns on JAX's persistent compilation cache in ``directory`` for this process (created if missing); returns its
    absolute path.

    Process-wide JAX configuration: the library never calls this by itself; the entry points call it for an explicit
    ``--compile-cache DIR`` option (setting the ``JAX_COMPILATION_CACHE_DIR`` environment variable does the same for
    any script, with JAX's 1 s threshold below). Call it before the programs to be cached are compiled. A later process
    that compiles the same programs (same shapes, settings, jax version and device) loads them instead of compiling
    them again. Programs that compile faster than ``min_compile_seconds`` are not written; the default 0 writes every
    one (many small programs add up: a warm run with 0 is faster than with JAX's 1 s threshold, docs/calibration.md
    "Compile time", "Persistent compilation cache"); ``None`` keeps JAX's setting
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
    """Settings of :func:`calibrate_layers` (the rows, seed and devices come from the run's
    :class:`kroquant_jax.layerset.RunConfig`). Defaults: the paper's Adam lr 1e-2 and 100 steps; the choices below
    the paper leaves open were made on the emoji testbed's captured layers (``docs/calibration.md``).

    Attributes:
      transform: registered parameterization name (``transforms.REGISTRY``); ``None`` only inside a
        :class:`Recipe`, which fills in its own.
      steps: Adam steps per layer (ignored for fixed transforms).
      learning_rate: Adam's (peak) learning rate.
      lr_schedule: ``"constant"``, or ``"cosine"``: decayed from ``learning_rate`` to 0 over ``steps``
        (``optax.cosine_decay_schedule``).
      select_every: score the iterate on the validation rows every this many steps (and at the start) and keep the
        best one; ``0`` keeps the last iterate.
      objective: quantizer / STE / regularizer gradient / matmul precision of the loss.
      safeguard: keep the best of {initial transforms, trained results} on the validation rows; if ``False`` the
        trained result of the first initial transform is kept.
      max_layers_per_program: at most this many stacked jobs per compiled program (memory bound).
    """

    transform: Optional[str] = "kron_lu"
    steps: int = 100
    learning_rate: float = 1e-2
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    select_every: int = 10
    objective: objectives.ObjectiveConfig = objectives.ObjectiveConfig()
    safeguard: bool = True
    max_layers_per_program: int = 64

    def __post_init__(self):
        if self.transform is not None:
            transforms.get(self.transform)  # raises on an unknown name
        if self.steps < 0:
            raise ValueError(f"CalibrationConfig.steps={self.steps} must be >= 0")
        if self.select_every < 0:
            raise ValueError(f"CalibrationConfig.select_every={self.select_every} must be >= 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"CalibrationConfig.lr_schedule={self.lr_schedule!r} must be 'constant' or 'cosine'")
        if self.max_layers_per_program < 1:
            raise ValueError(f"CalibrationConfig.max_layers_per_program={self.max_layers_per_program} must be >= 1")


#: The engine's settings before the defaults were chosen on real layers (the paper as written: the identity STE
#: inside the regularizers, a constant learning rate, the last iterate). Kept to reproduce earlier results.
PAPER_LITERAL = CalibrationConfig(lr_schedule="constant", select_every=0,
                                  objective=objectives.ObjectiveConfig(regularizer_grad="ste"))


@dataclasses.dataclass
class LayerCalibration:
    """The calibrated transform of one layer (host numpy leaves).

    Attributes:
      name: layer name.
      transform: parameterization name.
      params: the kept parameters.
      chosen: which candidate was kept: ``"init{k}"`` or ``"trained{k}"`` (``k`` indexes the initial transforms).
      validation_errors: relative output error on the validation rows of every candidate, ``{label: float}`` (the
        safeguard chooses on these).
      test_errors: the same on the test rows (reported, never used to choose).
      losses: ``(num_inits, steps)`` training loss curves (empty for fixed transforms).
      lambdas: ``(num_inits, 2)`` the ``(λ_A, λ_W)`` of each run.
      candidate_params: the parameters of every candidate, ``{label: params}`` (a later stage may choose again, e.g.
        a recipe's selection with the low-rank branch).
    """

    name: str
    transform: str
    params: Any
    chosen: str
    validation_errors: dict
    test_errors: dict
    losses: np.ndarray
    lambdas: np.ndarray
    candidate_params: dict = dataclasses.field(default_factory=dict)

    @property
    def test_error(self) -> float:
        """Test-row relative output error of the kept transform."""
        return self.test_errors[self.chosen]

    @property
    def validation_error(self) -> float:
        """Validation-row relative output error of the kept transform."""
        return self.validation_errors[self.chosen]


class LayerRows(NamedTuple):
    """A layer's three row slices, each ``(·, d)`` float32 (see :func:`kroquant_jax.layerset.split_rows`)."""

    calibration: np.ndarray
    validation: np.ndarray
    test: np.ndarray


def layer_rows(name: str, layer: LayerData, run: RunConfig) -> LayerRows:
    """The calibration, validation and test rows of a layer under the run's split."""
    split = run.split(name, layer.activations.shape[0])
    a = layer.activations
    return LayerRows(a[split.calibration], a[split.validation], a[split.test])


# ---------------------------------------------------------------------------------------------------------------------
# The per-layer program (pure), vmapped over the stacked layer axis.
# ---------------------------------------------------------------------------------------------------------------------


def _optimizer(cfg: CalibrationConfig) -> optax.GradientTransformation:
    if cfg.lr_schedule == "cosine":
        return optax.adam(optax.cosine_decay_schedule(cfg.learning_rate, cfg.steps))
    return optax.adam(cfg.learning_rate)


def _train_one(params0, a_cal, a_val, w, *, parameterization, cfg: CalibrationConfig):
    """Optimises one layer's transform. Returns ``(params, losses (steps,), lambdas (2,))``: the last iterate, or
    with ``cfg.select_every`` the iterate (the start included) of the lowest validation error among those scored."""
    obj_cfg = cfg.objective
    ref = objectives.reference_output(a_cal, w, obj_cfg)
    lambdas = objectives.auto_lambdas(objectives.loss_terms(params0, parameterization, a_cal, w, ref, obj_cfg))
    steps = cfg.steps
    if not parameterization.trainable or steps == 0:
        return params0, jnp.zeros((steps,), jnp.float32), jnp.stack(lambdas)
    opt = _optimizer(cfg)

    def loss_fn(p):
        return objectives.total_loss(p, parameterization, a_cal, w, lambdas, ref, obj_cfg)

    if not cfg.select_every:
        def step(carry, _):
            p, state = carry
            loss, grads = jax.value_and_grad(loss_fn)(p)
            updates, state = opt.update(grads, state, p)
            return (optax.apply_updates(p, updates), state), loss

        (params, _), losses = jax.lax.scan(step, (params0, opt.init(params0)), None, length=steps)
        return params, losses, jnp.stack(lambdas)

    k = min(cfg.select_every, steps)
    chunks = math.ceil(steps / k)

    def val_error(p):
        return objectives.relative_output_error(p, parameterization, a_val, w, obj_cfg)

    def masked_step(carry, i):  # steps past ``steps`` (the last chunk's tail) leave the carry unchanged
        p, state = carry
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, new_state = opt.update(grads, state, p)
        new_p = optax.apply_updates(p, updates)
        keep = i < steps
        pick = functools.partial(jax.tree.map, lambda x, y: jnp.where(keep, x, y))
        return (pick(new_p, p), pick(new_state, state)), loss

    def chunk(carry, c):
        p, state, best_p, best_e = carry
        (p, state), losses = jax.lax.scan(masked_step, (p, state), c * k + jnp.arange(k))
        e = val_error(p)
        better = e < best_e
        best_p = jax.tree.map(lambda x, y: jnp.where(better, x, y), p, best_p)
        return (p, state, best_p, jnp.where(better, e, best_e)), losses

    carry = (params0, opt.init(params0), params0, val_error(params0))
    (_, _, params, _), losses = jax.lax.scan(chunk, carry, jnp.arange(chunks))
    return params, losses.reshape(-1)[:steps], jnp.stack(lambdas)


def _errors(params, a_val, a_test, w, *, parameterization, obj_cfg):
    """``(validation error, test error)`` of one layer's transform."""
    return (objectives.relative_output_error(params, parameterization, a_val, w, obj_cfg),
            objectives.relative_output_error(params, parameterization, a_test, w, obj_cfg))


def _program(params0, a_cal, a_val, a_test, w, *, parameterization, cfg: CalibrationConfig):
    """Stacked program: train every job, evaluate initial and trained transforms on the validation and test rows.
    Returns ``(params, losses, lambdas, errors (L, 2 [init, trained], 2 [validation, test]))``."""
    train = jax.vmap(lambda p, a, av, ww: _train_one(p, a, av, ww, parameterization=parameterization, cfg=cfg))
    evaluate = jax.vmap(lambda p, av, at, ww: jnp.stack(_errors(p, av, at, ww, parameterization=parameterization,
                                                                obj_cfg=cfg.objective)))  # (L, 2)
    params, losses, lambdas = train(params0, a_cal, a_val, w)
    if not parameterization.trainable or cfg.steps == 0:
        err = evaluate(params0, a_val, a_test, w)
        return params, losses, lambdas, jnp.stack([err, err], axis=1)
    # Initial and trained transforms through one copy of the evaluation (lax.map runs it twice): a smaller program.
    both = jax.tree.map(lambda x0, x1: jnp.stack([x0, x1]), params0, params)  # leaves (2, L, ...)
    err = jax.lax.map(lambda p: evaluate(p, a_val, a_test, w), both)  # (2, L, 2)
    return params, losses, lambdas, jnp.swapaxes(err, 0, 1)


#: The compiled stacked program (static: the parameterization and the :class:`CalibrationConfig` as passed through
#: :func:`kroquant_jax.layerset.program_config`; XLA options: :func:`kroquant_jax.layerset.engine_jit`);
#: :func:`calibrate_layers` drives it.
calibration_program = engine_jit(_program, static_argnames=("parameterization", "cfg"))


def calibrate_layers(layer_set: LayerSet, config: CalibrationConfig = CalibrationConfig(),
                     inits: Optional[Mapping[str, Sequence[Any]]] = None, *, run: RunConfig = RunConfig(),
                     pad_to: int = 1) -> dict[str, LayerCalibration]:
    """Calibrates the transform of every layer of ``layer_set`` (see the module docstring).

    Args:
      layer_set: ``{name: (W (o, d), bias | None, A_rows (n, d))}``; validated (finite, shapes, d % 32 == 0).
      config: :class:`CalibrationConfig`.
      inits: optional ``{name: [params, ...]}`` initial transforms per layer (default ``[parameterization.init(d)]``);
        all initial transforms of a run must share the parameter tree structure.
      run: the row split (calibration / validation / test), its seed, sharding and progress.
      pad_to: size every program for at least this many layers (times their initial transforms; at most
        ``max_layers_per_program`` jobs): a caller running several batches of one shape passes its batch size, so
        that a smaller last batch reuses the compiled program (padding jobs are computed and dropped).

    Returns:
      ``{name: LayerCalibration}`` in the layer set's order.
    """
    if config.transform is None:
        raise ValueError("CalibrationConfig.transform is None: name the parameterization to calibrate")
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
        rows[name] = layer_rows(name, layer, run)

    groups: dict[tuple, list] = {}
    for job in jobs:
        name, _, p = job
        leaves, treedef = jax.tree.flatten(p)
        key = (layers[name].weight.shape, tuple(x.shape for x in rows[name]), treedef,
               tuple(np.shape(x) for x in leaves))
        groups.setdefault(key, []).append(job)

    steps = config.steps if parameterization.trainable else 0
    fn = functools.partial(calibration_program, parameterization=parameterization,
                           cfg=program_config(dataclasses.replace(config, steps=steps, safeguard=True)))
    bar = progress_bar(len(jobs), run.progress, f"calibrate {config.transform}")
    per_job = {}
    try:
        for group in groups.values():
            params0 = stack_trees([p for _, _, p in group])
            a_cal, a_val, a_test = (np.stack([rows[n][i] for n, _, _ in group]) for i in range(3))
            w = np.stack([layers[n].weight for n, _, _ in group])
            jobs_per_layer = len(group) / len({n for n, _, _ in group})
            out = run_stacked_padded(fn, [params0, a_cal, a_val, a_test, w], len(group),
                                     pad_to=math.ceil(pad_to * jobs_per_layer),
                                     max_per_program=config.max_layers_per_program, shard=run.shard, progress=bar)
            params, losses, lambdas, err = out  # err: (L, 2 [init, trained], 2 [validation, test])
            for i, (name, k, p) in enumerate(group):
                per_job[(name, k)] = (p, take_tree(params, i), losses[i], lambdas[i], np.asarray(err[i], float))
    finally:
        if bar is not None:
            bar.close()

    results = {}
    for name in layers:
        ks = sorted(k for (n, k) in per_job if n == name)
        val, test, candidates = {}, {}, {}
        for k in ks:
            p0, p, _, _, e = per_job[(name, k)]
            val[f"init{k}"], test[f"init{k}"], candidates[f"init{k}"] = e[0, 0], e[0, 1], p0
            if steps:
                val[f"trained{k}"], test[f"trained{k}"], candidates[f"trained{k}"] = e[1, 0], e[1, 1], p
        if config.safeguard:
            finite = {lab: e for lab, e in val.items() if np.isfinite(e)}
            if not finite:
                raise ValueError(f"layer {name!r}: every candidate transform gives a non-finite validation error")
            chosen = min(finite, key=lambda lab: (finite[lab], lab))
        else:
            chosen = "trained0" if steps else "init0"
        results[name] = LayerCalibration(
            name=name, transform=config.transform,
            params=jax.tree.map(np.asarray, candidates[chosen]), chosen=chosen,
            validation_errors={lab: float(e) for lab, e in val.items()},
            test_errors={lab: float(e) for lab, e in test.items()},
            losses=np.stack([per_job[(name, k)][2] for k in ks]),
            lambdas=np.stack([per_job[(name, k)][3] for k in ks]),
            candidate_params={lab: jax.tree.map(np.asarray, p) for lab, p in candidates.items()})
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Recipes: a transform (+ SmoothQuant init) (+ low-rank branch) (+ GPTQ) -> {name: QuantizedLinear}, resumable.
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A whole per-layer quantization method.

    Attributes:
      transform: parameterization of ``T``.
      train: optimise ``T`` with the calibration engine (ignored for fixed transforms).
      smooth_init: run the SmoothQuant (α, β) search first and start from its γ: for ``"diagonal"`` as the transform
        itself (SmoothQuant / SVDQuant's smoothing), for ``"smoothed_kron"`` as the initial transforms ``starts``
        names.
      starts: ``"smoothed_kron"`` with ``smooth_init`` only: the initial transforms the calibration starts from and
        the safeguard chooses among, names of :data:`kroquant_jax.transforms.smoothed_kron.STARTS`
        (``"hadamard"``: γ = 1 and Hadamard blocks; ``"smoothquant_hadamard"``: the search's γ and Hadamard blocks;
        ``"smoothquant"``: the search's γ unrotated, i.e. the SmoothQuant transform itself). ``None``:
        ``("hadamard", "smoothquant_hadamard")``, the two starts the engine had before this field existed.
      select_with_branch: ``"loraq"`` only: choose each layer's transform among the calibration's candidates (every
        start as started and trained) by the validation error of the whole layer (transform, the LoRaQ branch fitted
        to it, weight rounded to nearest) instead of the transform's alone: LoRaQ runs once per candidate. The
        transform is trained without the branch, and a transform better alone can be worse with it
        (docs/calibration.md, "Choosing with the branch"). ``None`` / ``False``: the calibration's choice;
        :func:`get_recipe` turns it on for ``smoothed_kroquant+loraq``.
      lowrank: ``None``, ``"loraq"`` (LoRaQ, branch in the layer's 4-bit format) or ``"svd"`` (SVDQuant's 16-bit SVD
        branch).
      smooth_svd_rank: rank (or fraction of ``min(o, d)``) of the 16-bit SVD branch inside the SmoothQuant search;
        ``None`` (default): the paper's 32 when the recipe has a low-rank branch that carries the main part of
        ``W T^{-T}`` (the search then models the deployed layer), 0 without one (plain SmoothQuant, searched for the
        plain 4-bit weight) and with ``gptq.lowrank_order="gptq_first"`` (its branch carries GPTQ's error only). It
        replaces ``smoothquant.svd_rank``.
      gptq: ``None`` (the stored weight is rounded to nearest) or the :class:`kroquant_jax.gptq.GPTQConfig` of GPTQ
        rounding with the Hessian of the transformed calibration rows (the ``+gptq`` suffix of :func:`get_recipe`).
      calibration: the calibration engine's settings; ``calibration.transform`` is ``None`` (filled in with
        ``transform``) or equal to ``transform`` (anything else raises).
      smoothquant, loraq, svdquant: the other stages' settings (each used only by the recipes that run the stage); a
        stage that runs must have the format of ``calibration.objective.fmt``, the one the layer is stored in (the
        LoRaQ branch is stored in it too).
      run: the run-level settings every stage reads (rows, seed, sharding, progress).
    """

    transform: str = "kron_lu"
    train: bool = True
    smooth_init: bool = False
    starts: Optional[tuple[str, ...]] = None
    select_with_branch: Optional[bool] = None
    lowrank: Optional[Literal["loraq", "svd"]] = None
    smooth_svd_rank: Optional[int | float] = None
    gptq: Optional[GPTQConfig] = None
    calibration: CalibrationConfig = CalibrationConfig(transform=None)
    smoothquant: SmoothQuantConfig = SmoothQuantConfig()
    loraq: LoRaQConfig = LoRaQConfig()
    svdquant: SVDQuantConfig = SVDQuantConfig()
    run: RunConfig = RunConfig()

    def __post_init__(self):
        transforms.get(self.transform)
        if self.lowrank not in (None, "loraq", "svd"):
            raise ValueError(f"Recipe.lowrank={self.lowrank!r} must be None, 'loraq' or 'svd'")
        if self.gptq is not None and not isinstance(self.gptq, GPTQConfig):
            raise ValueError(f"Recipe.gptq={self.gptq!r} must be None or a GPTQConfig")
        if self.smooth_init and self.transform not in ("diagonal", "smoothed_kron"):
            raise ValueError(f"Recipe.smooth_init needs transform 'diagonal' or 'smoothed_kron', got "
                             f"{self.transform!r}")
        if self.starts is not None:
            if self.transform != "smoothed_kron" or not self.smooth_init:
                raise ValueError(f"Recipe.starts={self.starts!r} needs transform 'smoothed_kron' with smooth_init, got "
                                 f"transform {self.transform!r}, smooth_init={self.smooth_init}")
            unknown = [n for n in self.starts if n not in transforms.smoothed_kron.STARTS]
            if unknown or not self.starts or len(set(self.starts)) != len(self.starts):
                raise ValueError(f"Recipe.starts={self.starts!r} must name distinct starts of "
                                 f"{list(transforms.smoothed_kron.STARTS)}")
        if self.select_with_branch and self.lowrank != "loraq":
            raise ValueError(f"Recipe.select_with_branch needs lowrank='loraq', got lowrank={self.lowrank!r}")
        if self.select_with_branch and self.gptq is not None and self.gptq.lowrank_order == "gptq_first":
            raise ValueError("Recipe.select_with_branch scores each candidate with a branch fitted to its rounded-to-"
                             "nearest residual, which gptq.lowrank_order='gptq_first' does not store (its branch fits "
                             "GPTQ's error): turn one of them off")
        stored = self.calibration.objective.fmt  # the format the layer's weight and activations are stored in
        for stage, runs in (("smoothquant", self.smooth_init), ("loraq", self.lowrank == "loraq"),
                            ("svdquant", self.lowrank == "svd")):
            if runs and getattr(self, stage).fmt != stored:
                raise ValueError(f"Recipe.{stage}.fmt={getattr(self, stage).fmt.name} differs from "
                                 f"calibration.objective.fmt={stored.name}: that stage would fit the layer for a "
                                 "format it is not stored in; give both the same format")
        if self.calibration.transform is None:
            object.__setattr__(self, "calibration", dataclasses.replace(self.calibration, transform=self.transform))
        elif self.calibration.transform != self.transform:
            raise ValueError(f"Recipe.transform={self.transform!r} conflicts with calibration.transform="
                             f"{self.calibration.transform!r} (leave calibration.transform None)")


#: The methods of the paper's comparison (add ``+loraq`` to any name for the LoRaQ branch, ``+gptq`` for GPTQ rounding;
#: :func:`get_recipe`).
RECIPES = {
    "rtn": Recipe(transform="identity", train=False),
    "smoothquant": Recipe(transform="diagonal", train=False, smooth_init=True),
    "hadamard32": Recipe(transform="hadamard32", train=False),
    "kroquant": Recipe(transform="kron_lu"),
    "smoothed_kroquant": Recipe(transform="smoothed_kron", smooth_init=True,
                                starts=("hadamard", "smoothquant_hadamard", "smoothquant")),
    "svdquant": Recipe(transform="diagonal", train=False, smooth_init=True, lowrank="svd"),
}


#: The suffixes :func:`get_recipe` accepts after a base name, and what each changes.
RECIPE_SUFFIXES = {"loraq": "the LoRaQ low-rank branch", "gptq": "GPTQ weight rounding (GPTQConfig())"}


def get_recipe(name: str, **overrides) -> Recipe:
    """``RECIPES[base]`` for ``name = "<base>[+suffix]..."`` with field ``overrides`` (a ``calibration`` override may
    leave its ``transform`` ``None``: the recipe's is filled in).

    Suffixes (:data:`RECIPE_SUFFIXES`, each at most once, in any order): ``+loraq`` adds the LoRaQ branch, ``+gptq``
    rounds the stored weight with GPTQ (``gptq=GPTQConfig()``), e.g. ``smoothed_kroquant+gptq+loraq``,
    ``svdquant+gptq``, ``rtn+gptq``. ``smoothed_kroquant+loraq`` (with or without ``+gptq``) chooses its transform
    with the branch (``select_with_branch=True``)."""
    base, *extras = name.split("+")
    if base not in RECIPES or any(e not in RECIPE_SUFFIXES for e in extras) or len(set(extras)) != len(extras):
        raise KeyError(f"unknown recipe {name!r}; available: {sorted(RECIPES)}, each with the suffixes "
                       f"{['+' + e for e in RECIPE_SUFFIXES]} (each at most once), e.g. 'smoothed_kroquant+gptq+loraq'")
    r = RECIPES[base]
    if "loraq" in extras:
        # Smoothed KroQuant's candidates are judged with their branch: its transform trained alone loses to its
        # untrained SmoothQuant start once LoRaQ is added (docs/calibration.md, "Choosing with the branch").
        r = dataclasses.replace(r, lowrank="loraq",
                                select_with_branch=True if r.transform == "smoothed_kron" else r.select_with_branch)
    if "gptq" in extras:
        r = dataclasses.replace(r, gptq=GPTQConfig())
    if "calibration" in overrides and overrides["calibration"].transform is None:
        overrides["calibration"] = dataclasses.replace(overrides["calibration"], transform=r.transform)
    return dataclasses.replace(r, **overrides)


def parse_rank(text: str, minimum: int = 1) -> int | float:
    """A branch rank on the command line: ``"128"`` -> 128 (absolute, at least ``minimum``), ``"0.125"`` -> 0.125
    (a fraction of each layer's ``min(o, d)``, :func:`kroquant_jax.lowrank.resolve_rank`). Raises
    ``argparse.ArgumentTypeError``."""
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor a fraction in (0, 1]") from None
        if not 0.0 < value <= 1.0:
            raise argparse.ArgumentTypeError(f"{text!r}: a fractional rank must be in (0, 1]") from None
        return value
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r}: a rank must be >= {minimum}")
    return value


def split_rows_wanted(args: argparse.Namespace) -> int:
    """The activation rows per layer that the row split of :func:`add_recipe_arguments`' options asks for
    (calibration + validation + test, each the flag or :class:`RunConfig`'s default): what a capture should keep so
    that no layer takes :func:`kroquant_jax.layerset.split_rows`' fallback."""
    defaults = RunConfig()
    return ((args.calib_rows or defaults.num_rows) + (args.calib_validation or defaults.num_validation)
            + (args.calib_test or defaults.num_test))


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the recipe settings every entry point shares (each defaults to ``None``: the recipe's own value); read
    them back with :func:`recipe_from_args`."""
    g = parser.add_argument_group("recipe settings (default: each recipe's own)")
    g.add_argument("--calib-steps", type=int, help="Adam steps of a learned transform (default 100)")
    g.add_argument("--lr-schedule", choices=("constant", "cosine"), help="calibration learning-rate schedule")
    g.add_argument("--select-every", type=int,
                   help="score the iterate on the validation rows every N steps and keep the best (0: the last)")
    g.add_argument("--regularizer-grad", choices=("ste", "detached"),
                   help="gradient through Q inside L_A and L_W (objectives.ObjectiveConfig)")
    g.add_argument("--precision", choices=("highest", "high", "default"), help="matmul precision of the loss")
    g.add_argument("--calib-rows", type=int, help="calibration rows per layer (default 1024)")
    g.add_argument("--calib-validation", "--calib-heldout", dest="calib_validation", type=int,
                   help="validation rows per layer (default 256)")
    g.add_argument("--calib-test", type=int, help="test rows per layer (default 256)")
    g.add_argument("--max-layers-per-program", type=int, help="layers calibrated together (default 64)")
    g.add_argument("--rank", "--lora-rank", dest="rank", type=parse_rank,
                   help="rank of the low-rank branch (LoRaQ default 128, SVDQuant 32): an int, or a fraction of each "
                        "layer's min(o, d), e.g. 0.125; a method spec '<recipe>@<rank>' sets it for one recipe")
    g.add_argument("--smooth-svd-rank", type=functools.partial(parse_rank, minimum=0),
                   help="rank of the 16-bit SVD branch inside the SmoothQuant search (default 32 with a branch, else 0)")
    g.add_argument("--smoothed-starts", nargs="+", choices=tuple(transforms.smoothed_kron.STARTS), metavar="START",
                   help="smoothed KroQuant's initial transforms, of " + ", ".join(transforms.smoothed_kron.STARTS)
                        + " (default: the recipe's)")
    g.add_argument("--select-with-branch", choices=("on", "off"),
                   help="a '+loraq' recipe: choose each layer's transform among the calibration's candidates by the "
                        "whole layer's validation error, one LoRaQ branch per candidate (Recipe.select_with_branch)")
    g.add_argument("--loraq-steps", type=int, help="LoRaQ Adam steps (default 500)")
    g.add_argument("--rotation-steps", type=int, help="LoRaQ Cayley rotation steps (default 500)")
    g.add_argument("--svd-refine", type=int, help="SVDQuant refinement candidates (default 0; paper: up to 100)")
    g.add_argument("--sq-grid", type=int, help="points per axis of SmoothQuant's (α, β) grid (default 11)")
    g.add_argument("--gptq-damp", type=float, help="GPTQ dampening, relative to mean(diag H) (default 0.01)")
    g.add_argument("--gptq-act-order", choices=("on", "off"), help="GPTQ act-order in whole scale groups (default off)")
    g.add_argument("--gptq-scales", choices=("dynamic", "static"),
                   help="GPTQ group scales from the error-updated (dynamic, default) or the original weights")
    g.add_argument("--gptq-order", choices=("branch_first", "gptq_first"),
                   help="GPTQ and the low-rank branch: branch fitted first, GPTQ of the residual (default), or GPTQ "
                        "first, branch fitted to its error in the H-norm (kroquant_jax.gptq.GPTQConfig)")


#: The destinations :func:`add_recipe_arguments` defines (the settings :func:`recipe_from_args` reads).
_RECIPE_ARGUMENTS = ("calib_steps", "lr_schedule", "select_every", "regularizer_grad", "precision", "calib_rows",
                     "calib_validation", "calib_test", "max_layers_per_program", "rank", "smooth_svd_rank",
                     "smoothed_starts", "select_with_branch", "loraq_steps", "rotation_steps", "svd_refine", "sq_grid",
                     "gptq_damp", "gptq_act_order", "gptq_scales", "gptq_order")


#: Stage settings of :func:`add_recipe_arguments` and the recipes that read them: a flag given for methods none of
#: which runs its stage would be ignored, so :func:`unused_stage_arguments` names it instead.
_STAGE_ARGUMENTS: dict[str, tuple[str, Callable[[Recipe], bool]]] = {
    **{k: ("a '+gptq' recipe", lambda r: r.gptq is not None)
       for k in ("gptq_damp", "gptq_act_order", "gptq_scales", "gptq_order")},
    "loraq_steps": ("a '+loraq' recipe", lambda r: r.lowrank == "loraq"),
    "rotation_steps": ("a '+loraq' recipe", lambda r: r.lowrank == "loraq"),
    "svd_refine": ("svdquant", lambda r: r.lowrank == "svd"),
    "rank": ("a recipe with a low-rank branch", lambda r: r.lowrank is not None),
    "sq_grid": ("a recipe with the SmoothQuant search", lambda r: r.smooth_init),
    "smooth_svd_rank": ("a recipe with the SmoothQuant search", lambda r: r.smooth_init),
    "smoothed_starts": ("a smoothed_kroquant recipe", lambda r: r.transform == "smoothed_kron" and r.smooth_init),
    "select_with_branch": ("a '+loraq' recipe", lambda r: r.lowrank == "loraq"),
}


def unused_stage_arguments(recipes: Mapping[str, Recipe], args: argparse.Namespace | Mapping[str, Any]) -> list[str]:
    """One message per stage flag of :func:`add_recipe_arguments` that was given (not ``None``) although none of
    ``recipes`` (``{method spec: Recipe}``) runs its stage, e.g. ``--gptq-damp`` for ``rtn kroquant``; empty when
    every given flag is used. ``kroquant calibrate`` / ``quantize-checkpoint`` turn a non-empty list into a one-line
    error, ``kroquant evaluate`` / ``demo`` into a note (runs to be merged share one command line)."""
    given = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    messages = []
    for dest, (needs, runs_stage) in _STAGE_ARGUMENTS.items():
        if given.get(dest) is not None and not any(runs_stage(r) for r in recipes.values()):
            flag = "--" + dest.replace("_", "-")
            messages.append(f"{flag} applies to {needs}, and none of the methods ({', '.join(recipes)}) has that stage")
    return messages


def recipe_from_args(spec: str, args: argparse.Namespace | Mapping[str, Any], **run_fields) -> Recipe:
    """The recipe of a method ``spec`` with the settings of :func:`add_recipe_arguments` (parsed ``args``, or a
    mapping of the same destinations, e.g. ``{"calib_steps": 20, "rank": 0.125}``; ``None`` or missing ones keep the
    recipe's values) and ``run_fields`` (:class:`RunConfig` fields, e.g. ``seed``, ``progress``).

    ``spec`` is a :func:`get_recipe` name, optionally with its own branch rank after an ``@``
    (``kroquant+loraq@128``, ``svdquant@0.125``; otherwise ``args.rank``). Raises ``ValueError`` naming the spec.
    """
    given_args = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    unknown = set(given_args) - set(_RECIPE_ARGUMENTS)
    if not isinstance(args, argparse.Namespace) and unknown:
        raise ValueError(f"recipe_from_args: unknown settings {sorted(unknown)}; known: {list(_RECIPE_ARGUMENTS)}")
    args = argparse.Namespace(**{k: given_args.get(k) for k in _RECIPE_ARGUMENTS})
    name, at, rank_text = spec.partition("@")
    try:
        recipe = get_recipe(name)
    except KeyError as err:
        raise ValueError(err.args[0]) from None
    if at and recipe.lowrank is None:
        raise ValueError(f"method {spec!r}: a rank after '@' needs a recipe with a low-rank branch "
                         f"('<name>+loraq@<rank>', 'svdquant@<rank>')")
    try:
        rank = parse_rank(rank_text) if at else args.rank
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"method {spec!r}: {err}") from None

    def given(**fields):
        return {k: v for k, v in fields.items() if v is not None}

    objective = recipe.calibration.objective
    objective = dataclasses.replace(objective, **given(regularizer_grad=args.regularizer_grad,
                                                       precision=args.precision))
    calibration = dataclasses.replace(recipe.calibration, objective=objective, **given(
        steps=args.calib_steps, lr_schedule=args.lr_schedule, select_every=args.select_every,
        max_layers_per_program=args.max_layers_per_program))
    run = dataclasses.replace(recipe.run, **given(num_rows=args.calib_rows, num_validation=args.calib_validation,
                                                  num_test=args.calib_test), **run_fields)
    # Only the stages the recipe runs take their settings (so the others, and a recipe's hash, stay as named).
    loraq, svdquant, smooth, smooth_svd_rank = recipe.loraq, recipe.svdquant, recipe.smoothquant, recipe.smooth_svd_rank
    gptq_cfg = recipe.gptq
    if gptq_cfg is not None:
        act_order = None if args.gptq_act_order is None else args.gptq_act_order in ("on", True)
        gptq_cfg = dataclasses.replace(gptq_cfg, **given(damp=args.gptq_damp, act_order=act_order,
                                                         scales=args.gptq_scales, lowrank_order=args.gptq_order))
    if recipe.lowrank == "loraq":
        loraq = dataclasses.replace(loraq, **given(steps=args.loraq_steps, rotation_steps=args.rotation_steps,
                                                   rank=rank))
    if recipe.lowrank == "svd":
        svdquant = dataclasses.replace(svdquant, **given(refine_steps=args.svd_refine, rank=rank))
    if recipe.smooth_init:
        if args.sq_grid is not None:
            grid = tuple(round(float(x), 4) for x in np.linspace(0.0, 1.0, args.sq_grid))
            smooth = dataclasses.replace(smooth, alphas=grid, betas=grid)
        if args.smooth_svd_rank is not None:
            smooth_svd_rank = args.smooth_svd_rank
    starts, select_with_branch = recipe.starts, recipe.select_with_branch
    if args.smoothed_starts is not None and recipe.transform == "smoothed_kron" and recipe.smooth_init:
        starts = tuple(args.smoothed_starts)
    if args.select_with_branch is not None and recipe.lowrank == "loraq":
        select_with_branch = args.select_with_branch in ("on", True)
    elif gptq_cfg is not None and gptq_cfg.lowrank_order == "gptq_first":
        select_with_branch = False  # the recipe's default cannot score what gptq_first stores (Recipe refuses both)
    return dataclasses.replace(recipe, calibration=calibration, run=run, loraq=loraq, svdquant=svdquant,
                               smoothquant=smooth, smooth_svd_rank=smooth_svd_rank, gptq=gptq_cfg, starts=starts,
                               select_with_branch=select_with_branch)


def _relative_error(y, ref) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), np.finfo(np.float32).tiny))


# Per-layer host-side steps of _quantize_batch as one compiled program each (per shape, transform and format): run
# eagerly, each of their small ops (the transform's blocks, the einsum, the norms of the weight error) would be
# compiled on its own for every new layer shape.
@functools.partial(jax.jit, static_argnames="transform")
def _transformed_activations(a: jax.Array, params, *, transform: str) -> jax.Array:
    """``A T (n, d)`` of the rows ``a (n, d)`` under the ``transform`` parameters ``params``."""
    return transforms.apply_to_activations(a, transforms.get(transform).blocks(params))


_weight_error = jax.jit(lowrank.weight_error, static_argnames=("weight_fmt", "branch_fmt"))


def _quantize_batch(layers: dict[str, LayerData], recipe: Recipe, pad_to: int = 1) -> tuple[dict, dict]:
    """All stages for a batch of layers (any shapes; programs sized for ``pad_to`` layers). Returns
    ``({name: QuantizedLinear}, {name: report})``."""
    from kroquant_jax import qlinear

    run = dataclasses.replace(recipe.run, progress=False)  # one bar: quantize_layer_set's
    cal = recipe.calibration if recipe.train else dataclasses.replace(recipe.calibration, steps=0)
    fmt = cal.objective.fmt
    reports = {n: {"transform": recipe.transform} for n in layers}
    inits = None
    if recipe.smooth_init:
        svd_rank = recipe.smooth_svd_rank
        if svd_rank is None:
            branch_first = recipe.gptq is None or recipe.gptq.lowrank_order != "gptq_first"
            svd_rank = 32 if recipe.lowrank and branch_first else 0
        sq = smoothquant.smoothquant_layers(layers, dataclasses.replace(recipe.smoothquant, svd_rank=svd_rank),
                                            run=run, pad_to=pad_to)
        inits = {}
        for n, res in sq.items():
            reports[n].update(alpha=res.alpha, beta=res.beta)
            if recipe.transform == "diagonal":
                inits[n] = [transforms.diagonal.from_scales(res.gamma)]
            else:
                inits[n] = [transforms.smoothed_kron.start(name, layers[n].weight.shape[1], res.gamma)
                            for name in recipe.starts or ("hadamard", "smoothquant_hadamard")]
    calib = calibrate_layers(layers, cal, inits=inits, run=run, pad_to=pad_to)
    selected_branches = {}
    if recipe.select_with_branch:
        calib, selected_branches, branch_errors = _select_with_branch(layers, calib, recipe, run, pad_to)
        for n, errs in branch_errors.items():
            reports[n].update(branch_candidates=errs)
    w_t, a_cal_t, a_test = {}, {}, {}
    for n, layer in layers.items():
        c = calib[n]
        reports[n].update(chosen=c.chosen, transform_validation_error=c.validation_error,
                          transform_test_error=c.test_error, candidates=dict(c.validation_errors),
                          candidates_test=dict(c.test_errors))
        # W T^{-T}: the program that build_qlinear runs for a layer without a branch (so it compiles once for both)
        w_t[n] = np.asarray(qlinear.residual_weight(layer.weight, transform=recipe.transform,
                                                    transform_params=c.params, lowrank_quantized=False))
        rows = layer_rows(n, layer, run)
        a_test[n] = rows.test
        # the slice sizes: fewer than the run asked for means the fallback split (a fifth validates, a fifth tests)
        reports[n]["rows"] = {"calibration": len(rows.calibration), "validation": len(rows.validation),
                              "test": len(rows.test)}
        if recipe.lowrank == "svd" or recipe.gptq is not None:
            a_cal_t[n] = np.asarray(_transformed_activations(jnp.asarray(rows.calibration), c.params,
                                                             transform=recipe.transform))
    hessians = {n: np.asarray(gptq.hessian(a_cal_t[n])) for n in layers} if recipe.gptq is not None else {}
    quantized_branch = recipe.lowrank == "loraq" and recipe.loraq.quantize_branch
    rounded = {}
    gptq_first = recipe.lowrank is not None and recipe.gptq is not None and recipe.gptq.lowrank_order == "gptq_first"
    if gptq_first:
        rounded, branches = _branches_after_gptq(w_t, hessians, recipe, fmt, run, pad_to)
    elif recipe.lowrank == "loraq":
        todo = {n: w for n, w in w_t.items() if n not in selected_branches}
        branches = {**lowrank.loraq_layers(todo, recipe.loraq, run=run, pad_to=pad_to), **selected_branches}
    elif recipe.lowrank == "svd":
        branches = lowrank.svdquant_layers(w_t, a_cal_t, recipe.svdquant, run=run, pad_to=pad_to)
    else:
        branches = {}
    lowranks = {n: (branches[n].left, branches[n].right) if n in branches else None for n in layers}
    if recipe.gptq is not None and not gptq_first:  # GPTQ of the residual against the branch as stored
        residuals = {n: np.asarray(qlinear.residual_weight(
            layer.weight, transform=recipe.transform, transform_params=calib[n].params, lowrank=lowranks[n],
            lowrank_quantized=quantized_branch, lowrank_fmt=recipe.loraq.fmt)) for n, layer in layers.items()}
        rounded = gptq.gptq_layers(residuals, hessians, fmt, recipe.gptq, run=run, pad_to=pad_to)
    out = {}
    forward = jax.jit(qlinear.qlinear_forward, static_argnames="path")
    for n, layer in layers.items():
        lr = lowranks[n]
        if n in branches:
            reports[n].update(weight_error_init=float(branches[n].error_init),  # the fit's start: see LowRank
                              weight_error_final=float(branches[n].error_final))
        q = qlinear.build_qlinear(layer.weight, layer.bias, transform=recipe.transform,
                                  transform_params=calib[n].params, lowrank=lr, lowrank_quantized=quantized_branch,
                                  weight_fmt=fmt, act_fmt=fmt, lowrank_fmt=recipe.loraq.fmt,
                                  quantized_weight=rounded.get(n), name=n)
        y = np.asarray(forward(q, jnp.asarray(a_test[n])))
        if layer.bias is not None:
            y = y - layer.bias
        ref = a_test[n].astype(np.float64) @ layer.weight.T.astype(np.float64)
        reports[n]["heldout_error"] = _relative_error(y, ref)
        if recipe.gptq is not None:  # the layer as stored, Q + B, against W~
            reports[n]["rounding"] = "gptq"
            reports[n]["weight_error"] = _relative_error(np.asarray(qlinear.effective_weight(q)), w_t[n])
        else:
            reports[n]["weight_error"] = float(_weight_error(jnp.asarray(w_t[n]), None, None, weight_fmt=fmt)
                                               if lr is None else np.float32(reports[n]["weight_error_final"]))
        out[n] = q
    return out, reports


def fallback_split_layers(reports: Mapping[str, dict], run: RunConfig) -> dict[str, dict]:
    """The layers of :func:`quantize_layer_set`'s ``reports`` that had fewer activation rows than ``run`` asks for
    (``num_rows + num_validation + num_test``) and so took :func:`kroquant_jax.layerset.split_rows`'s fallback (a
    fifth validates, a fifth tests): ``{name: {"calibration", "validation", "test"} row counts}``. Their reported
    errors rest on fewer test rows. Layers whose report has no ``rows`` (stores written before it was recorded) are
    left out."""
    wanted = {"calibration": run.num_rows, "validation": run.num_validation, "test": run.num_test}
    return {n: dict(r["rows"]) for n, r in reports.items()
            if "rows" in r and any(r["rows"][k] < v for k, v in wanted.items())}


def _branch_candidates(c: LayerCalibration) -> list[str]:
    """The labels of a calibration's candidates with a finite validation error: every start as started and every
    trained result (a transform that is worse alone can be the best one with a branch, e.g. SmoothQuant's own start)."""
    return sorted(lab for lab, e in c.validation_errors.items() if np.isfinite(e) and lab in c.candidate_params)


def _select_with_branch(layers: dict[str, LayerData], calib: dict[str, LayerCalibration], recipe: Recipe,
                        run: RunConfig, pad_to: int) -> tuple[dict, dict, dict]:
    """``Recipe.select_with_branch``: for every layer with more than one candidate transform, LoRaQ for each candidate
    and the layer (eq. 11, weight rounded to nearest) scored on the validation rows; the best one is kept.

    Returns ``(calib with the kept candidate per layer, {name: its LowRank} for the layers chosen here,
    {name: {label: validation error with the branch}})``."""
    from kroquant_jax import qlinear

    fmt = recipe.calibration.objective.fmt
    quantized_branch = recipe.loraq.quantize_branch
    jobs = {n: _branch_candidates(c) for n, c in calib.items()}
    jobs = {n: labels for n, labels in jobs.items() if len(labels) > 1}
    if not jobs:
        return calib, {}, {}
    key = "{}@candidate:{}".format
    w_t = {key(n, lab): np.asarray(qlinear.residual_weight(
        layers[n].weight, transform=recipe.transform, transform_params=calib[n].candidate_params[lab],
        lowrank_quantized=False)) for n, labels in jobs.items() for lab in labels}
    most = max(len(labels) for labels in jobs.values())
    branches = lowrank.loraq_layers(w_t, recipe.loraq, run=run, pad_to=pad_to * most)
    forward = jax.jit(qlinear.qlinear_forward, static_argnames="path")
    calib, kept, errors = dict(calib), {}, {}
    for n, labels in jobs.items():
        layer, c = layers[n], calib[n]
        a_val = layer_rows(n, layer, run).validation
        ref = a_val.astype(np.float64) @ layer.weight.T.astype(np.float64)
        errors[n] = {}
        for lab in labels:
            b = branches[key(n, lab)]
            q = qlinear.build_qlinear(layer.weight, None, transform=recipe.transform,
                                      transform_params=c.candidate_params[lab], lowrank=(b.left, b.right),
                                      lowrank_quantized=quantized_branch, weight_fmt=fmt, act_fmt=fmt,
                                      lowrank_fmt=recipe.loraq.fmt, name=n)
            errors[n][lab] = _relative_error(np.asarray(forward(q, jnp.asarray(a_val))), ref)
        best = min(errors[n], key=lambda lab: (errors[n][lab], lab))
        calib[n] = dataclasses.replace(c, params=c.candidate_params[best], chosen=best)
        kept[n] = branches[key(n, best)]
    return calib, kept, errors


def _branches_after_gptq(w_t: dict, hessians: dict, recipe: Recipe, fmt, run: RunConfig, pad_to: int
                         ) -> tuple[dict, dict[str, lowrank.LowRank]]:
    """``GPTQConfig.lowrank_order="gptq_first"``: GPTQ of each transformed weight ``W~`` (``Q``, the stored 4-bit
    weight), then the recipe's branch (LoRaQ's rank and storage, or SVDQuant's) fitted to that rounding's error
    ``E = W~ - Q`` in the ``H``-norm (:func:`kroquant_jax.gptq.whitened_low_rank`). Returns ``({name: Q}, {name:
    LowRank})``; ``error_init`` / ``error_fit`` / ``error_final`` of a ``LowRank`` are the relative weight errors of
    ``Q`` alone, with the branch, and with the branch as stored."""
    cfg = recipe.gptq
    first = gptq.gptq_layers(w_t, hessians, fmt, cfg, run=run, pad_to=pad_to)
    if recipe.lowrank == "loraq":
        rank_cfg, branch_fmt = recipe.loraq.rank, recipe.loraq.fmt if recipe.loraq.quantize_branch else None
    else:
        rank_cfg, branch_fmt = recipe.svdquant.rank, None
    fit = jax.jit(gptq.whitened_low_rank, static_argnames=("rank", "damp"))
    out = {}
    for n, w in w_t.items():
        rank = lowrank.resolve_rank(rank_cfg, w.shape, branch_fmt and branch_fmt.block_size, n)
        lowrank.check_rank(n, w.shape, rank, branch_fmt)
        w = jnp.asarray(w, jnp.float32)
        err = w - formats.dequantize(first[n], jnp.float32)
        left, right = fit(err, jnp.asarray(hessians[n]), rank=rank, damp=cfg.damp)
        norm = max(float(jnp.linalg.norm(w)), float(np.finfo(np.float32).tiny))
        e_init = float(jnp.linalg.norm(err)) / norm
        e_fit = float(jnp.linalg.norm(err - lowrank.branch(left, right, None))) / norm
        e_stored = float(jnp.linalg.norm(err - lowrank.branch(left, right, branch_fmt))) / norm
        out[n] = lowrank.LowRank(np.asarray(left), np.asarray(right), np.float32(e_init), np.float32(e_fit),
                                 np.float32(e_stored))
    return first, out


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
      of the final layer on the test rows, which nothing was chosen on), ``transform_validation_error`` and
      ``transform_test_error`` (the kept transform alone), ``chosen``, ``candidates`` (validation errors) and
      ``candidates_test``, ``rows`` (``{"calibration", "validation", "test"}`` row counts: below the run's
      settings where the layer took the fallback split) and, where they apply, ``alpha``/``beta`` and the weight
      errors; ``resumed`` is ``True`` for layers loaded from the store.

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
    todo, split_changed = [], []
    for n in layers:
        if store is not None and not overwrite and n in store:
            done_layers[n], rep = store.load(n)
            reports[n] = {k: v for k, v in rep.items() if k not in ("name", "fingerprint")}
            reports[n]["resumed"] = True
            split = recipe.run.split(n, layers[n].activations.shape[0])
            now = {"calibration": len(split.calibration), "validation": len(split.validation), "test": len(split.test)}
            if "rows" in rep and dict(rep["rows"]) != now:  # the same settings, another split: the fallback's rule
                split_changed.append((n, dict(rep["rows"]), now))
        else:
            todo.append(n)
    if split_changed:
        n, old, now = split_changed[0]
        others = f"; {len(split_changed) - 1} more stored layer(s) too" if len(split_changed) > 1 else ""
        raise provenance.StaleResultError(n, [f"row split {old} -> {now} (the rule for layers with fewer rows than "
                                              f"asked changed){others}"], store.directory)
    # The batches of the whole layer set, less the layers already stored: a resumed run runs the rest in the programs
    # (padded to the sizes) an uninterrupted one would, since a learned transform's last bits depend on that size.
    by_shape: dict[tuple, list[str]] = {}
    for n in layers:
        by_shape.setdefault(layers[n].weight.shape, []).append(n)
    pending = set(todo)
    batches = []  # (names, layers per program)
    for names in by_shape.values():
        per_batch = math.ceil(len(names) / math.ceil(len(names) / recipe.calibration.max_layers_per_program))
        for i in range(0, len(names), per_batch):
            left = [n for n in names[i:i + per_batch] if n in pending]
            if left:
                batches.append((left, per_batch))
    bar = progress_bar(len(todo), recipe.run.progress, "quantize")
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

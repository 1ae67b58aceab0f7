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
   ``max_layers_per_program`` (memory bound); every chunk of a group is padded to the same size so it compiles once.
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
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kroquant_jax import objectives, transforms
from kroquant_jax.layerset import LayerData, LayerSet, as_layer_set, split_rows

__all__ = ["CalibrationConfig", "LayerCalibration", "calibrate_layers", "layer_rows", "make_mesh", "run_stacked"]


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


def make_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A 1-D mesh ``("layers",)`` over ``devices`` (default: all local devices)."""
    devices = jax.local_devices() if devices is None else list(devices)
    return Mesh(np.array(devices), ("layers",))


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
    return params, losses, lambdas, evaluate(params0, a_held, w), evaluate(params, a_held, w)


_program_jit = jax.jit(_program, static_argnames=("parameterization", "steps", "learning_rate", "obj_cfg"))


def _stack(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def _take(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: np.asarray(x[i]), tree)


def _pad_rows(tree: Any, size: int) -> Any:
    """Pads the leading axis to ``size`` by repeating the first entry (padding jobs are computed and dropped)."""
    def pad(x):
        x = np.asarray(x)
        if x.shape[0] == size:
            return x
        return np.concatenate([x, np.repeat(x[:1], size - x.shape[0], axis=0)])
    return jax.tree.map(pad, tree)


def run_stacked(fn, stacked_inputs: Sequence[Any], num_jobs: int, *, max_per_program: int, shard: bool,
                progress=None) -> list:
    """Runs ``fn(*inputs)`` over chunks of the leading (layer) axis of ``stacked_inputs``; returns per-chunk outputs
    (host numpy, padding dropped) concatenated along the leading axis.

    Every chunk is padded to the same size (a multiple of the local device count when sharding) so that ``fn``
    compiles once; with ``shard`` each input leaf is placed with ``NamedSharding(mesh, P("layers"))``.
    """
    n_dev = jax.local_device_count() if shard else 1
    chunk = min(max_per_program, num_jobs)
    chunk = int(math.ceil(chunk / n_dev) * n_dev)
    sharding = NamedSharding(make_mesh(), PartitionSpec("layers")) if shard and n_dev > 1 else None
    outputs = []
    for start in range(0, num_jobs, chunk):
        stop = min(start + chunk, num_jobs)
        inputs = [_pad_rows(jax.tree.map(lambda x: np.asarray(x)[start:stop], t), chunk) for t in stacked_inputs]
        if sharding is not None:
            inputs = [jax.tree.map(lambda x: jax.device_put(x, sharding), t) for t in inputs]
        out = jax.device_get(fn(*inputs))
        outputs.append(jax.tree.map(lambda x: np.asarray(x)[: stop - start], out))
        if progress is not None:
            progress.update(stop - start)
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *outputs)


def _progress_bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="layer")


def calibrate_layers(layer_set: LayerSet, config: CalibrationConfig = CalibrationConfig(),
                     inits: Optional[Mapping[str, Sequence[Any]]] = None) -> dict[str, LayerCalibration]:
    """Calibrates the transform of every layer of ``layer_set`` (see the module docstring).

    Args:
      layer_set: ``{name: (W (o, d), bias | None, A_rows (n, d))}``; validated (finite, shapes, d % 32 == 0).
      config: :class:`CalibrationConfig`.
      inits: optional ``{name: [params, ...]}`` initial transforms per layer (default ``[parameterization.init(d)]``);
        all initial transforms of a run must share the parameter tree structure.

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
    bar = _progress_bar(len(jobs), config.progress, f"calibrate {config.transform}")
    per_job = {}
    try:
        for group in groups.values():
            params0 = _stack([p for _, _, p in group])
            a_cal = np.stack([rows[n][0] for n, _, _ in group])
            a_held = np.stack([rows[n][1] for n, _, _ in group])
            w = np.stack([layers[n].weight for n, _, _ in group])
            out = run_stacked(fn, [params0, a_cal, a_held, w], len(group),
                              max_per_program=config.max_layers_per_program, shard=config.shard, progress=bar)
            params, losses, lambdas, err_init, err_trained = out
            for i, (name, k, p) in enumerate(group):
                per_job[(name, k)] = (p, _take(params, i), losses[i], lambdas[i], float(err_init[i]),
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

"""Layer sets: the calibration input ``{name: (W (o, d), bias (o,) | None, A_rows (n, d))}``, validation, I/O, rows.

A *layer set* maps a layer name to a :class:`LayerData` (plain 3-tuples are accepted and converted): the layer's
weight ``W (o, d)`` (``O = A W^T + b``), its bias or ``None``, and activation samples ``A_rows (n, d)`` recorded at its
input (``models.capture`` produces them; :func:`load_layer_set` reads them back from ``.npz`` / ``.safetensors``).

Calibration rows (:func:`split_rows`): every method sees the same rows of a layer. They depend only on the seed and
the layer's name (never on the method), drawn without replacement into three disjoint slices: *calibration* (used to
optimise), *validation* (used to choose: the best iterate and the safeguard among candidate transforms) and *test*
(used only to report errors).

:class:`RunConfig` holds the settings every stage of a run reads (the row split, its seed, sharding, progress);
the stacked-execution helpers at the end of this module run one program over a stacked layer axis for every stage
(:mod:`kroquant_jax.calibrate`, :mod:`kroquant_jax.smoothquant`, :mod:`kroquant_jax.lowrank`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import numpy as np

from kroquant_jax.fileio import atomic_write_bytes, read_npz
from kroquant_jax.xla_options import unless_set_by_flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kroquant_jax.formats import check_finite

__all__ = ["ENGINE_XLA_OPTIONS", "LayerData", "RowSplit", "RunConfig", "as_layer_set", "atomic_write_bytes",
           "engine_compiler_options", "engine_jit", "group_by_shape", "load_layer_set", "make_mesh", "program_config",
           "progress_bar", "run_groups", "run_stacked", "run_stacked_padded", "save_layer_set", "split_rows",
           "stack_trees", "take_tree", "validate_layer"]


class LayerData(NamedTuple):
    """One linear layer and its activation samples.

    Attributes:
      weight: ``(o, d)``.
      bias: ``(o,)`` or ``None``.
      activations: ``(n, d)`` input rows.
    """

    weight: np.ndarray
    bias: Optional[np.ndarray]
    activations: np.ndarray


LayerSet = Mapping[str, Union[LayerData, tuple]]


def validate_layer(name: str, layer, block: int = 32) -> LayerData:
    """Checks one layer (shapes, width a multiple of ``block``, finite values); returns it as float32 numpy.

    Raises:
      ValueError: naming the layer and the offending tensor/shape.
    """
    if not isinstance(layer, LayerData):
        if len(layer) != 3:
            raise ValueError(f"layer {name!r}: expected (weight, bias, activations), got a {len(layer)}-tuple")
        layer = LayerData(*layer)
    w = np.asarray(layer.weight, np.float32)
    a = np.asarray(layer.activations, np.float32)
    b = None if layer.bias is None else np.asarray(layer.bias, np.float32)
    if w.ndim != 2:
        raise ValueError(f"layer {name!r}: weight must be (o, d), got shape {w.shape}")
    if a.ndim != 2:
        raise ValueError(f"layer {name!r}: activations must be (n, d), got shape {a.shape}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"layer {name!r}: activations {a.shape} and weight {w.shape} disagree on d "
                         f"({a.shape[1]} != {w.shape[1]})")
    if w.shape[1] % block:
        raise ValueError(f"layer {name!r}: d={w.shape[1]} (weight {w.shape}) must be a multiple of {block}")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"layer {name!r}: bias shape {b.shape} does not match weight {w.shape} (expected "
                         f"({w.shape[0]},))")
    if a.shape[0] < 3:
        raise ValueError(f"layer {name!r}: needs at least 3 activation rows (calibration, validation and test), got "
                         f"{a.shape}")
    check_finite(w, f"layer {name!r} weight")
    check_finite(a, f"layer {name!r} activations")
    if b is not None:
        check_finite(b, f"layer {name!r} bias")
    return LayerData(w, b, a)


def as_layer_set(layer_set: LayerSet, block: int = 32) -> dict[str, LayerData]:
    """Validates every layer (see :func:`validate_layer`); returns ``{name: LayerData}`` in the input's order."""
    if not layer_set:
        raise ValueError("empty layer set")
    return {name: validate_layer(name, layer, block) for name, layer in layer_set.items()}


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Indices into a layer's activation rows, three disjoint sorted slices: ``calibration`` (optimise),
    ``validation`` (select: best iterate, safeguard) and ``test`` (report)."""

    calibration: np.ndarray
    validation: np.ndarray
    test: np.ndarray


def layer_seed(seed: int, name: str) -> np.random.Generator:
    """The generator of a layer's row draw: depends on ``seed`` and the layer name only (stable across runs)."""
    return np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])


def split_rows(name: str, num_available: int, num_rows: int, num_validation: int, num_test: int, seed: int
               ) -> RowSplit:
    """Draws a layer's calibration, validation and test rows without replacement (disjoint), deterministic for
    ``seed``.

    One permutation of the rows: its first ``num_validation`` entries validate, the next ``num_rows`` calibrate, the
    next ``num_test`` test (so the calibration and validation rows do not depend on ``num_test``). With fewer than
    ``num_rows + num_validation + num_test`` rows available, validation and test each take at most a fifth of them
    (at least one; never more than asked) and calibration the rest, up to ``num_rows``, in the same permutation order
    (validation first): where all ``num_validation`` rows fit, they are the full split's and the calibration rows the
    first of its.

    Args:
      name: layer name (part of the seed, so layers draw different rows).
      num_available: ``n``, the layer's activation rows.
      num_rows: calibration rows wanted.
      num_validation: validation rows wanted.
      num_test: test rows wanted.
      seed: the run's seed.
    """
    if num_available < 3:
        raise ValueError(f"layer {name!r}: needs at least 3 activation rows (calibration, validation, test), got "
                         f"{num_available}")
    if min(num_rows, num_validation, num_test) < 1:
        raise ValueError(f"layer {name!r}: num_rows={num_rows}, num_validation={num_validation} and "
                         f"num_test={num_test} must be >= 1")
    perm = layer_seed(seed, name).permutation(num_available)
    if num_available >= num_rows + num_validation + num_test:
        n_val, n_cal, n_test = num_validation, num_rows, num_test
    else:
        fifth = max(1, num_available // 5)
        n_val, n_test = min(num_validation, fifth), min(num_test, fifth)
        n_cal = min(num_rows, num_available - n_val - n_test)
    return RowSplit(calibration=np.sort(perm[n_val:n_val + n_cal]), validation=np.sort(perm[:n_val]),
                    test=np.sort(perm[n_val + n_cal:n_val + n_cal + n_test]))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Settings of a run that every stage (SmoothQuant search, calibration, LoRaQ, SVDQuant) reads, so that all of
    them see the same rows and devices.

    Attributes:
      num_rows: calibration rows drawn per layer (default 1024: the paper's 128 samples are whole activation
        matrices, and 128 rows overfit 15 parameters x d/32 blocks).
      num_validation: validation rows per layer (best iterate, safeguard).
      num_test: test rows per layer (the reported errors only).
      seed: seed of the row draw.
      shard: shard the stacked layer axis over all local devices.
      progress: show tqdm progress bars.
    """

    num_rows: int = 1024
    num_validation: int = 256
    num_test: int = 256
    seed: int = 0
    shard: bool = True
    progress: bool = False

    def __post_init__(self):
        for field in ("num_rows", "num_validation", "num_test"):
            if getattr(self, field) < 1:
                raise ValueError(f"RunConfig.{field}={getattr(self, field)} must be >= 1")

    def split(self, name: str, num_available: int) -> RowSplit:
        """:func:`split_rows` of layer ``name`` with this run's settings."""
        return split_rows(name, num_available, self.num_rows, self.num_validation, self.num_test, self.seed)


# ---------------------------------------------------------------------------------------------------------------------
# File I/O: flat key layout "<name>/weight", "<name>/bias", "<name>/activations".
# ---------------------------------------------------------------------------------------------------------------------

_FIELDS = ("weight", "bias", "activations")


def _flatten(layer_set: LayerSet) -> dict[str, np.ndarray]:
    flat = {}
    for name, layer in as_layer_set(layer_set).items():
        if "/" in name.split("/")[-1] or any(name.endswith("/" + f) for f in _FIELDS):
            raise ValueError(f"layer name {name!r} clashes with the file key layout")
        flat[f"{name}/weight"] = layer.weight
        flat[f"{name}/activations"] = layer.activations
        if layer.bias is not None:
            flat[f"{name}/bias"] = layer.bias
    return flat


def save_layer_set(path: str, layer_set: LayerSet) -> None:
    """Saves a layer set to ``path`` (``.npz`` or ``.safetensors``), atomically."""
    flat = _flatten(layer_set)
    if path.endswith(".safetensors"):
        from safetensors.numpy import save

        data = save({k: np.ascontiguousarray(v) for k, v in flat.items()})
    elif path.endswith(".npz"):
        import io

        buf = io.BytesIO()
        np.savez(buf, **flat)
        data = buf.getvalue()
    else:
        raise ValueError(f"layer set path {path!r}: expected a .npz or .safetensors file")
    atomic_write_bytes(path, data)


def load_layer_set(path: str) -> dict[str, LayerData]:
    """Loads a layer set saved by :func:`save_layer_set` (or any file with ``<name>/weight``, ``<name>/activations``
    and optional ``<name>/bias`` keys); validates it."""
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file")
        try:
            flat = load_file(path)
        except SafetensorError as err:  # a truncated or corrupt file: its name, not only the reader's complaint
            raise ValueError(f"{path}: not a readable .safetensors file ({err})") from None
    elif path.endswith(".npz"):
        flat = read_npz(path)
    else:
        raise ValueError(f"layer set path {path!r}: expected a .npz or .safetensors file")
    names: dict[str, dict] = {}
    for key, value in flat.items():
        name, _, field = key.rpartition("/")
        if field not in _FIELDS or not name:
            raise ValueError(f"{path}: unexpected key {key!r} (expected '<layer>/weight|bias|activations')")
        names.setdefault(name, {})[field] = value
    out = {}
    for name, fields in names.items():
        missing = {"weight", "activations"} - set(fields)
        if missing:
            raise ValueError(f"{path}: layer {name!r} lacks {sorted(missing)}")
        out[name] = (fields["weight"], fields.get("bias"), fields["activations"])
    return as_layer_set(out)


# ---------------------------------------------------------------------------------------------------------------------
# Stacked execution over the layer axis (shared by calibrate, smoothquant, lowrank).
# ---------------------------------------------------------------------------------------------------------------------


#: XLA options every stacked engine program is compiled with (:func:`engine_jit`). On the GPU almost all of a
#: program's compile time was XLA's autotuner compiling Triton GEMM candidates; with Triton GEMMs off the products go
#: to cuBLAS, whose candidates need no kernel generation: the programs compile about 14x faster and run as fast
#: (docs/calibration.md, "Where the GPU compile time goes"). Turning autotuning off altogether
#: (``xla_gpu_autotune_level=0``) compiles fast too but runs 3-4x slower. The CPU ignores the option. It applies to
#: the engine's programs only; the serving kernels keep XLA's defaults.
ENGINE_XLA_OPTIONS: dict[str, Any] = {"xla_gpu_enable_triton_gemm": False}


def engine_compiler_options(xla_flags: Optional[str] = None) -> dict[str, Any]:
    """:data:`ENGINE_XLA_OPTIONS` less the options that ``xla_flags`` (default: the ``XLA_FLAGS`` environment
    variable) sets: a flag the user gives explicitly (``XLA_FLAGS=--xla_gpu_autotune_level=4``) is never overridden
    by a per-program option."""
    return unless_set_by_flags(ENGINE_XLA_OPTIONS, xla_flags)


def engine_jit(fun: Callable, **jit_kwargs) -> Callable:
    """``jax.jit(fun, **jit_kwargs)`` compiled with :func:`engine_compiler_options` (read now: for a module-level
    program, when the module is imported). Every stacked program of the engine (calibration, SmoothQuant search,
    LoRaQ, SVDQuant, GPTQ) is made with it."""
    return jax.jit(fun, compiler_options=engine_compiler_options() or None, **jit_kwargs)


def make_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A 1-D mesh ``("layers",)`` over ``devices`` (default: all local devices)."""
    devices = jax.local_devices() if devices is None else list(devices)
    return Mesh(np.array(devices), ("layers",))


def stack_trees(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def take_tree(tree: Any, i: int) -> Any:
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

    Every chunk is padded to the same size (a multiple of the local device count when sharding), and to at least 2
    jobs unless ``max_per_program`` is 1, so that ``fn`` compiles once and a job's result does not depend on how many
    others share its program; with ``shard`` each input leaf is placed with ``NamedSharding(mesh, P("layers"))``.
    """
    n_dev = jax.local_device_count() if shard else 1
    chunk = min(max_per_program, num_jobs)
    if max_per_program >= 2:
        # a program of one job compiles to other float rounding than a batch (XLA:CPU: a LoRaQ fit's randomized SVD
        # came out other, and with it the layer), so a layer alone in its shape runs beside a copy of itself
        chunk = max(chunk, 2)
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


def progress_bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="layer")


def run_stacked_padded(fn, stacked_inputs, num_jobs: int, *, pad_to: int, max_per_program: int, shard: bool,
                       progress=None) -> list:
    """:func:`run_stacked`, with programs sized for at least ``min(pad_to, max_per_program)`` jobs: a caller running
    several batches of one shape (``calibrate.quantize_layer_set``) passes its batch size, so a last, smaller batch
    reuses the compiled program instead of compiling one for its own size. Padding jobs repeat the first job and are
    dropped."""
    target = min(pad_to, max_per_program)
    if num_jobs >= target:
        return run_stacked(fn, stacked_inputs, num_jobs, max_per_program=max_per_program, shard=shard,
                           progress=progress)
    padded = [_pad_rows(t, target) for t in stacked_inputs]
    out = run_stacked(fn, padded, target, max_per_program=max_per_program, shard=shard)
    if progress is not None:
        progress.update(num_jobs)
    return jax.tree.map(lambda x: x[:num_jobs], out)


def run_groups(fn, groups: Mapping[Any, Sequence[str]], stack: Callable[[Sequence[str]], Sequence[Any]], *,
               max_per_program: int, run: RunConfig, pad_to: int, desc: str) -> dict[str, Any]:
    """A stage's driver loop: for every group of layer names (one shape each, e.g. :func:`group_by_shape`), runs
    ``fn`` over ``stack(names)`` (its inputs, leading axis = the group's layers) with :func:`run_stacked_padded`
    (``pad_to``, ``max_per_program``, ``run.shard``), a progress bar ``desc`` over all layers if ``run.progress``.

    Returns:
      ``{name: the output tree of fn at the name's position}`` (host numpy), in the order of ``groups``.
    """
    bar = progress_bar(sum(len(names) for names in groups.values()), run.progress, desc)
    out = {}
    try:
        for names in groups.values():
            res = run_stacked_padded(fn, list(stack(names)), len(names), pad_to=pad_to,
                                     max_per_program=max_per_program, shard=run.shard, progress=bar)
            for i, name in enumerate(names):
                out[name] = take_tree(res, i)
    finally:
        if bar is not None:
            bar.close()
    return out


def program_config(cfg):
    """``cfg`` (a stage config) with its driver-only field ``max_layers_per_program`` set to its default: the static
    argument of the compiled program, so that the field never causes a recompilation."""
    return dataclasses.replace(cfg, max_layers_per_program=type(cfg)().max_layers_per_program)


def group_by_shape(arrays: Mapping[str, Any]) -> dict[tuple, list[str]]:
    """``{shape: [names]}`` of ``{name: array}`` in input order (the stacking groups of a stage)."""
    groups: dict[tuple, list[str]] = {}
    for name, x in arrays.items():
        groups.setdefault(tuple(np.shape(x)), []).append(name)
    return groups

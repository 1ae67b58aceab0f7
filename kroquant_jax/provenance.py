"""Fingerprints of stored results: what produced a calibrated layer, so a stale one is never reused silently.

A stored layer (:class:`kroquant_jax.qlinear.QLinearStore`) carries the fingerprint of its inputs beside it: a hash of
the weight bytes, of the bias and of the activation rows, every numerics-relevant setting of the recipe (flattened to
dotted names, ``calibration.steps``, ``loraq.rank``, ...) and :data:`NUMERICS_VERSION`. Resuming compares the stored
fingerprint with the one of the current inputs and names what changed (:func:`describe_changes`).

Settings that only decide *how* the work is scheduled, not its result, are left out (:data:`EXECUTION_SETTINGS`:
progress bars, sharding, the number of layers per compiled program).

One-shot outputs (a verb's latents, images, tables) are claimed the same way: :func:`claim_output_folder` keys an
output folder by what produced its files, so a later run with other inputs refuses it (or, asked to overwrite,
clears the earlier run's files first) instead of replacing some of them and leaving the rest beside the new ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from kroquant_jax.fileio import atomic_write_json

__all__ = ["EXECUTION_SETTINGS", "NUMERICS_VERSION", "OutputFolderError", "RunFolderError", "StaleResultError",
           "array_digest", "check_run_folder", "claim_output_folder", "describe_changes", "describe_key_changes",
           "file_digest", "named_arrays_digest", "layer_fingerprint", "layer_set_mismatch", "recipe_settings",
           "without_execution_settings"]

#: Bump whenever a change to the library alters the numbers a recipe produces for the same inputs (quantizer rounding,
#: transform parameterization, optimiser, row draw): results stored under another version are then refused.
NUMERICS_VERSION = 1

#: Recipe fields (last dotted component) that do not change what a layer's result computes, so they are not keyed.
#: ``max_layers_per_program`` sets the size of the programs a learned transform is calibrated in, which can move
#: its last bits (float reassociation in a batch of another size): a store resumed with another value holds layers
#: equal up to those bits (with the same value a resumed run is bit-identical, ``calibrate.quantize_layer_set``).
EXECUTION_SETTINGS = frozenset({"progress", "shard", "max_layers_per_program"})


class StaleResultError(ValueError):
    """A stored result was produced from other inputs than the current ones.

    Attributes:
      layer: the layer's name.
      changes: what differs, e.g. ``["weight", "recipe setting calibration.steps: 100 -> 5"]``.
      location: where the result is stored (a folder).
    """

    def __init__(self, layer: str, changes: list[str], location: str):
        self.layer, self.changes, self.location = layer, list(changes), location
        super().__init__(f"{location}: stored layer {layer!r} was computed from other inputs ({'; '.join(changes)})")


class OutputFolderError(ValueError):
    """An output folder holds the files of another run (:func:`claim_output_folder`); the message names the flag,
    the folder and what differs."""


def array_digest(array: Optional[np.ndarray]) -> Optional[str]:
    """SHA-256 of a float32 array's shape and bytes (``None`` for ``None``), so equal values give equal digests
    whatever the input dtype or memory layout."""
    if array is None:
        return None
    a = np.ascontiguousarray(np.asarray(array, np.float32))
    h = hashlib.sha256(repr(a.shape).encode("ascii"))
    h.update(a.tobytes())
    return h.hexdigest()


def _flatten(prefix: str, value: Any, out: dict) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _flatten(f"{prefix}{f.name}.", getattr(value, f.name), out)
        return
    name = prefix[:-1]
    if name.rpartition(".")[2] in EXECUTION_SETTINGS:
        return
    if isinstance(value, (bool, int, float, str)) or value is None:
        out[name] = value
    elif isinstance(value, (tuple, list)):
        out[name] = [v if isinstance(v, (bool, int, float, str)) or v is None else repr(v) for v in value]
    else:
        out[name] = repr(value)


def without_execution_settings(config: Any) -> Any:
    """``config`` (a nested frozen dataclass) with every :data:`EXECUTION_SETTINGS` field at its default, e.g. to
    name a store by its ``repr``: configs that differ only in how the work is scheduled get one name."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return config
    changes = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in EXECUTION_SETTINGS and f.default is not dataclasses.MISSING:
            if value != f.default:
                changes[f.name] = f.default
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            inner = without_execution_settings(value)
            if inner is not value:
                changes[f.name] = inner
    return dataclasses.replace(config, **changes) if changes else config


def recipe_settings(recipe: Any) -> dict[str, Any]:
    """Every numerics-relevant field of a (nested) frozen dataclass config as ``{dotted.name: JSON value}``."""
    out: dict[str, Any] = {}
    _flatten("", recipe, out)
    return out


def layer_fingerprint(weight: np.ndarray, bias: Optional[np.ndarray], activations: Optional[np.ndarray],
                      recipe: Any) -> dict[str, Any]:
    """The fingerprint of one layer's result (JSON-serialisable).

    Args:
      weight: ``(o, d)``.
      bias: ``(o,)`` or ``None``.
      activations: ``(n, d)`` rows, or ``None`` to leave them out (a partial fingerprint, checked before a capture).
      recipe: the recipe (any frozen dataclass config).
    """
    fp = {"numerics_version": NUMERICS_VERSION, "weight": array_digest(weight), "bias": array_digest(bias),
          "recipe": recipe_settings(recipe)}
    if activations is not None:
        fp["activations"] = array_digest(activations)
    return fp


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_changes(stored: Optional[Mapping[str, Any]], current: Mapping[str, Any]) -> list[str]:
    """What differs between a stored fingerprint and the current one (only the keys ``current`` has); ``[]`` if they
    match. A missing stored fingerprint (a result written before fingerprints existed) is a change. A recipe setting
    missing on one side counts as ``None`` (so adding an optional stage whose default is ``None`` to the recipes
    leaves earlier results valid; its settings, once set, are changes)."""
    if not stored:
        return ["no fingerprint stored (written by an older version)"]
    changes = []
    if "numerics_version" in current and stored.get("numerics_version") != current["numerics_version"]:
        changes.append(f"library numerics version {stored.get('numerics_version')} -> {current['numerics_version']}")
    for key in ("weight", "bias", "activations"):
        if key in current and stored.get(key) != current[key]:
            changes.append(key if key != "bias" or (stored.get(key) and current[key])
                           else f"bias ({'none' if stored.get(key) is None else 'present'} -> "
                                f"{'none' if current[key] is None else 'present'})")
    if "recipe" in current:
        old, new = stored.get("recipe", {}), current["recipe"]
        for key in sorted(set(old) | set(new)):
            # A setting one side lacks equals ``None`` on the other: a stage field added with default ``None``
            # (absent stage, e.g. ``gptq``) keeps the results stored before the field existed.
            if old.get(key) != new.get(key):
                changes.append(f"recipe setting {key}: {_short(old.get(key, '<unset>'))} -> "
                               f"{_short(new.get(key, '<unset>'))}")
    return changes


def layer_set_mismatch(layer_set: Mapping[str, Any],
                       weights: Mapping[str, tuple[np.ndarray, Optional[np.ndarray]]]) -> Optional[str]:
    """Why ``layer_set`` (``{name: (W, bias, A)}``) was not captured from a model with these ``weights``
    (``{name: (W (o, d), bias (o,) | None)}``, e.g. a layer set saved from another checkpoint of the same shapes);
    ``None`` if every layer of ``weights`` is in it with the same weight and bias."""
    missing = [n for n in weights if n not in layer_set]
    if missing:
        return f"lacks layer {missing[0]!r} ({len(missing)} missing)"
    for name, (weight, bias) in weights.items():
        stored_weight, stored_bias = layer_set[name][0], layer_set[name][1]
        if np.shape(stored_weight) != np.shape(weight) or not np.array_equal(np.asarray(stored_weight, np.float32),
                                                                             np.asarray(weight, np.float32)):
            return f"layer {name!r} has other weights"
        if (stored_bias is None) != (bias is None) or (
                bias is not None and not np.array_equal(np.asarray(stored_bias, np.float32),
                                                        np.asarray(bias, np.float32))):
            return f"layer {name!r} has another bias"
    return None


def named_arrays_digest(named: Iterable[tuple[str, Any]], *, prefix: bytes = b"", algorithm: str = "sha256") -> str:
    """Hex digest of ``prefix`` then each ``(name, array)``'s name, shape, dtype and bytes, in the order given: a
    fingerprint of a tree of weights or data (``models.qad.fingerprint``, ``models.layers.params_digest``)."""
    digest = hashlib.new(algorithm, prefix)
    for name, leaf in named:
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{name}|{array.shape}|{array.dtype}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_record(path: Path) -> Optional[dict]:
    """A run's key file as JSON; None if absent, a key that matches none if unreadable."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"<unreadable>": str(path)}


def claim_output_folder(folder: str | os.PathLike, record: str, key: Mapping[str, Any], outputs: Sequence[str], *,
                        overwrite: bool = False, flag: str = "--out", remedy: str = "--overwrite") -> None:
    """Makes ``folder`` the output folder of the run keyed by ``key``, before anything is written into it.

    The folder's ``record`` file (JSON, written atomically) holds the key of the run whose files it holds;
    ``outputs`` are the glob patterns (relative to ``folder``) of the files such a run writes.

    * A folder without the record and without such files is this run's: the record is written.
    * A record with an equal ``key`` is the same run again, whose files this one replaces as it writes them.
    * A folder with such files and another key, or with such files and no record, raises
      :class:`OutputFolderError` naming ``flag``, the folder and the settings that differ, unless ``overwrite``: then
      the earlier run's files are deleted first, so none of them stays beside the new ones. (A record of another key
      without any of its files, e.g. from a run that failed before writing, is simply replaced.)

    The record is written before returning, so the files of an interrupted run are still known to be this key's.

    Args:
      folder: the output folder (created if missing).
      record: the record's file name, e.g. ``"generate_run.json"``.
      key: JSON-serialisable settings and input digests (:func:`file_digest`) that decide the run's files.
      outputs: e.g. ``("latents.npz", "images/w4a4_*.png")``.
      overwrite: delete another run's files instead of refusing.
      flag, remedy: the output flag and the flag that allows overwriting, as the message names them.
    """
    folder = Path(folder)
    key = json.loads(json.dumps(dict(key)))  # as it reads back (tuples as lists)
    record_path = folder / record
    present = sorted({p for pattern in outputs for p in folder.glob(pattern) if p.is_file()})
    stored = _read_record(record_path)
    if stored == key:
        return
    if present:
        if stored is None:
            why = f"holds {len(present)} output file(s) of an unknown run (no {record})"
        else:
            why = f"holds the outputs of a run with other inputs ({describe_key_changes(stored, key)})"
        if not overwrite:
            raise OutputFolderError(f"{flag} {folder}: {why}; use another {flag} or pass {remedy}")
        for path in present:
            path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, key)


class RunFolderError(ValueError):
    """A resumable run folder (training state, checkpoints) was made with other settings or inputs than this call's,
    or before its verb keyed its runs (:func:`check_run_folder`); the message names the folder and what differs."""


def _flat_key(value: Any, prefix: str, out: dict) -> None:
    if isinstance(value, Mapping) and value:
        for k in value:
            _flat_key(value[k], f"{prefix}{k}.", out)
    else:
        out[prefix[:-1]] = value


def describe_key_changes(stored: Mapping[str, Any], current: Mapping[str, Any], limit: int = 4) -> str:
    """``"name: old -> new; ..."`` for every setting (nested mappings flattened to dotted names) that differs between
    two run keys (as read back from JSON), at most ``limit`` of them (then ``"; and N more"``); ``<unset>`` for a
    setting one side lacks; ``""`` when they match."""
    old, new = {}, {}
    _flat_key(json.loads(json.dumps(dict(stored))), "", old)
    _flat_key(json.loads(json.dumps(dict(current))), "", new)
    differ = [k for k in sorted(set(old) | set(new)) if old.get(k, "<unset>") != new.get(k, "<unset>")]
    shown = "; ".join(f"{k}: {_short(old.get(k, '<unset>'))} -> {_short(new.get(k, '<unset>'))}"
                      for k in differ[:limit])
    return shown + (f"; and {len(differ) - limit} more" if len(differ) > limit else "")


def check_run_folder(folder: str | os.PathLike, record: str, key: Mapping[str, Any], has_results: bool, *,
                     flag: str = "--run", unverified: str = "its inputs and settings") -> None:
    """Makes ``folder`` the run folder of the run keyed by ``key`` before any of its results is read or written.

    ``record`` (JSON, in ``folder``) holds the key of the run whose results (training state, checkpoints) the folder
    holds; ``has_results`` says whether it holds any.

    * The same key: the run resumes (nothing written).
    * Another key: :class:`RunFolderError` naming ``flag``, the folder and each setting's old -> new value, when the
      folder holds results; without results (a run stopped before its first save) the record is replaced.
    * No record: written, unless the folder holds results, made before the verb keyed its runs: they cannot be
      verified (``unverified`` says what), so :class:`RunFolderError`.
    """
    folder = Path(folder)
    key = json.loads(json.dumps(dict(key)))
    path = folder / record
    stored = _read_record(path)
    if stored == key:
        return
    if has_results:
        if stored is None:
            raise RunFolderError(f"{flag} {folder}: holds results made before runs were keyed (no {record}), so "
                                 f"{unverified} cannot be verified; use another {flag}")
        raise RunFolderError(f"{flag} {folder}: made with other settings ({describe_key_changes(stored, key)}); "
                             f"use another {flag} or the same settings")
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, key)

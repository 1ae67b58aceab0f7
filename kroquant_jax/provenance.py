"""Fingerprints of stored results: what produced a calibrated layer, so a stale one is never reused silently.

A stored layer (:class:`kroquant_jax.qlinear.QLinearStore`) carries the fingerprint of its inputs beside it: a hash of
the weight bytes, of the bias and of the activation rows, every numerics-relevant setting of the recipe (flattened to
dotted names, ``calibration.steps``, ``loraq.rank``, ...) and :data:`NUMERICS_VERSION`. Resuming compares the stored
fingerprint with the one of the current inputs and names what changed (:func:`describe_changes`).

Settings that only decide *how* the work is scheduled, not its result, are left out (:data:`EXECUTION_SETTINGS`:
progress bars, sharding, the number of layers per compiled program).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Optional

import numpy as np

__all__ = ["EXECUTION_SETTINGS", "NUMERICS_VERSION", "StaleResultError", "array_digest", "describe_changes",
           "layer_fingerprint", "layer_set_mismatch", "recipe_settings"]

#: Bump whenever a change to the library alters the numbers a recipe produces for the same inputs (quantizer rounding,
#: transform parameterization, optimiser, row draw): results stored under another version are then refused.
NUMERICS_VERSION = 1

#: Recipe fields (last dotted component) that do not change a layer's result.
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

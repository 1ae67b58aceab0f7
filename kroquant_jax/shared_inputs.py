"""Linears that read the same input ("shared-input groups"), calibrated as one linear.

Serving runs linears that read the identical input tensor (a block's ``to_q`` / ``to_k`` / ``to_v``; Ideogram 4's
``w1`` / ``w3``) as one GEMM of their stacked weights ``[W_1; W_2; ...]``, with **one** activation transform and one
quantizer call of the input (as Nunchaku / SVDQuant serve a fused QKV). A checkpoint can only be served that way if
its group was calibrated as one layer: one transform ``T`` for all members, one low-rank branch over the concatenated
output, GPTQ with the one Hessian of the transformed input. :func:`fuse_shared_inputs` turns a layer set into that
layer set, on which ``kroquant_jax.calibrate.quantize_layer_set`` runs unchanged:

    groups = family.shared_inputs(model)                      # models.families: e.g. (("...to_q", "...to_k", ...),)
    fused = fuse_shared_inputs(layer_set, groups)             # {"...to_q|...to_k|...to_v": LayerData, ...}
    qlayers, reports = calibrate.quantize_layer_set(fused, "smoothed_kroquant")
    errors = member_errors(layer_set, groups, qlayers, fused_test_rows(fused, groups, run))   # {member: error}

A fused layer is named by its members' names joined by ``|`` (:func:`fused_name`; the convention of
``models.layer_shapes``, e.g. ``layers.3.feed_forward.w1|layers.3.feed_forward.w3``); its output features are the
members' in group order (:func:`output_slices`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kroquant_jax import qlinear
from kroquant_jax.layerset import LayerData, LayerSet, RunConfig, as_layer_set

__all__ = ["SEPARATOR", "check_groups", "fuse_shared_inputs", "fused_name", "fused_test_rows", "layer_errors",
           "member_errors", "members_of", "output_slices", "split_output", "stack_members"]

#: Joins the member names of a fused layer.
SEPARATOR = "|"


def fused_name(members: Sequence[str]) -> str:
    """The name of the fused layer of ``members`` (their names joined by :data:`SEPARATOR`, in group order)."""
    return SEPARATOR.join(members)


def members_of(name: str) -> tuple[str, ...]:
    """The member names of a fused layer's ``name`` (the inverse of :func:`fused_name`; one name for a plain layer)."""
    return tuple(name.split(SEPARATOR))


def check_groups(groups: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """``groups`` as tuples, checked: each has at least two members, no member name holds :data:`SEPARATOR`, and no
    layer is in two groups (or twice in one).

    Raises:
        ValueError: naming the group and the member at fault.
    """
    seen: dict[str, tuple[str, ...]] = {}
    out = []
    for group in groups:
        group = tuple(group)
        if len(group) < 2:
            raise ValueError(f"shared-input group {group}: needs at least two linears (one alone is no fusion)")
        for member in group:
            if SEPARATOR in member:
                raise ValueError(f"shared-input group {group}: member {member!r} holds {SEPARATOR!r}, which joins "
                                 f"the members of a fused layer's name")
            if member in seen:
                where = "twice in this group" if seen[member] is group else f"also in the group {seen[member]}"
                raise ValueError(f"shared-input group {group}: layer {member!r} is {where}")
            seen[member] = group
        out.append(group)
    return tuple(out)


def stack_members(members: Sequence[tuple[np.ndarray, np.ndarray | None]]) -> tuple[np.ndarray, np.ndarray | None]:
    """``[(W_i (o_i, d), bias_i (o_i,) | None)]`` -> ``(W (sum o, d), bias (sum o,) | None)``: the weights stacked
    along the output axis; the biases concatenated, a member without one contributing zeros when another has one,
    ``None`` when none has (float32). The fused weight of :func:`fuse_shared_inputs`, also for callers that have no
    rows yet (e.g. a result store's fingerprints checked before a capture)."""
    weight = np.concatenate([np.asarray(w, np.float32) for w, _ in members])  # (sum o, d)
    if all(b is None for _, b in members):
        return weight, None
    bias = np.concatenate([np.zeros(np.shape(w)[0], np.float32) if b is None else np.asarray(b, np.float32)
                           for w, b in members])  # (sum o,)
    return weight, bias


def fuse_shared_inputs(layer_set: LayerSet, groups: Sequence[Sequence[str]]) -> dict[str, LayerData]:
    """The layer set with each group of linears that read the same input replaced by one fused layer.

    The fused layer of a group ``(m_1, ..., m_k)`` is named :func:`fused_name` and holds:

    - weight ``[W_1; ...; W_k] (o_1 + ... + o_k, d)``: the members' weights stacked along the output axis;
    - bias: the members' biases concatenated the same way; a member without bias contributes zeros when another
      member has one (``x W^T + 0`` is that member's output), and the fused layer has none when no member has one;
    - rows ``A (n, d)``: the first member's rows. The members read the identical input tensor, so each member's
      recorded rows are draws from that same input (``models.capture`` draws each linear's rows with its own key,
      so they are different draws, not the same rows): the first member's are kept as they are, the others'
      dropped. Mixing the members' rows would weigh tokens drawn twice twice.

    The other layers are kept unchanged; the fused layer takes the place of its group's earliest member in the
    layer set's order (the other members are dropped).

    Args:
        layer_set: ``{name: (W (o, d), bias (o,) | None, A_rows (n, d))}`` (validated, see
            :func:`kroquant_jax.layerset.as_layer_set`).
        groups: the groups (e.g. ``models.families.Family.shared_inputs(model)``), checked by :func:`check_groups`.
    Returns:
        ``{name: LayerData}``: the fused layers and the layers in no group.
    Raises:
        ValueError: a member missing from the layer set, members of different input widths ``d``, a fused name that
            is already a layer's name, or a bad group (:func:`check_groups`); each naming the group and the layer.
    """
    layers = as_layer_set(layer_set)
    groups = check_groups(groups)
    fused_at: dict[str, tuple[str, ...]] = {}  # the group's earliest member in layer-set order -> the group
    grouped: set[str] = set()
    order = {name: k for k, name in enumerate(layers)}
    for group in groups:
        missing = [m for m in group if m not in layers]
        if missing:
            raise ValueError(f"shared-input group {group}: {missing} not in the layer set (e.g. "
                             f"{list(layers)[:3]})")
        widths = {m: layers[m].weight.shape[1] for m in group}
        if len(set(widths.values())) > 1:
            raise ValueError(f"shared-input group {group}: the members read inputs of different widths {widths}, so "
                             f"they cannot read the same input")
        name = fused_name(group)
        if name in layers:
            raise ValueError(f"shared-input group {group}: the layer set already holds a layer named {name!r}")
        fused_at[min(group, key=order.__getitem__)] = group
        grouped.update(group)
    out: dict[str, LayerData] = {}
    for name, layer in layers.items():
        if name in fused_at:
            group = fused_at[name]
            members = [layers[m] for m in group]
            weight, bias = stack_members([(m.weight, m.bias) for m in members])
            out[fused_name(group)] = LayerData(weight, bias, members[0].activations)
        elif name not in grouped:
            out[name] = layer
    return out


def output_slices(layer_set: LayerSet, members: Sequence[str]) -> dict[str, slice]:
    """``{member: slice of the fused layer's output features}`` of a group, from the members' weights in the
    (unfused) ``layer_set``: member ``i`` owns features ``[o_1 + ... + o_{i-1}, o_1 + ... + o_i)``."""
    slices, start = {}, 0
    for member in members:
        if member not in layer_set:
            raise ValueError(f"output_slices: layer {member!r} of {fused_name(members)!r} not in the layer set")
        layer = layer_set[member]
        size = np.shape(layer.weight if isinstance(layer, LayerData) else layer[0])[0]
        slices[member] = slice(start, start + size)
        start += size
    return slices


def split_output(y: np.ndarray, layer_set: LayerSet, members: Sequence[str]) -> dict[str, np.ndarray]:
    """A fused layer's output ``y (..., o_1 + ... + o_k)`` -> ``{member: y (..., o_i)}`` (see :func:`output_slices`).

    Raises:
        ValueError: when ``y``'s feature axis is not the members' output features together.
    """
    slices = output_slices(layer_set, members)
    total = next(reversed(slices.values())).stop
    if np.shape(y)[-1] != total:
        raise ValueError(f"split_output: {fused_name(members)!r} has {total} output features, the output has "
                         f"shape {np.shape(y)}")
    return {member: np.asarray(y)[..., s] for member, s in slices.items()}


def fused_test_rows(fused_set: LayerSet, groups: Sequence[Sequence[str]], run: RunConfig) -> dict[str, np.ndarray]:
    """``{fused name: (n_test, d)}``: the test rows of each group's fused layer under the run's row split
    (``RunConfig.split`` of the fused name: the rows the calibration of the fused layer reported on and chose
    nothing on)."""
    layers = as_layer_set(fused_set)
    out = {}
    for group in check_groups(groups):
        name = fused_name(group)
        if name not in layers:
            raise ValueError(f"fused_test_rows: no fused layer {name!r} in the layer set (fuse_shared_inputs first)")
        rows = layers[name].activations
        out[name] = rows[run.split(name, rows.shape[0]).test]
    return out


def member_errors(layer_set: LayerSet, groups: Sequence[Sequence[str]], qlayers: Mapping[str, object],
                  rows: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Each member's relative output error ``||y_i - A W_i^T|| / ||A W_i^T||`` when its group runs as the fused
    quantized layer ``qlayers[fused_name(group)]`` (a ``kroquant_jax.qlinear.QuantizedLinear``, simulation forward)
    on ``rows[fused_name(group)] (n, d)``; ``y_i`` is the member's slice of the output without the bias, the
    reference is float64, as ``quantize_layer_set``'s ``heldout_error``.

    Args:
        layer_set: the unfused layer set (the members' own weights).
        groups: the groups that were fused.
        qlayers: ``{fused name: QuantizedLinear}`` (e.g. the output of ``quantize_layer_set`` on the fused set).
        rows: ``{fused name: rows}`` to evaluate on (e.g. :func:`fused_test_rows`).
    Returns:
        ``{member: error}`` in group order.
    """
    layers = as_layer_set(layer_set)
    errors = {}
    for group in check_groups(groups):
        name = fused_name(group)
        for what, table in (("qlayers", qlayers), ("rows", rows)):
            if name not in table:
                raise ValueError(f"member_errors: {what} has no fused layer {name!r}")
        a, y = _output_without_bias(qlayers[name], rows[name])  # (n, d), (n, sum o)
        for member, part in split_output(y, layers, group).items():
            errors[member] = _relative_error(part, a, layers[member].weight)
    return errors


def layer_errors(layer_set: LayerSet, qlayers: Mapping[str, object], rows: Mapping[str, np.ndarray]
                 ) -> dict[str, float]:
    """:func:`member_errors` of plain (unfused) layers: ``{name: ||y - A W^T|| / ||A W^T||}`` of each
    ``qlayers[name]`` on ``rows[name] (n, d)``, the same measure, so per-linear and fused calibrations compare."""
    layers = as_layer_set(layer_set)
    errors = {}
    for name, a in rows.items():
        if name not in qlayers or name not in layers:
            raise ValueError(f"layer_errors: no quantized layer or layer-set entry {name!r}")
        a, y = _output_without_bias(qlayers[name], a)
        errors[name] = _relative_error(y, a, layers[name].weight)
    return errors


def _output_without_bias(q, rows) -> tuple[np.ndarray, np.ndarray]:
    """``(A float32 (n, d), the simulated output of q on A without its bias, float64 (n, o))``."""
    a = np.asarray(rows, np.float32)
    y = np.asarray(_simulate(q, jnp.asarray(a)), np.float64)
    if q.bias is not None:
        y = y - np.asarray(q.bias, np.float64)
    return a, y


_simulate = jax.jit(qlinear.qlinear_forward, static_argnames="path")  # eq. 11, fake quant (f32)


def _relative_error(y: np.ndarray, a: np.ndarray, weight: np.ndarray) -> float:
    """``||y - A W^T|| / ||A W^T||`` with the float64 reference."""
    ref = a.astype(np.float64) @ np.asarray(weight).T.astype(np.float64)  # (n, o)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), np.finfo(np.float32).tiny))

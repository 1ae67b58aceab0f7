"""The GEMM shapes of a family's quantizable linears, derived from its config (shape only, no weights).

The GPU benchmarks time the W4A4 / FP8 layers at the shapes of the real checkpoints; this module is where those
shapes come from, so that they follow the presets of :mod:`models.families` instead of being typed by hand:

    layer_shapes("flux")            # {"flux1.attn.q": (3072, 3072), "flux1.ff.up": (12288, 3072), ...}
    preset_layer_shapes("ideogram4", "flux1")   # both presets' tables, in that order

A shape is ``(out_features, in_features)`` = ``(n, k)`` of the GEMM ``x W^T`` (torch's weight layout). The model is
built under ``nnx.eval_shape`` (nothing allocated) and its quantizable linears (``Family.linear_sites``) are named by
the role they play in a block (:data:`ROLES`); a model's fused sites (``fused_sites()``: Ideogram 4's w1|w3 with the
SwiGLU epilogue) count as one GEMM whose output features are the members' together, as the served layer runs them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from flax import nnx

from models import families
from models.layers import linears

__all__ = ["PRESET_LABELS", "ROLES", "layer_shapes", "preset_layer_shapes", "shape_table"]

#: ``{label: (family name, preset name)}``: the prefix of each real checkpoint's layer names, in the benchmarks'
#: priority order (Ideogram 4 and FLUX.1 first).
PRESET_LABELS: dict[str, tuple[str, str]] = {
    "ideogram4": ("ideogram4", "Ideogram-4"),
    "flux1": ("flux", "FLUX.1-schnell"),
    "pixart_sigma": ("pixart", "PixArt-Sigma-XL-2-1024-MS"),
    "sana_1600m": ("sana", "Sana_1600M_1024px"),
}


def _attention(prefix: str, module: str, out: str = "to_out.0") -> dict[str, str]:
    """The roles ``<prefix>.q/k/v/out`` of an attention ``module``'s ``to_q/to_k/to_v`` and output projection."""
    return {f"{module}.to_{x}": f"{prefix}.{x}" for x in "qkv"} | {f"{module}.{out}": f"{prefix}.out"}


#: ``{family name: {site pattern: role}}``: every quantizable linear of a family, by its dotted path with the block
#: index as ``*`` (a fused site: its members' patterns joined by ``|``). The order of a family's roles is the order
#: in which :func:`layer_shapes` picks the name of each distinct shape (the first role that has it).
ROLES: dict[str, dict[str, str]] = {
    "ideogram4": {
        **_attention("attn", "layers.*.attention"),
        "layers.*.feed_forward.w1|layers.*.feed_forward.w3": "ffn.w13",
        "layers.*.feed_forward.w2": "ffn.w2",
    },
    "flux": {
        **_attention("attn", "transformer_blocks.*.attn"),
        **{f"transformer_blocks.*.attn.add_{x}_proj": f"attn.add_{x}" for x in "qkv"},
        "transformer_blocks.*.attn.to_add_out": "attn.add_out",
        "transformer_blocks.*.ff.net.0.proj": "ff.up",
        "transformer_blocks.*.ff.net.2": "ff.down",
        "transformer_blocks.*.ff_context.net.0.proj": "ff_context.up",
        "transformer_blocks.*.ff_context.net.2": "ff_context.down",
        **{f"single_transformer_blocks.*.attn.to_{x}": f"single.attn.{x}" for x in "qkv"},
        "single_transformer_blocks.*.proj_mlp": "single.proj_mlp",
        "single_transformer_blocks.*.proj_out": "single.proj_out",
    },
    "pixart": {
        **_attention("attn", "transformer_blocks.*.attn1"),
        **_attention("cross_attn", "transformer_blocks.*.attn2"),
        "transformer_blocks.*.ff.net.0.proj": "ff.up",
        "transformer_blocks.*.ff.net.2": "ff.down",
    },
    "sana": {
        **_attention("attn", "transformer_blocks.*.attn1"),
        **_attention("cross_attn", "transformer_blocks.*.attn2"),
        "transformer_blocks.*.ff.conv_inverted": "glumb.inverted",
        "transformer_blocks.*.ff.conv_point": "glumb.point",
    },
}

_BLOCK_INDEX = re.compile(r"^([A-Za-z_]+)\.\d+\.")


def _pattern(path: str) -> str:
    """``transformer_blocks.3.attn.to_q`` -> ``transformer_blocks.*.attn.to_q`` (the first index only)."""
    return _BLOCK_INDEX.sub(r"\1.*.", path, count=1)


def _resolve(family: str | families.Family, preset: str | Any | None) -> tuple[families.Family, Any, str]:
    """``(family, config, label)`` of a family and a preset name, a config of its type, or None (its only preset)."""
    fam = family if isinstance(family, families.Family) else families.get(family)
    if preset is None:
        if len(fam.presets) != 1:
            raise ValueError(f"{fam.name}: name a preset ({', '.join(fam.presets)})")
        preset = next(iter(fam.presets))
    if isinstance(preset, str):
        if preset not in fam.presets:
            raise ValueError(f"unknown {fam.name} preset {preset!r} (known: {', '.join(fam.presets)})")
        label = next((lab for lab, key in PRESET_LABELS.items() if key == (fam.name, preset)), fam.name)
        return fam, fam.presets[preset], label
    if not isinstance(preset, fam.config_type):
        raise ValueError(f"{fam.name}: a preset name or a {fam.config_type.__name__}, not {type(preset).__name__}")
    return fam, preset, fam.name


@functools.cache
def _role_shapes(family_name: str, cfg: Any) -> tuple[tuple[str, tuple[int, int]], ...]:
    """``((role, (out, in)), ...)`` of every role the model of ``cfg`` has, in the order of :data:`ROLES`."""
    fam = families.get(family_name)
    if fam.list_layout is not None:
        cfg = fam.list_layout(cfg)  # scanned blocks share one path: name them in the list layout
    model = nnx.eval_shape(lambda: fam.construct(cfg))
    sites = linears(model, quantizable_only=True)
    fused = getattr(model, "fused_sites", None)
    groups = {members[0]: members for members in (fused()[1].values() if fused is not None else ())}
    absorbed = {path for members in groups.values() for path in members[1:]}
    roles = ROLES[family_name]
    found: dict[str, tuple[int, int]] = {}
    for path, linear in sites.items():
        if path in absorbed:
            continue
        members = [sites[p] for p in groups.get(path, (path,))]
        if len({m.in_features for m in members}) != 1:
            raise ValueError(f"{fam.name}: the fused site {groups[path]} mixes input widths")
        key = "|".join(_pattern(p) for p in groups.get(path, (path,)))
        if key not in roles:
            raise ValueError(f"{fam.name}: the quantizable linear {path} ({key}) has no role in "
                             f"models.layer_shapes.ROLES")
        shape = (sum(m.out_features for m in members), linear.in_features)
        if found.setdefault(roles[key], shape) != shape:
            raise ValueError(f"{fam.name}: {roles[key]} has the shapes {found[roles[key]]} and {shape} in two blocks")
    return tuple((role, found[role]) for role in roles.values() if role in found)


def layer_shapes(family: str | families.Family, preset: str | Any | None = None) -> dict[str, tuple[int, int]]:
    """The distinct GEMM shapes ``{"<label>.<role>": (out_features, in_features)}`` of a family's quantizable
    linears, each named by the first role (in :data:`ROLES` order) that has it.

    Args:
        family: a registered family (``"pixart"``, ``"sana"``, ``"flux"``, ``"ideogram4"``) or its ``Family``.
        preset: a preset name of ``family.presets``, None for the family's only preset, or a config of the family's
            type (e.g. a tiny one); the label is the preset's in :data:`PRESET_LABELS` (``"flux1"``, ...), else the
            family name.

    Raises:
        ValueError: naming an unknown family or preset (and the known ones), or a quantizable linear that
            :data:`ROLES` does not name.
    """
    fam, cfg, label = _resolve(family, preset)
    distinct: dict[tuple[int, int], str] = {}
    for role, shape in _role_shapes(fam.name, cfg):
        distinct.setdefault(shape, role)
    return {f"{label}.{role}": shape for shape, role in distinct.items()}


def preset_layer_shapes(*labels: str) -> dict[str, tuple[int, int]]:
    """:func:`layer_shapes` of the presets of :data:`PRESET_LABELS` named by ``labels`` (default all), in that order.

    Raises:
        ValueError: naming an unknown label and the known ones.
    """
    unknown = [label for label in labels if label not in PRESET_LABELS]
    if unknown:
        raise ValueError(f"unknown preset label(s) {unknown} (known: {', '.join(PRESET_LABELS)})")
    shapes: dict[str, tuple[int, int]] = {}
    for label in labels or PRESET_LABELS:
        shapes.update(layer_shapes(*PRESET_LABELS[label]))
    return shapes


def shape_table(shapes: Mapping[str, tuple[int, int]]) -> list[tuple[str, str, int, int]]:
    """``[(label, role, n, k), ...]`` of a ``{"<label>.<role>": (n, k)}`` table (the benchmarks' row form)."""
    return [(*name.split(".", 1), n, k) for name, (n, k) in shapes.items()]

"""Checks on what a traced program computes, for the tests: every matmul (``dot_general``) of a function, nested
jaxprs included (scan, while, cond, pjit, custom_jvp/vjp, custom_linear_solve), and the precision it asks for; every
widening of an 8-bit float (:func:`float8_widenings`); and which arrays a lowered program holds as constants
(:func:`folded_leaves`: weights a jitted function closed over)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

HIGHEST = jax.lax.Precision.HIGHEST


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        stack = list(eqn.params.values())
        while stack:
            value = stack.pop()
            if isinstance(value, jex_core.ClosedJaxpr):
                yield from _equations(value.jaxpr)
            elif isinstance(value, jex_core.Jaxpr):
                yield from _equations(value)
            elif isinstance(value, (tuple, list)):
                stack.extend(value)


def _where(eqn) -> str:
    """``file:line (function)`` of the innermost project frame that made ``eqn``, and its operand shapes."""
    frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", None) or []
    here = next((f"{f.file_name.rsplit('/', 2)[-2]}/{f.file_name.rsplit('/', 1)[-1]}:{f.line_num} ({f.function_name})"
                 for f in frames if "/kroquant_jax/" in f.file_name), "?")
    return f"{here} {[v.aval.str_short() for v in eqn.invars]}"


def dot_generals(fn, *args) -> list[tuple[tuple, str]]:
    """``[(precision per operand, where), ...]`` of every ``dot_general`` in ``jax.make_jaxpr(fn)(*args)``;
    ``precision`` is ``(None, None)`` where the default was left to XLA (TF32 on NVIDIA GPUs for f32)."""
    out = []
    for eqn in _equations(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name == "dot_general":
            p = eqn.params["precision"]
            out.append((tuple(p) if isinstance(p, (tuple, list)) else (p, p), _where(eqn)))
    return out


def float8_widenings(fn, *args) -> list[str]:
    """``["float8_e4m3fn -> float32 at where", ...]``: every ``convert_element_type`` of ``jax.make_jaxpr(fn)(*args)``
    from an 8-bit float to a wider float. Inside one compiled program XLA:GPU replaces a chain ``f32 -> f8 -> f32`` by
    its input (excess precision, allowed by default), so a value rounded to f8 and widened back is unrounded there."""
    out = []
    for eqn in _equations(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name == "convert_element_type":
            src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
            if jnp.issubdtype(src, jnp.floating) and src.itemsize == 1 and jnp.issubdtype(dst, jnp.floating) \
                    and dst.itemsize > 1:  # (numpy does not count ml_dtypes' float8 types as floating)
                out.append(f"{src} -> {dst} at {_where(eqn)}")
    return out


def assert_every_dot_highest(fn, *args, min_dots: int = 1, must_include: str | None = None) -> list:
    """Asserts that every ``dot_general`` of ``fn(*args)`` asks for ``Precision.HIGHEST`` on both operands, in the
    jaxpr and in the lowered StableHLO (``precision = [HIGHEST, HIGHEST]`` on every ``stablehlo.dot_general``); that
    there are at least ``min_dots`` of them; and, if given, that ``must_include`` (a function name) made some of them
    (so the check cannot pass by tracing something else). Returns the jaxpr's list (see :func:`dot_generals`)."""
    dots = dot_generals(fn, *args)
    assert len(dots) >= min_dots, f"{len(dots)} dot_generals found, expected >= {min_dots}"
    if must_include is not None:
        assert any(f"({must_include}" in w for _, w in dots), f"no dot_general made by {must_include}: {dots}"
    bad = [(p, w) for p, w in dots if p != (HIGHEST, HIGHEST)]
    assert not bad, f"{len(bad)} of {len(dots)} dot_generals without Precision.HIGHEST: {bad}"
    hlo = [line for line in jax.jit(fn).lower(*args).as_text().splitlines() if "stablehlo.dot_general" in line]
    assert hlo, "no stablehlo.dot_general in the lowered program"
    bad_hlo = [line.strip() for line in hlo if not re.search(r"precision = \[HIGHEST, HIGHEST\]", line)]
    assert not bad_hlo, f"{len(bad_hlo)} of {len(hlo)} StableHLO dot_generals without HIGHEST: {bad_hlo[:5]}"
    return dots


def folded_leaves(lowered_text: str, tree, min_size: int = 128) -> list[str]:
    """The paths of the leaves of ``tree`` whose bytes are a constant of ``lowered_text`` (``jit(...).lower(...)
    .as_text()``): arrays the function closed over, which XLA gets as constants folded into the program, instead of
    taking them as arguments. Leaves of fewer than ``min_size`` elements (MLIR prints small constants as decimals,
    not as the bytes) and leaves of one repeated value (printed as a splat) are not looked for."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        value = np.asarray(leaf)
        if value.size < min_size or (value == value.flat[0]).all():
            continue
        if f'dense<"0x{value.tobytes().hex().upper()}">' in lowered_text:
            found.append(jax.tree_util.keystr(path))
    return found


def jit_constants(fn, *args) -> list:
    """The constants of the jitted functions that ``fn(*args)`` calls (the ``consts`` of every closed jaxpr in the
    equations of ``jax.make_jaxpr(fn)(*args)``, nested ones included): arrays such a function closed over, which XLA
    folds into its program, where an argument would be passed in at the call."""
    found = []
    for eqn in _equations(jax.make_jaxpr(fn)(*args).jaxpr):
        stack = list(eqn.params.values())
        while stack:
            value = stack.pop()
            if isinstance(value, jex_core.ClosedJaxpr):
                found.extend(value.consts)
            elif isinstance(value, (tuple, list)):
                stack.extend(value)
    return found

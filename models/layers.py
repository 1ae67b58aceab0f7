"""Layers shared by the DiT ports (Flax NNX), numerically matching their diffusers counterparts.

Naming: module attributes carry diffusers' names, so a layer's NNX path, joined with dots, equals its diffusers key
prefix (``transformer_blocks.3.attn1.to_q``). Every :class:`Linear` learns that dotted path (``Linear.path``) when the
top-level model calls :func:`name_linears` at the end of its constructor.

Linear hooks: every forward pass of every family takes an optional :class:`LinearHooks` and passes it down. A
:class:`Linear` called with hooks asks them to compute its output, which is how ``models.quantize_model`` swaps a
16-bit linear for a quantized one (``overrides={path: fn}``) and how ``models.capture`` records the inputs of the
quantizable linears (``recorder=...``), without any mutable state in the modules. :class:`FusedLinearHooks` adds
fused sites (a linear and the op after it, e.g. Ideogram 4's q/k projection + RMSNorm and its SwiGLU gate/up pair;
or linears that read the same input run as one GEMM, e.g. Ideogram 4's q | k | v), which a model consumes where it
has them. Where a model knows which input tokens are padding (a caption's attention
mask, Ideogram 4's padding segment) it passes the hooks on with :func:`with_token_mask`, so a recorder keeps only the
rows of real tokens.

Layouts: activations are channels-last ``(batch, tokens, channels)``; Linear kernels are ``(d_in, d_out)``; conv
kernels are HWIO.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kroquant_jax.provenance import named_arrays_digest

__all__ = [
    "Attention",
    "FeedForward",
    "FusedLinearHooks",
    "LayerNorm",
    "Linear",
    "InitKeys",
    "LinearHooks",
    "SharedOverrides",
    "ConvWeights",
    "PatchEmbed",
    "RMSNorm",
    "TextProjection",
    "TimestepEmbedding",
    "apply_rope",
    "block_attention_sites",
    "check_fused_sites",
    "ATTENTION_IMPLEMENTATIONS",
    "check_attention_impl",
    "dot_product_attention",
    "device_init",
    "host_init",
    "layer_norm",
    "linears",
    "params_digest",
    "name_linears",
    "rope_frequencies",
    "run_blocks_scanned",
    "sincos_pos_embed_2d",
    "timestep_embedding",
    "with_token_mask",
]


class Recorder(Protocol):
    """What :class:`LinearHooks` needs from a recorder (see ``models.capture``)."""

    def wants(self, path: str) -> bool: ...

    def record(self, path: str, x: jax.Array, token_mask: jax.Array | None = None) -> None: ...


def _qlinear_part(layer: Any, x: jax.Array, *, start: int, stop: int,
                  forward: Callable[[Any, jax.Array], jax.Array]) -> jax.Array:
    return forward(layer, x)[..., start:stop]  # (..., stop - start) of (..., o)


@jax.tree_util.register_pytree_node_class
class SharedOverrides(Mapping):
    """Per-linear overrides ``{linear path: x (..., d) -> (..., o_path)}`` whose layers are held **once** each.

    ``layers`` is ``{layer name: layer pytree}``; ``routes`` is ``{linear path: (layer name, forward, rows)}``: the
    override of ``path`` is ``forward(layers[name], x)``, and with ``rows = (start, stop)`` only those output features
    of it (a member of a fused layer ``a|b|c``). Looking a path up gives a ``jax.tree_util.Partial`` as a plain dict of
    overrides would, so :class:`LinearHooks` takes either (it keeps this one as it is, also in
    :meth:`FusedLinearHooks.entries`). ``models.quantize_model.split_qlinear_overrides`` builds one for a fused layer;
    :meth:`merged` joins them.

    Why a class and not a dict of per-member ``Partial`` s: the samplers take the overrides as a traced argument
    (``params["overrides"]``), and a pytree flattens every occurrence of a leaf. A dict gives the jitted program one
    copy of a fused layer's arrays per member, so to XLA the members' calls are calls of different layers, and the
    fused layer runs once per member (q | k | v: three times its work). Here the layer is one set of leaves; the
    members' calls read the same traced arrays and XLA merges them into one forward.

    Invariant: every route names a layer of ``layers``. ``forward`` and ``rows`` are static (the pytree's aux data).
    """

    def __init__(self, layers: Mapping[str, Any], routes: Mapping[str, tuple[str, Callable, tuple[int, int] | None]]):
        self._layers = dict(layers)
        self._routes = {path: (name, forward, None if rows is None else (int(rows[0]), int(rows[1])))
                        for path, (name, forward, rows) in routes.items()}
        unknown = sorted({name for name, _, _ in self._routes.values()} - set(self._layers))
        if unknown:
            raise ValueError(f"SharedOverrides: routes name layers {unknown} that are not among {sorted(self._layers)}")

    @classmethod
    def merged(cls, *parts: SharedOverrides) -> SharedOverrides:
        """One mapping of several (e.g. one per stored layer); a linear path or a layer name in two parts raises."""
        layers, routes = {}, {}
        for part in parts:
            twice = sorted((set(part._layers) & set(layers)) | (set(part._routes) & set(routes)))
            if twice:
                raise ValueError(f"SharedOverrides.merged: {twice} given twice")
            layers.update(part._layers)
            routes.update(part._routes)
        return cls(layers, routes)

    @classmethod
    def split(cls, name: str, layer: Any, forward: Callable, paths: Sequence[str], widths: Sequence[int]
              ) -> SharedOverrides:
        """A fused layer ``name`` whose output features are ``paths``' in order, ``widths[i]`` of them for
        ``paths[i]``: each path takes its slice of ``forward(layer, x)``."""
        bounds = np.cumsum([0, *widths]).tolist()
        return cls({name: layer}, {path: (name, forward, (bounds[i], bounds[i + 1])) for i, path in enumerate(paths)})

    @property
    def layers(self) -> dict[str, Any]:
        """``{layer name: layer}``, each layer once."""
        return dict(self._layers)

    def __getitem__(self, path: str) -> jax.tree_util.Partial:
        name, forward, rows = self._routes[path]
        if rows is not None:
            forward = functools.partial(_qlinear_part, start=rows[0], stop=rows[1], forward=forward)
        return jax.tree_util.Partial(forward, self._layers[name])

    def __iter__(self):
        return iter(self._routes)

    def __len__(self) -> int:
        return len(self._routes)

    def __repr__(self) -> str:
        return f"SharedOverrides({len(self._layers)} layers, {len(self._routes)} linears)"

    def tree_flatten(self):
        names = tuple(self._layers)
        return tuple(self._layers[n] for n in names), (names, tuple(self._routes.items()))

    @classmethod
    def tree_unflatten(cls, aux, children):
        names, routes = aux
        out = cls.__new__(cls)
        out._layers, out._routes = dict(zip(names, children)), dict(routes)
        return out


class LinearHooks:
    """Per-call routing of Linear layers: overrides by dotted path, and an optional input recorder.

    Args:
        overrides: ``{dotted path: fn(x (..., d)) -> y (..., o)}`` pure functions run instead of the 16-bit linear
            (a ``jax.tree_util.Partial`` keeps its arrays traced arguments instead of jit constants).
        recorder: an object with ``wants(path) -> bool`` and ``record(path, x, token_mask)``, called with each wanted
            input.
        token_mask: ``(...)`` bool, the shape of an input without its feature axis: which input tokens are real
            (False = padding that never reaches the model's output, e.g. masked caption tokens). Models set it with
            :func:`with_token_mask` where they know it; the recorder drops the masked rows; overrides ignore it.
    """

    def __init__(self, overrides: Mapping[str, Callable[[jax.Array], jax.Array]] | None = None,
                 recorder: Recorder | None = None, token_mask: jax.Array | None = None):
        # a SharedOverrides is kept as it is (immutable, and a pytree that holds each layer once); a dict is copied
        self.overrides = overrides if isinstance(overrides, SharedOverrides) else dict(overrides or {})
        self.recorder = recorder
        self.token_mask = token_mask

    def record(self, linear: "Linear", x: jax.Array) -> None:
        """Hand ``x`` (the input of ``linear``) and the token mask to the recorder when it wants that linear."""
        if self.recorder is not None and self.recorder.wants(linear.path):
            self.recorder.record(linear.path, x, self.token_mask)

    def __call__(self, linear: "Linear", x: jax.Array) -> jax.Array:
        self.record(linear, x)
        override = self.overrides.get(linear.path)
        if override is None:
            return linear.dense(x)
        y = override(x)
        expected = x.shape[:-1] + (linear.out_features,)
        if tuple(y.shape) != expected:
            raise ValueError(f"override of {linear.path}: returned shape {tuple(y.shape)}, expected {expected}")
        return y.astype(x.dtype)


def with_token_mask(hooks: LinearHooks | None, token_mask: jax.Array | None) -> LinearHooks | None:
    """``hooks`` for inputs whose real tokens are ``token_mask`` (``(...)``, True = real): a shallow copy that
    shares the overrides and the recorder. None hooks or a None mask return ``hooks`` unchanged."""
    if hooks is None or token_mask is None:
        return hooks
    masked = copy.copy(hooks)
    masked.token_mask = token_mask.astype(bool)
    return masked


class FusedLinearHooks(LinearHooks):
    """:class:`~models.layers.LinearHooks` with fused sites (a linear and the op after it run by one function).

    Args:
        overrides, recorder: as :class:`~models.layers.LinearHooks` (per-linear replacements, input recorder).
        projection_norm: ``{projection path: fn(x (..., d), scale (head_dim,), eps) -> (..., o)}``: the projection
            followed by RMSNorm over each head of ``head_dim`` outputs with weight ``scale`` (the model passes its own
            norm weight and eps, so the fused function never holds a stale copy). Replaces the projection and the norm.
        swiglu: ``{gate projection path: fn(x (..., d)) -> (..., f)}``: ``SiLU(x W_gate^T) * (x W_up^T)``. Replaces the
            gate and the up projection (the model says which linear is the up projection of a gate).
        shared_input: ``{first member's path: fn(x (..., d)) -> (..., o_1 + ... + o_k)}``: linears that read the same
            input run as one (e.g. ``[W_q; W_k; W_v]``: one activation transform, one quantizer call, one GEMM),
            their outputs concatenated in the site's member order. Replaces every member; the model applies what
            follows each member (e.g. the q/k RMSNorm) to its slice.
        stacked: the entries of block linears carry a leading ``num_layers`` axis on every array (for models whose
            blocks run under ``lax.scan``; the scan hands each block its slice). A model in list layout refuses them.

    A model calls :meth:`fused_projection_norm` / :meth:`fused_swiglu` / :meth:`fused_shared_input` at its fused
    sites and runs the unfused path when they return None; it checks the entries first with
    :func:`check_fused_sites`.
    """

    def __init__(self, overrides: Mapping[str, Callable[[jax.Array], jax.Array]] | None = None,
                 recorder: Recorder | None = None, *, projection_norm: Mapping[str, Callable] | None = None,
                 swiglu: Mapping[str, Callable] | None = None, shared_input: Mapping[str, Callable] | None = None,
                 stacked: bool = False):
        super().__init__(overrides, recorder)
        self.projection_norm = dict(projection_norm or {})
        self.swiglu = dict(swiglu or {})
        self.shared_input = dict(shared_input or {})
        self.stacked = bool(stacked)
        if stacked and recorder is not None:
            raise ValueError("FusedLinearHooks: a recorder cannot be combined with stacked (scanned) entries")

    def entries(self) -> dict[str, dict[str, Any]]:
        """The four entry tables (a pytree: ``jax.tree_util.Partial`` entries carry their arrays as leaves)."""
        overrides = self.overrides if isinstance(self.overrides, SharedOverrides) else dict(self.overrides)
        return {"overrides": overrides, "projection_norm": dict(self.projection_norm),
                "swiglu": dict(self.swiglu), "shared_input": dict(self.shared_input)}

    @classmethod
    def from_entries(cls, entries: Mapping[str, Mapping[str, Callable]], stacked: bool = False) -> "FusedLinearHooks":
        """Inverse of :meth:`entries` (e.g. one scanned block's slice of stacked entries)."""
        return cls(entries.get("overrides"), projection_norm=entries.get("projection_norm"),
                   swiglu=entries.get("swiglu"), shared_input=entries.get("shared_input"), stacked=stacked)

    def fused_projection_norm(self, projection: Any, x: jax.Array, scale: jax.Array, eps: float
                              ) -> jax.Array | None:
        """The fused projection + per-head RMSNorm of ``projection`` (a Linear) on ``x``, or None (run unfused)."""
        fn = self.projection_norm.get(projection.path)
        if fn is None:
            return None
        self.record(projection, x)
        y = fn(x, scale, eps)
        return _checked(y, x, projection.out_features, f"projection_norm entry {projection.path}")

    def fused_swiglu(self, gate: Any, up: Any, x: jax.Array) -> jax.Array | None:
        """``SiLU(gate(x)) * up(x)`` fused, keyed by the gate Linear's path, or None (run unfused)."""
        fn = self.swiglu.get(gate.path)
        if fn is None:
            return None
        for linear in (gate, up):
            self.record(linear, x)
        return _checked(fn(x), x, gate.out_features, f"swiglu entry {gate.path}")

    def fused_shared_input(self, members: tuple[Any, ...], x: jax.Array) -> tuple[jax.Array, ...] | None:
        """The outputs ``(..., o_i)`` of ``members`` (Linears reading the same ``x``) from one fused entry keyed by
        the first member's path, or None (run them one by one)."""
        fn = self.shared_input.get(members[0].path)
        if fn is None:
            return None
        for linear in members:
            self.record(linear, x)
        widths = [linear.out_features for linear in members]
        y = _checked(fn(x), x, sum(widths), f"shared_input entry {members[0].path}")
        return tuple(jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1))


def _checked(y: jax.Array, x: jax.Array, out_features: int, what: str) -> jax.Array:
    expected = x.shape[:-1] + (out_features,)
    if tuple(y.shape) != expected:
        raise ValueError(f"{what}: returned shape {tuple(y.shape)}, expected {expected}")
    return y.astype(x.dtype)


def check_fused_sites(hooks: Any, projection_norm_sites: Mapping[str, tuple[str, ...]],
                      swiglu_sites: Mapping[str, tuple[str, ...]],
                      shared_input_sites: Mapping[str, tuple[str, ...]] | None = None) -> None:
    """Raise a ValueError if a fused entry of ``hooks`` names no fused site of the model, or if a linear is replaced
    twice (by a per-linear override and a fused entry, or by two fused entries).

    Args:
        hooks: :class:`FusedLinearHooks` (plain :class:`~models.layers.LinearHooks` and None pass).
        projection_norm_sites: ``{projection path: (paths of the linears it replaces)}`` of the model.
        swiglu_sites: ``{gate path: (gate path, up path)}``.
        shared_input_sites: ``{first member path: (member paths, in output order)}`` (None: the model has none).
    """
    if not isinstance(hooks, FusedLinearHooks):
        return
    problems = []
    replaced: dict[str, str] = {}  # linear path -> the fused entry that replaces it
    for table, sites in (("projection_norm", projection_norm_sites), ("swiglu", swiglu_sites),
                         ("shared_input", shared_input_sites or {})):
        for name in getattr(hooks, table):
            if name not in sites:
                examples = ", ".join(sorted(sites)[:3]) or "none"
                problems.append(f"{table} entry {name!r} names no {table} site of the model (e.g. {examples})")
                continue
            clash = [p for p in sites[name] if p in hooks.overrides]
            if clash:
                problems.append(f"{table} entry {name!r} replaces {clash}, which also have per-linear overrides")
            for path in sites[name]:
                if path in replaced:
                    problems.append(f"{table} entry {name!r} replaces {path!r}, which {replaced[path]} already "
                                    "replaces")
                replaced.setdefault(path, f"{table} entry {name!r}")
    if problems:
        raise ValueError("bad fused hooks:\n  " + "\n  ".join(problems))


class Linear(nnx.Module):
    """``y = x @ kernel + bias``; kernel ``(in_features, out_features)`` (the transpose of torch's weight).

    ``quantizable`` marks the layers W4A4 applies to (transformer-block linears, SANA's 1x1 convs).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, quantizable: bool = False,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(in_features)
        self.in_features = in_features
        self.out_features = out_features
        self.quantizable = quantizable
        self.path = ""
        self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (in_features, out_features), dtype, -bound, bound))
        self.bias = nnx.Param(jax.random.uniform(rngs.params(), (out_features,), dtype, -bound, bound)) if bias \
            else None

    def dense(self, x: jax.Array) -> jax.Array:
        """The plain 16-bit (or fp32) forward: x (..., d) -> (..., o)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.path or 'Linear'}: input has {x.shape[-1]} features, expects {self.in_features}")
        kernel = self.kernel[...]
        y = jnp.matmul(x.astype(kernel.dtype), kernel)  # (..., o)
        if self.bias is not None:
            y = y + self.bias[...]  # (..., o)
        return y

    def __call__(self, x: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        return self.dense(x) if hooks is None else hooks(self, x)


def name_linears(model: nnx.Module) -> None:
    """Set ``Linear.path`` of every Linear in ``model`` to its dotted NNX path (= its diffusers key prefix)."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            node.path = ".".join(str(p) for p in path)


def linears(model: nnx.Module, quantizable_only: bool = False) -> dict[str, Linear]:
    """``{dotted path: Linear}`` of the model, in graph order (optionally only the quantizable ones)."""
    found = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and (node.quantizable or not quantizable_only):
            found[".".join(str(p) for p in path)] = node
    return found


def params_digest(model: nnx.Module, exclude_linears: Sequence[str] = (), config: Any = None) -> str:
    """SHA-256 of the model's parameters (each ``nnx.Param``'s path, shape, dtype and bytes, in graph order) and of
    ``repr(config)``, leaving out the kernel and bias of the linears named in ``exclude_linears`` (e.g. the quantized
    ones, whose weights a layer set already carries and compares): the rest of the model, which shapes the
    activations a capture records."""
    excluded = set(exclude_linears)

    def kept():
        for path, node in nnx.iter_graph(model):
            names = [str(p) for p in path]
            if isinstance(node, nnx.Param) and not (names[-1] in ("kernel", "bias")
                                                    and ".".join(names[:-1]) in excluded):
                yield ".".join(names), node[...]

    return named_arrays_digest(kept(), prefix=repr(config).encode())


def run_blocks_scanned(blocks: list[nnx.Module], x: jax.Array, hooks: LinearHooks | None,
                call: Callable[[nnx.Module, jax.Array, LinearHooks | None], jax.Array]) -> jax.Array:
    """``x = call(block, x, hooks)`` for each of ``blocks`` in turn, run as ONE ``lax.scan`` over their stacked
    parameters: XLA compiles one block (and its hooks) instead of ``len(blocks)`` copies. The result equals the
    Python loop's up to floating-point reassociation.

    ``blocks`` must share one structure (parameter shapes and dtypes; their :attr:`Linear.path` names differ). Inside
    the scan each step is a block rebuilt from the first block's structure, so its linears report the FIRST block's
    paths: an override of ``blocks[i]``'s linear ``<prefix_i>.<suffix>`` reaches it as ``<prefix_0>.<suffix>``.

    Hooks: every block must override the same linears (by suffix), each with a ``jax.tree_util.Partial`` of one
    function and one pytree structure across blocks (its arrays are stacked and sliced per step, e.g. a layer's
    weights and transform). Overrides given as a :class:`SharedOverrides` stay one: each step gets the block's
    layers once (a fused layer ``q|k|v`` runs once for its three members), which needs every block to route the
    same suffixes through layers of one structure, and each layer's members to lie in one block. A recorder, a
    fused hook table or a ``functools.partial`` override (whose arrays are hidden from the scan) raise ValueError.
    Overrides of linears outside ``blocks`` are not used here (the caller runs those linears itself, outside the
    scan). The token mask of ``hooks`` is kept.

    The stacked parameters are a copy made per call (one model's block parameters more memory while it runs).
    """
    if not blocks:
        return x
    if hooks is not None and (hooks.recorder is not None or isinstance(hooks, FusedLinearHooks)):
        raise ValueError("run_blocks_scanned: a recorder or fused hooks cannot run under the scan (run the blocks in "
                         "a loop)")
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(block)[1] for block in blocks[1:]]
    reference = jax.tree.structure(first)
    for i, state in enumerate(states):
        if jax.tree.structure(state) != reference or any(
                (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(state))):
            raise ValueError(f"run_blocks_scanned: block {i} has another parameter structure than block 0")
    # {suffix: path} of each block's linears
    suffixes = [{".".join(str(p) for p in path): node.path for path, node in nnx.iter_graph(block)
                 if isinstance(node, Linear)} for block in blocks]
    if hooks is not None and isinstance(hooks.overrides, SharedOverrides):
        return _run_blocks_scanned_shared(graphdef, states, suffixes, x, hooks, call)
    overrides = {} if hooks is None else dict(hooks.overrides)
    per_block = []
    for i, table in enumerate(suffixes):
        mine = {suffix: overrides.pop(path) for suffix, path in table.items() if path in overrides}
        if per_block and set(mine) != set(per_block[0]):
            raise ValueError(f"run_blocks_scanned: block {i} overrides {sorted(mine)}, block 0 overrides "
                             f"{sorted(per_block[0])}: every block must override the same linears")
        for suffix, fn in mine.items():
            if not isinstance(fn, jax.tree_util.Partial):
                raise ValueError(f"run_blocks_scanned: the override of {table[suffix]} must be a "
                                 f"jax.tree_util.Partial (its arrays are stacked over the blocks), got "
                                 f"{type(fn).__name__}")
            if jax.tree.structure(fn) != jax.tree.structure(per_block[0][suffix] if per_block else fn):
                raise ValueError(f"run_blocks_scanned: the override of {table[suffix]} has another function or "
                                 f"pytree structure than block 0's")
        per_block.append(mine)
    stacked_state = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)
    stacked_overrides = jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_block) if per_block[0] else {}
    names = suffixes[0]
    token_mask = None if hooks is None else hooks.token_mask

    def step(x, sliced):
        state, entries = sliced
        block = nnx.merge(graphdef, state)
        inner = None if hooks is None else LinearHooks({names[s]: fn for s, fn in entries.items()},
                                                       token_mask=token_mask)
        return call(block, x, inner), None

    x, _ = jax.lax.scan(step, x, (stacked_state, stacked_overrides))
    return x


def _run_blocks_scanned_shared(graphdef, states, suffixes, x, hooks, call):
    """:func:`run_blocks_scanned` with ``hooks.overrides`` a :class:`SharedOverrides`: per block, the layers its
    linears route to (each once), renamed by the first suffix they serve so that every block's mapping has one
    pytree structure; stacked and sliced per step like the block parameters."""
    shared: SharedOverrides = hooks.overrides
    served_paths: dict[str, set[str]] = {}  # layer name -> the linear paths it serves
    for path, (name, _, _) in shared._routes.items():
        served_paths.setdefault(name, set()).add(path)
    per_block = []
    for i, table in enumerate(suffixes):
        routes = {suffix: shared._routes[path] for suffix, path in table.items() if path in shared._routes}
        first = {}  # layer name -> the first suffix (sorted) it serves: the name it has in every block
        for suffix in sorted(routes):
            first.setdefault(routes[suffix][0], suffix)
        block_paths = set(table.values())
        for name in first:
            outside = sorted(served_paths[name] - block_paths)
            if outside:
                raise ValueError(f"run_blocks_scanned: layer {name} also serves {outside[:3]}, outside block {i}")
        mine = SharedOverrides({first[name]: shared._layers[name] for name in first},
                               {suffix: (first[name], forward, rows) for suffix, (name, forward, rows) in routes.items()})
        if per_block and jax.tree.structure(mine) != jax.tree.structure(per_block[0]):
            raise ValueError(f"run_blocks_scanned: block {i} routes {sorted(routes)} through layers of another "
                             f"structure than block 0's ({sorted(per_block[0])})")
        per_block.append(mine)
    stacked_state = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)
    stacked_overrides = jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_block)
    names = suffixes[0]

    def step(x, sliced):
        state, entries = sliced
        block = nnx.merge(graphdef, state)
        routed = SharedOverrides(entries.layers, {names[s]: route for s, route in entries._routes.items()})
        return call(block, x, LinearHooks(routed, token_mask=hooks.token_mask)), None

    x, _ = jax.lax.scan(step, x, (stacked_state, stacked_overrides))
    return x


def layer_norm(x: jax.Array, eps: float) -> jax.Array:
    """Non-affine LayerNorm over the last axis, computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm over the last axis, with optional affine ``weight``/``bias``."""

    def __init__(self, dim: int, eps: float, affine: bool, *, dtype: Any = jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype)) if affine else None
        self.bias = nnx.Param(jnp.zeros((dim,), dtype)) if affine else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = layer_norm(x, self.eps)  # (..., dim)
        if self.weight is not None:
            y = y * self.weight[...] + self.bias[...]  # (..., dim)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis (variance in fp32), optional ``weight`` (diffusers RMSNorm / torch.nn.RMSNorm)."""

    def __init__(self, dim: int, eps: float, affine: bool = True, *, dtype: Any = jnp.float32):
        self.eps = eps
        self.dim = dim
        self.weight = nnx.Param(jnp.ones((dim,), dtype)) if affine else None

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm of width {self.dim} got input of shape {x.shape}")
        variance = jnp.square(x.astype(jnp.float32)).mean(-1, keepdims=True)  # (..., 1)
        y = x.astype(jnp.float32) * jax.lax.rsqrt(variance + self.eps)  # (..., dim)
        if self.weight is not None:
            y = y * self.weight[...].astype(jnp.float32)  # (..., dim)
        return y.astype(x.dtype)


def timestep_embedding(t: jax.Array, dim: int = 256, flip_sin_to_cos: bool = True, shift: float = 0.0,
                       max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding of (possibly fractional) timesteps: t (b,) -> (b, dim) fp32 (diffusers
    ``get_timestep_embedding``)."""
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - shift)  # (half,)
    angles = t.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]  # (b, half)
    emb = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # (b, 2 half)
    if flip_sin_to_cos:
        emb = jnp.concatenate([emb[:, half:], emb[:, :half]], axis=-1)  # (b, 2 half)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))  # (b, dim)
    return emb


class TimestepEmbedding(nnx.Module):
    """diffusers TimestepEmbedding: ``linear_2(silu(linear_1(x)))``."""

    def __init__(self, in_channels: int, dim: int, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.linear_1 = Linear(in_channels, dim, dtype=dtype, rngs=rngs)
        self.linear_2 = Linear(dim, dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        return self.linear_2(jax.nn.silu(self.linear_1(x, hooks)), hooks)  # (b, dim)


class TextProjection(nnx.Module):
    """diffusers PixArtAlphaTextProjection: ``linear_2(act(linear_1(x)))``, act in {gelu_tanh, silu}."""

    def __init__(self, in_features: int, hidden: int, act: str = "gelu_tanh", *, dtype: Any = jnp.float32,
                 rngs: nnx.Rngs):
        if act not in ("gelu_tanh", "silu"):
            raise ValueError(f"TextProjection: unknown {act=}")
        self.act = act
        self.linear_1 = Linear(in_features, hidden, dtype=dtype, rngs=rngs)
        self.linear_2 = Linear(hidden, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        h = self.linear_1(x, hooks)  # (..., hidden)
        h = jax.nn.gelu(h, approximate=True) if self.act == "gelu_tanh" else jax.nn.silu(h)  # (..., hidden)
        return self.linear_2(h, hooks)  # (..., hidden)


class GELUProj(nnx.Module):
    """diffusers activations.GELU: ``gelu(proj(x))`` (tanh approximation when ``approximate``)."""

    def __init__(self, dim_in: int, dim_out: int, approximate: bool, *, quantizable: bool, dtype: Any,
                 rngs: nnx.Rngs):
        self.approximate = approximate
        self.proj = Linear(dim_in, dim_out, quantizable=quantizable, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        return jax.nn.gelu(self.proj(x, hooks), approximate=self.approximate)


class FeedForward(nnx.Module):
    """diffusers FeedForward with a GELU activation: ``net.2(gelu(net.0.proj(x)))`` (``net.1`` is dropout)."""

    def __init__(self, dim: int, inner_dim: int, dim_out: int | None = None, approximate: bool = True, *,
                 quantizable: bool = True, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.net = nnx.List([
            GELUProj(dim, inner_dim, approximate, quantizable=quantizable, dtype=dtype, rngs=rngs),
            None,
            Linear(inner_dim, dim_out or dim, quantizable=quantizable, dtype=dtype, rngs=rngs),
        ])

    def __call__(self, x: jax.Array, hooks: LinearHooks | None = None) -> jax.Array:
        return self.net[2](self.net[0](x, hooks), hooks)  # (..., dim_out)


#: How the models run softmax attention (a config field ``attention_impl`` of every family): ``"xla"``, the logits
#: materialised in fp32 (any device; diffusers' SDPA numerics), or ``"cudnn"``, cuDNN's fused flash attention
#: (``jax.nn.dot_product_attention``; NVIDIA GPUs, bf16 / fp16 inputs; what serving on the GPU wants).
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")


def check_attention_impl(value: str, where: str) -> None:
    """Raises ValueError naming ``where`` unless ``value`` is one of :data:`ATTENTION_IMPLEMENTATIONS`."""
    if value not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"{where}: attention_impl={value!r} must be one of {ATTENTION_IMPLEMENTATIONS}")


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None = None,
                          implementation: str = "xla") -> jax.Array:
    """Softmax attention. q (b, s, h, dh), k/v (b, t, h, dh), bias broadcastable to (b, h, s, t) -> (b, s, h, dh).

    Scale ``dh ** -0.5``. ``implementation`` (:data:`ATTENTION_IMPLEMENTATIONS`): ``"xla"`` computes the logits and
    softmax in fp32; ``"cudnn"`` is cuDNN's flash attention (the bias cast to q's dtype; fp32 softmax inside).
    """
    check_attention_impl(implementation, "dot_product_attention")
    if implementation == "cudnn":
        if jax.default_backend() != "gpu":
            raise ValueError(f"attention_impl='cudnn' needs an NVIDIA GPU (the backend is {jax.default_backend()}); "
                             "use 'xla'")
        # cuDNN wants the bias at full (b, 1, s, t): a (b, 1, 1, t) key mask is broadcast over the queries
        bias = None if bias is None else jnp.broadcast_to(bias, (q.shape[0], 1, q.shape[1], k.shape[1])).astype(q.dtype)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="cudnn")  # (b, s, h, dh)
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bshd,bthd->bhst", q, k, preferred_element_type=jnp.float32) * scale  # (b, h, s, t)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)  # (b, h, s, t)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # (b, h, s, t)
    return jnp.einsum("bhst,bthd->bshd", weights, v)  # (b, s, h, dh)


def mask_to_bias(mask: jax.Array | None, dtype: Any = jnp.float32) -> jax.Array | None:
    """A keep-mask (b, t) of 1/0 -> additive bias (b, 1, 1, t) of 0/-10000 (diffusers' convention); None stays None."""
    if mask is None:
        return None
    if mask.ndim != 2:
        raise ValueError(f"attention mask must be (batch, tokens), got shape {mask.shape}")
    return ((1.0 - mask.astype(dtype)) * -10000.0)[:, None, None, :]


class Attention(nnx.Module):
    """diffusers Attention with the default SDPA processor: ``to_q``, ``to_k``, ``to_v``, ``to_out.0``.

    Optional ``qk_norm="rms_norm_across_heads"`` (``norm_q``/``norm_k`` over the full width, as SANA 1.5).
    """

    def __init__(self, query_dim: int, heads: int, head_dim: int, kv_dim: int | None = None, *, bias: bool,
                 out_bias: bool = True, qk_norm: str | None = None, qk_eps: float = 1e-5, quantizable: bool = True,
                 attention_impl: str = "xla", dtype: Any = jnp.float32, rngs: nnx.Rngs):
        inner = heads * head_dim
        kv_dim = query_dim if kv_dim is None else kv_dim
        check_attention_impl(attention_impl, "Attention")
        self.heads = heads
        self.head_dim = head_dim
        self.attention_impl = attention_impl
        self.to_q = Linear(query_dim, inner, bias=bias, quantizable=quantizable, dtype=dtype, rngs=rngs)
        self.to_k = Linear(kv_dim, inner, bias=bias, quantizable=quantizable, dtype=dtype, rngs=rngs)
        self.to_v = Linear(kv_dim, inner, bias=bias, quantizable=quantizable, dtype=dtype, rngs=rngs)
        self.to_out = nnx.List([Linear(inner, query_dim, bias=out_bias, quantizable=quantizable, dtype=dtype,
                                       rngs=rngs)])
        if qk_norm is None:
            self.norm_q = self.norm_k = None
        elif qk_norm == "rms_norm_across_heads":
            self.norm_q = RMSNorm(inner, qk_eps, dtype=dtype)
            self.norm_k = RMSNorm(inner, qk_eps, dtype=dtype)
        else:
            raise NotImplementedError(f"Attention: {qk_norm=} is not ported (None, 'rms_norm_across_heads')")

    def shared_input_sites(self, self_attention: bool) -> dict[str, tuple[str, ...]]:
        """This attention's :class:`FusedLinearHooks` ``shared_input`` sites: ``{to_q: (to_q, to_k, to_v)}`` for a
        self-attention (the three read ``x``), ``{to_k: (to_k, to_v)}`` for a cross-attention (they read the
        context, ``to_q`` reads ``x``)."""
        if self_attention:
            return {self.to_q.path: (self.to_q.path, self.to_k.path, self.to_v.path)}
        return {self.to_k.path: (self.to_k.path, self.to_v.path)}

    def project_qkv(self, x: jax.Array, context: jax.Array, hooks: LinearHooks | None,
                    context_mask: jax.Array | None = None):
        """x (b, s, query_dim), context (b, t, kv_dim), context_mask (b, t) keep-mask or None ->
        q (b, s, h, dh), k, v (b, t, h, dh). The mask only reaches the hooks (see :func:`with_token_mask`).

        A ``shared_input`` entry of :class:`FusedLinearHooks` runs q | k | v as one linear (self-attention:
        ``context`` is ``x``; keyed by ``to_q``) or k | v as one (keyed by ``to_k``)."""
        fused = getattr(hooks, "fused_shared_input", None)
        context_hooks = with_token_mask(hooks, context_mask)
        qkv = None if fused is None else fused((self.to_q, self.to_k, self.to_v), x)
        if qkv is not None and context is not x:
            raise ValueError(f"shared_input entry {self.to_q.path}: q | k | v as one linear needs a self-attention "
                             "(here k and v read another input than q)")
        if qkv is not None:
            q, k, v = qkv  # (b, s, inner) each
        else:
            q = self.to_q(x, hooks)  # (b, s, inner)
            kv = None if fused is None else context_hooks.fused_shared_input((self.to_k, self.to_v), context)
            k, v = kv if kv is not None else (self.to_k(context, context_hooks),
                                              self.to_v(context, context_hooks))  # (b, t, inner) each
        if self.norm_q is not None:
            q = self.norm_q(q)  # (b, s, inner)
            k = self.norm_k(k)  # (b, t, inner)
        split = lambda a: a.reshape(a.shape[:2] + (self.heads, self.head_dim))  # noqa: E731
        return split(q), split(k), split(v)

    def __call__(self, x: jax.Array, context: jax.Array | None = None, bias: jax.Array | None = None,
                 hooks: LinearHooks | None = None, context_mask: jax.Array | None = None) -> jax.Array:
        """x (b, s, query_dim), context (b, t, kv_dim) or None (self-attention), bias (b, 1, 1, t), context_mask
        (b, t) keep-mask of the context tokens (for the hooks' recorder) -> (b, s, dim)."""
        context = x if context is None else context
        q, k, v = self.project_qkv(x, context, hooks, context_mask)  # (b, s, h, dh), (b, t, h, dh) x2
        out = dot_product_attention(q, k, v, bias, self.attention_impl)  # (b, s, h, dh)
        out = out.reshape(out.shape[:2] + (self.heads * self.head_dim,))  # (b, s, inner)
        return self.to_out[0](out, hooks)  # (b, s, query_dim)


def block_attention_sites(blocks: Any) -> tuple[dict, dict, dict[str, tuple[str, ...]]]:
    """The fused sites (as ``fused_sites()`` returns them, for :func:`check_fused_sites`) of blocks with a
    self-attention ``attn1`` and an optional cross-attention ``attn2`` (PixArt-Σ, SANA): no projection + norm or
    SwiGLU sites; ``shared_input`` sites ``attn1`` q | k | v and ``attn2`` k | v of every block."""
    shared = {}
    for block in blocks:
        shared.update(block.attn1.shared_input_sites(self_attention=True))
        if block.attn2 is not None:
            shared.update(block.attn2.shared_input_sites(self_attention=False))
    return {}, {}, shared


def sincos_pos_embed_2d(dim: int, grid_h: int, grid_w: int, base_size: int, interpolation_scale: float) -> np.ndarray:
    """diffusers get_2d_sincos_pos_embed (float64 numpy, static): -> (grid_h * grid_w, dim) float32."""
    if dim % 4:
        raise ValueError(f"2-D sincos position embedding needs {dim=} divisible by 4")
    pos_h = np.arange(grid_h, dtype=np.float32) / (grid_h / base_size) / interpolation_scale  # (gh,)
    pos_w = np.arange(grid_w, dtype=np.float32) / (grid_w / base_size) / interpolation_scale  # (gw,)
    mesh_w, mesh_h = np.meshgrid(pos_w, pos_h, indexing="xy")  # (gh, gw) each
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4.0))  # (dim/4,)

    def one_axis(pos: np.ndarray) -> np.ndarray:
        angles = np.outer(pos.reshape(-1).astype(np.float64), omega)  # (gh gw, dim/4)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)  # (gh gw, dim/2)

    return np.concatenate([one_axis(mesh_w), one_axis(mesh_h)], axis=1).astype(np.float32)  # (gh gw, dim)


class ConvWeights(nnx.Module):
    """The parameters of a 2-D convolution: ``kernel`` HWIO (kh, kw, c_in / groups, c_out), optional ``bias``."""

    def __init__(self, kh: int, kw: int, c_in_per_group: int, c_out: int, *, bias: bool, dtype: Any,
                 rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(kh * kw * c_in_per_group)
        self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (kh, kw, c_in_per_group, c_out), dtype,
                                                   -bound, bound))
        self.bias = nnx.Param(jax.random.uniform(rngs.params(), (c_out,), dtype, -bound, bound)) if bias else None


class PatchEmbed(nnx.Module):
    """diffusers PatchEmbed: a stride-p conv ``proj`` (kernel HWIO (p, p, c, dim)) plus optional 2-D sincos positions.

    Input (b, c, H, W) NCHW like diffusers; output (b, H/p * W/p, dim) tokens in row-major patch order.
    """

    def __init__(self, sample_size: int, patch_size: int, in_channels: int, dim: int,
                 interpolation_scale: float | None, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.base_size = sample_size // patch_size
        self.interpolation_scale = interpolation_scale
        self.proj = ConvWeights(patch_size, patch_size, in_channels, dim, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, c, height, width = x.shape
        p = self.patch_size
        if c != self.in_channels or height % p or width % p:
            raise ValueError(f"PatchEmbed: input {x.shape} needs {self.in_channels} channels and H, W multiples of "
                             f"{p}")
        kernel = self.proj.kernel[...]
        gh, gw = height // p, width // p
        patches = x.astype(kernel.dtype).reshape(b, c, gh, p, gw, p)  # (b, c, gh, p, gw, p)
        patches = patches.transpose(0, 2, 4, 3, 5, 1).reshape(b, gh * gw, p * p * c)  # (b, n, p p c)
        tokens = patches @ kernel.reshape(p * p * c, -1) + self.proj.bias[...]  # (b, n, dim)
        if self.interpolation_scale is None:
            return tokens
        pos = sincos_pos_embed_2d(tokens.shape[-1], gh, gw, self.base_size, self.interpolation_scale)  # (n, dim)
        return (tokens.astype(jnp.float32) + pos[None]).astype(tokens.dtype)  # (b, n, dim)


def unpatchify(tokens: jax.Array, height: int, width: int, patch_size: int, channels: int) -> jax.Array:
    """tokens (b, gh*gw, p*p*c) in diffusers' (p, q, c) order -> image (b, c, gh*p, gw*p)."""
    b = tokens.shape[0]
    gh, gw, p = height // patch_size, width // patch_size, patch_size
    x = tokens.reshape(b, gh, gw, p, p, channels)  # (b, gh, gw, p, q, c)
    x = x.transpose(0, 5, 1, 3, 2, 4)  # (b, c, gh, p, gw, q)
    return x.reshape(b, channels, gh * p, gw * p)  # (b, c, H, W)


def rope_frequencies(ids: jax.Array, axes_dims: tuple[int, ...], theta: float = 10000.0
                     ) -> tuple[jax.Array, jax.Array]:
    """FLUX's multi-axis RoPE: ids (s, n_axes) -> (cos, sin), each (s, sum(axes_dims)) fp32, pairs interleaved."""
    if ids.shape[-1] != len(axes_dims):
        raise ValueError(f"rope ids of shape {ids.shape} do not match {len(axes_dims)} axes {axes_dims}")
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # (dim/2,)
        angles = ids[:, axis].astype(jnp.float32)[:, None] * freqs[None, :]  # (s, dim/2)
        cos_parts.append(jnp.repeat(jnp.cos(angles), 2, axis=1))  # (s, dim)
        sin_parts.append(jnp.repeat(jnp.sin(angles), 2, axis=1))  # (s, dim)
    return jnp.concatenate(cos_parts, axis=1), jnp.concatenate(sin_parts, axis=1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (b, s, h, dh) with interleaved (real, imag) pairs; cos/sin (s, dh) -> rotated x, computed in fp32."""
    pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (-1, 2))  # (b, s, h, dh/2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)  # (b, s, h, dh)
    out = x.astype(jnp.float32) * cos[None, :, None, :] + rotated * sin[None, :, None, :]  # (b, s, h, dh)
    return out.astype(x.dtype)



def _init_rule(path: tuple, shape: tuple[int, ...]) -> tuple[str, float]:
    """``(distribution, value)`` of one parameter for :func:`host_init` / :func:`device_init`: ``"uniform"`` in
    ``±value``, ``"normal"`` divided by ``value``, or ``"constant"`` ``value``."""
    name = str(path[-1])
    if name == "kernel":
        return "uniform", 1.0 / math.sqrt(max(1, math.prod(shape[:-1])))
    if name in ("scale_shift_table", "embedding"):
        return "normal", math.sqrt(shape[-1])
    if name in ("weight", "scale"):
        return "constant", 1.0
    if name == "bias":
        return "constant", 0.0
    raise ValueError(f"random init: no init rule for parameter {'.'.join(map(str, path))} of shape {shape}")


def host_init(constructor: Callable[[], nnx.Module], seed: int = 0) -> nnx.Module:
    """Build ``constructor()`` abstractly and fill its parameters on the host with numpy (fast: no per-op compiles).

    Init: ``*.kernel`` uniform(±1/sqrt(fan_in)) with fan_in = prod(shape[:-1]) (torch's Linear/Conv default for
    the weight), biases 0, norm weights (``weight``, ``scale``) 1, ``*scale_shift_table`` and embedding tables
    normal / sqrt(dim).
    """
    abstract = nnx.eval_shape(constructor)
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    leaves = []
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        shape, dtype = tuple(value.shape), value.dtype
        kind, scale = _init_rule(path, shape)
        if kind == "uniform":
            array = rng.uniform(-scale, scale, shape)
        elif kind == "normal":
            array = rng.standard_normal(shape) / scale
        else:
            array = np.full(shape, scale)
        leaves.append((path, variable.replace(jnp.asarray(array, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def device_init(constructor: Callable[[], nnx.Module], seed: int = 0) -> nnx.Module:
    """:func:`host_init`'s distributions drawn on the default device with ``jax.random`` (one compiled draw per
    shape and dtype): for models too large to fill quickly on the host, e.g. FLUX.1's 12B parameters in a GPU
    benchmark. Other values than :func:`host_init`'s for the same seed."""
    abstract = nnx.eval_shape(constructor)
    graphdef, state = nnx.split(abstract)
    key = jax.random.key(seed)
    leaves = []
    for i, (path, variable) in enumerate(nnx.to_flat_state(state)):
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        shape, dtype = tuple(value.shape), value.dtype
        kind, scale = _init_rule(path, shape)
        leaves.append((path, variable.replace(_device_draw(jax.random.fold_in(key, i), shape, dtype, kind, scale))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_draw(key: jax.Array, shape: tuple[int, ...], dtype: Any, kind: str, scale: float) -> jax.Array:
    """One parameter ``shape`` in ``dtype`` drawn by :func:`_init_rule`'s ``(kind, scale)``."""
    if kind == "uniform":
        return (jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) * scale).astype(dtype)
    if kind == "normal":
        return (jax.random.normal(key, shape, jnp.float32) / scale).astype(dtype)
    return jnp.full(shape, scale, dtype)


class InitKeys:
    """A cheap stand-in for ``nnx.Rngs`` at construction time: ``params()`` returns ``fold_in(key, n)`` for
    n = 1, 2, ... (nnx.Rngs updates an nnx Variable at each draw, which is slow to trace for models with hundreds
    of parameters, e.g. under ``nnx.eval_shape`` of FLUX). Modules only draw keys in their constructors."""

    def __init__(self, seed: int = 0):
        self.key = jax.random.key(seed)
        self.count = 0

    def params(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count)

"""The served (deployable) W4A4 linear layer: one prepared layer type, one entry point, pluggable GEMM strategies.

A calibrated ``kroquant_jax.qlinear.QuantizedLinear`` is prepared once (:func:`serve`) into a :class:`ServedLinear`
(a pytree; stack it for ``lax.scan``) and run by :func:`forward` (paper eq. 11,
``Q(x T) Q(W~ - L R)^T + (x T)(L R)^T + b``, then an optional op)::

    from pallas_kernels import served
    s = served.serve(layer)                              # T prepared for its kernel, R T^T folded (bf16)
    s13 = served.serve(layer13, swiglu=True)             # a fused [W_gate; W_up] layer, rows in gate/up pairs
    y = served.forward(s, x)                             # (..., d) -> (..., o), the default options
    y = served.forward(s, x, op="rmsnorm", norm_weight=nw, head_dim=256, eps=1e-5)
    y = served.forward(s13, x, op="swiglu", options=served.ServeOptions(strategy="kernel", fused=False))

Every strategy starts with the fused transform + quantize kernel (``Q(x T)``, :func:`quantized_inputs`) and
``h = x (R T^T)^T`` (``T`` folded into ``R`` at preparation time, so the low-rank branch needs no ``x T``); the
strategy then computes the GEMM and the op:

* ``"dequant"`` (:data:`DEFAULT_STRATEGY`, a default :class:`ServeOptions`'s; :func:`default_strategy` picks the FP8
  strategy ``"fp8_mgpu"`` instead on Hopper where it serves every layer): "dequantize + cuBLAS",
  :func:`~pallas_kernels.w4a4_gemm.w4a4_matmul_dequant`: both packed operands decoded to bf16 by XLA fusions
  (exact), one bf16 GEMM with the low-rank pair joined along K (``[A | h] [W | L]^T``; NVFP4: a second GEMM for
  ``h L^T``), bias in f32, the output stored in bf16, then the op as XLA ops (f32 math). Faster than ``"kernel"`` and
  ``"mgpu"`` at every measured shape (docs/w4a4.md, "Served layers on the dequant strategy", "Why dequant is the
  default"); slower than the FP8 strategies of ``pallas_kernels.fp8_gemm`` on Hopper.
* ``"kernel"``: the Pallas-Triton W4A4 GEMM (:func:`~pallas_kernels.w4a4_gemm.w4a4_matmul`) with the low-rank term
  (packed ``L`` decoded) in its epilogue, and with ``fused`` (default True) the RMSNorm or SwiGLU in that epilogue
  too (:func:`~pallas_kernels.epilogues.gemm_rmsnorm` / :func:`~pallas_kernels.epilogues.gemm_swiglu`).
* ``"mgpu"``: the Mosaic GPU W4A4 GEMM (``pallas_kernels.w4a4_gemm_mgpu``, MXFP4; its jnp mirror off the GPU),
  ``h L^T`` beside it in XLA, then the op in XLA.

All equal :func:`reference` up to the order of the fp32 additions and the bf16 roundings of the GEMM output.

**Options** (:class:`ServeOptions`, one frozen dataclass for a whole model): the strategy, the implementation
(``impl``: ``None`` picks the compiled kernels on a GPU and the jnp references elsewhere, :func:`resolve_impl`;
``"interpret"`` runs the Pallas kernels in interpret mode on the CPU), the low-rank placement, the kernels' tiles.
Options that the chosen strategy does not read raise at construction (never silently ignored).

**Adding a strategy** (e.g. an FP8 one, in its own module)::

    from pallas_kernels import served

    class Fp8Strategy(served.Strategy):
        name = "fp8"
        options = frozenset({"gemm_blocks"})       # the ServeOptions fields it reads besides strategy/impl/quant_blocks

        def gemm(self, layer, x_q, lowrank, op, options, interpret):
            y = my_fp8_gemm(x_q, layer.weight, ...)  # (m, o) bf16
            return served.apply_op(y, op)

    served.register_strategy(Fp8Strategy())

Importing that module registers it; ``ServeOptions(strategy="fp8")`` then selects it everywhere (``forward``,
``models.quantize_model.served_hooks``). A strategy that needs its own prepared layer overrides :meth:`Strategy.prepare`
(and :meth:`Strategy.reference`); one that quantizes the activations differently overrides :meth:`Strategy.forward`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import MappingProxyType
from typing import Any, ClassVar, Iterable, Literal, Mapping, Optional

import jax
import jax.numpy as jnp

from kroquant_jax.formats import MXFP4, QuantFormat, QuantizedArray, as_float32, dequantize
from kroquant_jax.xla_options import unless_set_by_flags
from pallas_kernels import transform_quantize as tq
from pallas_kernels._compat import on_gpu
from pallas_kernels.epilogues import (EpilogueBlockSizes, gemm_reference, gemm_rmsnorm, gemm_swiglu, permute_rows,
                                      rmsnorm_heads, swiglu_permutation)
from pallas_kernels.w4a4_gemm import (BlockSizes, Compute, dequantize_bf16, even_odd_permutation, keeps_lowrank_packed,
                                      lowrank_h, w4a4_matmul, w4a4_matmul_dequant)

__all__ = [
    "DEFAULT_STRATEGY",
    "PREFERRED_STRATEGY_BY_COMPUTE_CAPABILITY",
    "IMPLS",
    "OPS",
    "OpCall",
    "ServeOptions",
    "ServedLinear",
    "Strategy",
    "apply_op",
    "default_strategy",
    "forward",
    "get_strategy",
    "prepare_layer_transform",
    "program_compiler_options",
    "quantized_inputs",
    "reference",
    "register_strategy",
    "resolve_impl",
    "serve",
    "strategy_names",
]

Op = Literal["none", "rmsnorm", "swiglu"]
#: The ops a served layer can run after its GEMM.
OPS = ("none", "rmsnorm", "swiglu")
#: Implementations: the compiled Pallas kernels, the same kernels in interpret mode (CPU), the jnp references.
IMPLS = ("pallas", "interpret", "reference")
#: The strategy of a default :class:`ServeOptions`: "dequantize + cuBLAS", which runs every layer on every GPU (the
#: faster of the non-FP8 strategies at every measured shape, docs/w4a4.md, "Why dequant is the default").
DEFAULT_STRATEGY = "dequant"
#: The strategy a GPU generation gets by default where one was measured faster than "dequant" and as exact on a real
#: checkpoint (:func:`default_strategy`): compute capability major -> strategy. Hopper (9.x): the fused FP8 kernel,
#: whose ``wgmma`` exists on sm_90 only (docs/w4a4.md, "The default strategy on Hopper").
PREFERRED_STRATEGY_BY_COMPUTE_CAPABILITY = {9: "fp8_mgpu"}


# ---------------------------------------------------------------------------------------------------------------------
# The prepared layer.
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=("transform", "weight", "right", "left", "bias"),
                   meta_fields=("act_fmt", "swiglu_rows"))
@dataclasses.dataclass(frozen=True)
class ServedLinear:
    """A ``QuantizedLinear`` prepared once for the GPU forward (a pytree; stack it for ``lax.scan``).

    Attributes:
      transform: the online ``T`` for the fused transform + quantize kernel (``pallas_kernels.transform_quantize``).
      weight: ``Q(W~ - L R)`` ``(o, d)`` packed; rows in gate/up pairs (``epilogues.pack_swiglu_weight``) if
        ``swiglu_rows``.
      right: ``R T^T`` ``(r, d)`` bf16 (``T`` folded in: ``(x T) R^T = x (R T^T)^T``), rows in
        :func:`~pallas_kernels.w4a4_gemm.even_odd_permutation` order when ``left`` is packed; None without a branch.
      left: ``L`` ``(o, r)``: packed MXFP4 (decoded in the GEMM epilogue) or bf16; rows permuted like ``weight``.
      bias: ``(o,)`` f32 (permuted like ``weight``) or None.
      act_fmt: the activations' format (static).
      swiglu_rows: whether the rows are in gate/up pairs (static; only the SwiGLU op takes such a layer).
    """

    transform: tq.PreparedTransform
    weight: QuantizedArray
    right: Optional[jax.Array]
    left: Optional[object]
    bias: Optional[jax.Array]
    act_fmt: QuantFormat = MXFP4()
    swiglu_rows: bool = False

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]


def prepare_layer_transform(layer, kernel: Optional[str] = None) -> tq.PreparedTransform:
    """The :class:`~pallas_kernels.transform_quantize.PreparedTransform` of a layer's online transform ``T``: K2
    (Kronecker-LU parameters rebuilt in registers) when the layer kept its ``transform_params``, else K1 on the stored
    blocks, Scale for a diagonal, Q4 for the identity, FWHT for ``"fwht"``. ``kernel="k1"`` forces the dense-block
    kernel for Kronecker transforms even if the parameters are kept."""
    cfg = layer.config
    name, d = cfg.transform, cfg.in_features
    if name in ("identity", "fwht"):
        return tq.prepare(name, d=d)
    if layer.transform_params is not None:
        return tq.prepare(name, layer.transform_params, d=d, kernel=kernel)
    blocks = jnp.asarray(layer.blocks, jnp.float32)
    if blocks.shape[1:] == (1, 1):
        return tq.PreparedTransform.from_inv_scale(blocks[:, 0, 0])
    return tq.PreparedTransform.from_blocks(blocks)


def serve_layer(layer, *, swiglu: bool = False, transform_kernel: Optional[str] = None) -> ServedLinear:
    """The :class:`ServedLinear` of a ``kroquant_jax.qlinear.QuantizedLinear`` ``(o, d)`` (what the built-in
    strategies' :meth:`Strategy.prepare` returns; see :func:`serve`)."""
    cfg = layer.config
    if swiglu and cfg.out_features % 2:
        raise ValueError(f"serve(swiglu=True): out_features={cfg.out_features} must be even (gate; up)")
    wfmt = getattr(layer.weight, "fmt", None)
    if type(cfg.act_fmt) is not type(wfmt) or cfg.act_fmt.block_size != wfmt.block_size:
        raise ValueError(f"serve: activations {cfg.act_fmt!r} and weight {wfmt!r} of layer "
                         f"({cfg.out_features}, {cfg.in_features}) must share one FP4 format (the W4A4 GEMM takes "
                         f"both operands packed alike)")
    transform = prepare_layer_transform(layer, transform_kernel)
    left = right = None
    if layer.lowrank_left is not None:
        left = layer.lowrank_left
        packed = keeps_lowrank_packed(left)
        if not packed:
            left = (dequantize(left, jnp.float32) if isinstance(left, QuantizedArray) else jnp.asarray(left))
            left = left.astype(jnp.bfloat16)
        r_dense = as_float32(layer.lowrank_right)  # (r, d) f32
        blocks = jnp.asarray(layer.blocks, jnp.float32)  # (d/n, n, n): (x T)_b = x_b K_b
        nb, n, _ = blocks.shape
        rank = r_dense.shape[0]
        # (x T) R^T = x (R T^T)^T with (R T^T)[r, b, i] = sum_j K_b[i, j] R[r, b, j]
        right = jnp.einsum("bij,rbj->rbi", blocks, r_dense.reshape(rank, nb, n),
                           precision=jax.lax.Precision.HIGHEST).reshape(rank, nb * n)
        if packed:
            right = right[even_odd_permutation(rank)]
        right = right.astype(jnp.bfloat16)
    weight, bias = layer.weight, (None if layer.bias is None else jnp.asarray(layer.bias, jnp.float32))
    if swiglu:
        perm = swiglu_permutation(cfg.out_features)
        weight = permute_rows(weight, perm)
        left = None if left is None else permute_rows(left, perm)
        bias = None if bias is None else bias[perm]
    return ServedLinear(transform=transform, weight=weight, right=right, left=left, bias=bias, act_fmt=cfg.act_fmt,
                        swiglu_rows=swiglu)


# ---------------------------------------------------------------------------------------------------------------------
# Options.
# ---------------------------------------------------------------------------------------------------------------------


#: ServeOptions fields that only some strategies read, with the value that counts as "not given".
_STRATEGY_FIELDS = {"fused": (None, False), "lowrank": ("fused",), "compute": ("bf16",), "gemm_blocks": (None,),
                    "norm_blocks": (None,), "swiglu_blocks": (None,)}


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How served layers run (static; one instance for a whole model).

    Attributes:
      strategy: a registered strategy name (:func:`strategy_names`; default :data:`DEFAULT_STRATEGY`).
      impl: ``None`` (:func:`resolve_impl`: the compiled kernels on a GPU, the jnp references elsewhere),
        ``"pallas"``, ``"interpret"`` (the Pallas kernels in interpret mode: the transform + quantize kernel, and
        for ``"kernel"`` the GEMMs; the ``"dequant"`` GEMM is XLA on every backend) or ``"reference"``
        (:func:`reference`, whatever the strategy).
      quant_blocks: tiles of the transform + quantize kernel (every strategy).
      fused: ``"kernel"``: the op in the GEMM's epilogue (``None`` / ``True``), or ``False``: the plain W4A4 GEMM then
        the op in XLA (the unfused baseline). The other strategies accept ``None`` / ``False``.
      lowrank: ``"fused"`` (``h L^T`` in the GEMM's epilogue, or joined to the dequant GEMM along K) or ``"beside"``
        (an XLA GEMM after it); ``"kernel"`` and ``"dequant"``.
      compute: tensor-core input type of the Pallas W4A4 kernels, ``"bf16"`` or ``"fp8"`` (MXFP4); ``"kernel"``.
      gemm_blocks: tiles of the plain W4A4 GEMM (``op="none"`` or unfused); ``"kernel"``.
      norm_blocks, swiglu_blocks: tiles of the fused RMSNorm / SwiGLU epilogue kernels; ``"kernel"``.
    """

    strategy: str = DEFAULT_STRATEGY
    impl: Optional[str] = None
    quant_blocks: Optional[tq.BlockSizes] = None
    fused: Optional[bool] = None
    lowrank: Literal["fused", "beside"] = "fused"
    compute: Compute = "bf16"
    gemm_blocks: Optional[BlockSizes] = None
    norm_blocks: Optional[EpilogueBlockSizes] = None
    swiglu_blocks: Optional[EpilogueBlockSizes] = None

    def __post_init__(self):
        strategy = get_strategy(self.strategy)
        if self.impl is not None and self.impl not in IMPLS:
            raise ValueError(f"ServeOptions: impl={self.impl!r} must be None, " + ", ".join(map(repr, IMPLS)))
        if self.lowrank not in ("fused", "beside"):
            raise ValueError(f"ServeOptions: lowrank={self.lowrank!r} must be 'fused' or 'beside'")
        if self.compute not in ("bf16", "fp8"):
            raise ValueError(f"ServeOptions: compute={self.compute!r} must be 'bf16' or 'fp8'")
        given = [name for name, unset in _STRATEGY_FIELDS.items()
                 if getattr(self, name) not in unset and name not in strategy.options]
        if given:
            text = ", ".join(f"{n}={getattr(self, n)!r}" if isinstance(getattr(self, n), (bool, str)) else n
                             for n in given)
            _load_builtin_strategies()  # name every strategy that reads them, the package's own included
            readers = sorted({s.name for s in _REGISTRY.values() if set(given) & s.options})
            raise ValueError(f"ServeOptions: {text} not read by strategy={self.strategy!r} (it would ignore them); "
                             f"they apply to strategy {' / '.join(map(repr, readers)) or '(none registered)'}")


def resolve_impl(impl: Optional[str], x: Any = None) -> str:
    """``impl`` of :class:`ServeOptions` -> ``"pallas"``, ``"interpret"`` or ``"reference"``: ``None`` picks the
    compiled kernels when ``x`` (or the default backend) is on a GPU, the jnp references elsewhere."""
    if impl is None:
        return "pallas" if on_gpu(x) else "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be None, " + ", ".join(map(repr, IMPLS)))
    return impl


# ---------------------------------------------------------------------------------------------------------------------
# Ops after the GEMM.
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpCall:
    """The op of one :func:`forward` call: ``name`` in :data:`OPS`; for ``"rmsnorm"`` the weight ``(head_dim,)``,
    ``head_dim`` and ``eps``."""

    name: str = "none"
    norm_weight: Optional[jax.Array] = None
    head_dim: Optional[int] = None
    eps: float = 1e-6

    def check(self, layer: ServedLinear) -> None:
        """Raise a ValueError if the op does not fit ``layer``."""
        if self.name not in OPS:
            raise ValueError(f"op={self.name!r} must be " + ", ".join(map(repr, OPS)))
        if (self.name == "swiglu") != layer.swiglu_rows:
            raise ValueError(f"op={self.name!r} on a layer with swiglu_rows={layer.swiglu_rows}: only the SwiGLU op "
                             f"takes (and needs) a layer prepared with serve(swiglu=True)")
        nw, hd = self.norm_weight, self.head_dim
        if self.name == "rmsnorm" and (nw is None or hd is None or nw.shape != (hd,) or layer.out_features % hd):
            raise ValueError(f"rmsnorm: norm_weight {None if nw is None else nw.shape} must be (head_dim,) = ({hd},), "
                             f"and head_dim must divide out_features={layer.out_features}")


def swiglu_pairs(c: jax.Array) -> jax.Array:
    """``SiLU(c[:, 0::2]) * c[:, 1::2]`` in f32 (gate/up pairs adjacent: a ``swiglu_rows`` layer's output columns),
    returned in ``c.dtype``: ``(m, 2f)`` -> ``(m, f)``; the pairs are read in place, not gathered into a copy."""
    cf = c.astype(jnp.float32).reshape(c.shape[0], -1, 2)
    return (jax.nn.silu(cf[..., 0]) * cf[..., 1]).astype(c.dtype)


def apply_op(y: jax.Array, op: OpCall) -> jax.Array:
    """The op on a GEMM output ``y (m, o)`` (f32 math, ``y.dtype`` out): per-head RMSNorm, or SwiGLU on gate/up
    pairs (the rows of a ``swiglu_rows`` layer are in gate/up pairs, so its output columns are)."""
    if op.name == "rmsnorm":
        return rmsnorm_heads(y, op.norm_weight, head_dim=op.head_dim, eps=op.eps)
    if op.name == "swiglu":
        return swiglu_pairs(y)
    return y


# ---------------------------------------------------------------------------------------------------------------------
# Strategies.
# ---------------------------------------------------------------------------------------------------------------------


def quantized_inputs(layer: ServedLinear, x2: jax.Array, impl: str,
                     quant_blocks: Optional[tq.BlockSizes] = None) -> tuple[QuantizedArray, Optional[tuple]]:
    """``x2 (m, d)`` bf16 -> ``(Q(x T), lowrank (h (m, r) bf16, L) or None)``: the fused transform + quantize kernel
    (``impl`` ``"pallas"``, ``"interpret"`` or ``"reference"``) and ``h = x (R T^T)^T``."""
    x_q = tq.transform_quantize(x2, layer.transform, layer.act_fmt, block_sizes=quant_blocks, impl=impl,
                                round_to_input=False)
    lowrank = None
    if layer.left is not None:
        h = lowrank_h(x2, layer.right)  # (m, r)
        lowrank = (h, layer.left)
    return x_q, lowrank


def lowrank_beside(h: jax.Array, left) -> jax.Array:
    """``h L^T`` in f32 by an XLA GEMM (a packed ``L`` decoded to a transient bf16 copy in ``h``'s even/odd order)."""
    if isinstance(left, QuantizedArray):
        left = dequantize_bf16(left, order="even_odd")
    return jnp.matmul(h, left.T, preferred_element_type=jnp.float32)


class Strategy:
    """A rule for running a served layer's GEMM (and op). Subclass it, set :attr:`name` and :attr:`options`, override
    :meth:`gemm` (or :meth:`forward`), and :func:`register_strategy` an instance (see the module docstring).

    Attributes:
      name: the registry key (``ServeOptions.strategy``).
      options: the :class:`ServeOptions` fields this strategy reads besides ``strategy``, ``impl`` and
        ``quant_blocks`` (every other strategy-specific field raises when set).
      program_xla_options: XLA options for a whole program (a sampler) whose layers run this strategy, where they
        measured faster than XLA's defaults; :func:`program_compiler_options` hands them to ``jax.jit``.
    """

    name: ClassVar[str] = ""
    options: ClassVar[frozenset] = frozenset()
    program_xla_options: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    def unsupported(self, layer) -> Optional[str]:
        """Why this strategy cannot serve the ``QuantizedLinear`` ``layer`` (checked without preparing it), or None.
        :func:`default_strategy` asks it of every layer of a model before choosing the strategy for all of them."""
        return None

    def prepare(self, layer, *, swiglu: bool = False, transform_kernel: Optional[str] = None) -> Any:
        """The prepared (served) layer of a ``QuantizedLinear``; the built-in strategies share :class:`ServedLinear`."""
        return serve_layer(layer, swiglu=swiglu, transform_kernel=transform_kernel)

    def forward(self, layer, x2: jax.Array, op: OpCall, options: ServeOptions, impl: str) -> jax.Array:
        """``x2 (m, d)`` bf16/fp16 -> ``(m, o')`` (``impl`` ``"pallas"`` or ``"interpret"``)."""
        x_q, lowrank = quantized_inputs(layer, x2, impl, options.quant_blocks)
        return self.gemm(layer, x_q, lowrank, op, options, interpret=impl == "interpret")

    def gemm(self, layer, x_q: QuantizedArray, lowrank: Optional[tuple], op: OpCall, options: ServeOptions,
             interpret: bool) -> jax.Array:
        """``Q(x T) W^T + h L^T + b``, then the op: ``(m, o')``."""
        raise NotImplementedError(f"strategy {self.name!r} defines no gemm")

    def reference(self, layer, x2: jax.Array, op: OpCall) -> jax.Array:
        """The jnp reference (fused semantics: the op on the f32 GEMM output), ``(m, o')`` f32."""
        x_q, lowrank = quantized_inputs(layer, x2, "reference")
        y = gemm_reference(x_q, layer.weight, lowrank=lowrank, bias=layer.bias)  # (m, o) f32
        return apply_op(y, op)


class DequantStrategy(Strategy):
    """"dequantize + cuBLAS": both operands decoded to bf16 by XLA, one GEMM, the op in XLA."""

    name = "dequant"
    options = frozenset({"lowrank"})

    def gemm(self, layer, x_q, lowrank, op, options, interpret):
        if options.lowrank == "fused" or lowrank is None:
            y = w4a4_matmul_dequant(x_q, layer.weight, lowrank=lowrank, bias=layer.bias)  # (m, o) bf16
        else:
            y = w4a4_matmul_dequant(x_q, layer.weight, bias=layer.bias, out_dtype=jnp.float32)
            y = (y + lowrank_beside(*lowrank)).astype(jnp.bfloat16)
        return apply_op(y, op)


class KernelStrategy(Strategy):
    """The Pallas-Triton W4A4 kernels, the low-rank term and (``fused``) the op in their epilogue."""

    name = "kernel"
    options = frozenset({"fused", "lowrank", "compute", "gemm_blocks", "norm_blocks", "swiglu_blocks"})

    def gemm(self, layer, x_q, lowrank, op, options, interpret):
        fused_op = op.name != "none" and options.fused is not False
        if fused_op and options.lowrank == "beside" and lowrank is not None:
            raise ValueError(f"strategy='kernel': lowrank='beside' runs h L^T after the GEMM, so op={op.name!r} "
                             f"cannot be in its epilogue: pass fused=False")
        common = dict(bias=layer.bias, compute=options.compute, interpret=interpret)
        if not fused_op:
            if options.lowrank == "fused" or lowrank is None:
                y = w4a4_matmul(x_q, layer.weight, lowrank=lowrank, block_sizes=options.gemm_blocks,
                                **common)  # (m, o) bf16, as a separate kernel stores it
            else:
                y = w4a4_matmul(x_q, layer.weight, block_sizes=options.gemm_blocks, out_dtype=jnp.float32, **common)
                y = (y + lowrank_beside(*lowrank)).astype(jnp.bfloat16)
            return apply_op(y, op)
        if op.name == "rmsnorm":
            return gemm_rmsnorm(x_q, layer.weight, op.norm_weight, head_dim=op.head_dim, eps=op.eps, lowrank=lowrank,
                                block_sizes=options.norm_blocks, **common)
        return gemm_swiglu(x_q, layer.weight, lowrank=lowrank, block_sizes=options.swiglu_blocks, **common)


class MgpuStrategy(Strategy):
    """The Mosaic GPU W4A4 GEMM (MXFP4; its jnp mirror off the GPU), ``h L^T`` beside it, the op in XLA."""

    name = "mgpu"

    def gemm(self, layer, x_q, lowrank, op, options, interpret):
        from pallas_kernels.w4a4_gemm_mgpu import w4a4_matmul_mgpu  # noqa: PLC0415 - Mosaic GPU loads on demand

        if lowrank is None:
            y = w4a4_matmul_mgpu(x_q, layer.weight, bias=layer.bias)
        else:
            y = w4a4_matmul_mgpu(x_q, layer.weight, bias=layer.bias, out_dtype=jnp.float32)
            y = (y + lowrank_beside(*lowrank)).astype(jnp.bfloat16)
        return apply_op(y, op)


_REGISTRY: dict[str, Strategy] = {}
# Strategies of this package that live in their own modules (they import this one, so they are imported on first
# lookup rather than here): every registry query sees them without the caller importing them first.
_BUILTIN_STRATEGY_MODULES = ("pallas_kernels.fp8_gemm",)


def _load_builtin_strategies() -> None:
    for module in _BUILTIN_STRATEGY_MODULES:
        importlib.import_module(module)


def program_compiler_options(strategy: Optional[str], xla_flags: Optional[str] = None) -> dict[str, Any]:
    """``compiler_options`` for ``jax.jit`` of a program whose W4A4 layers run ``strategy`` (None: no served layers,
    ``{}``): its :attr:`Strategy.program_xla_options`, less those the user's ``XLA_FLAGS`` (or ``xla_flags``) sets
    (:func:`kroquant_jax.xla_options.unless_set_by_flags`)."""
    if strategy is None:
        return {}
    return unless_set_by_flags(get_strategy(strategy).program_xla_options, xla_flags)


def register_strategy(strategy: Strategy, *, replace: bool = False) -> Strategy:
    """Add ``strategy`` under ``strategy.name`` (a ValueError if the name is taken, unless ``replace``)."""
    if not isinstance(strategy, Strategy) or not strategy.name:
        raise TypeError(f"register_strategy takes a Strategy instance with a name, got {strategy!r}")
    unknown = set(strategy.options) - set(_STRATEGY_FIELDS)
    if unknown:
        raise ValueError(f"strategy {strategy.name!r}: options {sorted(unknown)} are no strategy fields of "
                         f"ServeOptions ({', '.join(_STRATEGY_FIELDS)})")
    if strategy.name in _REGISTRY and not replace:
        raise ValueError(f"a strategy named {strategy.name!r} is already registered")
    _REGISTRY[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    """The registered strategy ``name`` (a ValueError naming the registered ones otherwise)."""
    if name not in _REGISTRY:
        _load_builtin_strategies()
    if name not in _REGISTRY:
        raise ValueError(f"strategy={name!r} is not registered; choose from {', '.join(map(repr, _REGISTRY))} "
                         f"('dequant', the default: decode + one cuBLAS GEMM; 'kernel': the Pallas-Triton W4A4 "
                         f"kernels)")
    return _REGISTRY[name]


def strategy_names() -> tuple[str, ...]:
    """The registered strategies, in registration order (the package's own ones always included)."""
    _load_builtin_strategies()
    return tuple(_REGISTRY)


for _strategy in (DequantStrategy(), KernelStrategy(), MgpuStrategy()):
    register_strategy(_strategy)


# ---------------------------------------------------------------------------------------------------------------------
# The entry points.
# ---------------------------------------------------------------------------------------------------------------------


def default_strategy(layers: Iterable = (), device: Any = None) -> tuple[str, str]:
    """The strategy that serves ``layers`` (``QuantizedLinear``) on ``device`` (default: JAX's first device) when
    none is named, and why: the GPU generation's :data:`PREFERRED_STRATEGY_BY_COMPUTE_CAPABILITY` if that strategy
    can serve every layer (:meth:`Strategy.unsupported`), else :data:`DEFAULT_STRATEGY` (also on a CPU, or a GPU
    without a preferred strategy). One strategy for the whole model: a layer the preferred one cannot serve keeps
    every layer on the default, and the reason names that layer's shape.

    Returns:
      ``(strategy name, one line saying why)``.
    """
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return DEFAULT_STRATEGY, f"{DEFAULT_STRATEGY!r}: the default off a GPU ({device.platform})"
    capability = str(getattr(device, "compute_capability", ""))
    major = int(capability.split(".")[0]) if capability.split(".")[0].isdigit() else None
    preferred = PREFERRED_STRATEGY_BY_COMPUTE_CAPABILITY.get(major)
    if preferred is None:
        return DEFAULT_STRATEGY, (f"{DEFAULT_STRATEGY!r}: the default on compute capability {capability or '?'} "
                                  f"(no faster strategy measured there)")
    strategy = get_strategy(preferred)
    for layer in layers:
        why = strategy.unsupported(layer)
        if why is not None:
            return DEFAULT_STRATEGY, (f"{DEFAULT_STRATEGY!r}: {preferred!r}, the default on compute capability "
                                      f"{capability}, cannot serve layer ({layer.config.out_features}, "
                                      f"{layer.config.in_features}): {why}")
    return preferred, f"{preferred!r}: the default on compute capability {capability}"


def serve(layer, *, swiglu: bool = False, transform_kernel: Optional[str] = None,
          strategy: str = DEFAULT_STRATEGY) -> ServedLinear:
    """Prepare a calibrated ``kroquant_jax.qlinear.QuantizedLinear`` ``(o, d)`` once for :func:`forward`.

    Args:
      layer: the calibrated layer (packed weight; low-rank factors packed, 16/32-bit or absent).
      swiglu: the layer is a fused ``[W_gate; W_up]`` ``(2f, d)``: permute its rows (and ``L``'s, the bias's) once into
        gate/up pairs for the SwiGLU op.
      transform_kernel: ``"k1"`` to run a Kronecker transform with dense blocks instead of K2.
      strategy: whose :meth:`Strategy.prepare` builds the layer (the built-in strategies share one layout).
    """
    return get_strategy(strategy).prepare(layer, swiglu=swiglu, transform_kernel=transform_kernel)


def _flat_input(layer: ServedLinear, x: jax.Array) -> jax.Array:
    d = layer.in_features
    if x.shape[-1] != d:
        raise ValueError(f"served linear ({layer.out_features}, {d}): input of shape {x.shape} has {x.shape[-1]} "
                         f"features")
    x2 = x.reshape(-1, d)
    if x2.dtype not in (jnp.bfloat16, jnp.float16):
        x2 = x2.astype(jnp.bfloat16)
    return x2


def forward(layer: ServedLinear, x: jax.Array, *, op: Op = "none", options: ServeOptions = ServeOptions(),
            norm_weight: Optional[jax.Array] = None, head_dim: Optional[int] = None, eps: float = 1e-6,
            out_dtype=None) -> jax.Array:
    """Eq. 11 on the packed operands, then ``op``: ``(..., d)`` -> ``(..., o)`` (``(..., o/2)`` for SwiGLU).

    Args:
      layer: from :func:`serve`.
      x: activations, bf16 or fp16 (others are cast to bf16).
      op: ``"none"``, ``"rmsnorm"`` (per head of ``head_dim`` outputs, weight ``norm_weight (head_dim,)``, ``eps``)
        or ``"swiglu"`` (a layer prepared with ``swiglu=True``).
      options: :class:`ServeOptions` (strategy, impl, low-rank placement, tiles).
      out_dtype: default ``x.dtype``.
    """
    call = OpCall(op, norm_weight, head_dim, eps)
    call.check(layer)
    strategy = get_strategy(options.strategy)
    impl = resolve_impl(options.impl, x)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x2 = _flat_input(layer, x)
    if impl == "reference":
        y = strategy.reference(layer, x2, call)
    else:
        y = strategy.forward(layer, x2, call, options, impl)
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype)


def reference(layer: ServedLinear, x: jax.Array, *, op: Op = "none", norm_weight: Optional[jax.Array] = None,
              head_dim: Optional[int] = None, eps: float = 1e-6, out_dtype=None,
              strategy: str = DEFAULT_STRATEGY) -> jax.Array:
    """The jnp reference of :func:`forward` (fused semantics: the op on the f32 GEMM output): the transform +
    quantizer reference, the dequantized product in f32, ``h L^T``, bias, op."""
    call = OpCall(op, norm_weight, head_dim, eps)
    call.check(layer)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = get_strategy(strategy).reference(layer, _flat_input(layer, x), call)
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype)

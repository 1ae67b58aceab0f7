"""The QAD training step of Ideogram 4 sharded with ``jax.sharding`` over any number of devices (FSDP).

The step is the QAD method of :mod:`models.qad` (its STE fake-quant linear, noising, loss and optimizer) on the
Ideogram 4 transformer of :mod:`models.ideogram4`:

* **Teacher**: the frozen 16-bit model (``teacher_dtype``, bf16 by default) running both CFG branches as the pipeline
  does (:func:`models.ideogram4_sampling.guided_velocity`: the conditional branch on ``[text][image]``, the
  unconditional one on the image tokens with zero text features); target ``v_u + w(sigma) (v_c - v_u)`` with the
  config's :class:`models.qad.GuidanceSchedule`, no gradient.
* **Student**: the conditional branch only, initialised from the teacher's weights (the seed's 16-bit init), every
  block linear (``to_q/k/v/out.0``, ``w1/w2/w3``) in W4A4 fake quant through :func:`models.qad.student_forward` (the
  STE), with a frozen identity transform of ``transform_block`` (1: none; 32: the cost of a Hadamard-32 PTQ student)
  and an optional zero low-rank branch of ``rank``; every other parameter trained in 16 bits (``compute_dtype``)
  from a ``master_dtype`` copy.
* **Loss**: :func:`models.qad.distillation_loss` on :func:`models.qad.noised_batch` latents; Ideogram 4's velocity is
  ``x0 - eps`` (the pipeline hands ``-v`` to its scheduler), model time ``1 - sigma``.
* **Layout**: per sample one prompt of ``text_tokens`` real tokens and a ``grid`` of image tokens in the packed layout
  of :func:`models.ideogram4_sampling.prepare_ids` (one segment, no attention mask); 1K = 64 x 64 image tokens.

Sharding (:func:`fsdp_spec`): a 1-D mesh, axis ``"fsdp"``, over the devices. The batch is split over it
(data-parallel); every parameter, optimizer moment, gradient and the frozen teacher are split over it along one axis
(FSDP: each device stores ``1/n``); inside each scanned block the linears' weights are all-gathered just before use
(an explicit ``with_sharding_constraint`` to replicated in the linear hooks, so XLA gathers one block's weights at a
time and, in the backward, reduce-scatters their gradients) and the activations stay batch-sharded.

Memory-saving choices (:class:`ShardedQADConfig`): ``remat`` (``jax.checkpoint`` per student block: only the block
inputs are kept for the backward), ``master_dtype`` (bf16 master weights halve the weights and their gradients, but
AdamW updates below a bf16 ulp of a weight are lost: no stochastic rounding here), ``opt_dtype`` (the AdamW moments'
storage, computed in float32: :func:`models.qad.with_state_dtype`), the donated state (the step updates it in
place), and the quantized linears' 16-bit kernels left out of the student's and teacher's model states (the hooks
replace those linears, so zero-size placeholders fill their places in the graph: no dead copies, no dead moments).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import ideogram4 as ig
from models import ideogram4_sampling as sampling
from models import qad
from models.layers import FusedLinearHooks, linears

__all__ = ["MESH_AXIS", "DTYPES", "ShardedQADConfig", "ShardedQAD", "make_mesh", "fsdp_spec", "shardings_for",
           "model_configs", "build"]

MESH_AXIS = "fsdp"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ShardedQADConfig:
    """Settings of the sharded Ideogram 4 QAD step.

    qad: the method (format, STE, fm_weight, guidance schedule, AdamW); ``qad.batch_size`` is the global batch (a
        multiple of the number of devices).
    num_blocks: transformer blocks of the student and the teacher (34 is the whole model; fewer fit one device).
    text_tokens: real text tokens per sample; grid: image-token grid ``(h, w)`` (64 x 64 = 1024 x 1024 pixels).
    master_dtype / opt_dtype / compute_dtype / teacher_dtype: ``"float32"`` or ``"bfloat16"``: the student's trainable
        parameters, the AdamW moments' storage, the student's 16-bit compute, the frozen teacher.
    remat: ``jax.checkpoint`` per student block.
    transform_block: block size of the student's frozen identity transform ``T``; rank: its low-rank branch (zeros).
    min_shard_elements: arrays with fewer elements stay replicated.
    """

    qad: qad.QADConfig = qad.QADConfig(schedule=qad.GuidanceSchedule(noisy=7.0, clean=3.0), batch_size=1)
    num_blocks: int = ig.IDEOGRAM4.num_layers
    text_tokens: int = 128
    grid: tuple[int, int] = (64, 64)
    master_dtype: str = "float32"
    opt_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    teacher_dtype: str = "bfloat16"
    remat: bool = True
    transform_block: int = 1
    rank: int = 0
    min_shard_elements: int = 1024

    def __post_init__(self):
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))
        for name in ("master_dtype", "opt_dtype", "compute_dtype", "teacher_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"ShardedQADConfig.{name}={getattr(self, name)!r} must be one of {sorted(DTYPES)}")
        for name in ("num_blocks", "text_tokens", "transform_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"ShardedQADConfig.{name}={getattr(self, name)} must be >= 1")
        if len(self.grid) != 2 or min(self.grid) < 1:
            raise ValueError(f"ShardedQADConfig.grid={self.grid} must be two positive sizes (h, w)")
        if self.rank < 0 or self.min_shard_elements < 0:
            raise ValueError(f"ShardedQADConfig: rank={self.rank} and min_shard_elements={self.min_shard_elements} "
                             "must be >= 0")

    @property
    def tokens(self) -> int:
        """Tokens of the conditional sequence: ``text_tokens + h * w``."""
        return self.text_tokens + self.grid[0] * self.grid[1]


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The 1-D mesh (axis :data:`MESH_AXIS`) over ``devices`` (None: all devices)."""
    return Mesh(np.asarray(list(jax.devices() if devices is None else devices)), (MESH_AXIS,))


def fsdp_spec(shape: Sequence[int], num_devices: int, min_elements: int = 1024) -> PartitionSpec:
    """Where an array of ``shape`` is split over the mesh: along its largest axis whose size is a multiple of
    ``num_devices``, but never along the leading axis of an array of two or more axes (the layer axis of the scanned
    blocks: each block's slice must be whole on the mesh); replicated when no axis qualifies, when the array has
    fewer than ``min_elements`` elements, or on one device."""
    shape = tuple(int(s) for s in shape)
    if num_devices == 1 or not shape or int(np.prod(shape)) < max(min_elements, 1):
        return PartitionSpec()
    candidates = [a for a in range(1 if len(shape) > 1 else 0, len(shape)) if shape[a] % num_devices == 0]
    if not candidates:
        return PartitionSpec()
    axis = max(candidates, key=lambda a: (shape[a], a))
    return PartitionSpec(*[MESH_AXIS if a == axis else None for a in range(len(shape))])


def shardings_for(abstract: Any, mesh: Mesh, min_elements: int = 1024) -> Any:
    """The :func:`fsdp_spec` ``NamedSharding`` of every leaf of a pytree of arrays or ``ShapeDtypeStruct`` s."""
    n = mesh.devices.size
    return jax.tree.map(lambda a: NamedSharding(mesh, fsdp_spec(np.shape(a), n, min_elements)), abstract)


def model_configs(base: ig.Ideogram4Config, config: ShardedQADConfig) -> tuple[ig.Ideogram4Config,
                                                                               ig.Ideogram4Config]:
    """``(teacher, student)`` architectures: ``base`` (its widths and ``attention_impl``) with ``config.num_blocks``
    scanned blocks (one compiled block, whatever the depth), the teacher in ``teacher_dtype``, the student computing
    in ``compute_dtype`` with ``config.remat``."""
    teacher_dtype, compute_dtype = DTYPES[config.teacher_dtype], DTYPES[config.compute_dtype]
    common = dict(num_layers=config.num_blocks, scan_layers=True)
    teacher = dataclasses.replace(base, **common, dtype=teacher_dtype, param_dtype=teacher_dtype, remat=False)
    student = dataclasses.replace(base, **common, dtype=compute_dtype, param_dtype=DTYPES[config.master_dtype],
                                  remat=config.remat)
    return teacher, student


@dataclasses.dataclass(frozen=True)
class ShardedQAD:
    """The compiled-on-first-call functions of one sharded QAD step (:func:`build`).

    init: ``key -> (state, frozen)``: random teacher weights and the student initialised from them, created sharded
        on the mesh. ``state`` is :func:`models.qad.init_state`'s ``{"trainable": {"model": student nnx state
        without the quantized kernels, "layers": {linear path: {"weight" (N, o, d), "bias" (N, o), "left" (N, o, r),
        "right" (N, r, d)}}}, "opt_state", "step", "key"}``; ``frozen = {"teacher": teacher nnx state without the
        quantized kernels, "kernels": {linear path: (N, d, o)}, "blocks": {linear path: (N, d / n, n, n)}}``.
    make_batch: ``key -> batch``: ``{"latents" (B, h w, C) float32 clean latents, "text_features" (B, T, F),
        "position_ids" (B, T + h w, 3), "indicator" (B, T + h w)}``, random, batch-sharded.
    step: ``(state, frozen, batch) -> (state, {"loss", "distill", "flow_matching", "grad_norm"})``, one optimizer
        step; the input state is donated.
    loss: ``(trainable, frozen, batch, key) -> (loss, {"distill", "flow_matching"})`` (the step's objective).
    teacher_target / student_velocity: ``(frozen, batch, noisy, sigma)`` / ``(trainable, frozen, batch, noisy,
        sigma) -> (B, h w, C)`` float32: the loss's guided teacher velocity and the student's prediction at the noised
        latents ``noisy (B, h w, C)`` of noise levels ``sigma (B,)``.
    """

    config: ShardedQADConfig
    teacher_config: ig.Ideogram4Config
    student_config: ig.Ideogram4Config
    mesh: Mesh
    state_shardings: Any
    frozen_shardings: Any
    batch_shardings: Any
    init: Callable
    make_batch: Callable
    step: Callable
    loss: Callable
    teacher_target: Callable
    student_velocity: Callable


def _quantized_kernel_filter(names: frozenset[str]) -> Callable[[tuple, Any], bool]:
    return lambda path, _: path[-1] == "kernel" and ".".join(str(p) for p in path[:-1]) in names


def _fsdp_dense(replicated: NamedSharding, batch: NamedSharding, kernel: jax.Array, x: jax.Array) -> jax.Array:
    """The teacher's bias-free 16-bit linear ``x (B, ..., d) @ kernel (d, o)`` with the kernel all-gathered."""
    kernel = jax.lax.with_sharding_constraint(kernel, replicated)
    return jnp.matmul(jax.lax.with_sharding_constraint(x, batch).astype(kernel.dtype), kernel)


def _fsdp_student_linear(forward: Callable, replicated: NamedSharding, batch: NamedSharding, layer: dict,
                         blocks: jax.Array, through: jax.Array, x: jax.Array) -> jax.Array:
    """:func:`models.qad.student_linear` (``forward``) with the layer's arrays all-gathered."""
    layer, blocks = jax.lax.with_sharding_constraint((layer, blocks), replicated)
    return forward(layer, blocks, through, jax.lax.with_sharding_constraint(x, batch))


def build(base: ig.Ideogram4Config, config: ShardedQADConfig, mesh: Mesh | None = None) -> ShardedQAD:
    """The sharded QAD step of ``base`` (e.g. ``models.ideogram4.IDEOGRAM4``) under ``config`` on ``mesh`` (None:
    all devices). Validates the settings against the architecture and the mesh before anything is compiled.

    Raises:
        ValueError: the batch is not a multiple of the device count, the transform block does not divide a
            quantized linear's input width, the format's block does not, or a quantized linear has a bias.
    """
    mesh = make_mesh() if mesh is None else mesh
    if mesh.axis_names != (MESH_AXIS,):
        raise ValueError(f"build: the mesh must be 1-D with axis {MESH_AXIS!r} (make_mesh), got {mesh.axis_names}")
    n_dev = mesh.devices.size
    qcfg = config.qad
    batch_size, num_blocks, text_tokens = qcfg.batch_size, config.num_blocks, config.text_tokens
    if batch_size % n_dev:
        raise ValueError(f"build: batch {batch_size} (qad.batch_size) is not a multiple of the {n_dev} devices")
    teacher_cfg, student_cfg = model_configs(base, config)
    master, opt_dtype = DTYPES[config.master_dtype], DTYPES[config.opt_dtype]
    compute = DTYPES[config.compute_dtype]

    abstract_teacher = nnx.eval_shape(lambda: ig.Ideogram4Transformer(teacher_cfg, rngs=nnx.Rngs(0)))
    abstract_student = nnx.eval_shape(lambda: ig.Ideogram4Transformer(student_cfg, rngs=nnx.Rngs(0)))
    quantized = linears(abstract_teacher, quantizable_only=True)
    block = config.transform_block
    quant_block = qcfg.quant_format.block_size
    for name, linear in quantized.items():
        if linear.bias is not None:
            raise ValueError(f"build: quantized linear {name} has a bias; the sharded step handles bias-free ones")
        if linear.in_features % block or linear.in_features % quant_block:
            raise ValueError(f"build: {name} has {linear.in_features} inputs, not a multiple of transform_block="
                             f"{block} and of the {qcfg.fmt} block {quant_block}")
    names = frozenset(quantized)
    kernel_filter = _quantized_kernel_filter(names)
    teacher_graph, kernel_abstract, _ = nnx.split(abstract_teacher, kernel_filter, ...)
    student_graph, _, _ = nnx.split(abstract_student, kernel_filter, ...)
    # The hooks replace the quantized linears, so their kernels are never read: zero-size placeholders keep the graph
    # whole (the leading layer axis stays, for the scan) without holding the 16-bit kernels twice.
    placeholders = jax.tree.map(lambda a: np.zeros((num_blocks, 0), a.dtype), kernel_abstract)

    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = NamedSharding(mesh, PartitionSpec(MESH_AXIS))
    optimizer = qad.make_optimizer(qcfg, opt_dtype)
    student_fn, through = qad.student_forward(qcfg, lowrank_quantized=False)
    through = jnp.broadcast_to(through, (num_blocks,))  # stacked hooks: every leaf has the layer axis
    dense = functools.partial(_fsdp_dense, replicated, batch_sharding)
    student_linear = functools.partial(_fsdp_student_linear, student_fn, replicated, batch_sharding)

    def init(key: jax.Array) -> tuple[dict, dict]:
        teacher = ig.Ideogram4Transformer(teacher_cfg, rngs=nnx.Rngs(params=key))
        kernels = {name: lin.kernel[...] for name, lin in linears(teacher, quantizable_only=True).items()}
        _, _, teacher_rest = nnx.split(teacher, kernel_filter, ...)
        blocks, layers = {}, {}
        for name, kernel in kernels.items():
            _, d, o = kernel.shape
            eye = jnp.broadcast_to(jnp.eye(block, dtype=jnp.float32), (num_blocks, d // block, block, block))
            blocks[name] = eye
            layers[name] = {"weight": jnp.swapaxes(kernel, -1, -2).astype(master),
                            "bias": jnp.zeros((num_blocks, o), master),
                            "left": jnp.zeros((num_blocks, o, config.rank), master),
                            "right": jnp.zeros((num_blocks, config.rank, d), master)}
        state = qad.init_state(qad.cast_floating(teacher_rest, master), layers, qcfg, state_dtype=opt_dtype)
        return state, {"teacher": teacher_rest, "kernels": kernels, "blocks": blocks}

    layout = sampling.prepare_ids([text_tokens] * batch_size, *config.grid, text_tokens)
    num_image = layout.num_image_tokens

    def make_batch(key: jax.Array) -> dict:
        key_latents, key_text = jax.random.split(key)
        return {"latents": jax.random.normal(key_latents, (batch_size, num_image, base.in_channels), jnp.float32),
                "text_features": jax.random.normal(key_text, (batch_size, text_tokens, base.llm_features_dim),
                                                   DTYPES[config.teacher_dtype]),
                "position_ids": jnp.asarray(layout.position_ids), "indicator": jnp.asarray(layout.indicator)}

    def teacher_target(frozen: dict, batch: dict, noisy: jax.Array, sigma: jax.Array) -> jax.Array:
        arrays = (batch["position_ids"], None, batch["indicator"])
        teacher = nnx.merge(teacher_graph, placeholders, frozen["teacher"])
        hooks = FusedLinearHooks({name: jax.tree_util.Partial(dense, kernel)
                                  for name, kernel in frozen["kernels"].items()}, stacked=True)
        branches = sampling.prepare_branches(teacher, teacher, batch["text_features"], arrays, text_tokens)
        guidance = qcfg.schedule(sigma)[:, None, None]  # (B, 1, 1)
        return sampling.guided_velocity(teacher, teacher, branches, noisy, 1.0 - sigma, guidance, text_tokens,
                                        hooks=hooks)  # (B, N, C); Ideogram 4's time runs from noise (0) to data (1)

    def student_velocity(trainable: dict, frozen: dict, batch: dict, noisy: jax.Array,
                         sigma: jax.Array) -> jax.Array:
        arrays = (batch["position_ids"], None, batch["indicator"])
        student = nnx.merge(student_graph, placeholders, qad.cast_floating(trainable["model"], compute))
        hooks = FusedLinearHooks({name: jax.tree_util.Partial(student_linear, layer, frozen["blocks"][name], through)
                                  for name, layer in trainable["layers"].items()}, stacked=True)
        text = sampling.prepare_branches(student, student, batch["text_features"], arrays, text_tokens)
        return sampling.conditional_velocity(student, text, noisy, 1.0 - sigma, text_tokens, hooks)  # (B, N, C)

    def loss(trainable: dict, frozen: dict, batch: dict, key: jax.Array) -> tuple[jax.Array, dict]:
        clean = batch["latents"]  # (B, N, C)
        sigma, noise, noisy = qad.noised_batch(key, clean, qcfg)  # (B,), (B, N, C) x 2
        target = jax.lax.stop_gradient(teacher_target(frozen, batch, noisy, sigma))  # (B, N, C)
        predicted = student_velocity(trainable, frozen, batch, noisy, sigma)  # (B, N, C)
        return qad.distillation_loss(predicted, target, clean - noise, qcfg.fm_weight)

    abstract_state, abstract_frozen = jax.eval_shape(init, jax.random.key(0))
    state_shardings = shardings_for(abstract_state, mesh, config.min_shard_elements)
    frozen_shardings = shardings_for(abstract_frozen, mesh, config.min_shard_elements)
    batch_shardings = jax.tree.map(lambda _: batch_sharding, jax.eval_shape(make_batch, jax.random.key(0)))

    def step(state: dict, frozen: dict, batch: dict) -> tuple[dict, dict]:
        key, key_loss = jax.random.split(jax.random.wrap_key_data(state["key"]))
        (value, parts), grads = jax.value_and_grad(loss, has_aux=True)(state["trainable"], frozen, batch, key_loss)
        grads = jax.lax.with_sharding_constraint(grads, state_shardings["trainable"])  # reduce-scattered (FSDP)
        new, grad_norm = qad.apply_gradients(state, grads, key, optimizer, qcfg)
        return new, {"loss": value, "grad_norm": grad_norm, **parts}

    return ShardedQAD(
        config=config, teacher_config=teacher_cfg, student_config=student_cfg, mesh=mesh,
        state_shardings=state_shardings, frozen_shardings=frozen_shardings, batch_shardings=batch_shardings,
        init=jax.jit(init, out_shardings=(state_shardings, frozen_shardings)),
        make_batch=jax.jit(make_batch, out_shardings=batch_shardings),
        step=jax.jit(step, in_shardings=(state_shardings, frozen_shardings, batch_shardings),
                     out_shardings=(state_shardings, replicated), donate_argnums=0),
        loss=jax.jit(loss, in_shardings=(state_shardings["trainable"], frozen_shardings, batch_shardings,
                                         replicated), out_shardings=replicated),
        teacher_target=jax.jit(teacher_target), student_velocity=jax.jit(student_velocity))

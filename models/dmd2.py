"""DMD2 timestep distillation for flow-matching DiTs (Yin et al. 2024, "Improved Distribution Matching Distillation").

Three networks of one architecture, as pytrees of parameters beside one shared model (``FlowModel``):

* **generator** ``G``: the few-step student, initialised from the teacher (16-bit), or as a W4A4 student
  (:class:`W4A4Generator`) from a calibrated PTQ store (:func:`load_ptq_store`) or from a quantized checkpoint folder
  such as an exported QAD student (:func:`load_init_checkpoint`): every quantizable linear in W4A4 fake quant with
  the straight-through estimator, exactly the forward of the QAD student (``models.qad.student_velocity``). At a
  student step of noise level ``sigma_i`` it predicts a velocity, turned into a clean image ``x0 = x - sigma_i v``.
  A trained W4A4 generator becomes a quantized checkpoint folder again with :func:`plan_export` / :func:`export_run`
  (``kroquant dmd2 export``).
* **real score**: the frozen teacher with classifier-free guidance (``DMD2Config.guidance`` applied where the noise
  level lies in ``guidance_sigma_range``, scale 1 outside: a guidance-interval schedule).
* **fake score**: a trainable copy of the teacher, trained with the teacher's flow-matching loss on detached
  generator samples, so that it tracks the generator's current distribution.

Flow-matching convention (``models.testbed``): ``x_sigma = (1 - sigma) x0 + sigma eps``, velocity ``v = eps - x0``.
So ``x0 = x_sigma - sigma v``, ``eps = x_sigma + (1 - sigma) v``, and the score of the noisy marginal is
``grad log p(x_sigma) = -eps / sigma = -(x_sigma - (1 - sigma) x0) / sigma**2``.

**Distribution-matching gradient.** The reverse KL between the generator's distribution and the teacher's, measured
at noise level ``sigma``, has the per-sample gradient ``s_fake(x_sigma) - s_real(x_sigma)``
``= (1 - sigma) (x0_fake - x0_real) / sigma**2`` (the difference of the two scores). DMD2 writes it in the
``x0`` domain and normalises it per sample by the mean absolute distance of the real score's denoised estimate::

    grad = (x0_fake - x0_real) / mean_{c,h,w} |x - x0_real|,     loss = 0.5 mean((x - stopgrad(x - grad))**2)

so that ``d loss / d x = grad / numel(x)``: gradient descent moves each sample towards the teacher's denoised
estimate and away from the fake score's. ``sigma`` is uniform in ``[dm_sigma_min, dm_sigma_max]``.

**Two-timescale updates.** The fake score is updated every step, the generator every ``fake_updates_per_generator``
-th step (DMD2's 5). One jitted *cycle* is one generator update followed by that many fake-score updates, the first
of them on the very samples the generator update made (detached), as in DMD2's training loop. Optionally the fake
score first gets ``fake_warmup`` updates on the initial generator's samples (:func:`make_fake_warmup`, run once by
:func:`train` on a fresh run), and its flow-matching noise levels are the teacher's logit-normal ones or uniform over
the DM range (``fake_sigma_sampling``).

**GAN (optional, ``gan_generator_weight > 0``).** A small head (:class:`GanHead`) reads the fake score's token
features at ``gan_feature_layer`` (the input of that linear, a ``models.layers.LinearHooks`` recorder) and outputs one
logit. The discriminator (head and fake score) minimises ``softplus(logit_fake) + softplus(-logit_real)`` on clean
real images and clean detached generator samples (noised to a uniform level in ``[0, gan_max_sigma]``); the generator
minimises ``softplus(-logit_fake)``. The real images are the only data DMD2 sees; the distribution-matching term is
data-free and there is no regression loss.

**Backward simulation.** The student's ``K`` steps use the noise levels ``1, (K-1)/K, ..., 1/K``; a sample is
``x0_k = G(x_k, sigma_k)``, ``x_{k+1} = (1 - sigma_{k+1}) x0_k + sigma_{k+1} eps_{k+1}`` with fresh noise. Training
picks a step ``j`` uniformly per batch, runs the student's own first ``j`` steps without gradient from pure noise, and
trains the step ``j`` prediction: the training inputs are the student's own intermediate states, not noised data. A
model trained on the ``K``-step grid samples with any count (1, 2, 4, 8, ...): the generator is a continuous-time
network, and 1 and 2 steps use levels of the 4-step grid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kroquant_jax import provenance
from kroquant_jax.fileio import atomic_append_text, atomic_write_json, read_json_object
from models import qad
from models.testbed import data as testbed_data
from models.testbed import model as testbed
from models.layers import LinearHooks, linears

__all__ = ["DMD2Config", "FlowModel", "GanHead", "DMD2Divergence", "pixart_flow_model", "x0_from_velocity",
           "eps_from_velocity", "score_from_velocity", "FAKE_SIGMA_SAMPLING", "student_sigmas",
           "guided_velocity", "generate", "backward_simulate", "dm_gradient", "dm_loss", "fake_score_loss",
           "gan_logits", "make_optimizers", "init_state", "prompt_set", "prompt_batches", "make_cycle",
           "make_fake_warmup", "train", "restore_state",
           "forward_passes_per_image", "W4A4Generator", "PTQStore", "load_ptq_store", "load_init_checkpoint",
           "generator_key", "training_key", "check_run_key", "RunKeyMismatch", "restore_generator", "ExportPlan",
           "plan_export", "export_run"]

FAKE_SIGMA_SAMPLING = ("logit_normal", "uniform")  # DMD2Config.fake_sigma_sampling

Cond = Any  # a pytree of per-sample conditioning arrays (leading axis = batch)
Params = Any
#: ``(data, key) -> (cond, real_images (b, c, h, w) or None, real_cond or None)``: one training batch drawn from
#: ``data`` (the prompt set, a pytree of arrays, an argument of the jitted programs), see :func:`make_cycle`
SampleBatch = Callable[[Any, jax.Array], tuple[Cond, jax.Array | None, Cond | None]]


# --------------------------------------------------------------------------------------------------------------------
# Configuration and model adapter
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DMD2Config:
    """Settings of the distillation (defaults: DMD2's recipe where it transfers; see docs/dmd2.md).

    num_steps: the student's step count during training (backward-simulation grid).
    guidance: real-score CFG scale; applied where ``guidance_sigma_range[0] <= sigma <= guidance_sigma_range[1]``.
    dm_sigma_min, dm_sigma_max: the distribution-matching noise-level range (DMD2: 2% to 98% of the timesteps).
    fake_updates_per_generator: fake-score updates per generator update (DMD2's two-timescale ratio 5).
    generator_lr, fake_lr: AdamW learning rates (constant after ``warmup`` linear warm-up steps).
    weight_decay, grad_clip: AdamW weight decay and global-norm clipping of each network's gradient.
    gan_generator_weight, gan_discriminator_weight: GAN loss weights (0 for the generator switches the GAN off).
    gan_feature_layer: the linear whose input (tokens (b, n, d)) feeds the GAN head.
    gan_max_sigma: GAN inputs are noised to a uniform level in [0, gan_max_sigma] (0: clean images).
    backward_simulation: False trains every step on pure noise (a one-step student whatever num_steps says).
    fake_warmup: fake-score (+ discriminator) updates on the initial generator's samples before the first generator
        update (0: none). The fake score starts as the unguided teacher; the warm-up lets it fit the generator first.
    fake_sigma_sampling: noise levels of the fake score's flow-matching loss: ``"logit_normal"`` (the teacher's own
        objective) or ``"uniform"`` in ``[dm_sigma_min, dm_sigma_max]`` (the levels the DM loss queries it at, as the
        public DMD2 code trains its fake score on uniform timesteps).
    """

    num_steps: int = 4
    guidance: float = 3.0
    guidance_sigma_range: tuple[float, float] = (0.0, 1.0)
    dm_sigma_min: float = 0.02
    dm_sigma_max: float = 0.98
    fake_updates_per_generator: int = 5
    generator_lr: float = 1e-5
    fake_lr: float = 1e-5
    warmup: int = 0
    weight_decay: float = 0.01
    grad_clip: float = 10.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    gan_generator_weight: float = 0.0
    gan_discriminator_weight: float = 0.0
    gan_feature_layer: str = "transformer_blocks.5.ff.net.0.proj"
    gan_max_sigma: float = 0.0
    backward_simulation: bool = True
    fake_warmup: int = 0
    fake_sigma_sampling: str = "logit_normal"

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"DMD2Config: {self.num_steps=} must be >= 1")
        if not 0.0 < self.dm_sigma_min < self.dm_sigma_max < 1.0:
            raise ValueError(f"DMD2Config: need 0 < dm_sigma_min ({self.dm_sigma_min}) < dm_sigma_max "
                             f"({self.dm_sigma_max}) < 1")
        low, high = self.guidance_sigma_range
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"DMD2Config: {self.guidance_sigma_range=} must satisfy 0 <= low <= high <= 1")
        if self.fake_updates_per_generator < 1:
            raise ValueError(f"DMD2Config: {self.fake_updates_per_generator=} must be >= 1")
        if self.generator_lr <= 0 or self.fake_lr <= 0:
            raise ValueError(f"DMD2Config: learning rates must be > 0 ({self.generator_lr=}, {self.fake_lr=})")
        if self.gan_generator_weight < 0 or self.gan_discriminator_weight < 0:
            raise ValueError("DMD2Config: GAN weights must be >= 0")
        if not 0.0 <= self.gan_max_sigma < 1.0:
            raise ValueError(f"DMD2Config: {self.gan_max_sigma=} must be in [0, 1)")
        if self.fake_warmup < 0:
            raise ValueError(f"DMD2Config: {self.fake_warmup=} must be >= 0")
        if self.fake_sigma_sampling not in FAKE_SIGMA_SAMPLING:
            raise ValueError(f"DMD2Config: {self.fake_sigma_sampling=} must be one of {FAKE_SIGMA_SAMPLING}")

    @property
    def gan(self) -> bool:
        return self.gan_generator_weight > 0 or self.gan_discriminator_weight > 0


@dataclasses.dataclass(frozen=True)
class FlowModel:
    """The network shared by generator, real and fake score (each call takes its own parameters).

    apply: ``(params, x (b, c, h, w), sigma (b,) in [0, 1], cond) -> velocity (b, c, h, w)``.
    apply_features: ``(params, x, sigma, cond) -> (velocity, features (b, n, d))``; None if no GAN is used.
    uncond: ``cond -> cond`` of the same batch with the empty caption (the CFG negative).
    """

    apply: Callable[[Params, jax.Array, jax.Array, Cond], jax.Array]
    uncond: Callable[[Cond], Cond]
    apply_features: Callable[[Params, jax.Array, jax.Array, Cond], tuple[jax.Array, jax.Array]] | None = None


class _FeatureRecorder:
    """A LinearHooks recorder keeping the input of one linear (in the same trace)."""

    def __init__(self, path: str):
        self.path = path
        self.value = None

    def wants(self, path: str) -> bool:
        return path == self.path

    def record(self, path: str, x: jax.Array, token_mask: jax.Array | None = None) -> None:
        """Keeps ``x (b, n, d)`` (the hooks of :func:`pixart_flow_model` carry no token mask)."""
        self.value = x


@dataclasses.dataclass(frozen=True)
class W4A4Generator:
    """The frozen parts of a W4A4 generator (the QAD student's forward, ``models.qad.student_velocity``).

    blocks: ``{layer: (d / n, n, n)}`` the online transform ``T`` of each quantizable linear (frozen).
    quant: a :class:`models.qad.QADConfig` whose ``fmt`` (the store's W4A4 format) and ``ste`` (the STE rule) the
        forward uses; its training fields are not read here.
    lowrank_quantized: the low-rank branch is fake-quantized too (LoRaQ) rather than 16-bit (SVDQuant).

    The generator's parameters are then ``{"model": nnx state (the 16-bit parameters), "layers": {layer: {"weight"
    W~ (o, d), "bias" (o,), "left" L (o, r), "right" R (r, d)}}}`` (``models.qad.student_from_qlinears``).
    """

    blocks: Mapping[str, jax.Array]
    quant: qad.QADConfig
    lowrank_quantized: bool


def _null_cond(null_context: jax.Array, null_mask: jax.Array) -> Callable[[Cond], Cond]:
    """``FlowModel.uncond`` of the testbed PixArt: the empty caption ``(t, c)`` / ``(t,)`` broadcast to the batch."""

    def uncond(cond):
        b = cond["context"].shape[0]
        return {"context": jnp.broadcast_to(null_context.astype(cond["context"].dtype), (b,) + null_context.shape),
                "mask": jnp.broadcast_to(null_mask.astype(cond["mask"].dtype), (b,) + null_mask.shape)}

    return uncond


def pixart_flow_model(graphdef: nnx.GraphDef, null_context: jax.Array, null_mask: jax.Array,
                      feature_layer: str | None = None, compute_dtype: Any = jnp.float32,
                      w4a4: W4A4Generator | None = None) -> FlowModel:
    """The testbed PixArt as a :class:`FlowModel`; ``cond = {"context": (b, t, c), "mask": (b, t)}``.

    Parameters are cast to ``compute_dtype`` for the forward pass (fp32 masters stay in the optimizer); the
    velocity comes back in fp32. ``feature_layer``: dotted path of a linear whose input feeds the GAN head.
    ``w4a4``: the model is the W4A4 student instead (parameters as :class:`W4A4Generator` says; the 16-bit
    parameters are cast to ``compute_dtype``, the quantized layers compute in fp32 from their fp32 masters); it has
    no ``apply_features`` (the GAN head reads the 16-bit fake score).
    """
    if w4a4 is not None and feature_layer is not None:
        raise ValueError("pixart_flow_model: a W4A4 generator has no GAN features (feature_layer must be None)")

    def cast(tree):
        return jax.tree.map(lambda p: p.astype(compute_dtype), tree)

    def forward(params, x, sigma, cond, hooks):
        x, context = x.astype(compute_dtype), cond["context"].astype(compute_dtype)
        timestep = sigma * testbed.TIMESTEP_SCALE
        if w4a4 is None:
            # without hooks the blocks run under one lax.scan (one compiled block); a GAN feature recorder needs
            # the loop
            out = nnx.merge(graphdef, cast(params))(x, context, timestep, encoder_attention_mask=cond["mask"],
                                                    hooks=hooks, scan_blocks=hooks is None)  # (b, 3, s, s)
        else:
            trainable = {"model": cast(params["model"]), "layers": params["layers"]}
            out = qad.student_velocity(graphdef, trainable, w4a4.blocks, w4a4.quant, w4a4.lowrank_quantized, x,
                                       timestep, context, cond["mask"])  # (b, 3, s, s)
        return out.astype(jnp.float32)

    def apply(params, x, sigma, cond):
        return forward(params, x, sigma, cond, None)

    def apply_features(params, x, sigma, cond):
        recorder = _FeatureRecorder(feature_layer)
        velocity = forward(params, x, sigma, cond, LinearHooks(recorder=recorder))
        if recorder.value is None:
            raise KeyError(f"pixart_flow_model: no linear named {feature_layer!r} (DMD2Config.gan_feature_layer)")
        return velocity, recorder.value.astype(jnp.float32)  # (b, 3, s, s), (b, n, d)

    return FlowModel(apply=apply, uncond=_null_cond(null_context, null_mask),
                     apply_features=apply_features if feature_layer else None)


def overrides_flow_model(graphdef: nnx.GraphDef, null_context: jax.Array, null_mask: jax.Array) -> FlowModel:
    """The testbed PixArt with its linears routed through per-call overrides: a W4A4 generator as it is served.

    Parameters are ``{"model": nnx state (the 16-bit rest, in its own dtype), "overrides": {linear path: pytree
    callable}}``, e.g. ``models.quantized_checkpoint.QuantizedCheckpoint.served_overrides`` of the generator's
    exported folder, so the same :func:`generate` samples it as the fake-quant :func:`pixart_flow_model` one. The
    inputs are cast to the model's dtype; the velocity comes back in fp32. No ``apply_features`` (evaluation only).
    """

    def apply(params, x, sigma, cond):
        dtype = jax.tree.leaves(params["model"])[0].dtype
        out = nnx.merge(graphdef, params["model"])(x.astype(dtype), cond["context"].astype(dtype),
                                                   sigma * testbed.TIMESTEP_SCALE,
                                                   encoder_attention_mask=cond["mask"],
                                                   hooks=LinearHooks(params["overrides"]))  # (b, 3, s, s)
        return out.astype(jnp.float32)

    return FlowModel(apply=apply, uncond=_null_cond(null_context, null_mask))


@dataclasses.dataclass(frozen=True)
class PTQStore:
    """The initialisation of a W4A4 generator: a calibrated PTQ store (:func:`load_ptq_store`, ``kind``
    ``"ptq_store"``) or a quantized checkpoint folder (:func:`load_init_checkpoint`, ``kind`` ``"init_checkpoint"``).

    path: the folder (absolute). sha256: the content hash of its files (names and bytes).
    generator: the initial generator parameters (see :class:`W4A4Generator`). w4a4: its frozen parts.
    """

    path: str
    sha256: str
    generator: dict[str, Any]
    w4a4: W4A4Generator
    kind: str = "ptq_store"

    @property
    def flag(self) -> str:
        """The command-line flag that names such a folder."""
        return "--init-checkpoint" if self.kind == "init_checkpoint" else "--ptq-store"


def _quantized_shapes(prefix: str, rows: int, cols: int, block: int) -> dict[str, tuple[int, ...]]:
    """The safetensors keys and shapes of a packed ``(rows, cols)`` array (``kroquant_jax.qlinear``'s layout)."""
    return {f"{prefix}.codes": (rows, cols // 2), f"{prefix}.scales": (rows, cols // block),
            f"{prefix}.tensor_scale": (1,)}


def _check_layer_file(path: Path, name: str, out_features: int, in_features: int) -> str:
    """Check one ``QLinearStore`` file against the model's linear ``name`` ``(o, d)`` before it is decoded.

    Returns the layer's W4A4 format name. Raises ValueError naming the file, the layer and the key.
    """
    from safetensors import safe_open

    where = f"--ptq-store file {path} (layer {name})"
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get("qlinear", "null"))
        if not isinstance(meta, dict) or "config" not in meta or "weight" not in meta:
            raise ValueError(f"{where}: no 'qlinear' metadata (not written by kroquant_jax.qlinear.QLinearStore)")
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return _check_layer_meta(meta, shapes, where, out_features, in_features)


def _check_layer_meta(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str, o: int,
                      d: int) -> str:
    """Check one layer's ``kroquant_jax.qlinear.to_state`` metadata and its arrays' shapes ``{key: shape}`` against
    the model's linear ``(o, d)``. Returns the W4A4 format name; raises ValueError starting with ``where``."""
    config = meta["config"]
    if (config.get("out_features"), config.get("in_features")) != (o, d):
        raise ValueError(f"{where}: its config is ({config.get('out_features')}, {config.get('in_features')}), the "
                         f"model's linear is ({o}, {d})")
    if config.get("input_pad", 0):
        raise ValueError(f"{where}: input_pad {config['input_pad']} is not supported by the W4A4 generator")
    fmt = config["act_fmt"]
    if meta["weight"]["fmt"] != fmt:
        raise ValueError(f"{where}: weight format {meta['weight']['fmt']} differs from the activation format {fmt}")
    block = int(fmt["block_size"])
    expected = dict(_quantized_shapes("weight", o, d, block))
    blocks = shapes.get("blocks")
    if blocks is None or len(blocks) != 3 or blocks[1] != blocks[2] or blocks[0] * blocks[1] != d:
        raise ValueError(f"{where}: key 'blocks' has shape {blocks}, expected (d / n, n, n) with d = {d}")
    if meta.get("has_bias"):
        expected["bias"] = (o,)
    lowrank = meta.get("lowrank")
    if lowrank is not None:
        rank = int(config["rank"])
        if lowrank.get("quantized"):
            for side in ("left", "right"):
                if lowrank[side]["fmt"] != fmt:
                    raise ValueError(f"{where}: lowrank_{side} format {lowrank[side]['fmt']} differs from {fmt}")
            expected.update(_quantized_shapes("lowrank_left", o, rank, block))
            expected.update(_quantized_shapes("lowrank_right", rank, d, block))
        else:
            expected.update({"lowrank_left": (o, rank), "lowrank_right": (rank, d)})
    for key, shape in expected.items():
        if key not in shapes:
            raise ValueError(f"{where}: key {key!r} is missing (expected shape {shape})")
        if shapes[key] != shape:
            raise ValueError(f"{where}: key {key!r} has shape {shapes[key]}, expected {shape}")
    return str(fmt["name"])


def load_ptq_store(folder: str | Path, model: nnx.Module) -> PTQStore:
    """Read and validate a calibrated PTQ store (a ``kroquant_jax.qlinear.QLinearStore`` folder, any recipe, as
    ``kroquant qad --ptq-store`` reads it) as the initial W4A4 generator of ``model`` (the 16-bit teacher).

    Every quantizable linear of ``model`` must have exactly one layer file of matching shapes, all in one W4A4 format
    (MXFP4 or NVFP4 with that format's default scale rule); checked file by file before any layer is decoded, so a
    bad store fails in seconds with a ValueError naming the file, the layer and the key. The generator is then
    ``models.qad.student_from_qlinears`` (``W~`` the stored residual dequantized, the branch and the bias as stored,
    the blocks frozen: it starts as the PTQ model) beside the teacher's 16-bit parameters; the forward uses QAD's
    plain STE.
    """
    from safetensors import safe_open

    from kroquant_jax.qlinear import load_qlinear

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--ptq-store {folder}: no such folder")
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("."))
    if not files:
        raise ValueError(f"--ptq-store {folder}: no layer files (*.safetensors)")
    wanted = linears(model, quantizable_only=True)
    by_name, digest = {}, hashlib.sha256()
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = json.loads((f.metadata() or {}).get("qlinear", "{}"))
        except Exception as error:  # a truncated or foreign file: name it
            raise ValueError(f"--ptq-store file {path}: not a readable safetensors layer ({error})") from error
        name = meta.get("extra", {}).get("name")
        if name is None:
            raise ValueError(f"--ptq-store file {path}: no layer name in its metadata")
        if name in by_name:
            raise ValueError(f"--ptq-store {folder}: layer {name} is stored twice ({by_name[name].name}, {path.name})")
        if name not in wanted:
            raise ValueError(f"--ptq-store file {path}: layer {name} is not a quantizable linear of the teacher")
        by_name[name] = path
        digest.update(f"{path.name}|{provenance.file_digest(path)}\n".encode())
    missing = [name for name in wanted if name not in by_name]
    if missing:
        raise ValueError(f"--ptq-store {folder}: no layer file for {len(missing)} quantizable linear(s) of the "
                         f"teacher, e.g. {missing[:3]}")
    fmt_names = {name: _check_layer_file(by_name[name], name, linear.out_features, linear.in_features)
                 for name, linear in wanted.items()}
    if len(set(fmt_names.values())) > 1:
        raise ValueError(f"--ptq-store {folder}: layers in several formats {sorted(set(fmt_names.values()))}")
    fmt = next(iter(fmt_names.values()))
    if fmt not in qad.FORMATS:
        raise ValueError(f"--ptq-store {folder}: format {fmt!r} is not one of {sorted(qad.FORMATS)}")
    qlayers = {}
    for name, path in by_name.items():
        layer, _ = load_qlinear(str(path))
        if layer.config.act_fmt != qad.FORMATS[fmt]():
            raise ValueError(f"--ptq-store file {path} (layer {name}): format {layer.config.act_fmt} is not the "
                             f"default {qad.FORMATS[fmt]()} the QAD student's forward uses")
        qlayers[name] = layer
    layers, blocks, lowrank_quantized = qad.student_from_qlinears(model, qlayers, fmt=qad.FORMATS[fmt]())
    _, params = nnx.split(model)
    generator = {"model": jax.tree.map(lambda p: jnp.array(p, jnp.float32), params),
                 "layers": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), layers)}
    w4a4 = W4A4Generator(blocks={k: jnp.asarray(v, jnp.float32) for k, v in blocks.items()},
                         quant=qad.QADConfig(fmt=fmt, ste="identity"), lowrank_quantized=lowrank_quantized)
    return PTQStore(path=str(folder.absolute()), sha256=digest.hexdigest(), generator=generator, w4a4=w4a4)


#: The files of a quantized checkpoint folder (``models.quantized_checkpoint``) that its run key hashes.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "quantized.safetensors", "quantization_config.json")


def load_init_checkpoint(folder: str | Path, model: nnx.Module) -> PTQStore:
    """Read and validate a quantized checkpoint folder (``models.quantized_checkpoint``, e.g. a QAD student written
    by ``kroquant qad --export-dir`` or a generator by ``kroquant dmd2 export``) as the initial W4A4 generator of
    ``model`` (the 16-bit teacher, which gives the architecture; its weights are not used).

    The folder must be a model of the teacher's family and config, with a packed layer for every quantizable linear
    of the teacher, all in one W4A4 format (MXFP4 or NVFP4 with that format's default scale rule); its metadata and
    array shapes are checked layer by layer before anything is decoded (ValueError naming the file, the layer and
    the key). The generator then starts from what the folder holds:

    * ``"model"``: its 16-bit rest (``model.safetensors``, fp32; the quantized linears' stored kernels are zero
      placeholders, never used);
    * ``"layers"``: ``W~`` = the dequantized packed residual (the folder keeps the codes, not the fp32 master, so
      training resumes from the rounded value; re-quantizing it returns the same MXFP4 codes, so the initial forward
      is the folder's simulate forward), the bias, the low-rank branch (dequantized when packed); the blocks
      ``T`` are frozen as for a PTQ store.

    ``sha256`` hashes the names and bytes of :data:`CHECKPOINT_FILES`.
    """
    from safetensors import safe_open

    from kroquant_jax import formats
    from models import convert, families
    from models.quantized_checkpoint import FORMAT_VERSION, load_quantized_checkpoint

    flag = "--init-checkpoint"
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{flag} {folder}: no such folder")
    for name in CHECKPOINT_FILES:
        if not (folder / name).is_file():
            raise ValueError(f"{flag} {folder}: no {name} (not a quantized checkpoint folder written by kroquant; a "
                             "QLinearStore folder of layer files is a --ptq-store)")
    texts = {}
    for name in ("config.json", "quantization_config.json"):
        try:
            texts[name] = json.loads((folder / name).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{flag} file {folder / name}: not JSON ({error})") from None
    qconfig, diffusers_config = texts["quantization_config.json"], texts["config.json"]
    if qconfig.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{flag} file {folder / 'quantization_config.json'}: format_version "
                         f"{qconfig.get('format_version')!r}, this library reads {FORMAT_VERSION}")
    family = families.family_of(model)
    theirs = families.detect(diffusers_config, f"{flag} file {folder / 'config.json'}")
    if theirs is not family:
        raise ValueError(f"{flag} file {folder / 'config.json'}: a {theirs.name} model, the teacher is {family.name}")
    cfg, ours = theirs.config_from_diffusers(diffusers_config), family.config_of(model)
    differing = families.differing_fields(ours, cfg)
    if differing:
        field = differing[0]
        raise ValueError(f"{flag} file {folder / 'config.json'}: {field} is {getattr(cfg, field)!r}, the teacher's is "
                         f"{getattr(ours, field)!r} (differing: {differing})")
    wanted = linears(model, quantizable_only=True)
    stored = qconfig.get("layers") or {}
    foreign = [name for name in stored if name not in wanted]
    if foreign:
        raise ValueError(f"{flag} file {folder / 'quantization_config.json'}: layer {foreign[0]} is not a "
                         "quantizable linear of the teacher")
    missing = [name for name in wanted if name not in stored]
    if missing:
        raise ValueError(f"{flag} {folder}: no quantized layer for {len(missing)} quantizable linear(s) of the "
                         f"teacher, e.g. {missing[:3]} (a W4A4 generator quantizes every one)")
    arrays_path = folder / "quantized.safetensors"
    try:
        with safe_open(str(arrays_path), framework="numpy") as f:
            all_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as error:  # a truncated or foreign file: name it
        raise ValueError(f"{flag} file {arrays_path}: not a readable safetensors file ({error})") from error
    fmt_names = {}
    for name, linear in wanted.items():
        prefix = f"{name}/"
        shapes = {k[len(prefix):]: shape for k, shape in all_shapes.items() if k.startswith(prefix)}
        meta = stored[name].get("meta") if isinstance(stored[name], Mapping) else None
        where = f"{flag} file {arrays_path} (layer {name})"
        if not isinstance(meta, Mapping) or "config" not in meta or "weight" not in meta:
            raise ValueError(f"{flag} file {folder / 'quantization_config.json'} (layer {name}): no layer metadata")
        fmt_names[name] = _check_layer_meta(meta, shapes, where, linear.out_features, linear.in_features)
    by_format = {fmt: name for name, fmt in fmt_names.items()}
    if len(by_format) > 1:
        raise ValueError(f"{flag} {folder}: layers in several formats ("
                         + ", ".join(f"{name} is {fmt}" for fmt, name in sorted(by_format.items())) + ")")
    fmt = next(iter(by_format))
    if fmt not in qad.FORMATS:
        raise ValueError(f"{flag} {folder}: format {fmt!r} is not one of {sorted(qad.FORMATS)}")
    try:
        loaded = load_quantized_checkpoint(folder, "float32")
    except convert.ConversionError as error:
        raise ValueError(f"{flag} file {folder / 'model.safetensors'}: {str(error).splitlines()[0]}") from None
    kinds = {name: q.lowrank_quantized for name, q in loaded.qlayers.items() if q.lowrank_left is not None}
    if len(set(kinds.values())) > 1:
        packed = next(name for name, k in kinds.items() if k)
        plain = next(name for name, k in kinds.items() if not k)
        raise ValueError(f"{flag} {folder}: mixed low-rank branches (layer {packed} packed, {plain} 16-bit)")
    layers, blocks = {}, {}
    for name, q in loaded.qlayers.items():
        if q.config.act_fmt != qad.FORMATS[fmt]():
            raise ValueError(f"{arrays_path} (layer {name}): format {q.config.act_fmt} is not the default "
                             f"{qad.FORMATS[fmt]()} the QAD student's forward uses")
        o, d = q.config.out_features, q.config.in_features
        if q.lowrank_left is None:
            left, right = np.zeros((o, 0), np.float32), np.zeros((0, d), np.float32)
        else:
            left, right = formats.as_float32(q.lowrank_left), formats.as_float32(q.lowrank_right)  # (o, r), (r, d)
        layers[name] = {"weight": formats.dequantize(q.weight, jnp.float32),  # (o, d): the rounded residual
                        "bias": jnp.zeros((o,), jnp.float32) if q.bias is None else jnp.asarray(q.bias, jnp.float32),
                        "left": jnp.asarray(left, jnp.float32), "right": jnp.asarray(right, jnp.float32)}
        blocks[name] = jnp.asarray(q.blocks, jnp.float32)
    _, teacher_state = nnx.split(model)
    _, state = nnx.split(loaded.model)
    ours_leaves = {jax.tree_util.keystr(path): leaf
                   for path, leaf in jax.tree_util.tree_flatten_with_path(teacher_state)[0]}
    for path, leaf in ((jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]):
        if path not in ours_leaves or np.shape(ours_leaves[path]) != np.shape(leaf):
            raise ValueError(f"{flag} file {folder / 'model.safetensors'}: parameter {path} has shape {np.shape(leaf)}"
                             f", the teacher's {np.shape(ours_leaves[path]) if path in ours_leaves else 'none'}")
    if jax.tree.structure(state) != jax.tree.structure(teacher_state):
        raise ValueError(f"{flag} file {folder / 'model.safetensors'}: its parameter tree differs from the teacher's")
    digest = hashlib.sha256()
    for name in CHECKPOINT_FILES:
        digest.update(f"{name}|{provenance.file_digest(folder / name)}\n".encode())
    generator = {"model": jax.tree.map(lambda p: jnp.array(p, jnp.float32), state), "layers": layers}
    w4a4 = W4A4Generator(blocks=blocks, quant=qad.QADConfig(fmt=fmt, ste="identity"),
                         lowrank_quantized=bool(kinds and next(iter(kinds.values()))))
    return PTQStore(path=str(folder.absolute()), sha256=digest.hexdigest(), generator=generator, w4a4=w4a4,
                    kind="init_checkpoint")


class GanHead(nnx.Module):
    """Realism logit from fake-score token features: (b, n, d) -> LayerNorm, Linear d->d, SiLU, mean over tokens,
    Linear d->1 -> (b,)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.hidden = nnx.Linear(dim, dim, rngs=rngs)
        self.out = nnx.Linear(dim, 1, kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

    def __call__(self, features: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.hidden(self.norm(features)))  # (b, n, d)
        return self.out(h.mean(axis=1))[:, 0]  # (b,)


# --------------------------------------------------------------------------------------------------------------------
# Flow-matching conversions and the student sampler
# --------------------------------------------------------------------------------------------------------------------


def _bcast(sigma: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.reshape(sigma, sigma.shape + (1,) * (x.ndim - sigma.ndim))  # (b, 1, ..., 1)


def x0_from_velocity(x: jax.Array, velocity: jax.Array, sigma: jax.Array) -> jax.Array:
    """``x0 = x_sigma - sigma v``. x, velocity (b, ...), sigma (b,) -> (b, ...)."""
    return x - _bcast(sigma, x) * velocity


def eps_from_velocity(x: jax.Array, velocity: jax.Array, sigma: jax.Array) -> jax.Array:
    """``eps = x_sigma + (1 - sigma) v``. x, velocity (b, ...), sigma (b,) -> (b, ...)."""
    return x + (1.0 - _bcast(sigma, x)) * velocity


def score_from_velocity(x: jax.Array, velocity: jax.Array, sigma: jax.Array) -> jax.Array:
    """``grad log p(x_sigma) = -eps / sigma`` (sigma > 0). x, velocity (b, ...), sigma (b,) -> (b, ...)."""
    return -eps_from_velocity(x, velocity, sigma) / _bcast(sigma, x)


def student_sigmas(num_steps: int) -> np.ndarray:
    """The student's noise levels ``1, (K-1)/K, ..., 1/K`` (K,) (DMD2's 999, 749, 499, 249 for K = 4)."""
    if num_steps < 1:
        raise ValueError(f"student_sigmas: {num_steps=} must be >= 1")
    return (np.arange(num_steps, 0, -1) / num_steps).astype(np.float32)


def guided_velocity(model: FlowModel, params: Params, x: jax.Array, sigma: jax.Array, cond: Cond, guidance: float,
                    sigma_range: tuple[float, float] = (0.0, 1.0)) -> jax.Array:
    """CFG velocity ``v_u + g (v_c - v_u)`` (both branches in one batch), scale 1 where sigma is outside the range.

    x (b, ...), sigma (b,) -> (b, ...). guidance 1 runs the conditional branch alone.
    """
    if guidance == 1.0:
        return model.apply(params, x, sigma, cond)
    b = x.shape[0]
    both = jax.tree.map(lambda c, u: jnp.concatenate([c, u], 0), cond, model.uncond(cond))
    velocity = model.apply(params, jnp.concatenate([x, x], 0), jnp.concatenate([sigma, sigma], 0), both)  # (2b, ...)
    conditional, unconditional = velocity[:b], velocity[b:]
    inside = (sigma >= sigma_range[0]) & (sigma <= sigma_range[1])  # (b,)
    scale = _bcast(jnp.where(inside, guidance, 1.0), x)
    return unconditional + scale * (conditional - unconditional)


def generate(model: FlowModel, params: Params, key: jax.Array, cond: Cond, shape: tuple[int, ...],
             num_steps: int) -> jax.Array:
    """The student's ``num_steps``-step sample: predict x0, re-noise to the next level with fresh noise, repeat.

    key: PRNG key (start noise and the re-noising). shape: (b, c, h, w). Returns x0 (b, c, h, w), float32.
    """
    sigmas = jnp.asarray(student_sigmas(num_steps))
    keys = jax.random.split(key, num_steps)
    x = jax.random.normal(keys[0], shape, jnp.float32)
    b = shape[0]
    x0 = x
    for k in range(num_steps):  # unrolled: num_steps is small and static
        sigma = jnp.full((b,), sigmas[k])
        x0 = x0_from_velocity(x, model.apply(params, x, sigma, cond), sigma)
        if k + 1 < num_steps:
            x = (1.0 - sigmas[k + 1]) * x0 + sigmas[k + 1] * jax.random.normal(keys[k + 1], shape, jnp.float32)
    return x0


def forward_passes_per_image(num_steps: int, guidance: float) -> int:
    """Network evaluations per image: steps x (2 with CFG, 1 without)."""
    return num_steps * (1 if guidance == 1.0 else 2)


def backward_simulate(model: FlowModel, params: Params, key: jax.Array, cond: Cond, shape: tuple[int, ...],
                      num_steps: int) -> tuple[jax.Array, jax.Array]:
    """The generator's training input: ``(x_j (b, c, h, w), sigma_j (b,))`` after ``j`` of its own steps (no gradient).

    ``j`` is uniform in ``[0, num_steps)``, one per batch; ``j = 0`` is pure noise at sigma 1.
    """
    sigmas = jnp.asarray(student_sigmas(num_steps))
    key_j, key_start, key_loop = jax.random.split(key, 3)
    j = jax.random.randint(key_j, (), 0, num_steps)
    b = shape[0]
    frozen = jax.lax.stop_gradient(params)

    def body(k, x):
        sigma = jnp.full((b,), sigmas[k])
        x0 = x0_from_velocity(x, model.apply(frozen, x, sigma, cond), sigma)
        noise = jax.random.normal(jax.random.fold_in(key_loop, k), shape, jnp.float32)
        return (1.0 - sigmas[k + 1]) * x0 + sigmas[k + 1] * noise

    x = jax.random.normal(key_start, shape, jnp.float32)
    x = jax.lax.fori_loop(0, j, body, x)  # a while loop (dynamic trip count): forward only
    return jax.lax.stop_gradient(x), jnp.full((b,), sigmas[j])


# --------------------------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------------------------


def dm_gradient(x0: jax.Array, x0_real: jax.Array, x0_fake: jax.Array) -> jax.Array:
    """DMD2's normalised distribution-matching gradient ``(x0_fake - x0_real) / mean|x0 - x0_real|`` per sample.

    x0: generator samples (b, ...); x0_real, x0_fake: the two scores' denoised estimates (b, ...). Non-finite values
    (a zero normaliser) become 0.
    """
    axes = tuple(range(1, x0.ndim))
    normaliser = jnp.mean(jnp.abs(x0 - x0_real), axis=axes, keepdims=True)  # (b, 1, ...)
    return jnp.nan_to_num((x0_fake - x0_real) / normaliser, nan=0.0, posinf=0.0, neginf=0.0)


def dm_loss(model: FlowModel, real_params: Params, fake_params: Params, x0: jax.Array, cond: Cond, key: jax.Array,
            config: DMD2Config) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The distribution-matching loss of generator samples ``x0`` (b, c, h, w); its gradient w.r.t. x0 is
    ``dm_gradient / numel``. Returns ``(loss, {"dm_grad_norm": ...})``."""
    b = x0.shape[0]
    key_sigma, key_noise = jax.random.split(key)
    sigma = jax.random.uniform(key_sigma, (b,), jnp.float32, config.dm_sigma_min, config.dm_sigma_max)
    noise = jax.random.normal(key_noise, x0.shape, jnp.float32)
    detached = jax.lax.stop_gradient(x0)
    x_t = (1.0 - _bcast(sigma, x0)) * detached + _bcast(sigma, x0) * noise
    real = jax.lax.stop_gradient(real_params)
    fake = jax.lax.stop_gradient(fake_params)
    x0_real = x0_from_velocity(x_t, guided_velocity(model, real, x_t, sigma, cond, config.guidance,
                                                    config.guidance_sigma_range), sigma)
    x0_fake = x0_from_velocity(x_t, model.apply(fake, x_t, sigma, cond), sigma)
    grad = jax.lax.stop_gradient(dm_gradient(detached, x0_real, x0_fake))
    loss = 0.5 * jnp.mean(jnp.square(x0 - jax.lax.stop_gradient(x0 - grad)))
    return loss, {"dm_grad_norm": jnp.sqrt(jnp.sum(jnp.square(grad)))}


def fake_score_loss(model: FlowModel, fake_params: Params, x0: jax.Array, cond: Cond, key: jax.Array,
                    sigma_sampling: str = "logit_normal",
                    sigma_range: tuple[float, float] = (0.0, 1.0)) -> jax.Array:
    """The teacher's flow-matching loss (``models.testbed.flow_matching_loss``, no caption dropout) on detached
    generator samples x0 (b, c, h, w); sigma logit-normal (the teacher's) or, with ``sigma_sampling="uniform"``,
    uniform in ``sigma_range`` (see ``DMD2Config.fake_sigma_sampling``)."""
    if sigma_sampling not in FAKE_SIGMA_SAMPLING:
        raise ValueError(f"fake_score_loss: {sigma_sampling=} must be one of {FAKE_SIGMA_SAMPLING}")
    detached = jax.lax.stop_gradient(x0)

    def velocity_fn(x, timestep, context, mask):
        return model.apply(fake_params, x, timestep / testbed.TIMESTEP_SCALE, {"context": context, "mask": mask})

    if not (isinstance(cond, dict) and set(cond) == {"context", "mask"}):
        raise ValueError("fake_score_loss: cond must be {'context': (b, t, c), 'mask': (b, t)}")
    flow = testbed.FlowMatchingConfig(caption_dropout=0.0)
    null_context = jnp.zeros(cond["context"].shape[1:], cond["context"].dtype)
    null_mask = jnp.zeros(cond["mask"].shape[1:], cond["mask"].dtype)
    sigma = None
    if sigma_sampling == "uniform":
        key, key_sigma = jax.random.split(key)
        sigma = jax.random.uniform(key_sigma, (x0.shape[0],), jnp.float32, sigma_range[0], sigma_range[1])
    return testbed.flow_matching_loss(velocity_fn, detached, cond["context"], cond["mask"], key, flow, null_context,
                                      null_mask, sigma=sigma)


def gan_logits(model: FlowModel, fake_params: Params, head_graphdef: nnx.GraphDef, head_params: Params,
               x0: jax.Array, cond: Cond, key: jax.Array, max_sigma: float) -> jax.Array:
    """Realism logits (b,) of images x0 (b, c, h, w): noised to sigma ~ U[0, max_sigma], fake-score features, head."""
    if model.apply_features is None:
        raise ValueError("gan_logits: the FlowModel has no apply_features (build it with a feature_layer)")
    b = x0.shape[0]
    key_sigma, key_noise = jax.random.split(key)
    sigma = jax.random.uniform(key_sigma, (b,), jnp.float32, 0.0, max_sigma) if max_sigma > 0 else jnp.zeros((b,))
    x_t = (1.0 - _bcast(sigma, x0)) * x0 + _bcast(sigma, x0) * jax.random.normal(key_noise, x0.shape, jnp.float32)
    _, features = model.apply_features(fake_params, x_t, sigma, cond)  # (b, n, d)
    return nnx.merge(head_graphdef, head_params)(features)  # (b,)


# --------------------------------------------------------------------------------------------------------------------
# Training state and the jitted cycle
# --------------------------------------------------------------------------------------------------------------------


def make_optimizers(config: DMD2Config) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
    """(generator, fake score + GAN head) AdamW with global-norm clipping and linear warm-up."""

    def one(lr):
        schedule = optax.linear_schedule(0.0, lr, config.warmup) if config.warmup > 0 else lr
        return optax.chain(optax.clip_by_global_norm(config.grad_clip),
                           optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2,
                                       weight_decay=config.weight_decay))

    return one(config.generator_lr), one(config.fake_lr)


def init_state(teacher_params: Params, head_params: Params, config: DMD2Config, seed: int,
               generator: Params | None = None) -> dict[str, Any]:
    """Training state: generator and fake score copied from the teacher, the GAN head, both optimizer states, the step
    counter (fake-score updates done) and the PRNG key as raw ``uint32`` data (checkpointable).

    ``generator``: other initial generator parameters (e.g. :attr:`PTQStore.generator`, a W4A4 student) instead of
    the teacher's; every leaf of it is trained. The fake score is the teacher's copy either way.
    """
    gen_opt, fake_opt = make_optimizers(config)
    generator = jax.tree.map(lambda p: jnp.array(p, jnp.float32),
                             teacher_params if generator is None else generator)
    critic = {"fake": jax.tree.map(lambda p: jnp.array(p, jnp.float32), teacher_params), "head": head_params}
    return {"generator": generator, "critic": critic, "gen_opt": gen_opt.init(generator),
            "critic_opt": fake_opt.init(critic), "step": jnp.asarray(0, jnp.int32),
            "key": jax.random.key_data(jax.random.key(seed))}


def prompt_set(dataset: testbed_data.EmojiDataset) -> dict[str, jax.Array]:
    """The arrays :func:`prompt_batches` draws from, on the device: ``images`` (n, s, s, 3) uint8, ``context``
    (n, t, c) as stored (fp16: cast per batch), ``mask`` (n, t) float32."""
    return {"images": jnp.asarray(dataset.images), "context": jnp.asarray(dataset.context),
            "mask": jnp.asarray(dataset.context_mask, jnp.float32)}


def prompt_batches(batch_size: int) -> SampleBatch:
    """The ``sample_batch`` of :func:`make_cycle` over a :func:`prompt_set`: ``batch_size`` prompts for the generator
    and, independently, ``batch_size`` real images (pixels in [-1, 1]) with their own prompts, each drawn uniformly
    with replacement; contexts in float32."""

    def sample_batch(data, key):
        n = data["images"].shape[0]
        key_prompt, key_real = jax.random.split(key)
        prompt = jax.random.randint(key_prompt, (batch_size,), 0, n)
        real = jax.random.randint(key_real, (batch_size,), 0, n)
        context, mask = data["context"], data["mask"]
        return ({"context": context[prompt].astype(jnp.float32), "mask": mask[prompt]},
                testbed.images_to_pixels(data["images"][real]),
                {"context": context[real].astype(jnp.float32), "mask": mask[real]})

    return sample_batch


def _finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(tree)]))


def _critic_parts(model: FlowModel, config: DMD2Config, head_graphdef: nnx.GraphDef | None,
                  image_shape: tuple[int, ...], generator_model: FlowModel):
    """The pieces :func:`make_cycle` and :func:`make_fake_warmup` share: ``make_samples(generator, key, cond) -> x0``
    (the generator's training samples through ``generator_model``, backward-simulated) and ``critic_update(state, x0,
    cond, key, real_images, real_cond) -> (state, {"fake_loss", "gan_d"})`` (one fake-score + discriminator AdamW
    update through ``model``)."""
    _, critic_opt = make_optimizers(config)

    def make_samples(generator, key, cond):
        key_sim, _ = jax.random.split(key)
        if config.backward_simulation and config.num_steps > 1:
            x, sigma = backward_simulate(generator_model, generator, key_sim, cond, image_shape, config.num_steps)
        else:
            x = jax.random.normal(key_sim, image_shape, jnp.float32)
            sigma = jnp.ones((image_shape[0],), jnp.float32)
        return x0_from_velocity(x, generator_model.apply(generator, x, sigma, cond), sigma)  # (b, c, h, w)

    def critic_loss(critic, x0, cond, key, real_images, real_cond):
        key_fm, key_gan = jax.random.split(key)
        loss = fake_score_loss(model, critic["fake"], x0, cond, key_fm, config.fake_sigma_sampling,
                               (config.dm_sigma_min, config.dm_sigma_max))
        gan_d = jnp.zeros(())
        if config.gan_discriminator_weight > 0:  # fake and real in one batch: one fake-score forward
            b = x0.shape[0]
            both = jnp.concatenate([jax.lax.stop_gradient(x0), real_images], 0)  # (2b, c, h, w)
            both_cond = jax.tree.map(lambda f, r: jnp.concatenate([f, r], 0), cond, real_cond)
            logits = gan_logits(model, critic["fake"], head_graphdef, critic["head"], both, both_cond, key_gan,
                                config.gan_max_sigma)  # (2b,)
            gan_d = jnp.mean(jax.nn.softplus(logits[:b])) + jnp.mean(jax.nn.softplus(-logits[b:]))
        return loss + config.gan_discriminator_weight * gan_d, {"fake_loss": loss, "gan_d": gan_d}

    def critic_update(state, x0, cond, key, real_images, real_cond):
        (_, aux), grads = jax.value_and_grad(critic_loss, has_aux=True)(state["critic"], x0, cond, key, real_images,
                                                                        real_cond)
        updates, opt = critic_opt.update(grads, state["critic_opt"], state["critic"])
        critic = optax.apply_updates(state["critic"], updates)
        return {**state, "critic": critic, "critic_opt": opt, "step": state["step"] + 1}, aux

    return make_samples, critic_update


def make_fake_warmup(model: FlowModel, config: DMD2Config, head_graphdef: nnx.GraphDef | None,
                     sample_batch: SampleBatch, image_shape: tuple[int, ...], generator_model: FlowModel | None = None,
                     data: Any = None):
    """A jitted ``state -> (state, metrics)`` running ``config.fake_warmup`` fake-score (+ discriminator) updates on
    fresh samples of the current generator (which it leaves unchanged), in one ``lax.scan``.

    Arguments (``generator_model`` and ``data`` included) as :func:`make_cycle`. metrics: ``fake_loss_first`` /
    ``fake_loss_last`` (the flow-matching loss of the first and last warm-up update), ``gan_d`` (mean) and
    ``finite``. Raises ValueError when ``config.fake_warmup`` is 0.
    """
    if config.fake_warmup < 1:
        raise ValueError(f"make_fake_warmup: DMD2Config.fake_warmup is {config.fake_warmup}; nothing to warm up")
    make_samples, critic_update = _critic_parts(model, config, head_graphdef, image_shape,
                                                model if generator_model is None else generator_model)

    def warmup_step(data, state, k):
        key_b, key_s, key_c = jax.random.split(jax.random.fold_in(jax.random.wrap_key_data(state["key"]), k), 3)
        cond, real_images, real_cond = sample_batch(data, key_b)
        x0 = jax.lax.stop_gradient(make_samples(state["generator"], key_s, cond))
        return critic_update(state, x0, cond, key_c, real_images, real_cond)

    @jax.jit
    def fake_warmup(state, data):  # the prompt set an argument: closed over, XLA would fold it in as constants
        key_next, _ = jax.random.split(jax.random.wrap_key_data(state["key"]))
        new, aux = jax.lax.scan(lambda s, k: warmup_step(data, s, k), state, jnp.arange(config.fake_warmup))
        new = {**new, "key": jax.random.key_data(key_next)}
        metrics = {"fake_loss_first": aux["fake_loss"][0], "fake_loss_last": aux["fake_loss"][-1],
                   "gan_d": jnp.mean(aux["gan_d"])}
        finite = _finite(metrics) & _finite(new["critic"])
        return new, {**metrics, "finite": finite.astype(jnp.float32)}

    def run(state):
        return fake_warmup(state, data)

    return run


def make_cycle(model: FlowModel, config: DMD2Config, head_graphdef: nnx.GraphDef | None, sample_batch: SampleBatch,
               image_shape: tuple[int, ...], cycles: int = 1, generator_model: FlowModel | None = None,
               data: Any = None):
    """A jitted ``(state, teacher_params) -> (state, metrics)`` running ``cycles`` DMD2 cycles.

    One cycle = one generator update, then ``config.fake_updates_per_generator`` fake-score (+ discriminator)
    updates in one ``lax.scan`` (one compiled copy of the update), the first on the generator update's own (detached)
    samples. The discriminator scores fake and real images in one batch. (``config.fake_warmup`` is not run here:
    see :func:`make_fake_warmup` and :func:`train`.)

    sample_batch: ``(data, key) -> (cond, real_images (b, c, h, w) or None, real_cond or None)``: prompts for the
        generator and, for the GAN, a batch of real images with their conditioning (e.g. :func:`prompt_batches`).
    data: what ``sample_batch`` draws from (a pytree of arrays, e.g. :func:`prompt_set`; None: nothing), an argument
        of the jitted program: arrays ``sample_batch`` closed over instead would be folded into it as constants.
    image_shape: (b, c, h, w) of the generator's batch.
    generator_model: the generator's network when it is not ``model`` (the real and fake scores' network), e.g. the
        W4A4 student of ``pixart_flow_model(..., w4a4=...)``; None: ``model``.
    metrics: means over the call of ``dm_loss``, ``dm_grad_norm``, ``fake_loss``, ``gan_g``, ``gan_d`` and ``finite``
    (1.0 when every loss and parameter stayed finite).
    """
    gen_opt, _ = make_optimizers(config)
    make_samples, critic_update = _critic_parts(model, config, head_graphdef, image_shape,
                                                model if generator_model is None else generator_model)

    def generator_loss(generator, critic, teacher, key, cond):
        key_sample, key_dm, key_gan = jax.random.split(key, 3)
        x0 = make_samples(generator, key_sample, cond)
        loss, aux = dm_loss(model, teacher, critic["fake"], x0, cond, key_dm, config)
        gan_g = jnp.zeros(())
        if config.gan_generator_weight > 0:
            frozen = jax.lax.stop_gradient(critic)
            logits = gan_logits(model, frozen["fake"], head_graphdef, frozen["head"], x0, cond, key_gan,
                                config.gan_max_sigma)
            gan_g = jnp.mean(jax.nn.softplus(-logits))
        total = loss + config.gan_generator_weight * gan_g
        return total, (x0, {"dm_loss": loss, "gan_g": gan_g, **aux})

    def one_cycle(state, teacher, data):
        key = jax.random.wrap_key_data(state["key"])
        key, key_batch, key_gen, key_critic, key_rest = jax.random.split(key, 5)
        batch = sample_batch(data, key_batch)
        (_, (x0, gen_aux)), grads = jax.value_and_grad(generator_loss, has_aux=True)(
            state["generator"], state["critic"], teacher, key_gen, batch[0])
        updates, opt = gen_opt.update(grads, state["gen_opt"], state["generator"])
        state = {**state, "generator": optax.apply_updates(state["generator"], updates), "gen_opt": opt}
        first = (jax.lax.stop_gradient(x0),) + tuple(batch)

        def critic_step(state, k):
            # update 0 reuses the generator update's samples; the others draw prompts and (gradient-free) samples
            key_b, key_s, key_c = jax.random.split(jax.random.fold_in(key_rest, k), 3)

            def fresh():
                cond, real_images, real_cond = sample_batch(data, key_b)
                return (jax.lax.stop_gradient(make_samples(state["generator"], key_s, cond)), cond, real_images,
                        real_cond)

            x0, cond, real_images, real_cond = jax.lax.cond(k == 0, lambda: first, fresh)
            key_update = jax.random.wrap_key_data(jnp.where(k == 0, jax.random.key_data(key_critic),
                                                            jax.random.key_data(key_c)))
            return critic_update(state, x0, cond, key_update, real_images, real_cond)

        state, critic_aux = jax.lax.scan(critic_step, state, jnp.arange(config.fake_updates_per_generator))
        state = {**state, "key": jax.random.key_data(key)}
        metrics = {**gen_aux, **jax.tree.map(jnp.mean, critic_aux)}
        finite = _finite(metrics) & _finite(state["generator"]) & _finite(state["critic"])
        return state, {**metrics, "finite": finite.astype(jnp.float32)}

    @jax.jit
    def dmd2_cycle(state, teacher, data):  # the prompt set an argument: closed over, XLA would fold it in as constants
        state, metrics = jax.lax.scan(lambda s, _: one_cycle(s, teacher, data), state, None, length=cycles)
        return state, {**jax.tree.map(jnp.mean, metrics), "finite": jnp.min(metrics["finite"])}

    def run(state, teacher):
        return dmd2_cycle(state, teacher, data)

    return run


# --------------------------------------------------------------------------------------------------------------------
# The training loop: orbax checkpoints, resume, one progress bar, NaN stop
# --------------------------------------------------------------------------------------------------------------------


class DMD2Divergence(FloatingPointError):
    """A loss or parameter became NaN/Inf; the last good checkpoint is kept."""


class RunKeyMismatch(ValueError):
    """A run folder's checkpoints were made from another generator initialisation than this call's."""


RUN_KEY_FILE = "dmd2_run.json"
#: The key of a run folder with checkpoints and no key file: made before runs were keyed, when every generator
#: started from the teacher.
TEACHER_KEY = {"generator": "teacher"}


def generator_key(store: PTQStore | None) -> dict[str, Any]:
    """What a run folder is keyed by: the generator's initialisation, the teacher (``store`` None), a PTQ store or a
    quantized checkpoint folder (its content hash and folder name, which are compared, and its absolute path,
    recorded): ``{"generator": {"ptq_store" | "init_checkpoint": name, "sha256": hex}, "<kind>_path": path}``."""
    if store is None:
        return dict(TEACHER_KEY)
    return {"generator": {store.kind: Path(store.path).name, "sha256": store.sha256}, f"{store.kind}_path": store.path}


def _init_kind(generator: Mapping[str, Any]) -> str:
    """``"ptq_store"`` or ``"init_checkpoint"``: the kind of a W4A4 generator key's initialisation."""
    return "init_checkpoint" if "init_checkpoint" in generator else "ptq_store"


def _describe(key: Mapping[str, Any]) -> str:
    generator = key["generator"]
    if generator == "teacher":
        return "the 16-bit teacher (no --ptq-store)"
    kind = _init_kind(generator)
    flag = "--init-checkpoint" if kind == "init_checkpoint" else "--ptq-store"
    return f"{flag} {key.get(f'{kind}_path', generator[kind])} (sha256 {generator['sha256'][:12]})"


def training_key(config: DMD2Config, *, seed: int, batch_size: int, compute_dtype: str, data: Mapping[str, Any],
                 teacher: Params) -> dict[str, Any]:
    """What a run's checkpoints depend on besides the generator's initialisation (:func:`generator_key`), stored
    under ``"training"`` in ``dmd2_run.json``: every :class:`DMD2Config` field (learning rates, ratio, guidance and
    its interval, the DM and GAN settings, the fake-score warm-up), the seed, the batch size, the compute dtype, and
    fingerprints of the training records (``data``: :func:`prompt_set`) and of the teacher's weights (the real
    score, the fake score's start and, without an initialisation, the generator's). Not the cycle count, the time
    budget, the cycles per call (the keys live in the state: any grouping gives the same cycles) or the save
    interval."""
    return {"config": json.loads(json.dumps(dataclasses.asdict(config))), "seed": int(seed),
            "batch_size": int(batch_size), "compute_dtype": str(compute_dtype), "data": qad.fingerprint(dict(data)),
            "teacher": qad.fingerprint(teacher)}


def check_run_key(run_dir: str | Path, key: Mapping[str, Any], write: bool) -> None:
    """Refuse a run folder made from another generator initialisation or, where ``key`` has a ``"training"`` entry
    (:func:`training_key`), with other training settings (:class:`RunKeyMismatch`, one line).

    The stored key is ``run_dir/dmd2_run.json``, or :data:`TEACHER_KEY` for a folder with checkpoints and no key;
    the ``generator`` entries are compared (a moved copy of the same store resumes), then each entry of
    ``key["training"]`` (all of them for a training call; e.g. only the teacher for an evaluation). A folder with
    checkpoints whose key lacks the training settings (written before they were keyed) is refused for training, as
    they cannot be verified; an evaluation of it checks the generator alone, as before. ``write``: store ``key``
    when the folder has none, or has no checkpoints yet (a fresh run).
    """
    run_dir = Path(run_dir)
    path = run_dir / RUN_KEY_FILE
    has_checkpoints = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    if path.exists():
        stored = read_json_object(path)
    elif has_checkpoints:
        stored = TEACHER_KEY
    else:
        stored = None
    key = json.loads(json.dumps(dict(key)))
    if stored is not None and stored["generator"] != key["generator"]:
        raise RunKeyMismatch(f"{run_dir}: its generator was initialised from {_describe(stored)}, this call's from "
                             f"{_describe(key)}; use another --run or the same --ptq-store / --init-checkpoint")
    training = key.get("training")
    if stored is not None and training is not None:
        old = stored.get("training")
        if old is None and has_checkpoints and write:
            raise RunKeyMismatch(f"{run_dir}: its checkpoints predate the keyed training settings ({RUN_KEY_FILE} "
                                 "records only the generator's initialisation), so their teacher, data and settings "
                                 "cannot be verified; use another --run")
        if old is not None:
            old = {k: old.get(k, "<unset>") for k in training}
            if old != training:
                raise RunKeyMismatch(f"{run_dir}: trained with other settings "
                                     f"({provenance.describe_key_changes(old, training)}); use another --run or the "
                                     "same settings")
    if write and (stored is None or (not has_checkpoints and stored != key)):
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, dict(key))


def train(run_cycles, state: dict[str, Any], teacher: Params, run_dir: str | Path, total_cycles: int,
          cycles_per_call: int, save_every_calls: int = 10, time_budget: float | None = None,
          progress: bool = True, log_extra: dict[str, Any] | None = None,
          warmup: Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]] | None = None,
          run_key: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``run_cycles`` (from :func:`make_cycle` with ``cycles=cycles_per_call``) until ``total_cycles`` cycles.

    ``warmup`` (from :func:`make_fake_warmup`) runs once before the first cycle of a fresh run (not on resume: its
    result is in the checkpoints, saved as cycle 0 as soon as it ends), logged as a ``warmup`` line; a non-finite
    warm-up raises :class:`DMD2Divergence`.

    Resumes from the latest orbax checkpoint in ``run_dir/checkpoints`` (same structure as ``state``; continuing is
    bit-identical to an uninterrupted run, since the batch and noise keys live in the state). Saves every
    ``save_every_calls`` calls and at the end; a non-finite loss or parameter raises :class:`DMD2Divergence` without
    saving the bad state. Appends one JSON line per call to ``run_dir/log.jsonl``.

    ``run_key`` (:func:`generator_key`; None: the teacher's) is checked against the folder's before anything is
    restored (:func:`check_run_key`: a folder made from another initialisation raises :class:`RunKeyMismatch`) and
    stored in a fresh folder.

    Returns ``(state, summary)``; summary has ``cycles``, ``generator_updates``, ``fake_updates``, ``elapsed_s``,
    ``resumed_from``.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    if total_cycles % cycles_per_call:
        raise ValueError(f"train: total_cycles {total_cycles} must be a multiple of cycles_per_call "
                         f"{cycles_per_call}")
    run_dir = Path(run_dir).absolute()
    check_run_key(run_dir, TEACHER_KEY if run_key is None else run_key, write=True)
    manager = ocp.CheckpointManager(run_dir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    resumed_from = manager.latest_step()
    if resumed_from is not None:
        state = manager.restore(resumed_from, args=ocp.args.StandardRestore(state))
    # Orbax restores arrays committed to their devices, and jit lowers committed arguments with their shardings:
    # commit a fresh state the same way, so that a fresh and a resumed run are one program (one entry of a
    # persistent compilation cache, not two compilations).
    state = jax.device_put(state, jax.tree.map(lambda leaf: leaf.sharding, state))
    cycle = 0 if resumed_from is None else resumed_from
    log_path = run_dir / "log.jsonl"
    atomic_append_text(log_path, json.dumps({"event": "start", "cycle": cycle, "device": str(jax.devices()[0]),
                                             "jax": jax.__version__, **(log_extra or {})}) + "\n")
    began = time.perf_counter()
    last_saved = resumed_from
    if warmup is not None and resumed_from is None:
        state, metrics = warmup(state)
        metrics = {k: float(v) for k, v in metrics.items()}
        if metrics["finite"] != 1.0 or not all(math.isfinite(v) for v in metrics.values()):
            raise DMD2Divergence(f"DMD2 fake-score warm-up diverged (a loss or parameter is NaN/Inf: {metrics}); "
                                 "no checkpoint had been saved yet")
        atomic_append_text(log_path, json.dumps({"event": "warmup", "fake_updates": int(state["step"]), **metrics,
                                                 "elapsed_s": round(time.perf_counter() - began, 2)}) + "\n")
        # saved as cycle 0 at once: a call whose time budget or a kill ends it before the first cycle resumes past
        # the warm-up instead of running it again
        manager.save(0, args=ocp.args.StandardSave(state))
        last_saved = 0
    bar = tqdm(total=total_cycles, initial=cycle, unit="cycle", disable=not progress, dynamic_ncols=True)
    calls = 0
    try:
        while cycle < total_cycles:
            if time_budget is not None and time.perf_counter() - began > time_budget:
                break
            new_state, metrics = run_cycles(state, teacher)
            metrics = {k: float(v) for k, v in metrics.items()}
            if metrics["finite"] != 1.0 or not all(math.isfinite(v) for v in metrics.values()):
                manager.wait_until_finished()
                kept = (f"the last good checkpoint (cycle {last_saved}) is kept in {run_dir / 'checkpoints'}"
                        if last_saved is not None else "no checkpoint had been saved yet")
                raise DMD2Divergence(f"DMD2 training diverged in cycles {cycle + 1}..{cycle + cycles_per_call} (a "
                                     f"loss or parameter is NaN/Inf: {metrics}); {kept}")
            state = new_state
            cycle += cycles_per_call
            calls += 1
            bar.update(cycles_per_call)
            bar.set_postfix(dm=f"{metrics['dm_loss']:.4f}", fake=f"{metrics['fake_loss']:.4f}")
            atomic_append_text(log_path, json.dumps({"event": "call", "cycle": cycle, **metrics,
                                                     "elapsed_s": round(time.perf_counter() - began, 2)}) + "\n")
            if calls % save_every_calls == 0:
                manager.save(cycle, args=ocp.args.StandardSave(state))
                last_saved = cycle
    finally:
        bar.close()
    if cycle != last_saved and cycle > 0:
        manager.save(cycle, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    manager.close()
    elapsed = time.perf_counter() - began
    summary = {"cycles": cycle, "fake_updates": int(state["step"]), "elapsed_s": round(elapsed, 2),
               "resumed_from": resumed_from}
    atomic_append_text(log_path, json.dumps({"event": "end", **summary}) + "\n")
    return state, summary


def restore_state(run_dir: str | Path, template: dict[str, Any],
                  run_key: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], int]:
    """The latest checkpoint of a :func:`train` run -> ``(state, cycles done)``; ``template`` gives the structure
    (e.g. :func:`init_state` of the same teacher and generator). ``run_key`` (None: the teacher's) is checked first
    (:func:`check_run_key`). Raises FileNotFoundError when the run has no checkpoint."""
    import orbax.checkpoint as ocp

    check_run_key(run_dir, TEACHER_KEY if run_key is None else run_key, write=False)
    directory = Path(run_dir).absolute() / "checkpoints"
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step()
    if step is None:
        manager.close()
        raise FileNotFoundError(f"{directory}: no DMD2 checkpoint (run `kroquant dmd2 train --run {run_dir}` first)")
    state = manager.restore(step, args=ocp.args.StandardRestore(template))
    manager.close()
    return state, int(step)


def restore_generator(run_dir: str | Path, template: Params,
                      run_key: Mapping[str, Any] | None = None) -> tuple[Params, int]:
    """The generator of the latest checkpoint of a :func:`train` run -> ``(generator params, cycles done)``, read
    alone (an orbax partial restore: the critic and the optimizer states are not needed to export it); ``template``
    is the initial generator (e.g. :attr:`PTQStore.generator`) giving the structure. ``run_key`` (None: the
    teacher's) is checked first (:func:`check_run_key`). Raises FileNotFoundError when the run has no checkpoint."""
    import orbax.checkpoint as ocp

    check_run_key(run_dir, TEACHER_KEY if run_key is None else run_key, write=False)
    directory = Path(run_dir).absolute() / "checkpoints"
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no DMD2 checkpoint (run `kroquant dmd2 train --run {run_dir}` first)")
    manager = ocp.CheckpointManager(directory)
    try:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"{directory}: no DMD2 checkpoint (run `kroquant dmd2 train --run {run_dir}` "
                                    "first)")
        restored = manager.restore(step, args=ocp.args.PyTreeRestore(item={"generator": template},
                                                                     partial_restore=True))
    finally:
        manager.close()
    return restored["generator"], int(step)


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What :func:`export_run` needs, read from a run folder without loading any weights (:func:`plan_export`).

    run_dir, out: the run and the folder to write (absolute). key: the run's stored key (``dmd2_run.json``).
    init_kind: ``"ptq_store"`` or ``"init_checkpoint"``. init_path: the generator's initialisation folder (the one
    recorded in the key unless another location was given). teacher: the teacher folder the last training call used
    (from ``log.jsonl``; None if not recorded). config: that call's :class:`DMD2Config`. cycle: the latest
    checkpoint's cycle.
    """

    run_dir: Path
    out: Path
    key: dict
    init_kind: str
    init_path: str
    teacher: str | None
    config: DMD2Config
    cycle: int


def plan_export(run_dir: str | Path, out: str | Path, overwrite: bool = False,
                init_path: str | Path | None = None, init_kind: str | None = None) -> ExportPlan:
    """Validate a ``kroquant dmd2 export`` before anything is loaded: the run folder, its key (a W4A4 generator:
    a 16-bit one, trained without ``--ptq-store`` / ``--init-checkpoint``, has no quantized layers to export), a
    checkpoint, the recorded training config, and ``out`` (absent or empty unless ``overwrite``).

    ``init_path``: where the generator's initialisation folder is now, when it moved (its SHA-256 is still checked
    against the run's key by :func:`export_run`), of ``init_kind`` (``"ptq_store"`` / ``"init_checkpoint"``, the
    flag it was given with; it must be the run's). Raises ValueError (one line, naming the flag and the folder)."""
    import orbax.checkpoint as ocp

    run_dir = Path(run_dir).absolute()
    if not (run_dir / "checkpoints").is_dir():
        raise ValueError(f"--run {run_dir}: no DMD2 run there (no checkpoints folder)")
    key_path = run_dir / RUN_KEY_FILE
    key = read_json_object(key_path) if key_path.exists() else dict(TEACHER_KEY)
    if key.get("generator", "teacher") == "teacher":
        raise ValueError(f"--run {run_dir}: its generator is 16-bit (trained without --ptq-store or "
                         "--init-checkpoint), so it has no W4A4 layers to export as a quantized checkpoint")
    manager = ocp.CheckpointManager(run_dir / "checkpoints")
    cycle = manager.latest_step()
    manager.close()
    if cycle is None:
        raise ValueError(f"--run {run_dir}: no checkpoint saved yet")
    starts = []
    if (run_dir / "log.jsonl").exists():
        records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
        starts = [r for r in records if r.get("event") == "start" and "config" in r]
    if not starts:
        raise ValueError(f"--run {run_dir}: log.jsonl records no training config (not a `kroquant dmd2 train` run)")
    recorded = dict(starts[-1]["config"])
    recorded["guidance_sigma_range"] = tuple(recorded["guidance_sigma_range"])
    kind = _init_kind(key["generator"])
    if init_kind is not None and init_kind != kind:
        raise ValueError(f"--{init_kind.replace('_', '-')} {init_path}: the run {run_dir} was initialised from "
                         f"{_describe(key)}")
    out = qad.check_export_dir(Path(out).absolute(), overwrite)
    return ExportPlan(run_dir=run_dir, out=out, key=key, init_kind=kind,
                      init_path=str(init_path if init_path is not None else key.get(f"{kind}_path",
                                                                                    key["generator"][kind])),
                      teacher=starts[-1].get("teacher"), config=DMD2Config(**recorded), cycle=int(cycle))


def export_run(plan: ExportPlan, model: nnx.Module) -> dict[str, Any]:
    """Write the latest checkpoint's W4A4 generator of ``plan``'s run as a quantized checkpoint folder
    (``models.qad.export_student_checkpoint``: its trained 16-bit rest and packed layers; ``kroquant generate``
    serves it, ``--init-checkpoint`` starts from it).

    ``model``: the 16-bit teacher (architecture; for a PTQ store also the start of ``W~``). The initialisation
    folder is read again (:func:`load_ptq_store` / :func:`load_init_checkpoint`) for the frozen transforms and the
    format, and its key must be the run's (:class:`RunKeyMismatch` otherwise). The folder records the DMD2 config as
    its recipe settings and, under ``extra``, the run, the cycle, the initialisation (name, SHA-256, path), the
    teacher and the student's sampler (``steps`` = the trained step count, flow Euler at guidance 1: the
    deterministic counterpart of the re-noising sampler :func:`generate`, on the same noise levels).

    Returns ``{"out", "cycle", "layers", "format", "init"}``.
    """
    load = load_init_checkpoint if plan.init_kind == "init_checkpoint" else load_ptq_store
    store = load(plan.init_path, model)
    key = generator_key(store)
    generator, cycle = restore_generator(plan.run_dir, store.generator, key)
    graphdef, _ = nnx.split(model)
    extra = {"trained_by": "kroquant dmd2 train", "run": str(plan.run_dir), "cycle": cycle,
             "steps": plan.config.num_steps, "init": key["generator"], "init_path": store.path,
             "teacher": plan.teacher,
             "sampler_note": "trained with DMD2's re-noising sampler (x0, fresh noise) at sigma 1, (K-1)/K, ..., 1/K; "
                             "flow_euler at guidance 1 with these steps is its deterministic counterpart"}
    qlayers = qad.export_student_checkpoint(plan.out, graphdef, generator, store.w4a4.blocks, store.w4a4.quant,
                                            store.w4a4.lowrank_quantized, recipe_name="dmd2", recipe=plan.config,
                                            extra=extra)
    return {"out": str(plan.out), "cycle": cycle, "layers": len(qlayers), "format": store.w4a4.quant.fmt,
            "init": key["generator"]}

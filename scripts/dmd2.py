"""DMD2 timestep distillation of the emoji testbed DiT, and the distribution metrics of teacher and students.

    kroquant build-emoji-dataset --from-npz runs/emoji32.npz --out runs/dmd2_prompts.npz --prompts 1024
    kroquant dmd2 reference --data runs/emoji32.npz --out runs/dmd2_reference.npz
    kroquant dmd2 train --data runs/dmd2_prompts.npz --run runs/dmd2 --time-budget 60
    kroquant dmd2 evaluate --data runs/dmd2_prompts.npz --reference runs/dmd2_reference.npz --run runs/dmd2 \\
        --out runs/dmd2_eval
    kroquant dmd2 export --run runs/dmd2_w4a4 --out runs/dmd2_w4a4_checkpoint

``train``: generator and fake score start from the teacher (``--teacher``, a diffusers PixArt directory); with
``--ptq-store DIR`` (a calibrated ``QLinearStore`` folder, as ``kroquant qad --ptq-store`` reads) the generator is the
W4A4 student initialised from it instead (every quantizable linear in W4A4 fake quant with the STE, the QAD student's
forward; the fake and real scores stay 16-bit); with ``--init-checkpoint DIR`` (a quantized checkpoint folder, e.g. a
QAD student of ``kroquant qad --export-dir``) the W4A4 generator starts from that folder's 16-bit rest and packed
layers (``models.dmd2.load_init_checkpoint``). Prompts are the training records of ``--data``; the GAN's real images
are the same records' images. Method: ``models/dmd2.py``. A run folder is keyed (``dmd2_run.json``) by the
generator's initialisation: resuming it (or evaluating it) with another ``--ptq-store`` / ``--init-checkpoint``, or
none, is refused; and by what its checkpoints depend on (``models.dmd2.training_key``): resuming it with another
teacher (its weights), other training records (``--data``'s training split), seed, batch size, compute dtype or
DMD2 setting (learning rates, ``--ratio``, ``--guidance`` and its interval, ``--num-steps``, the DM, GAN and warm-up
flags) is refused in one line naming each setting's old -> new value, and so is evaluating it with another teacher.
``--cycles``, ``--time-budget``, ``--cycles-per-call`` and ``--save-every-calls`` are not keyed (a rerun may train
further). A folder trained before the settings were keyed is refused for training (they cannot be verified).
``evaluate``: the teacher (Euler, ``--teacher-steps`` x 2 CFG branches; the reference system), the same teacher
unguided (``--teacher-steps`` x 1 branch, CFG 1: the distribution a ``--guidance 1`` real score targets; left out when
``--guidance`` is 1), the teacher's weights used as a 4-step
student without training, with ``--ptq-store`` / ``--init-checkpoint`` also the untrained W4A4 generator twice: as
it is served without DMD2 (``initial_w4a4_euler``: ``--teacher-steps`` Euler steps from the teacher's start noise,
with CFG ``--guidance`` for a PTQ store, one branch for an init checkpoint such as a QAD student) and at
``--num-steps`` steps, one branch, and the trained student at 1, 2, 4, 8 steps (W4A4 fake quant with
``--ptq-store``): Fréchet distance of in-domain encoder features to the real training images and to the teacher's
samples, caption accuracy, seed diversity, nearest-image outcomes, wall time per image, a grid PNG and
``report.json``. The encoder (``models/testbed/metrics.py``) is trained on the reference images once and cached
(``--encoder-dir``). ``--served STRATEGY`` adds the trained W4A4 student as it is served (``student_served``: exported
to ``OUT/served_checkpoint``, its layers run by that served strategy, the same noise as the fake-quant student, with
its PSNR against the fake-quant student's images).
``export``: a W4A4 run's latest generator as a quantized checkpoint folder (``models.quantized_checkpoint``: its
trained 16-bit rest and packed layers) that ``kroquant generate`` serves and ``--init-checkpoint`` starts from; a
16-bit run (no ``--ptq-store`` / ``--init-checkpoint``) is refused.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kroquant_jax import provenance
from kroquant_jax.fileio import atomic_write_json
from models import dmd2, families, image_metrics, pixart, qad
from models.testbed import metrics as emoji_metrics
from models.testbed import model as testbed
from models.testbed import data as testbed_data
from models.layers import linears
from pallas_kernels import served
from scripts.common_args import UserError, action_parser, finite_float, nonnegative_int, positive_int, verb_parser
from scripts.eval_testbed import DEFAULT_CHECKPOINT as DEFAULT_TEACHER

DEFAULTS = dmd2.DMD2Config()


EXAMPLES = ("reference --data runs/emoji32.npz --out runs/dmd2_reference.npz",
            "train --data runs/dmd2_prompts.npz --run runs/dmd2 --time-budget 60",
            "train --data runs/dmd2_prompts.npz --run runs/dmd2_w4a4 --ptq-store runs/ptq_stores/qlayers/RECIPE-HASH "
            "--time-budget 60",
            "evaluate --data runs/dmd2_prompts.npz --reference runs/dmd2_reference.npz --run runs/dmd2 "
            "--out runs/dmd2_eval",
            "train --data runs/dmd2_prompts.npz --run runs/dmd2_from_qad --init-checkpoint runs/qad/export/qad_ptq "
            "--time-budget 60",
            "export --run runs/dmd2_w4a4 --out runs/dmd2_w4a4_checkpoint")


def parse_args(argv=None) -> argparse.Namespace:
    """The options of ``kroquant dmd2 reference | train | evaluate | export``."""
    parser = verb_parser("dmd2", __doc__, EXAMPLES)
    sub = parser.add_subparsers(dest="action", required=True)
    ref = action_parser(sub, "dmd2", "reference",
                        "Write the real images of a full dataset (no text) for the Fréchet-distance reference.",
                        (EXAMPLES[0].split(" ", 1)[1],))
    ref.add_argument("--data", required=True, help="full dataset .npz (kroquant build-emoji-dataset)")
    ref.add_argument("--out", required=True, help="reference images .npz to write")
    docs = {"train": ("Train the few-step student (generator and fake score start from the teacher).",
                      EXAMPLES[1].split(" ", 1)[1]),
            "evaluate": ("Compare the teacher, the untrained and the trained student on in-domain metrics.\n\n"
                         "Fréchet distance, caption accuracy, seed diversity, nearest-image outcomes and wall time "
                         "per image;\nreport.json and grid.png in --out.", EXAMPLES[3].split(" ", 1)[1])}
    for name, (doc, example) in docs.items():
        p = action_parser(sub, "dmd2", name, doc, (example,))
        p.add_argument("--data", required=True, help="dataset or prompt-subset .npz (kroquant build-emoji-dataset)")
        p.add_argument("--teacher", default=str(DEFAULT_TEACHER), help="diffusers PixArt directory")
        p.add_argument("--run", required=True, help="training folder (orbax checkpoints, log.jsonl)")
        p.add_argument("--num-steps", type=positive_int, default=DEFAULTS.num_steps,
                       help="student steps trained (backward simulation)")
        p.add_argument("--guidance", type=finite_float, default=DEFAULTS.guidance,
                       help="real-score / teacher CFG scale")
        p.add_argument("--seed", type=int, default=0, help="seed of the initialisation, the batches and the noise")
        p.add_argument("--gan-feature-layer", default=DEFAULTS.gan_feature_layer,
                       help="the linear whose input tokens feed the GAN head")
        init = p.add_mutually_exclusive_group()
        init.add_argument("--ptq-store", default=None,
                          help="calibrated PTQ QLinearStore folder (any recipe): the generator is the W4A4 student "
                               "initialised from it (fake quant with the STE); the run is keyed by it")
        init.add_argument("--init-checkpoint", default=None,
                          help="quantized checkpoint folder (kroquant qad --export-dir, kroquant dmd2 export): the "
                               "generator is the W4A4 student starting from its 16-bit rest and packed layers; the "
                               "run is keyed by it")
    train = sub.choices["train"]
    train.add_argument("--cycles", type=positive_int, default=100000,
                       help="generator updates (each with --ratio fake updates)")
    train.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds (resumable)")
    train.add_argument("--batch-size", type=positive_int, default=64, help="prompts (and real images) per update")
    train.add_argument("--ratio", type=positive_int, default=DEFAULTS.fake_updates_per_generator,
                       help="fake-score updates per generator update (DMD2: 5)")
    train.add_argument("--generator-lr", type=float, default=DEFAULTS.generator_lr,
                       help="AdamW learning rate of the generator")
    train.add_argument("--fake-lr", type=float, default=DEFAULTS.fake_lr, help="AdamW learning rate of the fake score")
    train.add_argument("--dm-sigma-range", type=float, nargs=2, default=(DEFAULTS.dm_sigma_min, DEFAULTS.dm_sigma_max),
                       metavar=("MIN", "MAX"), help="noise levels of the distribution-matching loss")
    train.add_argument("--guidance-sigma-range", type=float, nargs=2, default=(0.0, 1.0), metavar=("LOW", "HIGH"),
                       help="noise levels where the real score applies --guidance")
    train.add_argument("--gan-generator-weight", type=float, default=0.0,
                       help="GAN loss weight of the generator; 0 switches the GAN off")
    train.add_argument("--gan-discriminator-weight", type=float, default=0.0,
                       help="GAN loss weight of the discriminator (the fake score's head)")
    train.add_argument("--gan-max-sigma", type=float, default=0.0,
                       help="GAN inputs are noised to a uniform level in [0, this] (0: clean images)")
    train.add_argument("--fake-warmup", type=nonnegative_int, default=DEFAULTS.fake_warmup,
                       help="fake-score updates on the initial generator's samples before the first generator update "
                            "(a fresh run only; 0: none)")
    train.add_argument("--fake-sigma-sampling", choices=dmd2.FAKE_SIGMA_SAMPLING, default=DEFAULTS.fake_sigma_sampling,
                       help="noise levels of the fake score's flow-matching loss: logit_normal (the teacher's "
                            "objective) or uniform over --dm-sigma-range (as the public DMD2 code)")
    train.add_argument("--cycles-per-call", type=positive_int, default=10, help="generator updates per compiled call")
    train.add_argument("--save-every-calls", type=positive_int, default=50, help="checkpoint every N calls")
    train.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                       help="dtype of the networks' forward passes")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    evaluate = sub.choices["evaluate"]
    evaluate.add_argument("--reference", required=True, help="reference images (kroquant dmd2 reference) or dataset")
    evaluate.add_argument("--out", required=True, help="output folder (report.json, grid.png)")
    evaluate.add_argument("--samples", type=positive_int, default=1024, help="training captions sampled per system")
    evaluate.add_argument("--teacher-steps", type=positive_int, default=20, help="Euler steps of the teacher")
    evaluate.add_argument("--student-steps", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                          help="step counts the trained student is evaluated at")
    evaluate.add_argument("--batch-size", type=positive_int, default=512, help="captions per sampling call")
    evaluate.add_argument("--encoder-dir", default="runs/emoji_encoder",
                          help="cache folder of the in-domain encoder (trained once on the reference images)")
    evaluate.add_argument("--encoder-steps", type=positive_int, default=1500, help="training steps of the encoder")
    evaluate.add_argument("--encoder-batch-size", type=positive_int, default=256,
                          help="images per training step of the encoder")
    evaluate.add_argument("--nearest", type=nonnegative_int, default=128,
                          help="samples per system for the nearest-image check")
    evaluate.add_argument("--grid-rows", type=positive_int, default=8, help="captions shown in grid.png")
    evaluate.add_argument("--served", metavar="STRATEGY", default=None,
                          help="also evaluate the W4A4 student as it is served: its latest checkpoint exported to "
                               "OUT/served_checkpoint (kroquant dmd2 export) and sampled at --num-steps through that "
                               "strategy's served layers (pallas_kernels.served: dequant, fp8, fp8_mgpu, ...), "
                               "with the fake-quant student's noise; needs --ptq-store or --init-checkpoint")
    export = action_parser(sub, "dmd2", "export",
                           "Write a W4A4 run's latest generator as a quantized checkpoint folder (kroquant generate).",
                           (EXAMPLES[5].split(" ", 1)[1],))
    export.add_argument("--run", required=True, help="training folder of a W4A4 generator (--ptq-store or "
                        "--init-checkpoint)")
    export.add_argument("--out", required=True, help="quantized checkpoint folder to write")
    export.add_argument("--overwrite", action="store_true", help="replace --out when it exists and is not empty")
    export.add_argument("--teacher", default=None, help="diffusers PixArt directory (default: the one the run's last "
                        "training call recorded)")
    moved = export.add_mutually_exclusive_group()
    moved.add_argument("--ptq-store", default=None, help="where the run's PTQ store is now, if it moved (default: the "
                       "path the run recorded; its SHA-256 must match the run's)")
    moved.add_argument("--init-checkpoint", default=None, help="where the run's initial checkpoint folder is now, if "
                       "it moved (default: the recorded path; its SHA-256 must match the run's)")
    return parser.parse_args(argv)


#: DMD2Config's fields as the train flags that set them (its errors are reported by flag).
CONFIG_FLAGS = {"num_steps": "--num-steps", "guidance": "--guidance", "dm_sigma_min": "--dm-sigma-range",
                "dm_sigma_max": "--dm-sigma-range", "guidance_sigma_range": "--guidance-sigma-range",
                "fake_updates_per_generator": "--ratio", "generator_lr": "--generator-lr", "fake_lr": "--fake-lr",
                "gan_generator_weight": "--gan-generator-weight", "gan_max_sigma": "--gan-max-sigma",
                "gan_discriminator_weight": "--gan-discriminator-weight", "fake_warmup": "--fake-warmup",
                "fake_sigma_sampling": "--fake-sigma-sampling"}


def config_from(args: argparse.Namespace) -> dmd2.DMD2Config:
    """The run's :class:`~models.dmd2.DMD2Config` from the flags; a setting it refuses is a :class:`UserError` that
    names the flags (checked before the teacher or the dataset is loaded)."""
    try:
        return _config_from(args)
    except ValueError as err:
        message = str(err).removeprefix("DMD2Config: ")
        flags = [flag for field, flag in CONFIG_FLAGS.items() if re.search(rf"\b{field}\b", message)]
        raise UserError(f"{' / '.join(dict.fromkeys(flags)) or 'the DMD2 settings'}: {message}") from None


def _config_from(args: argparse.Namespace) -> dmd2.DMD2Config:
    extra = {}
    if args.action == "train":
        extra = dict(fake_updates_per_generator=args.ratio, generator_lr=args.generator_lr, fake_lr=args.fake_lr,
                     dm_sigma_min=args.dm_sigma_range[0], dm_sigma_max=args.dm_sigma_range[1],
                     guidance_sigma_range=tuple(args.guidance_sigma_range),
                     gan_generator_weight=args.gan_generator_weight,
                     gan_discriminator_weight=args.gan_discriminator_weight, gan_max_sigma=args.gan_max_sigma,
                     fake_warmup=args.fake_warmup, fake_sigma_sampling=args.fake_sigma_sampling)
    return dmd2.DMD2Config(num_steps=args.num_steps, guidance=args.guidance,
                           gan_feature_layer=args.gan_feature_layer, **extra)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What both actions build: the teacher, the dataset, the networks and the template training state.

    flow: the real and fake scores' network (16-bit); generator_flow: the generator's (``flow`` itself, or the W4A4
    student with ``--ptq-store`` / ``--init-checkpoint``); store: the initialisation read (None without either);
    run_key: the run folder's key (``models.dmd2.generator_key`` and, under ``"training"``,
    ``models.dmd2.training_key`` to train, the teacher's fingerprint alone to evaluate).
    """

    cfg: Any
    graphdef: Any
    teacher: Any
    dataset: Any
    flow: dmd2.FlowModel
    generator_flow: dmd2.FlowModel
    head_graphdef: Any
    config: dmd2.DMD2Config
    state: dict
    store: dmd2.PTQStore | None
    run_key: dict


def setup(args: argparse.Namespace, compute_dtype) -> Setup:
    """Teacher, dataset, the FlowModels and the template training state (the PTQ store or initial checkpoint is read
    and validated here, before anything is compiled)."""
    config = config_from(args)  # bad settings fail before anything loads
    cfg, model = families.PIXART.from_diffusers(args.teacher, "float32")
    layers = linears(model)
    if args.gan_feature_layer not in layers:
        raise KeyError(f"--gan-feature-layer {args.gan_feature_layer!r} is not a linear of {args.teacher}")
    store = None
    if args.ptq_store is not None:
        store = dmd2.load_ptq_store(args.ptq_store, model)
    elif args.init_checkpoint is not None:
        store = dmd2.load_init_checkpoint(args.init_checkpoint, model)
    graphdef, teacher = nnx.split(model)
    dataset = testbed_data.load_dataset(args.data)
    if cfg.sample_size != dataset.image_size:
        raise ValueError(f"{args.teacher}: sample_size {cfg.sample_size} != {args.data} image size "
                         f"{dataset.image_size}")
    null_context = jnp.asarray(dataset.null_context, jnp.float32)
    null_mask = jnp.asarray(dataset.null_mask, jnp.float32)
    flow = dmd2.pixart_flow_model(graphdef, null_context, null_mask, args.gan_feature_layer, compute_dtype)
    generator_flow = flow if store is None else dmd2.pixart_flow_model(graphdef, null_context, null_mask, None,
                                                                       compute_dtype, w4a4=store.w4a4)
    head = dmd2.GanHead(layers[args.gan_feature_layer].in_features, rngs=nnx.Rngs(args.seed))
    head_graphdef, head_params = nnx.split(head)
    state = dmd2.init_state(teacher, head_params, config, args.seed,
                            generator=None if store is None else store.generator)
    # the run folder's key: the generator's initialisation and, to train, every setting and input the checkpoints
    # depend on (a rerun with another one is refused, not resumed); an evaluation checks the teacher too
    if args.action == "train":
        training = dmd2.training_key(config, seed=args.seed, batch_size=args.batch_size,
                                     compute_dtype=args.compute_dtype,
                                     data=dmd2.prompt_set(dataset.split(heldout=False)), teacher=teacher)
    else:
        training = {"teacher": qad.fingerprint(teacher)}
    return Setup(cfg=cfg, graphdef=graphdef, teacher=teacher, dataset=dataset, flow=flow,
                 generator_flow=generator_flow, head_graphdef=head_graphdef, config=config, state=state, store=store,
                 run_key={**dmd2.generator_key(store), "training": training})


def cmd_train(args: argparse.Namespace) -> int:
    compute_dtype = jnp.dtype(args.compute_dtype)
    built = setup(args, compute_dtype)
    cfg, config, flow, head_graphdef = built.cfg, built.config, built.flow, built.head_graphdef
    train = built.dataset.split(heldout=False)
    n, b = train.num_examples, args.batch_size
    # the training prompts and images are an argument of the jitted programs (not constants folded into them)
    data, sample_batch = dmd2.prompt_set(train), dmd2.prompt_batches(b)
    shape = (b, cfg.in_channels, cfg.sample_size, cfg.sample_size)
    run_cycles = dmd2.make_cycle(flow, config, head_graphdef, sample_batch, shape, cycles=args.cycles_per_call,
                                 generator_model=built.generator_flow, data=data)
    warmup = (dmd2.make_fake_warmup(flow, config, head_graphdef, sample_batch, shape,
                                    generator_model=built.generator_flow, data=data) if config.fake_warmup else None)
    total = -(-args.cycles // args.cycles_per_call) * args.cycles_per_call
    state, summary = dmd2.train(run_cycles, built.state, built.teacher, args.run, total, args.cycles_per_call,
                                warmup=warmup, save_every_calls=args.save_every_calls, time_budget=args.time_budget,
                                progress=not args.no_progress, run_key=built.run_key,
                                log_extra={"config": dataclasses.asdict(config), "batch_size": b,
                                           "prompts": n, "teacher": str(args.teacher), **built.run_key})
    summary = {**summary, "batch_size": b, "generator_updates": summary["cycles"],
               "images_per_s_generator": round(summary["cycles"] * b / max(summary["elapsed_s"], 1e-9), 1)}
    print(json.dumps(summary), flush=True)
    return 0


def _noise(seed: int, indices: np.ndarray, shape: tuple[int, ...]) -> jax.Array:
    """Per-record start noise (depends on the seed and the record only)."""
    return jnp.stack([jax.random.normal(jax.random.fold_in(jax.random.key(seed), int(i)), shape, jnp.float32)
                      for i in indices])


def _check_served(args: argparse.Namespace) -> None:
    """``--served`` names a served strategy and the run has W4A4 layers to serve (checked before anything loads)."""
    if args.served is None:
        return
    if args.served not in served.strategy_names():
        raise ValueError(f"--served {args.served}: not a served strategy ({', '.join(served.strategy_names())})")
    if args.ptq_store is None and args.init_checkpoint is None:
        raise ValueError(f"--served {args.served}: needs the W4A4 run's --ptq-store or --init-checkpoint (a 16-bit "
                         "generator has no W4A4 layers to serve)")


def served_student(args: argparse.Namespace, built: Setup, out: Path):
    """The run's latest generator exported to ``out/served_checkpoint`` (replaced if present: it is this
    evaluation's output) and loaded with ``--served``'s served layers -> ``(FlowModel, params, export summary)``."""
    from models.quantized_checkpoint import load_quantized_checkpoint

    kind = "ptq_store" if args.ptq_store is not None else "init_checkpoint"
    plan = dmd2.plan_export(args.run, out / "served_checkpoint", overwrite=True,
                            init_path=args.ptq_store or args.init_checkpoint, init_kind=kind)
    summary = dmd2.export_run(plan, nnx.merge(built.graphdef, built.teacher))
    loaded = load_quantized_checkpoint(plan.out)
    overrides = loaded.served_overrides(served.ServeOptions(strategy=args.served))
    graphdef, params = nnx.split(loaded.model)
    flow = dmd2.overrides_flow_model(graphdef, jnp.asarray(built.dataset.null_context, jnp.float32),
                                     jnp.asarray(built.dataset.null_mask, jnp.float32))
    return flow, {"model": params, "overrides": overrides}, summary


def sampled_records(heldout: np.ndarray, samples: int) -> np.ndarray:
    """The training records ``dmd2 evaluate`` samples (``heldout (n,) bool``): ``samples`` of them at random (seed 0),
    in record order, or all when there are no more. Not a prefix: the records are in the font's code-point order, so
    the first ones are one corner of the training distribution the Fréchet distance compares with."""
    train_records = np.flatnonzero(~np.asarray(heldout, bool))
    chosen = np.random.default_rng(0).choice(train_records, min(samples, train_records.size), replace=False)
    return np.sort(chosen)


def cmd_evaluate(args: argparse.Namespace) -> int:
    _check_served(args)
    built = setup(args, jnp.float32)
    cfg, graphdef, teacher, dataset = built.cfg, built.graphdef, built.teacher, built.dataset
    state, cycle = dmd2.restore_state(args.run, built.state, run_key=built.run_key)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ref_images, ref_heldout, _ = emoji_metrics.load_reference_images(args.reference)
    _, class_images = emoji_metrics.glyph_classes(ref_images)
    encoder_config = emoji_metrics.EncoderConfig(steps=args.encoder_steps, batch_size=args.encoder_batch_size)
    enc_graphdef, enc_params = emoji_metrics.cached_encoder(args.encoder_dir, class_images, encoder_config,
                                                            provenance.file_digest(args.reference), progress=True)
    real_features = emoji_metrics.encoder_features(enc_graphdef, enc_params, ref_images[~ref_heldout])
    real_accuracy = emoji_metrics.caption_accuracy(
        emoji_metrics.classify(enc_graphdef, enc_params, class_images), np.arange(class_images.shape[0]))

    train_indices = sampled_records(dataset.heldout, args.samples)
    targets = emoji_metrics.class_of(dataset.images[train_indices], class_images)
    channel_shape = (cfg.in_channels, cfg.sample_size, cfg.sample_size)
    null_context = jnp.asarray(dataset.null_context, jnp.float32)
    null_mask = jnp.asarray(dataset.null_mask, jnp.float32)

    @functools.partial(jax.jit, static_argnames="guidance")
    def teacher_sample(params, noise, context, mask, guidance):
        return testbed.euler_sample(testbed.pixart_velocity_fn(nnx.merge(graphdef, params)), noise, context, mask,
                                    null_context, null_mask, args.teacher_steps, guidance)

    # the teacher with CFG (the reference system) and, as a control, unguided: one branch, the distribution the
    # student's real score targets under --guidance 1
    teacher_guidance = {"teacher": args.guidance, **({"teacher_unguided": 1.0} if args.guidance != 1.0 else {})}
    # a W4A4 init sampled as it is served without DMD2: the teacher's Euler steps, both CFG branches for a PTQ store
    # (the two-branch PTQ model), one branch for an init checkpoint (a QAD student has the guidance folded in)
    euler_guidance = {} if built.store is None else {
        "initial_w4a4_euler": args.guidance if built.store.kind == "ptq_store" else 1.0}

    @functools.partial(jax.jit, static_argnames="guidance")
    def generator_euler(params, noise, context, mask, guidance):
        def velocity_fn(x, timestep, context_, mask_):
            return built.generator_flow.apply(params, x, timestep / testbed.TIMESTEP_SCALE,
                                              {"context": context_, "mask": mask_})

        return testbed.euler_sample(velocity_fn, noise, context, mask, null_context, null_mask, args.teacher_steps,
                                    guidance)

    def student_sample(flow, params, key, cond, steps):
        return dmd2.generate(flow, params, key, cond, (cond["mask"].shape[0],) + channel_shape, steps)

    def student_jits(flow):
        return {steps: jax.jit(functools.partial(student_sample, flow, steps=steps))
                for steps in sorted(set(args.student_steps) | {args.num_steps})}

    # the untrained 16-bit student (the teacher's weights), the untrained W4A4 generator (the PTQ model) and the
    # trained student, each through its own network
    score_jits = student_jits(built.flow)
    generator_jits = score_jits if built.store is None else student_jits(built.generator_flow)
    samplers = {"untrained": (score_jits, teacher)}
    if built.store is not None:
        samplers["untrained_w4a4"] = (generator_jits, built.store.generator)
    samplers["student"] = (generator_jits, state["generator"])
    served_export = None
    if args.served is not None:  # the same student through the served layers of its exported folder
        served_flow, served_params, served_export = served_student(args, built, out)
        # compiled as kroquant generate compiles a sampler of these served layers (the strategy's XLA options)
        samplers["student_served"] = ({args.num_steps: jax.jit(
            functools.partial(student_sample, served_flow, steps=args.num_steps),
            compiler_options=served.program_compiler_options(args.served) or None)}, served_params)
    # the restored checkpoint's arrays are committed to a device, the teacher's and the store's are not, and jit
    # compiles one program per argument placement: every system's parameters are placed as the checkpoint's, so the
    # controls and the student share one compiled sampler per network and step count
    placement = jax.tree.leaves(state["generator"])[0].sharding
    samplers = {kind: (jits, jax.device_put(params, placement)) for kind, (jits, params) in samplers.items()}

    def run_system(name, seed):
        images, began = [], None
        for start in range(0, len(train_indices), args.batch_size):
            chunk = train_indices[start:start + args.batch_size]
            cond = {"context": jnp.asarray(dataset.context[chunk], jnp.float32),
                    "mask": jnp.asarray(dataset.context_mask[chunk], jnp.float32)}
            if name in teacher_guidance:
                pixels = teacher_sample(teacher, _noise(seed, chunk, channel_shape), cond["context"], cond["mask"],
                                        teacher_guidance[name])
            elif name in euler_guidance:  # the same start noise as the teacher's
                pixels = generator_euler(samplers["untrained_w4a4"][1], _noise(seed, chunk, channel_shape),
                                         cond["context"], cond["mask"], euler_guidance[name])
            else:
                kind, steps = name.split("@")
                jits, params = samplers[kind]
                pixels = jits[int(steps)](params, jax.random.fold_in(jax.random.key(seed), start), cond)
            pixels = jax.block_until_ready(pixels)
            if began is None:  # the first batch compiles; time the rest
                began = time.perf_counter()
                timed_from = len(images) + 1
            images.append(testbed.pixels_to_images(pixels))
        seconds = time.perf_counter() - began
        timed = sum(len(x) for x in images[timed_from:])
        return np.concatenate(images), (seconds / timed if timed else None)

    controls = [f"{kind}@{args.num_steps}" for kind in samplers if kind not in ("student", "student_served")]
    served_systems = [] if served_export is None else [f"student_served@{args.num_steps}"]
    systems = ([*teacher_guidance, *euler_guidance, *controls] + [f"student@{s}" for s in args.student_steps]
               + served_systems)
    euler_systems = {**teacher_guidance, **euler_guidance}  # sampled with --teacher-steps Euler steps
    samples, report = {}, {"systems": {}}
    pool = dataset.images.astype(np.float32) / 255
    bases = [testbed_data.base_sequence(testbed_data.text_to_sequence(s)) for s in dataset.sequences]
    teacher_features = None
    for name in systems:
        first, per_image_s = run_system(name, args.seed)
        second, _ = run_system(name, args.seed + 1)
        samples[name] = first
        metrics = emoji_metrics.sample_metrics(enc_graphdef, enc_params, first, targets, real_features,
                                               teacher_features)
        features = np.stack([emoji_metrics.encoder_features(enc_graphdef, enc_params, x) for x in (first, second)])
        if name == "teacher":
            teacher_features = features[0]
        outcomes = collections.Counter(emoji_metrics.nearest_outcome(image, int(i), dataset, pool, bases)[0]
                                       for image, i in zip(first[:args.nearest], train_indices[:args.nearest]))
        steps = args.teacher_steps if name in euler_systems else int(name.split("@")[1])
        report["systems"][name] = {
            **metrics, "seed_diversity": emoji_metrics.seed_diversity(features, real_features),
            "nearest": {o: outcomes[o] for o in emoji_metrics.OUTCOMES},
            "forward_passes_per_image": dmd2.forward_passes_per_image(steps, euler_systems.get(name, 1.0)),
            "wall_s_per_image": per_image_s}
        print(name, json.dumps(report["systems"][name]), flush=True)
    for name in served_systems:  # the served student against the fake-quant one: same noise, same weights
        simulated = samples.get(f"student@{args.num_steps}")
        if simulated is None:
            simulated, _ = run_system(f"student@{args.num_steps}", args.seed)
        served_images, fake_images = samples[name].astype(np.float32) / 255, simulated.astype(np.float32) / 255
        per_image = image_metrics.psnr(served_images, fake_images)
        pooled_mse = float(np.mean((served_images - fake_images) ** 2))
        row = report["systems"][name]
        # the mean over images counts an identical image (inf) as 99 dB, as the QAD tables do, so it moves with the
        # share of identical images; the PSNR of the pooled squared error and that share say what it is made of
        row["psnr_vs_fake_quant_db"] = float(np.mean(np.minimum(per_image, 99.0)))
        row["psnr_vs_fake_quant_pooled_db"] = float("inf") if pooled_mse == 0 else float(-10 * np.log10(pooled_mse))
        row["identical_to_fake_quant_fraction"] = float(np.mean(np.isinf(per_image)))
        print(name, "PSNR vs the fake-quant student (dB): mean over images", row["psnr_vs_fake_quant_db"],
              "(identical images counted as 99 dB:", f"{row['identical_to_fake_quant_fraction']:.3f} of them), pooled",
              row["psnr_vs_fake_quant_pooled_db"], flush=True)
    teacher_fd = report["systems"]["teacher"]["fd_real"]
    for name, row in report["systems"].items():
        row["fd_ratio_vs_teacher"] = row["fd_real"] / teacher_fd
    report["settings"] = {
        "teacher": str(args.teacher), "data": str(args.data), "reference": str(args.reference),
        "samples": int(len(train_indices)), "teacher_steps": args.teacher_steps, "guidance": args.guidance,
        "student_cycles": cycle, "fake_updates": int(state["step"]), "seeds": [args.seed, args.seed + 1],
        "encoder_top1_on_real_glyphs": real_accuracy, "classes": int(class_images.shape[0]),
        "real_reference_images": int(real_features.shape[0]), "jax": jax.__version__,
        "device": str(jax.devices()[0]), "generator_forward": "16-bit" if built.store is None else
        f"W4A4 {built.store.w4a4.quant.fmt} fake quant (STE), one branch",
        "evaluation_compute_dtype": "float32", **built.run_key}  # every network here; training's is in the run key
    if served_export is not None:
        report["settings"]["served"] = {"strategy": args.served, "checkpoint": served_export["out"],
                                        "xla_options": served.program_compiler_options(args.served),
                                        "cycle": served_export["cycle"], "layers": served_export["layers"]}
    atomic_write_json(out / "report.json", report)
    rows_idx = np.arange(min(args.grid_rows, len(train_indices)))
    rows = [[dataset.images[train_indices[k]]] + [samples[name][k] for name in systems] for k in rows_idx]
    init_title = "PTQ" if built.store is None or built.store.kind == "ptq_store" else "initial"
    control_titles = {"untrained": f"untrained {args.num_steps}",
                      "untrained_w4a4": f"{init_title} W4A4 {args.num_steps}"}
    teacher_titles = [f"teacher {args.teacher_steps}x{dmd2.forward_passes_per_image(1, g)}"
                      + ("" if name == "teacher" else " CFG 1") for name, g in teacher_guidance.items()]
    euler_titles = [f"{init_title} W4A4 {args.teacher_steps}x{dmd2.forward_passes_per_image(1, g)}"
                    for g in euler_guidance.values()]
    titles = (["dataset", *teacher_titles, *euler_titles] + [control_titles[c.split("@")[0]] for c in controls]
              + [f"DMD2 {s}" for s in args.student_steps] + [f"DMD2 {args.num_steps} {args.served}"
                                                             for _ in served_systems])
    student = "DMD2 student" if built.store is None else "W4A4 DMD2 student"
    testbed.save_caption_grid(str(out / "grid.png"), [str(dataset.captions[train_indices[k]]) for k in rows_idx],
                              rows, titles, title=f"teacher (Euler, CFG {args.guidance:g}) vs {student} "
                                                  f"({cycle} generator updates)")
    print(json.dumps(report["settings"]), flush=True)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``kroquant dmd2 export``: validated (run, key, checkpoint, --out) before the teacher is loaded."""
    moved_kind = "ptq_store" if args.ptq_store is not None else "init_checkpoint" if args.init_checkpoint else None
    plan = dmd2.plan_export(args.run, args.out, args.overwrite, init_path=args.ptq_store or args.init_checkpoint,
                            init_kind=moved_kind)
    teacher = args.teacher or plan.teacher or str(DEFAULT_TEACHER)
    if not Path(teacher).is_dir():
        raise ValueError(f"--teacher {teacher}: no such folder (the run recorded {plan.teacher!r})")
    _, model = families.PIXART.from_diffusers(teacher, "float32")
    print(json.dumps(dmd2.export_run(plan, model)), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.action == "export":
        return cmd_export(args)
    if args.action == "reference":
        data = testbed_data.load_dataset(args.data)
        emoji_metrics.write_reference_images(args.out, data.images, data.heldout, data.sequences)
        return 0
    return cmd_train(args) if args.action == "train" else cmd_evaluate(args)


if __name__ == "__main__":
    sys.exit(main())

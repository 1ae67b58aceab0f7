"""Quantization-aware distillation of the emoji testbed DiT, CFG folded into one branch (``models.qad``), and its
evaluation against the 16-bit teacher with CFG, the two-branch PTQ W4A4 model and the seed's two controls.

    kroquant qad --out runs/qad --data runs/qad_data/emoji32_qad.npz \\
        --ptq-store runs/ptq_svd/qlayers/svdquant-<hash> --steps 1000

Variants (each trained in its own run folder ``--out``/runs/<name>, resumable, keyed by its settings):

* ``qad_16bit``: the seed's QAD, student initialised from the 16-bit weights (RTN W4A4 at step 0);
* ``qad_ptq``: the student initialised from the calibrated PTQ layers of ``--ptq-store`` (any recipe);
* ``naive_16bit``: the seed's naive distillation (``naive=True``: no gradient through the weight quantizers, so the
  quantized weights stay frozen; the activations keep ``--ste``'s rule; ``models.qad``).
* ``naive_ptq``: the naive distillation from the PTQ layers (not run by default).
* ``distill_16bit``: the control of what one branch can fold at all: the same loss, data and steps with no
  quantization (every weight trained in 16 bits; not run by default). Its held-out PSNR bounds what a one-branch
  student of this model reaches, so it separates the cost of folding CFG from the cost of 4 bits. Its export is a
  16-bit diffusers folder (``models.qad.export_unquantized_student``), not a quantized one.

Evaluation: held-out captions (never trained on) and training captions that QAD did not train on, several seeds
each, 20 Euler steps; the reference is the 16-bit teacher with CFG; the PTQ models run both branches with CFG, the
students one branch at guidance 1. Writes ``qad_report.json``, ``qad_table.md``, ``qad_grid.png``,
``qad_curves.png`` in ``--out``.

Selection: every ``--curve-every`` steps the one-branch student is scored on ``--validation-captions`` further
held-out captions (neither trained on nor evaluated); ``--select-best`` evaluates each student at its best-scoring
iterate (``models.qad.BestIterate``, kept in its run folder) instead of the last, and the table names the step.

Two-stage start: ``--student-init DIR`` (a one-branch 16-bit student of ``--checkpoint``, e.g. ``distill_16bit``'s
export) gives the students that folder's weights instead of the teacher's; the teacher, its targets and reference
images stay ``--checkpoint``'s. ``--ptq-store`` layers must then be calibrated on that student, and the RTN / PTQ
baselines run one branch on its weights (a column "16-bit student init, one branch" shows the start itself).

Export: ``--export-dir DIR`` writes each trained student (the iterate evaluated: its best with ``--select-best``,
else its last) as a quantized checkpoint folder ``DIR/<variant>`` (``models.qad.export_student_checkpoint``: its
trained 16-bit rest and packed W4A4 layers), which ``kroquant generate`` serves (one branch, guidance 1) and
``kroquant dmd2 train --init-checkpoint`` starts from. An existing non-empty ``DIR/<variant>`` is refused before
any work unless ``--overwrite-export``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kroquant_jax.fileio import atomic_path, atomic_write_text
from models import convert, families, pixart, qad
from models.testbed import model as testbed
from models.testbed import data as testbed_data
from models.testbed.evaluation import image_metrics_of, psnr_text, seed_image_metrics
from scripts.common_args import nonnegative_int, positive_int, require_paths, verb_parser

REPO = Path(__file__).resolve().parents[1]


VARIANTS = ("qad_16bit", "qad_ptq", "naive_16bit", "naive_ptq", "distill_16bit")
UNQUANTIZED = "distill_16bit"  # the one-branch student without quantization: no W4A4 layers, every weight trained
EXAMPLES = ("--out runs/qad --data runs/qad_data/emoji32_qad.npz --ptq-store runs/ptq_svd/qlayers/svdquant-HASH "
            "--steps 1000",
            "--out runs/qad_quick --data runs/qad_data/emoji32_qad.npz --variants qad_16bit --train-seconds 300",
            "--out runs/qad --data runs/qad_data/emoji32_qad.npz --ptq-store runs/ptq_svd/qlayers/svdquant-HASH "
            "--variants qad_ptq --select-best --export-dir runs/qad/export")


def parse_args(argv=None) -> argparse.Namespace:
    """The options of ``kroquant qad``."""
    p = verb_parser("qad", __doc__, EXAMPLES)
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "emoji_pixart"),
                   help="diffusers PixArt directory of the 16-bit teacher")
    p.add_argument("--data", required=True, help="training records (.npz of kroquant build-emoji-dataset)")
    p.add_argument("--prompts", default=None, help="evaluation captions (default <checkpoint>/testbed_prompts.npz)")
    p.add_argument("--out", required=True, help="output folder (run folders, report, table, images)")
    p.add_argument("--ptq-store", nargs="+", default=[],
                   help="QLinearStore folders of calibrated PTQ models: each is evaluated with CFG (two branches); "
                        "qad_ptq / naive_ptq start from the first")
    p.add_argument("--ptq-name", nargs="+", default=None,
                   help="the PTQ recipes' names in the tables, one per --ptq-store (default: each folder's name "
                        "without its hash, e.g. svdquant)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:3]),
                   help="students trained: qad_ or naive_ (quantized weights frozen: no gradient through their "
                        "quantizers), from _16bit (the 16-bit weights) or _ptq (the layers of --ptq-store); "
                        "distill_16bit: the same distillation without quantization (the control of what one branch "
                        "can fold)")
    p.add_argument("--fmt", choices=sorted(qad.FORMATS), default="mxfp4", help="W4A4 format of the students")
    p.add_argument("--ste", choices=("identity", "clipped"), default="identity", help="STE of the QAD students")
    p.add_argument("--steps", type=positive_int, default=1000, help="training steps per variant")
    p.add_argument("--batch-size", type=positive_int, default=128, help="training records per step")
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate")
    p.add_argument("--warmup", type=nonnegative_int, default=50, help="linear learning-rate warm-up steps")
    p.add_argument("--fm-weight", type=float, default=0.25, help="weight of the flow-matching loss on real images")
    p.add_argument("--guidance", type=float, nargs=2, default=[3.0, 3.0], metavar=("NOISY", "CLEAN"),
                   help="teacher schedule w(sigma): NOISY over sigma >= 0.4, CLEAN below 0.1 (default constant 3, "
                        "the testbed's CFG, so the students aim at the reference images)")
    p.add_argument("--train-seconds", type=float, default=None,
                   help="stop each variant's training after this many seconds (resumable; steps reached reported)")
    p.add_argument("--chunk", type=positive_int, default=50, help="training steps per compiled call")
    p.add_argument("--save-every", type=positive_int, default=500, help="checkpoint every N steps")
    p.add_argument("--sample-steps", type=positive_int, default=20, help="Euler steps of the evaluation samples")
    p.add_argument("--eval-captions", type=positive_int, default=24, help="held-out captions evaluated")
    p.add_argument("--eval-train-captions", type=positive_int, default=16,
                   help="training captions evaluated (none of them trained on)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1000, 2000, 3000], help="noise seeds of the evaluation")
    p.add_argument("--curve-every", type=positive_int, default=100,
                   help="validation PSNR every N steps (a multiple of --chunk), for the curves and --select-best")
    p.add_argument("--validation-captions", type=positive_int, default=8,
                   help="held-out captions after the evaluated ones (never trained on, never evaluated) that score "
                        "the one-branch student during training, with the first seed")
    p.add_argument("--select-best", action="store_true",
                   help="evaluate each student at its best validation iterate (kept on disk, resumable) instead of "
                        "its last")
    p.add_argument("--student-init", default=None,
                   help="diffusers folder of a one-branch 16-bit student of --checkpoint (e.g. --variants "
                        "distill_16bit's --export-dir): the students start from its weights instead of the teacher's; "
                        "--ptq-store layers must be calibrated on it, and the RTN / PTQ baselines run one branch")
    p.add_argument("--export-dir", default=None,
                   help="write each trained student (its evaluated iterate) as a quantized checkpoint folder "
                        "DIR/<variant> (kroquant generate; kroquant dmd2 train --init-checkpoint)")
    p.add_argument("--overwrite-export", action="store_true",
                   help="replace existing non-empty --export-dir/<variant> folders")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def _inputs(dataset, indices):
    return (jnp.asarray(dataset.context[indices], jnp.float32), jnp.asarray(dataset.context_mask[indices], jnp.float32))


def main(argv=None) -> int:
    from kroquant_jax.qlinear import QLinearStore

    args = parse_args(argv)
    out = Path(args.out)
    for flag, value in (("--steps", args.steps), ("--save-every", args.save_every)):
        if value % args.chunk:
            raise ValueError(f"{flag} {value} must be a multiple of --chunk {args.chunk} (training runs in compiled "
                             "chunks of that many steps)")
    if args.curve_every % args.chunk:
        raise ValueError(f"--curve-every {args.curve_every} must be a multiple of --chunk {args.chunk} (the student is "
                         "scored between compiled chunks)")
    ptq_variants = [v for v in args.variants if v.endswith("_ptq")]
    if ptq_variants and not args.ptq_store:
        given = "--variants" in (argv if argv is not None else sys.argv[1:])
        raise ValueError(f"--variants {' '.join(ptq_variants)}{'' if given else ' (of the default variants)'} "
                         "need --ptq-store (a calibrated QLinearStore folder), or name --variants without them")
    names = args.ptq_name or [Path(folder).name.rsplit("-", 1)[0] for folder in args.ptq_store]
    if len(names) != len(args.ptq_store) or len(set(names)) != len(names):
        raise ValueError(f"--ptq-name {names} must give one distinct name per --ptq-store ({len(args.ptq_store)})")
    for folder in args.ptq_store:
        if not Path(folder).is_dir():
            raise ValueError(f"--ptq-store {folder}: no such folder")
    if args.student_init is not None and not (Path(args.student_init) / "config.json").is_file():
        raise ValueError(f"--student-init {args.student_init}: not a diffusers folder (no config.json)")
    exports = {} if args.export_dir is None else {
        v: qad.check_export_dir(Path(args.export_dir) / v, args.overwrite_export, "--export-dir",
                                "--overwrite-export") for v in args.variants}
    require_paths(("--checkpoint", args.checkpoint), ("--prompts", args.prompts))
    prompts = testbed_data.load_dataset(args.prompts or str(Path(args.checkpoint) / "testbed_prompts.npz"))
    all_heldout = np.flatnonzero(prompts.heldout)
    if len(all_heldout) < args.eval_captions + args.validation_captions:
        raise ValueError(f"--eval-captions {args.eval_captions} + --validation-captions {args.validation_captions}: "
                         f"the prompts have only {len(all_heldout)} held-out captions")
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    cfg, teacher = families.PIXART.from_diffusers(args.checkpoint, "float32")
    student_model = teacher  # the student starts from the teacher's weights (its copy is trained) ...
    if args.student_init is not None:  # ... or from a one-branch student's, e.g. a CFG-folded 16-bit one
        differ = families.differing_fields(cfg, families.PIXART.config_from_diffusers(
            convert.read_diffusers_config(args.student_init)))  # its config.json, before its weights
        if differ:
            raise ValueError(f"--student-init {args.student_init}: not a model of --checkpoint {args.checkpoint} "
                             f"(config differs in {differ})")
        _, student_model = families.PIXART.from_diffusers(args.student_init, "float32")
    heldout = all_heldout[:args.eval_captions]
    validation = all_heldout[args.eval_captions:args.eval_captions + args.validation_captions]
    last = args.eval_captions + len(validation) - 1
    captions_key = qad.fingerprint({"context": prompts.context[validation], "mask": prompts.context_mask[validation]})
    selection = (f"validation PSNR: held-out captions {args.eval_captions}..{last} ({captions_key[:12]}), "
                 f"seed {args.seeds[0]}, {args.sample_steps} Euler steps")
    # opened before the setup: a run folder whose best iterate was selected by another measure is refused now
    bests = {v: qad.BestIterate(out / "runs" / v, selection) for v in args.variants} if args.select_best else {}
    for variant, best in bests.items():
        if best.step is None and qad.latest_checkpoint(out / "runs" / variant / "checkpoints") is not None:
            raise ValueError(f"{out / 'runs' / variant}: trained without --select-best, so its earlier iterates were "
                             "not kept; use another --out or drop --select-best")
    train_eval = np.flatnonzero(~prompts.heldout)[32:32 + args.eval_train_captions]  # not eval_testbed's calibration
    # training records: the training split of --data, minus every caption evaluated here
    full = testbed_data.load_dataset(args.data)
    banned = set(prompts.captions[heldout]) | set(prompts.captions[train_eval]) | set(prompts.captions[validation])
    keep = np.flatnonzero(~full.heldout & ~np.isin(full.captions, list(banned)))
    data = {"images": jnp.asarray(full.images[keep]), "context": jnp.asarray(full.context[keep]),
            "context_mask": jnp.asarray(full.context_mask[keep]), "null_context": jnp.asarray(full.null_context),
            "null_mask": jnp.asarray(full.null_mask)}
    null_context = jnp.asarray(prompts.null_context, jnp.float32)
    null_mask = jnp.asarray(prompts.null_mask, jnp.float32)
    schedule = qad.GuidanceSchedule(noisy=args.guidance[0], clean=args.guidance[1])
    base = qad.QADConfig(fmt=args.fmt, ste=args.ste, fm_weight=args.fm_weight, schedule=schedule, lr=args.lr,
                         warmup=args.warmup, batch_size=args.batch_size, steps=args.steps, chunk=args.chunk,
                         save_every=args.save_every)
    teacher_graph, teacher_state = nnx.split(teacher)
    student_graph, student_state = nnx.split(student_model)
    # the baselines' layers belong to the teacher (run with CFG, two branches) or to a one-branch student (one branch)
    baseline_cfg = args.student_init is None
    size = cfg.sample_size

    # the PTQ layers and the inits (the 16-bit init gets the PTQ rank as an all-zero branch: same compiled step)
    ptq_models = {}
    for name, folder in zip(names, args.ptq_store):
        try:  # the student quantizes with --fmt: a store in another format is refused, not silently re-rounded
            qlayers = QLinearStore(folder).load_all()
            ptq_models[name] = qad.student_from_qlinears(student_model, qlayers, fmt=base.quant_format)
        except ValueError as err:
            raise ValueError(f"--ptq-store {folder} (--fmt {args.fmt}): {err}") from None
    ptq_name, ptq = next(iter(ptq_models.items())) if ptq_models else ("ptq", None)
    rank = 0 if ptq is None else next(iter(ptq[0].values()))["left"].shape[1]
    block = 1 if ptq is None else next(iter(ptq[1].values())).shape[-1]
    rtn_layers, rtn_blocks = qad.student_from_model(student_model, rank=rank, block=block)
    inits = {"16bit": (rtn_layers, rtn_blocks, False), "unquantized": ({}, {}, False)}
    if ptq is not None:
        inits["ptq"] = ptq

    captions = np.concatenate([heldout, train_eval])
    held = slice(0, len(heldout))

    def noise_for(seed):
        return qad.record_noise(seed, captions, (cfg.in_channels, size, size))

    context, mask = _inputs(prompts, captions)

    teacher_sample = qad.teacher_sampler(teacher_graph, null_context, null_mask, args.sample_steps, schedule)

    def teacher_images(noise):
        return teacher_sample(teacher_state, noise, context, mask)

    def quantized_velocity(config, trainable, blocks, packed):
        return lambda x, t, c, m: qad.student_velocity(student_graph, trainable, blocks, config, packed, x, t, c, m)

    def cfg_images(trainable, blocks, packed, noise, context, mask):
        fn = quantized_velocity(base, trainable, blocks, packed)
        return qad.guided_sample(fn, noise, context, mask, null_context, null_mask, args.sample_steps, schedule)

    cfg_images = jax.jit(cfg_images, static_argnums=2)

    def one_branch(trainable, blocks, packed, noise, context, mask):
        return qad.student_sample(quantized_velocity(base, trainable, blocks, packed), noise, context, mask,
                                  args.sample_steps)

    one_branch = jax.jit(one_branch, static_argnums=2)

    def images(pixels):
        return testbed.pixels_to_images(pixels)

    reference = {s: images(teacher_images(noise_for(s))) for s in args.seeds}
    columns = {"16-bit CFG (teacher)": reference}
    passes = {"16-bit CFG (teacher)": 2 * args.sample_steps}
    if not baseline_cfg:  # the student's own start, before any quantization
        title = "16-bit student init, one branch"
        columns[title] = {s: images(one_branch({"model": student_state, "layers": {}}, {}, False, noise_for(s),
                                               context, mask)) for s in args.seeds}
        passes[title] = args.sample_steps
    baseline_titles = {}
    for name, (layers, blocks, packed) in {"rtn": inits["16bit"], **ptq_models}.items():
        trainable = {"model": student_state, "layers": jax.tree.map(jnp.asarray, layers)}
        title = baseline_titles[name] = f"{name} W4A4 CFG" if baseline_cfg else f"{name} W4A4, one branch"
        sampler = cfg_images if baseline_cfg else one_branch
        columns[title] = {s: images(sampler(trainable, blocks, packed, noise_for(s), context, mask))
                          for s in args.seeds}
        passes[title] = (2 if baseline_cfg else 1) * args.sample_steps
    if ptq is not None:
        title = baseline_titles[ptq_name]
        columns[f"{ptq_name} + colour correction"] = {
            s: np.concatenate([qad.colour_correct(columns[title][s][held], reference[s][held]),
                               qad.colour_correct(columns[title][s][len(heldout):], reference[s][len(heldout):])])
            for s in args.seeds}
        passes[f"{ptq_name} + colour correction"] = passes[title]
    setup_s = time.perf_counter() - began
    print(f"setup (reference and PTQ images): {setup_s:.0f} s", flush=True)

    # the validation captions: score the students during training (curves, --select-best), never reported as results
    curve_noise = qad.record_noise(args.seeds[0], validation, (cfg.in_channels, size, size))
    curve_ctx, curve_mask = _inputs(prompts, validation)
    curve_ref = images(teacher_sample(teacher_state, curve_noise, curve_ctx, curve_mask))
    training = {}
    def write_all():
        """Images, metrics, report, table, grid and curves of what is done so far (rewritten after each stage)."""
        with atomic_path(str(out / "qad_images.npz"), suffix=".npz") as temporary:  # the images, before any metric
            np.savez_compressed(temporary, titles=np.array(list(columns)), seeds=np.array(args.seeds),
                                **{f"column{k}_seed{s}": by_seed[s] for k, by_seed in enumerate(columns.values())
                                   for s in args.seeds})
        atomic_write_text(out / "qad_training.json", json.dumps(training))
        # metrics: every image of every seed against the teacher's image of the same caption and seed; the PSNR's
        # standard error is over the captions (their means over seeds), as kroquant evaluate reports it
        results = {}
        for title, by_seed in columns.items():
            entry = {"forward_passes_per_image": passes[title]}
            for split, part in (("heldout", held), ("train", slice(len(heldout), None))):
                entry[split] = column_metrics(by_seed, reference, args.seeds, part)
            results[title] = entry
        report = {"settings": vars(args), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                  "train_records": int(len(keep)), "heldout_captions": [str(c) for c in prompts.captions[heldout]],
                  "train_eval_captions": [str(c) for c in prompts.captions[train_eval]],
                  "validation_captions": [str(c) for c in prompts.captions[validation]], "setup_s": round(setup_s, 1),
                  "total_s": round(time.perf_counter() - began, 1), "results": results, "training": training,
                  "schedule": schedule.label()}
        atomic_write_text(out / "qad_report.json", json.dumps(report, indent=1))
        atomic_write_text(out / "qad_table.md", table(report))
        rows = min(12, len(heldout))
        titles = list(columns)
        seed = args.seeds[0]
        testbed.save_caption_grid(str(out / "qad_grid.png"), [str(c) for c in prompts.captions[heldout[:rows]]],
                                  [[columns[t][seed][k] for t in titles] for k in range(rows)], titles,
                                  title=f"held-out captions, seed {seed}: teacher"
                                        f"{'/PTQ' if baseline_cfg else ''} with CFG (2 branches),\n"
                                        f"{'' if baseline_cfg else 'PTQ of the 16-bit student and '}"
                                        f"students at guidance 1 (1 branch), {args.fmt.upper()} W4A4"
                                        + (f" ({UNQUANTIZED}: 16-bit)" if UNQUANTIZED in columns else ""))
        curves(out / "qad_curves.png", training)
        return report

    for variant in args.variants:
        init = "ptq" if variant.endswith("_ptq") else "unquantized" if variant == UNQUANTIZED else "16bit"
        layers, blocks, packed = inits[init]
        config = dataclasses.replace(base, naive=True) if variant.startswith("naive") else base
        chunk = qad.make_train_chunk(student_graph, teacher_graph, teacher_state, blocks, config, packed, data)
        state = qad.init_state(student_state, layers, config)
        key_extra = {"init": init if init != "ptq" else f"{ptq_name}:{qad.fingerprint(layers)}",
                     "data": qad.fingerprint(data), "teacher": qad.fingerprint(teacher_state),
                     **({} if args.student_init is None else {"student_init": qad.fingerprint(student_state)})}

        run_dir = out / "runs" / variant
        best = bests.get(variant)

        def on_chunk(step, state, record, blocks=blocks, packed=packed, best=best):
            if step % args.curve_every == 0:
                got = images(one_branch(state["trainable"], blocks, packed, curve_noise, curve_ctx, curve_mask))
                record["validation_psnr_db"] = image_metrics_of(got, curve_ref)["psnr_db"]
                if best is not None:
                    best.offer(step, state["trainable"], record["validation_psnr_db"])

        # the run folder's key first: the init offered to a BestIterate below must not replace the best iterate of a
        # folder trained with other settings, which qad.train would refuse only afterwards
        qad.check_run_folder(run_dir, config, key_extra)
        init_psnr = image_metrics_of(images(one_branch(state["trainable"], blocks, packed, curve_noise, curve_ctx,
                                                       curve_mask)), curve_ref)["psnr_db"]
        if best is not None:
            best.offer(0, state["trainable"], init_psnr)  # the init competes too
        t0 = time.perf_counter()
        state, records = qad.train(run_dir, chunk, state, config, key_extra,
                                   progress=not args.no_progress, on_chunk=on_chunk, time_budget=args.train_seconds)
        train_s = time.perf_counter() - t0
        log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
        trainable = state["trainable"] if best is None else best.trainable(state["trainable"])
        training[variant] = {"train_s_this_call": round(train_s, 1), "steps": int(state["step"]), "log": log,
                             "config": config.to_json(), "init": init, "init_validation_psnr_db": init_psnr,
                             "selected_step": int(state["step"]) if best is None else best.step,
                             "selected_by": "last iterate" if best is None else selection}
        if variant in exports and variant == UNQUANTIZED:
            prompts_file = Path(args.prompts or Path(args.checkpoint) / "testbed_prompts.npz")
            qad.export_unquantized_student(
                exports[variant], student_graph, trainable["model"], prompts=prompts_file,
                extra={"trained_by": "kroquant qad", "variant": variant, "step": training[variant]["selected_step"],
                       "selected_by": training[variant]["selected_by"],
                       "teacher": str(Path(args.checkpoint).absolute()), "teacher_fingerprint": key_extra["teacher"],
                       "data": key_extra["data"],
                       "steps": args.sample_steps, "config": config.to_json()})
            training[variant]["export"] = str(exports[variant])
        elif variant in exports:
            init_folder = None if init == "16bit" else str(Path(args.ptq_store[0]).absolute())
            qad.export_student_checkpoint(
                exports[variant], student_graph, trainable, blocks, config, packed, recipe_name=variant,
                recipe=config, extra={"trained_by": "kroquant qad", "variant": variant,
                                      "step": training[variant]["selected_step"],
                                      "selected_by": training[variant]["selected_by"], "init": key_extra["init"],
                                      "ptq_store": init_folder, "teacher": str(Path(args.checkpoint).absolute()),
                                      "teacher_fingerprint": key_extra["teacher"], "data": key_extra["data"],
                                      "steps": args.sample_steps, "student_init": None if args.student_init is None
                                      else str(Path(args.student_init).absolute())})
            training[variant]["export"] = str(exports[variant])
        columns[variant] = {s: images(one_branch(trainable, blocks, packed, noise_for(s), context, mask))
                            for s in args.seeds}
        passes[variant] = args.sample_steps
        print(f"{variant}: {int(state['step'])} steps in {train_s:.0f} s, last loss {log[-1]['loss']:.4f}; "
              f"evaluated at step {training[variant]['selected_step']}", flush=True)
        write_all()

    report = write_all()
    print(table(report), flush=True)
    return 0


def column_metrics(by_seed: dict, reference: dict, seeds, part) -> dict:
    """A column's images ``by_seed[s] (captions, s, s, 3) uint8`` against the teacher's (``reference[s]``), captions
    ``part`` of each seed: ``seed_image_metrics`` (PSNR's standard error over the captions' means over seeds), with
    ``psnr_db_per_seed`` also for one seed."""
    got = np.stack([by_seed[s][part] for s in seeds])  # (S, n, s, s, 3)
    ref = np.stack([reference[s][part] for s in seeds])
    metrics = seed_image_metrics(got, ref)
    return {"psnr_db_per_seed": [metrics["psnr_db"]], **metrics}


def table(report: dict) -> str:
    lines = [f"{report['device']}, jax {report['jax']}; teacher {report['schedule']}; "
             f"{len(report['heldout_captions'])} held-out + {len(report['train_eval_captions'])} training captions "
             f"(not trained on) x seeds {report['settings']['seeds']}; metrics vs the teacher's image", "",
             "| model | forward passes / image | held-out PSNR (dB ± s.e. over captions) | held-out SSIM "
             "| chroma ratio | saturation ratio | train-caption PSNR (dB ± s.e.) | train-caption SSIM |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for title, r in report["results"].items():
        h, t = r["heldout"], r["train"]
        trained = report["training"].get(title)
        if trained is not None and trained.get("selected_step") not in (None, trained["steps"]):
            title = f"{title} (best validation iterate: step {trained['selected_step']} of {trained['steps']})"
        lines.append(f"| {title} | {r['forward_passes_per_image']} | {psnr_text(h)} | "
                     f"{h['ssim']:.3f} | {h['chroma_ratio']:.3f} | {h['saturation_ratio']:.3f} | "
                     f"{psnr_text(t)} | {t['ssim']:.3f} |")
    return "\n".join(lines) + "\n"


def curves(path: Path, training: dict) -> None:
    """Loss (distillation and total) and the validation PSNR of the one-branch student over steps, per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for variant, t in training.items():
        steps = [r["step"] for r in t["log"]]
        left.plot(steps, [r["distill"] for r in t["log"]], label=f"{variant} distill")
        points = [(0, t["init_validation_psnr_db"])] + [(r["step"], r["validation_psnr_db"]) for r in t["log"]
                                                        if "validation_psnr_db" in r]
        if points:
            right.plot(*zip(*points), marker="o", label=variant)
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("distillation MSE (chunk mean)")
    right.set_xlabel("step")
    right.set_ylabel("validation PSNR vs teacher CFG (dB)")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    figure.tight_layout()
    try:
        with atomic_path(str(path), suffix=".png") as temporary:
            figure.savefig(temporary, dpi=110)
    finally:
        plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())

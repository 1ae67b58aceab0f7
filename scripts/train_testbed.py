"""Train the emoji testbed DiT (pixel-space PixArt-Σ, flow matching) in JAX and export a diffusers checkpoint.

    kroquant build-emoji-dataset --out data/emoji32.npz
    kroquant train-testbed --data data/emoji32.npz --run runs/testbed --export checkpoints/emoji_pixart \
        --steps 20000 --time-budget 330

Objective, sampler and model: see ``models/testbed/model.py``, the training step ``models/testbed/training.py``, and
docs/testbed.md. Parameters are fp32 (AdamW with warmup, then constant learning rate, gradient clipping), the
forward/backward pass runs in ``--compute-dtype`` (bf16 by default), and an exponential moving average (EMA) of the
parameters is what gets exported (fp16 safetensors).

Training stops at ``--steps`` or when ``--time-budget`` seconds have passed, whichever comes first; the training
state (parameters, EMA, optimizer, step, PRNG key) is saved to ``<run>/train_state.npz`` every ``--save-every``
steps and at the end (atomic writes), and a later run with the same ``--run`` resumes from it. The run folder is keyed
by ``<run>/train_run.json`` (:func:`run_key`: the training split's content, the architecture, the seed and every
optimisation setting): a folder whose state was trained with another dataset or settings, or before runs were keyed,
is refused in one line naming each setting's old -> new value. ``--steps``, ``--time-budget``, ``--chunk`` (the keys
live in the state: any chunking gives the same steps), ``--save-every`` and the export and sampling flags are not in
the key: a rerun may train further or export differently.
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
from tqdm import tqdm

from kroquant_jax import provenance
from kroquant_jax.fileio import atomic_append_text, atomic_path
from models import families
from models.testbed import data as testbed_data
from models.testbed import model as testbed
from models.testbed.training import (build_model, load_train_state, make_optimizer, make_train_chunk,
                                     sample_captions, save_train_state)
from scripts.common_args import nonnegative_int, positive_int, verb_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = verb_parser("train-testbed", __doc__, (
        "--data data/emoji32.npz --run runs/testbed --export checkpoints/emoji_pixart --steps 20000",
        "--data data/emoji32.npz --sample-from checkpoints/emoji_pixart --sample-grid grid.png"))
    parser.add_argument("--data", required=True, help="dataset .npz from scripts.build_emoji_dataset")
    parser.add_argument("--run", default=None, help="folder for the training state and the log (resumed if present)")
    parser.add_argument("--export", default=None, help="write the EMA model here as a diffusers directory")
    parser.add_argument("--steps", type=positive_int, default=20000, help="total optimizer steps")
    parser.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds of training")
    parser.add_argument("--batch-size", type=positive_int, default=256, help="training batch size")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=nonnegative_int, default=500, help="linear warm-up steps")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--ema-decay", type=float, default=0.9995, help="decay of the exported parameter EMA")
    parser.add_argument("--caption-dropout", type=float, default=0.1, help="CFG dropout probability")
    parser.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="dtype of the forward/backward pass")
    parser.add_argument("--chunk", type=positive_int, default=50, help="optimizer steps per jitted call")
    parser.add_argument("--save-every", type=positive_int, default=2000, help="save the training state every N steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the batches")
    parser.add_argument("--num-layers", type=positive_int, default=None, help="override the block count (smoke tests)")
    parser.add_argument("--export-dtype", choices=("float16", "float32"), default="float16",
                        help="dtype of the exported safetensors")
    parser.add_argument("--sample-grid", default=None, help="write a PNG of held-out captions sampled at the end")
    parser.add_argument("--sample-steps", type=positive_int, default=30, help="Euler steps of the sample grid")
    parser.add_argument("--guidance", type=float, default=3.0, help="CFG scale of the sample grid")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar (plain log lines instead)")
    parser.add_argument("--sample-from", default=None,
                        help="no training: load this diffusers checkpoint and write --sample-grid with captions")
    parser.add_argument("--sample-split", choices=("heldout", "train"), default="heldout",
                        help="captions of the --sample-from grid")
    parser.add_argument("--sample-count", type=positive_int, default=16, help="captions in the --sample-from grid")
    parser.add_argument("--sample-seeds", type=int, nargs="+", default=[0, 1, 2], help="one column per seed")
    return parser.parse_args(argv)


#: The run folder's key file (:func:`run_key`).
RUN_RECORD = "train_run.json"


def run_key(args: argparse.Namespace, cfg, arrays: dict) -> dict:
    """What a run folder's training state depends on: the training arrays' content (``arrays``: the training split's
    images, captions and masks, the null caption), the architecture ``cfg`` (``--num-layers``, the image size), the
    seed and the optimisation settings. Not the step count, the time budget, ``--chunk`` or the save and export
    settings, which do not change a step's result."""
    return {"data": {name: provenance.array_digest(np.asarray(value)) for name, value in sorted(arrays.items())},
            "model": json.loads(json.dumps(dataclasses.asdict(cfg))), "seed": args.seed,
            "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
            "ema_decay": args.ema_decay, "caption_dropout": args.caption_dropout,
            "compute_dtype": args.compute_dtype}


def sample_checkpoint_grid(args: argparse.Namespace) -> None:
    """--sample-from: the first ``--sample-count`` captions of a split, the dataset image, one sample per seed."""
    if not args.sample_grid:
        raise ValueError("--sample-from needs --sample-grid PATH")
    cfg, model = families.PIXART.from_diffusers(args.sample_from, "float32")
    dataset = testbed_data.load_dataset(args.data).split(heldout=args.sample_split == "heldout")
    if cfg.sample_size != dataset.image_size:
        raise ValueError(f"{args.sample_from}: sample_size {cfg.sample_size} != dataset image size "
                         f"{dataset.image_size}")
    graphdef, params = nnx.split(model)
    indices = np.arange(min(args.sample_count, dataset.num_examples))
    columns = [sample_captions(graphdef, params, dataset, indices, seed, args.sample_steps, args.guidance)
               for seed in tqdm(args.sample_seeds, desc="seeds", disable=args.no_progress)]  # each (n, s, s, 3)
    rows = [[dataset.images[i]] + [column[k] for column in columns] for k, i in enumerate(indices)]
    titles = ["dataset"] + [f"seed {seed}" for seed in args.sample_seeds]
    testbed.save_caption_grid(args.sample_grid, [str(dataset.captions[i]) for i in indices], rows, titles,
                              title=f"{args.sample_split} captions, Euler {args.sample_steps} steps, CFG "
                                    f"{args.guidance:g}")
    print(f"wrote {args.sample_grid}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sample_from:
        sample_checkpoint_grid(args)
        return 0
    if not args.run:
        raise ValueError("training needs --run FOLDER")
    run_dir = Path(args.run)
    run_dir.mkdir(parents=True, exist_ok=True)
    dataset = testbed_data.load_dataset(args.data)
    train = dataset.split(heldout=False)
    cfg = testbed.TESTBED_PIXART_CONFIG
    if args.num_layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    if cfg.sample_size != dataset.image_size:
        cfg = dataclasses.replace(cfg, sample_size=dataset.image_size)
    compute_dtype = jnp.dtype(args.compute_dtype)
    flow = testbed.FlowMatchingConfig(caption_dropout=args.caption_dropout)

    arrays = {
        "images": train.images,  # (n, s, s, 3) uint8
        "context": train.context,  # (n, t, 384) fp16
        "context_mask": train.context_mask,  # (n, t) uint8
        "null_context": dataset.null_context,  # (t, 384)
        "null_mask": dataset.null_mask,  # (t,)
    }
    state_path = run_dir / "train_state.npz"
    # a state trained with another dataset or settings is refused before it is read, not resumed under these
    provenance.check_run_folder(run_dir, RUN_RECORD, run_key(args, cfg, arrays), state_path.exists(),
                                unverified="the dataset and settings its train_state.npz was trained with")
    model = build_model(cfg, args.seed)
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(args.lr, args.warmup, args.weight_decay)
    state = {"params": params, "ema": jax.tree.map(jnp.copy, params), "opt_state": optimizer.init(params),
             "step": jnp.asarray(0, jnp.int32), "key": jax.random.key_data(jax.random.key(args.seed))}
    if state_path.exists():
        state = load_train_state(state_path, state)
    state["key"] = jax.random.wrap_key_data(jnp.asarray(state["key"], jnp.uint32))
    start_step = int(state["step"])
    num_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))

    data = {name: jnp.asarray(value) for name, value in arrays.items()}
    train_chunk = make_train_chunk(graphdef, optimizer, flow, data, args.batch_size, args.chunk, args.ema_decay,
                                   compute_dtype)
    log_path = run_dir / "log.jsonl"
    header = {"event": "start", "step": start_step, "params": int(num_params), "train_examples": train.num_examples,
              "device": str(jax.devices()[0]), "jax": jax.__version__, "args": vars(args)}
    atomic_append_text(log_path, json.dumps(header) + "\n")
    print(json.dumps(header), flush=True)

    began = time.perf_counter()
    step = start_step
    bar = tqdm(total=args.steps, initial=start_step, disable=args.no_progress, unit="step", dynamic_ncols=True)
    last_saved = step
    while step < args.steps:
        if args.time_budget is not None and time.perf_counter() - began > args.time_budget:
            break
        state, loss = train_chunk(state)
        loss = float(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss} at step {step + args.chunk}")
        step = int(state["step"])
        elapsed = time.perf_counter() - began
        bar.update(args.chunk)
        bar.set_postfix(loss=f"{loss:.4f}")
        record = {"event": "chunk", "step": step, "loss": loss, "elapsed_s": round(elapsed, 2)}
        atomic_append_text(log_path, json.dumps(record) + "\n")
        if args.no_progress and (step // args.chunk) % 20 == 0:
            print(json.dumps(record), flush=True)
        if step - last_saved >= args.save_every:
            save_train_state(state_path, {**state, "key": jax.random.key_data(state["key"])})
            last_saved = step
    bar.close()
    elapsed = time.perf_counter() - began
    save_train_state(state_path, {**state, "key": jax.random.key_data(state["key"])})
    summary = {"event": "end", "step": step, "steps_this_run": step - start_step, "elapsed_s": round(elapsed, 1),
               "images_per_s": round((step - start_step) * args.batch_size / max(elapsed, 1e-9), 1)}
    atomic_append_text(log_path, json.dumps(summary) + "\n")
    print(json.dumps(summary), flush=True)

    ema_model = nnx.merge(graphdef, state["ema"])
    if args.export:
        families.PIXART.to_diffusers(ema_model, args.export, dtype=args.export_dtype)
        print(f"exported {args.export}", flush=True)
    if args.sample_grid:
        held = dataset.split(heldout=True)
        indices = np.arange(min(held.num_examples, 32))
        images = sample_captions(graphdef, state["ema"], held, indices, args.seed, args.sample_steps, args.guidance)
        from PIL import Image

        pairs = np.stack([held.images[indices], images], axis=1).reshape(-1, *images.shape[1:])  # (2n, s, s, 3)
        grid = testbed.image_grid(pairs, columns=16, scale=2)
        with atomic_path(args.sample_grid, suffix=".png") as temporary:
            Image.fromarray(grid).save(temporary)
        print(f"wrote {args.sample_grid}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

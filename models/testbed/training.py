"""Training of the testbed DiT: the jitted optimizer chunk (flow matching, EMA), its optimizer, init, resumable state.

``scripts/train_testbed.py`` (``kroquant train-testbed``) is the main over these: parameters in fp32 (AdamW with
warm-up, then a constant learning rate, gradient clipping), the forward/backward pass in a compute dtype (bf16 by
default), an exponential moving average (EMA) of the parameters, the training state saved as one ``.npz`` keyed by
pytree path (:func:`save_train_state`, atomic) and resumed from it (:func:`load_train_state`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kroquant_jax.fileio import atomic_path
from models import convert, families
from models.pixart import PixArtConfig
from models.testbed import data as testbed_data
from models.testbed import model as testbed

__all__ = ["build_model", "load_train_state", "make_optimizer", "make_train_chunk", "sample_captions",
           "save_train_state"]


def save_train_state(path: Path, state) -> None:
    """Write the training-state pytree as an .npz keyed by ``jax.tree_util.keystr`` paths (atomic)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    arrays = {jax.tree_util.keystr(key): np.asarray(leaf) for key, leaf in leaves}
    with atomic_path(path, suffix=".npz") as temporary:
        with open(temporary, "wb") as handle:
            np.savez(handle, **arrays)

def load_train_state(path: Path, template):
    """Read :func:`save_train_state`'s file into the structure of ``template`` (keys and shapes must match)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    with np.load(path, allow_pickle=False) as archive:
        names = [jax.tree_util.keystr(key) for key, _ in leaves]
        missing = sorted(set(names) - set(archive.files))
        unexpected = sorted(set(archive.files) - set(names))
        if missing or unexpected:
            raise KeyError(f"{path}: training state does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
        restored = []
        for name, (_, leaf) in zip(names, leaves):
            value = archive[name]
            if value.shape != np.shape(leaf):
                raise ValueError(f"{path}: {name} has shape {value.shape}, the model expects {np.shape(leaf)}")
            restored.append(jnp.asarray(value, dtype=jnp.asarray(leaf).dtype))
    return jax.tree_util.tree_unflatten(treedef, restored)

def build_model(cfg: PixArtConfig, seed: int) -> nnx.Module:
    """The PixArt port with the DiT/PixArt training initialisation (fp32 parameters)."""
    build = lambda: families.PIXART.build(cfg, jnp.float32, seed)  # noqa: E731
    initial = testbed.init_for_training(convert.flat_state_dict(build()), seed)
    return convert.merge_flat_state(build, initial)

def make_optimizer(lr: float, warmup: int, weight_decay: float) -> optax.GradientTransformation:
    """AdamW (b1 0.9, b2 0.999) with a linear warm-up over ``warmup`` steps to ``lr``, then constant, after global-norm
    clipping at 1."""
    schedule = optax.linear_schedule(0.0, lr, max(warmup, 1))  # then constant at lr
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=weight_decay))

def make_train_chunk(graphdef, optimizer, flow: testbed.FlowMatchingConfig, data: dict, batch_size: int,
                     chunk: int, ema_decay: float, compute_dtype):
    """A jitted function running ``chunk`` optimizer steps: state -> (state, mean loss over the chunk)."""
    num_examples = data["images"].shape[0]

    def loss_fn(params, images, context, mask, key, null_context, null_mask):
        low = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        model = nnx.merge(graphdef, low)
        pixels = testbed.images_to_pixels(images)  # (b, 3, s, s)
        return testbed.flow_matching_loss(testbed.pixart_velocity_fn(model), pixels, context.astype(compute_dtype),
                                          mask, key, flow, null_context.astype(compute_dtype), null_mask)

    def one_step(state, data):
        key, key_batch, key_loss = jax.random.split(state["key"], 3)
        index = jax.random.randint(key_batch, (batch_size,), 0, num_examples)  # (b,)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], data["images"][index], data["context"][index],
                                                  data["context_mask"][index], key_loss, data["null_context"],
                                                  data["null_mask"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        step = state["step"] + 1
        decay = jnp.minimum(ema_decay, (1.0 + step) / (10.0 + step))  # EMA warm-up
        ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state["ema"], params)
        return {"params": params, "ema": ema, "opt_state": opt_state, "step": step, "key": key}, loss

    @jax.jit
    def run(state, data):  # the training set an argument: closed over, XLA would fold it in as constants
        state, losses = jax.lax.scan(lambda state, _: one_step(state, data), state, None, length=chunk)
        return state, losses.mean()

    def train_chunk(state):
        return run(state, data)

    return train_chunk

@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "guidance"))
def _sample_captions(params, noise, context, mask, null_context, null_mask, *, graphdef, num_steps: int,
                     guidance: float):
    # one module-level program for every call of the same shapes and settings (e.g. one per seed of a grid); the
    # weights an argument: closed over, XLA would fold them in as constants
    return testbed.euler_sample(testbed.pixart_velocity_fn(nnx.merge(graphdef, params)), noise, context, mask,
                                null_context, null_mask, num_steps, guidance)

def sample_captions(graphdef, params, dataset: testbed_data.EmojiDataset, indices: np.ndarray, seed: int,
                    num_steps: int, guidance: float) -> np.ndarray:
    """Sample the captions ``dataset.captions[indices]`` (fixed seed) -> (n, s, s, 3) uint8."""
    size = dataset.image_size
    noise = jax.random.normal(jax.random.key(seed), (len(indices), 3, size, size), jnp.float32)  # (n, 3, s, s)
    pixels = _sample_captions(params, noise, jnp.asarray(dataset.context[indices], jnp.float32),
                              jnp.asarray(dataset.context_mask[indices]),
                              jnp.asarray(dataset.null_context, jnp.float32), jnp.asarray(dataset.null_mask),
                              graphdef=graphdef, num_steps=num_steps, guidance=guidance)
    return testbed.pixels_to_images(pixels)

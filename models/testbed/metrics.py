"""Metrics for emoji-testbed samples that fit a distribution-matching student.

A DMD student leaves the teacher's sampling trajectory on purpose, so sample-wise PSNR against the teacher does not
measure it. These metrics compare distributions and captions instead:

* :class:`EmojiEncoder`: a small CNN classifier over the dataset's distinct glyph images (one class per distinct
  image; records sharing a glyph share a class), trained with augmentations that cover what a sampler gets wrong
  (pixel noise, a blur, one-pixel shifts, contrast). Its penultimate features (``feature_dim`` wide) are the
  in-domain embedding.
* :func:`frechet_distance`: the Fréchet distance between two Gaussians fitted to features (eigen-based matrix square
  root of symmetric PSD matrices, stable where ``scipy.linalg.sqrtm`` of a product can go complex).
* caption alignment: the classifier's top-1 accuracy on *which emoji was asked for* (``caption_accuracy``).
* :func:`seed_diversity`: the mean pairwise feature distance between samples of the same caption under different
  seeds, relative to the mean distance between different real glyphs.
* :func:`nearest_outcome`: memorisation / mode-collapse check: is a sample's nearest dataset image (pixel MSE) its own
  glyph, a sibling (same base emoji), or another emoji.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kroquant_jax.fileio import atomic_path, atomic_write_text
from models.testbed.evaluation import OUTCOMES, nearest_outcome  # noqa: F401 (the check's one home, re-exported)

__all__ = ["EncoderConfig", "EmojiEncoder", "glyph_classes", "train_encoder", "encoder_features", "classify",
           "feature_statistics", "frechet_distance", "frechet_to", "caption_accuracy", "seed_diversity",
           "OUTCOMES", "nearest_outcome", "save_encoder", "load_encoder", "cached_encoder", "class_of",
           "write_reference_images", "load_reference_images", "sample_metrics"]

#: The encoder's training and feature programs are run-time bound (convolutions over thousands of images): they keep
#: XLA's full backend optimisation even in a process whose XLA_FLAGS lower it (the CPU test suite runs at -O0,
#: tests/conftest.py), where they would run several times slower.
FULL_BACKEND_OPTIMIZATION = {"xla_backend_optimization_level": 3}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """The encoder and its training. widths: conv channels (stride 1, then stride 2 each); feature_dim: embedding."""

    widths: tuple[int, ...] = (32, 64, 128, 128)
    feature_dim: int = 128
    steps: int = 1500
    batch_size: int = 256
    lr: float = 2e-3
    noise_max: float = 0.15
    seed: int = 0

    def __post_init__(self):
        if not self.widths or self.feature_dim < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"EncoderConfig: bad sizes {self}")


class EmojiEncoder(nnx.Module):
    """uint8-derived pixels (b, s, s, 3) in [-1, 1] -> (features (b, feature_dim), logits (b, num_classes))."""

    def __init__(self, config: EncoderConfig, num_classes: int, *, rngs: nnx.Rngs):
        channels = (3,) + tuple(config.widths)
        self.convs = nnx.List([nnx.Conv(channels[i], channels[i + 1], (3, 3), strides=1 if i == 0 else 2,
                                        rngs=rngs) for i in range(len(config.widths))])
        self.norms = nnx.List([nnx.GroupNorm(w, num_groups=8, rngs=rngs) for w in config.widths])
        self.embed = nnx.Linear(config.widths[-1], config.feature_dim, rngs=rngs)
        self.head = nnx.Linear(config.feature_dim, num_classes, rngs=rngs)

    def __call__(self, pixels: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = pixels
        for conv, norm in zip(self.convs, self.norms):
            h = jax.nn.silu(norm(conv(h)))  # (b, s', s', w)
        features = self.embed(h.mean(axis=(1, 2)))  # (b, feature_dim)
        return features, self.head(jax.nn.silu(features))  # (b, f), (b, classes)


def _pixels(images: np.ndarray | jax.Array) -> jax.Array:
    """uint8 (b, s, s, 3) -> float32 (b, s, s, 3) in [-1, 1]."""
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be (batch, height, width, 3) uint8, got shape {images.shape}")
    return jnp.asarray(images, jnp.float32) / 127.5 - 1.0


def glyph_classes(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(class of each record (n,), one image per class (c, s, s, 3))``: identical images share a class."""
    flat = images.reshape(images.shape[0], -1)
    _, first, inverse = np.unique(flat, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first)  # classes in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank[inverse.reshape(-1)].astype(np.int32), images[np.sort(first)]


def _augment(key: jax.Array, pixels: jax.Array, noise_max: float) -> jax.Array:
    """Random one-pixel shifts (white fill), a 3x3 blur on half the batch, contrast in [0.85, 1.15], pixel noise."""
    b = pixels.shape[0]
    k_shift, k_blur, k_contrast, k_level, k_noise = jax.random.split(key, 5)
    shifts = jax.random.randint(k_shift, (b, 2), -1, 2)
    padded = jnp.pad(pixels, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=1.0)  # white border

    def shift(image, offset):
        return jax.lax.dynamic_slice(image, (1 + offset[0], 1 + offset[1], 0), pixels.shape[1:])

    x = jax.vmap(shift)(padded, shifts)  # (b, s, s, 3)
    blurred = jax.lax.reduce_window(jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge"), 0.0, jax.lax.add,
                                    (1, 3, 3, 1), (1, 1, 1, 1), "VALID") / 9.0
    x = jnp.where(jax.random.bernoulli(k_blur, 0.5, (b, 1, 1, 1)), 0.5 * (x + blurred), x)
    x = x * jax.random.uniform(k_contrast, (b, 1, 1, 1), minval=0.85, maxval=1.15)
    level = jax.random.uniform(k_level, (b, 1, 1, 1), maxval=noise_max)
    return jnp.clip(x + level * jax.random.normal(k_noise, x.shape), -1.0, 1.0)


def train_encoder(class_images: np.ndarray, config: EncoderConfig, progress: bool = False
                  ) -> tuple[nnx.GraphDef, Any]:
    """Train the classifier on one image per class (c, s, s, 3) uint8 with augmentations -> (graphdef, params)."""
    from tqdm import tqdm

    num_classes = class_images.shape[0]
    model = EmojiEncoder(config, num_classes, rngs=nnx.Rngs(config.seed))
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(optax.cosine_decay_schedule(config.lr, config.steps), weight_decay=1e-4)
    data = _pixels(class_images)  # (c, s, s, 3)

    def loss_fn(params, key):
        key_index, key_aug = jax.random.split(key)
        labels = jax.random.randint(key_index, (config.batch_size,), 0, num_classes)
        _, logits = nnx.merge(graphdef, params)(_augment(key_aug, data[labels], config.noise_max))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @functools.partial(jax.jit, compiler_options=FULL_BACKEND_OPTIMIZATION)
    def chunk(params, opt_state, key):
        def one(carry, k):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, k)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(one, (params, opt_state), jax.random.split(key, 50))
        return params, opt_state, losses.mean()

    opt_state = optimizer.init(params)
    key = jax.random.key(config.seed)
    for index in tqdm(range(0, config.steps, 50), desc="encoder", disable=not progress):
        params, opt_state, _ = chunk(params, opt_state, jax.random.fold_in(key, index))
    return graphdef, params


@functools.partial(jax.jit, static_argnums=0, compiler_options=FULL_BACKEND_OPTIMIZATION)
def _encode(graphdef, params, images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 (b, s, s, 3) -> (features, logits): one compiled program per encoder structure and batch shape, with
    the weights an argument (not constants folded into a fresh program at every call)."""
    return nnx.merge(graphdef, params)(_pixels(images))


def _batched(graphdef, params, images: np.ndarray, batch: int = 512) -> tuple[np.ndarray, np.ndarray]:
    feats, logits = [], []
    for start in range(0, images.shape[0], batch):
        f, l = _encode(graphdef, params, images[start:start + batch])
        feats.append(np.asarray(f))
        logits.append(np.asarray(l))
    return np.concatenate(feats), np.concatenate(logits)


def encoder_features(graphdef, params, images: np.ndarray) -> np.ndarray:
    """uint8 images (n, s, s, 3) -> features (n, feature_dim) float32."""
    return _batched(graphdef, params, images)[0]


def classify(graphdef, params, images: np.ndarray) -> np.ndarray:
    """uint8 images (n, s, s, 3) -> predicted class (n,)."""
    return np.argmax(_batched(graphdef, params, images)[1], axis=-1)


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, d) -> (mean (d,), covariance (d, d)), float64, unbiased."""
    features = np.asarray(features, np.float64)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"feature_statistics: need (n >= 2, d) features, got {features.shape}")
    return features.mean(axis=0), np.cov(features, rowvar=False)


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh(0.5 * (matrix + matrix.T))
    return (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T


def frechet_distance(mu1: np.ndarray, cov1: np.ndarray, mu2: np.ndarray, cov2: np.ndarray) -> float:
    """``|mu1 - mu2|^2 + tr(C1) + tr(C2) - 2 tr((C1^1/2 C2 C1^1/2)^1/2)`` (symmetric eigen-decompositions only)."""
    if mu1.shape != mu2.shape or cov1.shape != cov2.shape or cov1.shape != mu1.shape * 2:
        raise ValueError(f"frechet_distance: shapes {mu1.shape}, {cov1.shape} vs {mu2.shape}, {cov2.shape}")
    root1 = _psd_sqrt(cov1)
    cross = _psd_sqrt(root1 @ cov2 @ root1)
    value = float(np.sum(np.square(mu1 - mu2)) + np.trace(cov1) + np.trace(cov2) - 2.0 * np.trace(cross))
    return max(value, 0.0)


def frechet_to(features: np.ndarray, reference: np.ndarray) -> float:
    """Fréchet distance between the Gaussians of two feature sets (n, d), (m, d)."""
    return frechet_distance(*feature_statistics(features), *feature_statistics(reference))


def frechet_mean_term(features: np.ndarray, reference: np.ndarray) -> float:
    """The ``|mu1 - mu2|^2`` part of :func:`frechet_to` (the rest, the covariance part, is never negative): a shift of
    every sample the same way (a colour cast, a blur) shows here, a change of spread or diversity in the rest."""
    return float(np.sum(np.square(np.asarray(features, np.float64).mean(0) - np.asarray(reference, np.float64).mean(0))))


def caption_accuracy(predicted: np.ndarray, target: np.ndarray) -> float:
    """Top-1 accuracy: fraction of samples classified as the glyph their caption asked for."""
    predicted, target = np.asarray(predicted), np.asarray(target)
    if predicted.shape != target.shape or predicted.size == 0:
        raise ValueError(f"caption_accuracy: shapes {predicted.shape} vs {target.shape}")
    return float(np.mean(predicted == target))


def seed_diversity(features_by_seed: np.ndarray, reference: np.ndarray) -> float:
    """Mean distance between samples of one caption under different seeds / mean distance between reference items.

    features_by_seed: (seeds >= 2, n, d) features of the same n captions per seed; reference: (m, d) (real glyphs).
    0 means every seed gives the same image; the teacher's value is the bar for a student.
    """
    s = features_by_seed.shape[0]
    if features_by_seed.ndim != 3 or s < 2:
        raise ValueError(f"seed_diversity: need (seeds >= 2, n, d), got {features_by_seed.shape}")
    pairs = [np.linalg.norm(features_by_seed[a] - features_by_seed[b], axis=-1).mean()
             for a in range(s) for b in range(a + 1, s)]
    rng = np.random.default_rng(0)
    i, j = rng.integers(0, reference.shape[0], (2, 4096))
    keep = i != j
    scale = np.linalg.norm(reference[i[keep]] - reference[j[keep]], axis=-1).mean()
    return float(np.mean(pairs) / scale)


# --------------------------------------------------------------------------------------------------------------------
# Persistence: the encoder is trained once per dataset and cached
# --------------------------------------------------------------------------------------------------------------------


def save_encoder(directory: str | Path, config: EncoderConfig, num_classes: int, params, meta: dict) -> None:
    """``config.json`` (encoder config, classes, meta) and ``params.npz`` (flat keys), atomic."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    with atomic_path(directory / "params.npz", suffix=".npz") as temporary:
        with open(temporary, "wb") as handle:
            np.savez(handle, **arrays)
    atomic_write_text(directory / "config.json", json.dumps(
        {"config": dataclasses.asdict(config), "num_classes": num_classes, **meta}, indent=2))


def load_encoder(directory: str | Path) -> tuple[nnx.GraphDef, Any, dict]:
    """Read :func:`save_encoder`'s folder -> (graphdef, params, config.json dict)."""
    directory = Path(directory)
    info = json.loads((directory / "config.json").read_text())
    raw = dict(info["config"])
    raw["widths"] = tuple(raw["widths"])
    config = EncoderConfig(**raw)
    graphdef, template = nnx.split(nnx.eval_shape(lambda: EmojiEncoder(config, info["num_classes"],
                                                                       rngs=nnx.Rngs(0))))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    with np.load(directory / "params.npz") as archive:
        names = [jax.tree_util.keystr(k) for k, _ in leaves]
        missing = sorted(set(names) - set(archive.files))
        if missing:
            raise KeyError(f"{directory}/params.npz: missing {missing[:5]}")
        values = [jnp.asarray(archive[n]) for n in names]
    return graphdef, jax.tree_util.tree_unflatten(treedef, values), info


def cached_encoder(directory: str | Path, class_images: np.ndarray, config: EncoderConfig, data_sha: str,
                   progress: bool = False) -> tuple[nnx.GraphDef, Any]:
    """Load the encoder cached in ``directory`` if it was trained on the same data and config, else train and save.

    data_sha: an identifier of the training images (e.g. the dataset file's SHA-256)."""
    directory = Path(directory)
    if (directory / "config.json").exists():
        info = json.loads((directory / "config.json").read_text())
        same = (info.get("data_sha") == data_sha and info.get("num_classes") == class_images.shape[0]
                and info.get("config") == json.loads(json.dumps(dataclasses.asdict(config))))
        if same:
            graphdef, params, _ = load_encoder(directory)
            return graphdef, params
    graphdef, params = train_encoder(class_images, config, progress=progress)
    save_encoder(directory, config, class_images.shape[0], params, {"data_sha": data_sha})
    return graphdef, params


def class_of(images: np.ndarray, class_images: np.ndarray) -> np.ndarray:
    """The class (index into ``class_images`` (c, s, s, 3)) of each image (n, s, s, 3), by exact equality.

    Raises KeyError naming the first image that is not one of the class images."""
    lookup = {image.tobytes(): k for k, image in enumerate(class_images)}
    out = np.empty(images.shape[0], np.int32)
    for i, image in enumerate(images):
        if image.tobytes() not in lookup:
            raise KeyError(f"class_of: image {i} is none of the {class_images.shape[0]} class images")
        out[i] = lookup[image.tobytes()]
    return out


def write_reference_images(path: str | Path, images: np.ndarray, heldout: np.ndarray, sequences: np.ndarray) -> None:
    """The real images of a dataset without its text encodings (a small file for the FD reference), atomic."""
    with atomic_path(path, suffix=".npz") as temporary, open(temporary, "wb") as handle:
        np.savez_compressed(handle, images=images, heldout=heldout, sequences=sequences)


def load_reference_images(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(images (n, s, s, 3) uint8, heldout (n,) bool, sequences (n,) str)`` from a reference or full dataset file."""
    with np.load(path, allow_pickle=False) as archive:
        missing = [k for k in ("images", "heldout", "sequences") if k not in archive]
        if missing:
            raise KeyError(f"{path} lacks keys {missing}: not an emoji dataset or reference-image file")
        return archive["images"], archive["heldout"], archive["sequences"]


def sample_metrics(graphdef, params, images: np.ndarray, targets: np.ndarray, real_features: np.ndarray,
                   teacher_features: np.ndarray | None = None) -> dict[str, float]:
    """FD to the real images (and to the teacher's samples) with its mean part (``*_mean_term``,
    :func:`frechet_mean_term`), and caption accuracy of uint8 samples (n, s, s, 3) asked for the classes ``targets``
    (n,)."""
    features, logits = _batched(graphdef, params, images)
    out = {"fd_real": frechet_to(features, real_features),
           "fd_real_mean_term": frechet_mean_term(features, real_features),
           "caption_accuracy": caption_accuracy(np.argmax(logits, -1), targets)}
    if teacher_features is not None:
        out["fd_teacher"] = frechet_to(features, teacher_features)
        out["fd_teacher_mean_term"] = frechet_mean_term(features, teacher_features)
    return out

"""In-domain metrics (models/testbed/metrics.py): Fréchet distance, the glyph classifier, diversity, nearest image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.linalg

from models.testbed import metrics as emoji_metrics
from models.testbed import data as testbed_data

CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "emoji_pixart"


def test_frechet_distance_closed_form_gaussians():
    rng = np.random.default_rng(0)
    d = 6
    a = rng.standard_normal((d, d))
    b = rng.standard_normal((d, d))
    cov1, cov2 = a @ a.T + 0.1 * np.eye(d), b @ b.T + 0.1 * np.eye(d)
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    reference = (np.sum((mu1 - mu2) ** 2) + np.trace(cov1) + np.trace(cov2)
                 - 2 * np.trace(scipy.linalg.sqrtm(cov1 @ cov2)).real)
    assert emoji_metrics.frechet_distance(mu1, cov1, mu2, cov2) == pytest.approx(reference, rel=1e-6)
    # diagonal case by hand: sum (m1 - m2)^2 + sum (s1 - s2)^2
    s1, s2 = np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 1.0])
    value = emoji_metrics.frechet_distance(np.zeros(3), np.diag(s1 ** 2), np.ones(3), np.diag(s2 ** 2))
    assert value == pytest.approx(3.0 + np.sum((s1 - s2) ** 2), rel=1e-9)
    assert emoji_metrics.frechet_distance(mu1, cov1, mu1, cov1) == pytest.approx(0.0, abs=1e-8)
    # rank-deficient covariances (fewer samples than dimensions) stay real and finite
    low = rng.standard_normal((3, d))
    assert np.isfinite(emoji_metrics.frechet_to(low, rng.standard_normal((50, d))))
    # sample estimate approaches the closed form
    x = rng.multivariate_normal(mu1, cov1, 20000)
    y = rng.multivariate_normal(mu2, cov2, 20000)
    assert emoji_metrics.frechet_to(x, y) == pytest.approx(reference, rel=0.05)
    with pytest.raises(ValueError, match="shapes"):
        emoji_metrics.frechet_distance(mu1, cov1, mu2[:3], cov2[:3, :3])
    # the mean term: all of the FD of a translated copy, a part of it otherwise
    shift = rng.standard_normal(d)
    assert emoji_metrics.frechet_mean_term(x + shift, x) == pytest.approx(np.sum(shift ** 2), rel=1e-9)
    assert emoji_metrics.frechet_to(x + shift, x) == pytest.approx(np.sum(shift ** 2), rel=1e-6)
    assert 0 < emoji_metrics.frechet_mean_term(x, y) < emoji_metrics.frechet_to(x, y)


def test_glyph_classes_and_class_of():
    images = np.zeros((5, 2, 2, 3), np.uint8)
    images[1] = 7
    images[2] = 9
    images[3] = 7  # same glyph as record 1
    classes, class_images = emoji_metrics.glyph_classes(images)
    assert classes.tolist() == [0, 1, 2, 1, 0] and class_images.shape[0] == 3
    assert emoji_metrics.class_of(images, class_images).tolist() == classes.tolist()
    with pytest.raises(KeyError, match="image 0 is none"):
        emoji_metrics.class_of(np.full((1, 2, 2, 3), 3, np.uint8), class_images)


def test_classifier_beats_chance_on_real_and_noisy_glyphs_and_caches(tmp_path):
    """The encoder trained on 20 glyph classes classifies the real and noisy glyphs well above chance; a second
    cached_encoder call gives back the saved parameters; the FD and sample metrics of its features."""
    data = testbed_data.load_dataset(str(CHECKPOINT / "testbed_prompts.npz"))
    _, class_images = emoji_metrics.glyph_classes(data.images[:20])
    config = emoji_metrics.EncoderConfig(widths=(8, 16, 16), feature_dim=16, steps=200, batch_size=32, lr=5e-3)
    graphdef, params = emoji_metrics.cached_encoder(tmp_path / "enc", class_images, config, "sha-x")
    n = class_images.shape[0]
    real = emoji_metrics.caption_accuracy(emoji_metrics.classify(graphdef, params, class_images), np.arange(n))
    rng = np.random.default_rng(0)
    noisy = np.clip(class_images + rng.normal(0, 8, class_images.shape), 0, 255).astype(np.uint8)
    noisy_acc = emoji_metrics.caption_accuracy(emoji_metrics.classify(graphdef, params, noisy), np.arange(n))
    assert real > 0.8 and noisy_acc > 0.5, (real, noisy_acc)  # chance is 1/20
    # cached: same data id and config -> the saved parameters come back (the features of every class image: the
    # batch shape already compiled for classify)
    graphdef2, params2 = emoji_metrics.cached_encoder(tmp_path / "enc", class_images, config, "sha-x")
    features = emoji_metrics.encoder_features(graphdef, params, class_images)
    np.testing.assert_array_equal(features, emoji_metrics.encoder_features(graphdef2, params2, class_images))
    # FD of real images to themselves ~0, to a shifted version > 0
    assert emoji_metrics.frechet_to(features, features) == pytest.approx(0.0, abs=1e-6)
    metrics = emoji_metrics.sample_metrics(graphdef, params, noisy, np.arange(n), features, features)
    assert metrics["fd_real"] > 0 and metrics["fd_teacher"] == metrics["fd_real"]
    assert 0 <= metrics["fd_real_mean_term"] == metrics["fd_teacher_mean_term"] <= metrics["fd_real"]
    assert metrics["caption_accuracy"] == pytest.approx(noisy_acc)


def test_seed_diversity():
    rng = np.random.default_rng(1)
    reference = rng.standard_normal((100, 4))
    same = np.stack([reference[:10], reference[:10]])
    assert emoji_metrics.seed_diversity(same, reference) == 0.0
    different = np.stack([reference[:10], reference[10:20]])
    assert emoji_metrics.seed_diversity(different, reference) == pytest.approx(1.0, rel=0.25)
    # exact: seeds shifted by 0, v, 2v (|v| = 2: pair distances 2, 4, 2) over reference items 3 * e_i (every pair
    # 3 * sqrt(2) apart): mean distance over seed pairs / mean distance between reference items
    v = np.array([0.0, 2.0, 0.0, 0.0])
    shifted = np.stack([reference[:10], reference[:10] + v, reference[:10] + 2 * v])
    assert emoji_metrics.seed_diversity(shifted, 3.0 * np.eye(4)) == pytest.approx((8 / 3) / (3 * np.sqrt(2)),
                                                                                    rel=1e-12)
    with pytest.raises(ValueError, match="seeds >= 2"):
        emoji_metrics.seed_diversity(reference[None], reference)


def test_nearest_outcome_and_reference_file(tmp_path):
    data = testbed_data.load_dataset(str(CHECKPOINT / "testbed_prompts.npz"))
    pool = data.images.astype(np.float32) / 255
    bases = [testbed_data.base_sequence(testbed_data.text_to_sequence(s)) for s in data.sequences]
    outcome, nearest, mse = emoji_metrics.nearest_outcome(data.images[3], 3, data, pool, bases)
    assert outcome == "own glyph" and mse == 0.0 and np.array_equal(data.images[nearest], data.images[3])
    other = next(i for i in range(1, data.num_examples) if bases[i] != bases[0])
    assert emoji_metrics.nearest_outcome(data.images[other], 0, data, pool, bases)[0] == "other emoji"
    path = tmp_path / "ref.npz"
    emoji_metrics.write_reference_images(path, data.images, data.heldout, data.sequences)
    images, heldout, sequences = emoji_metrics.load_reference_images(path)
    assert np.array_equal(images, data.images) and np.array_equal(heldout, data.heldout)
    with pytest.raises(KeyError, match="lacks keys"):
        np.savez(tmp_path / "bad.npz", images=images)
        emoji_metrics.load_reference_images(tmp_path / "bad.npz")

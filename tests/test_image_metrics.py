import numpy as np
import pytest

from models import image_metrics as M


def _images(seed, n=3, h=32, w=32):
    rng = np.random.default_rng(seed)
    base = rng.uniform(0, 1, size=(n, h // 4, w // 4, 3))
    return np.clip(np.kron(base, np.ones((1, 4, 4, 1))) + 0.05 * rng.normal(size=(n, h, w, 3)), 0, 1)


def test_psnr_known_value_and_identity():
    ref = _images(0)
    noisy = np.clip(ref + 0.1, 0, 1)
    mse = np.mean((noisy - ref) ** 2, axis=(1, 2, 3))
    np.testing.assert_allclose(M.psnr(noisy, ref), 10 * np.log10(1 / mse))
    assert np.all(np.isinf(M.psnr(ref, ref)))
    with pytest.raises(ValueError, match="shapes differ"):
        M.psnr(ref[:, :16], ref)


def test_range_psnr_takes_the_reference_range_as_its_peak():
    ramp = np.linspace(-2, 2, 48).reshape(3, 4, 4)  # a latent: range 4
    assert M.range_psnr(ramp + 0.4, ramp) == pytest.approx(20.0)  # 10 log10(4^2 / 0.4^2)
    assert M.range_psnr(ramp, ramp) == float("inf")
    with pytest.raises(ValueError, match="shapes differ"):
        M.range_psnr(ramp[:2], ramp)


def test_ssim_matches_scikit_image():
    skm = pytest.importorskip("skimage.metrics")
    ref, other = _images(1), _images(2)
    mixed = 0.7 * ref + 0.3 * other
    ours = M.ssim(mixed, ref)
    theirs = [skm.structural_similarity(mixed[i], ref[i], gaussian_weights=True, sigma=1.5,
                                        use_sample_covariance=False, channel_axis=-1, data_range=1.0)
              for i in range(len(ref))]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(M.ssim(ref, ref), 1.0)
    assert np.all(M.ssim(other, ref) < 0.5)


def test_color_ratios_detect_desaturation():
    ref = _images(3)
    gray = ref.mean(-1, keepdims=True)
    washed = 0.5 * ref + 0.5 * gray  # halve the colour
    r = M.color_ratios(washed, ref)
    assert 0.4 < r["chroma_ratio"] < 0.6 and r["saturation_ratio"] < 0.8
    assert M.color_ratios(ref, ref) == {"chroma_ratio": 1.0, "saturation_ratio": 1.0}
    np.testing.assert_allclose(M.mean_chroma(np.repeat(gray, 3, -1)), 0.0, atol=1e-3)
    with pytest.raises(ValueError, match="NaN"):
        M.psnr(np.full((1, 16, 16, 3), np.nan), ref[:1, :16, :16])

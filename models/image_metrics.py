"""Image-similarity metrics against the 16-bit reference: PSNR, SSIM and colour (chroma / saturation) ratios.

All functions take ``float`` images in ``[0, 1]`` of shape ``(..., H, W, 3)`` (numpy or jax arrays) and return numpy.
The chroma ratio measures the second seed's FP4 failure mode (washed-out colour): ``< 1`` means the quantized model's
images are less colourful than the reference's.
"""

from __future__ import annotations

import numpy as np

_SSIM_K1, _SSIM_K2, _SSIM_SIGMA, _SSIM_RADIUS = 0.01, 0.03, 1.5, 5  # Wang et al. 2004: 11x11 Gaussian, sigma 1.5


def _as_images(x, name: str) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if x.ndim < 3 or x.shape[-1] != 3:
        raise ValueError(f"{name}: expected RGB images of shape (..., H, W, 3), got {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: images contain NaN/Inf")
    return x


def psnr(images, reference, data_range: float = 1.0) -> np.ndarray:
    """Peak signal-to-noise ratio in dB per image ``(...)``; ``inf`` for identical images."""
    x, ref = _as_images(images, "images"), _as_images(reference, "reference")
    if x.shape != ref.shape:
        raise ValueError(f"psnr: shapes differ: {x.shape} vs {ref.shape}")
    mse = np.mean((x - ref) ** 2, axis=(-3, -2, -1))
    with np.errstate(divide="ignore"):
        return 10.0 * np.log10(data_range**2 / mse)


def range_psnr(test, reference) -> float:
    """PSNR in dB of one array of any shape (e.g. a latent ``(c, H, W)``) with the reference's value range
    ``max - min`` as the peak; ``inf`` for identical arrays. For samples that are not RGB images in [0, 1]."""
    test, reference = np.asarray(test, np.float64), np.asarray(reference, np.float64)
    if test.shape != reference.shape:
        raise ValueError(f"range_psnr: shapes differ: {test.shape} vs {reference.shape}")
    mse = float(np.mean((reference - test) ** 2))
    peak = float(reference.max() - reference.min())
    return float("inf") if mse == 0 else 10.0 * np.log10(peak ** 2 / mse)


def _gaussian_filter_valid(img: np.ndarray) -> np.ndarray:
    """Separable 11x11 Gaussian filter (sigma 1.5) over axes (-3, -2) of ``(..., H, W, C)``, 'valid' region only."""
    t = np.arange(-_SSIM_RADIUS, _SSIM_RADIUS + 1)
    g = np.exp(-(t**2) / (2 * _SSIM_SIGMA**2))
    g /= g.sum()
    n = 2 * _SSIM_RADIUS + 1
    h, w = img.shape[-3], img.shape[-2]
    rows = sum(g[i] * img[..., i:h - n + 1 + i, :, :] for i in range(n))
    return sum(g[i] * rows[..., :, i:w - n + 1 + i, :] for i in range(n))


def ssim(images, reference, data_range: float = 1.0) -> np.ndarray:
    """Mean structural similarity per image ``(...)`` (Gaussian-weighted, per channel, averaged; Wang et al. 2004).

    Matches ``skimage.metrics.structural_similarity(..., gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, channel_axis=-1)`` (tested); images must be at least 11x11.
    """
    x, ref = _as_images(images, "images"), _as_images(reference, "reference")
    if x.shape != ref.shape:
        raise ValueError(f"ssim: shapes differ: {x.shape} vs {ref.shape}")
    if min(x.shape[-3:-1]) < 2 * _SSIM_RADIUS + 1:
        raise ValueError(f"ssim needs images of at least 11x11 pixels, got {x.shape[-3:-1]}")
    c1, c2 = (_SSIM_K1 * data_range) ** 2, (_SSIM_K2 * data_range) ** 2
    mu_x, mu_y = _gaussian_filter_valid(x), _gaussian_filter_valid(ref)
    sxx = _gaussian_filter_valid(x * x) - mu_x**2
    syy = _gaussian_filter_valid(ref * ref) - mu_y**2
    sxy = _gaussian_filter_valid(x * ref) - mu_x * mu_y
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sxx + syy + c2))
    return s.mean(axis=(-3, -2, -1))


def _srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB in [0, 1] -> CIELAB (D65) ``(..., 3)``."""
    lin = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    m = np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
                  [0.0193339, 0.1191920, 0.9503041]])
    xyz = lin @ m.T / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1)


def mean_chroma(images) -> np.ndarray:
    """Mean CIELAB chroma ``C* = sqrt(a*^2 + b*^2)`` per image ``(...)``."""
    lab = _srgb_to_lab(np.clip(_as_images(images, "images"), 0.0, 1.0))
    return np.sqrt(lab[..., 1] ** 2 + lab[..., 2] ** 2).mean(axis=(-2, -1))


def mean_saturation(images) -> np.ndarray:
    """Mean HSV saturation ``(max - min) / max`` per image ``(...)`` (0 where max = 0)."""
    x = np.clip(_as_images(images, "images"), 0.0, 1.0)
    mx, mn = x.max(-1), x.min(-1)
    sat = np.where(mx > 0, (mx - mn) / np.where(mx > 0, mx, 1.0), 0.0)
    return sat.mean(axis=(-2, -1))


def color_ratios(images, reference) -> dict[str, float]:
    """``{"chroma_ratio", "saturation_ratio"}``: the set's mean over the reference set's mean (1.0 = same colour)."""
    return {
        "chroma_ratio": float(mean_chroma(images).mean() / max(mean_chroma(reference).mean(), 1e-12)),
        "saturation_ratio": float(mean_saturation(images).mean() / max(mean_saturation(reference).mean(), 1e-12)),
    }

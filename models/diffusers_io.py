"""Torch-side helpers around diffusers (text encoders and VAEs), for the command-line scripts.

The JAX side (every other module of ``models``) never imports this file: the Flax ports take precomputed prompt
embeddings and return latents. These helpers need ``torch``, ``diffusers`` and ``transformers`` and load components
from LOCAL pipeline directories only (no hub downloads).

* :func:`encode_prompts`: prompts -> the embeddings ``.npz`` layout of ``scripts/quantize_checkpoint.py``, through
  the pipeline's own ``encode_prompt`` (PixArt-Σ: T5, 300 tokens; SANA: Gemma-2; FLUX: T5 + CLIP).
* :func:`decode_latents`: latents (N, C, h, w) -> uint8 images (N, H, W, 3) with the family's VAE and scaling.
* :func:`save_pngs`: write images as PNGs, atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kroquant_jax.fileio import atomic_path

__all__ = ["decode_latents", "encode_prompts", "save_pngs"]

_PIPELINES = {"pixart": "PixArtSigmaPipeline", "sana": "SanaPipeline", "flux": "FluxPipeline"}


def encode_prompts(pipeline_dir: str, prompts: list[str], family: str, negative_prompt: str = "",
                   max_sequence_length: int | None = None, device: str = "cpu") -> dict[str, np.ndarray]:
    """Encode prompts with the text encoder(s) of a local diffusers pipeline directory.

    Returns (float32 numpy): PixArt/SANA ``context (P, t, c)``, ``mask (P, t)``, ``uncond_context (1, t, c)``,
    ``uncond_mask (1, t)``; FLUX ``context (P, t, 4096)``, ``pooled (P, 768)``.
    """
    import diffusers
    import torch

    if family not in _PIPELINES:
        raise ValueError(f"unknown {family=}; one of {sorted(_PIPELINES)}")
    pipeline_cls = getattr(diffusers, _PIPELINES[family])
    pipe = pipeline_cls.from_pretrained(pipeline_dir, transformer=None, vae=None, local_files_only=True).to(device)
    with torch.no_grad():
        if family == "flux":
            embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, device=device,
                                                   max_sequence_length=max_sequence_length or 512)
            return {"context": embeds.float().cpu().numpy(), "pooled": pooled.float().cpu().numpy()}
        kwargs = {"max_sequence_length": max_sequence_length or 300}
        embeds, mask, neg, neg_mask = pipe.encode_prompt(prompts, do_classifier_free_guidance=True,
                                                         negative_prompt=negative_prompt, device=device, **kwargs)
    return {"context": embeds.float().cpu().numpy(), "mask": mask.float().cpu().numpy(),
            "uncond_context": neg[:1].float().cpu().numpy(), "uncond_mask": neg_mask[:1].float().cpu().numpy()}


def decode_latents(vae_dir: str, latents: np.ndarray, family: str, device: str = "cpu") -> np.ndarray:
    """latents (N, C, h, w) -> images (N, H, W, 3) uint8, with the VAE of ``vae_dir`` (AutoencoderKL for
    PixArt/FLUX, AutoencoderDC for SANA) and the pipeline's scaling (``/ scaling_factor``, ``+ shift_factor`` for
    FLUX)."""
    import diffusers
    import torch

    vae_cls = diffusers.AutoencoderDC if family == "sana" else diffusers.AutoencoderKL
    vae = vae_cls.from_pretrained(vae_dir, local_files_only=True).to(device).eval()
    x = torch.from_numpy(np.asarray(latents, np.float32)).to(device, vae.dtype)
    x = x / vae.config.scaling_factor
    if family == "flux" and getattr(vae.config, "shift_factor", None) is not None:
        x = x + vae.config.shift_factor
    with torch.no_grad():
        images = vae.decode(x).sample.float().cpu().numpy()  # (N, 3, H, W) in [-1, 1]
    images = np.clip((images + 1.0) * 127.5 + 0.5, 0, 255).astype(np.uint8)
    return images.transpose(0, 2, 3, 1)  # (N, H, W, 3)


def save_pngs(images: np.ndarray, folder: str | os.PathLike, prefix: str = "") -> list[Path]:
    """Write images (N, H, W, 3) uint8 as ``{prefix}{i:04d}.png`` in ``folder`` (each atomically)."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, image in enumerate(images):
        path = folder / f"{prefix}{index:04d}.png"
        with atomic_path(path, suffix=".png") as tmp:
            Image.fromarray(image).save(tmp)
        paths.append(path)
    return paths

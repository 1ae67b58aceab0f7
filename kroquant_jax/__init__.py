"""kroquant-jax: W4A4 quantization of diffusion transformers in JAX (pure math layer).

Modules: :mod:`~kroquant_jax.formats` (MXFP4/NVFP4, STE), :mod:`~kroquant_jax.transforms` (block-transform
parameterizations), :mod:`~kroquant_jax.norm_commutation` (paper appendix C).
"""

__version__ = "0.1.0"

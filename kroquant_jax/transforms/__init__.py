"""Block-transform parameterizations behind one interface (see :mod:`kroquant_jax.transforms.base`).

>>> from kroquant_jax import transforms
>>> p = transforms.get("kron_lu")
>>> params = p.init(1152)
>>> t_blocks = p.blocks(params)          # (36, 32, 32)
>>> a_t = transforms.apply_to_activations(a, t_blocks)               # A T
>>> w_t = transforms.apply_to_weights(w, p.inverse_blocks(params))   # W T^{-T}

Adding a parameterization is one small file that builds a :class:`Parameterization` and one line in ``REGISTRY``.
"""

from kroquant_jax.transforms.base import (
    BLOCK,
    Parameterization,
    WidthOnly,
    apply_to_activations,
    apply_to_weights,
    check_width,
    dense_matrix,
    normalized_hadamard,
)
from kroquant_jax.transforms.cayley import CAYLEY32
from kroquant_jax.transforms.dense import DENSE32
from kroquant_jax.transforms.diagonal import DIAGONAL
from kroquant_jax.transforms.fixed import FWHT, HADAMARD32, IDENTITY
from kroquant_jax.transforms.kron_lu import KRON_LU
from kroquant_jax.transforms.kron_lu_shared import KRON_LU_SHARED
from kroquant_jax.transforms.smoothed_kron import SMOOTHED_KRON

REGISTRY: dict[str, Parameterization] = {
    p.name: p
    for p in (KRON_LU, SMOOTHED_KRON, KRON_LU_SHARED, DENSE32, CAYLEY32, DIAGONAL, HADAMARD32, FWHT, IDENTITY)
}


def get(name: str) -> Parameterization:
    """The parameterization registered as ``name`` (see ``REGISTRY``)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown transform {name!r}; available: {sorted(REGISTRY)}") from None


__all__ = [
    "BLOCK", "CAYLEY32", "DENSE32", "DIAGONAL", "FWHT", "HADAMARD32", "IDENTITY", "KRON_LU", "KRON_LU_SHARED",
    "Parameterization", "REGISTRY", "SMOOTHED_KRON", "WidthOnly", "apply_to_activations", "apply_to_weights",
    "check_width", "dense_matrix", "get", "normalized_hadamard",
]

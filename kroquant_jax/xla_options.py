"""XLA options given to one program (``jax.jit(..., compiler_options=...)``), never against the user's ``XLA_FLAGS``.

The library sets no process-wide XLA flag: where a kind of program measured faster with an XLA option (the stacked
calibration engine, :data:`kroquant_jax.layerset.ENGINE_XLA_OPTIONS`; the served W4A4 strategies'
``program_xla_options``, :func:`pallas_kernels.served.program_compiler_options`), that program is compiled with it,
unless the user's ``XLA_FLAGS`` names the same option: a flag given explicitly is never overridden.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

__all__ = ["unless_set_by_flags"]


def unless_set_by_flags(options: Mapping[str, Any], xla_flags: Optional[str] = None) -> dict[str, Any]:
    """``options`` less those that ``xla_flags`` (default: the ``XLA_FLAGS`` environment variable) sets, as
    ``--name=value``, ``--name value`` or a bare ``--name``."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {k: v for k, v in options.items() if not re.search(rf"(^|\s)--?{re.escape(k)}(=|\s|$)", flags)}

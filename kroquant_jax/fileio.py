"""Small file helpers shared by every atomic writer of the project."""

from __future__ import annotations

import os

FILE_MODE = 0o644
DIR_MODE = 0o755


def publishable(path: str | os.PathLike) -> None:
    """Gives a temporary file (``tempfile.mkstemp``: mode 0600) or folder (``mkdtemp``: 0700) the usual permissions
    (0644 / 0755) before it is renamed into place, so results and checkpoints are readable like any other file."""
    os.chmod(path, DIR_MODE if os.path.isdir(path) else FILE_MODE)

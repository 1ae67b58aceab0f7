"""Atomic file writes shared by every writer of the project (results, checkpoints, images, tables), and
:func:`read_npz`, the ``.npz`` reader whose errors name the file.

A reader never sees a half-written file and an interrupted run never destroys the previous version: every writer
writes into a temporary file in the target's folder (same filesystem), flushes it, gives it the usual permissions
and renames it onto the target with ``os.replace``. On any error the temporary file is removed and the target is
left as it was.

:class:`StagedResults` is the benchmarks' results file on top of it: a dict saved after every stage, so a timeout keeps
what finished, and a stage that raises records its error instead of ending the run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["DIR_MODE", "FILE_MODE", "StagedResults", "atomic_append_text", "atomic_path", "atomic_write_bytes",
           "atomic_write_json", "atomic_write_text", "publishable", "read_npz", "replace_folder"]

FILE_MODE = 0o644
DIR_MODE = 0o755


def publishable(path: str | os.PathLike) -> None:
    """Gives a temporary file (``tempfile.mkstemp``: mode 0600) or folder (``mkdtemp``: 0700) the usual permissions
    (0644 / 0755) before it is renamed into place, so results and checkpoints are readable like any other file."""
    os.chmod(path, DIR_MODE if os.path.isdir(path) else FILE_MODE)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """Yields a fresh temporary path next to ``path``; renamed onto ``path`` (mode 0644) when the block exits normally,
    removed when it raises.

    ``suffix`` ends the temporary name, for writers that pick the format from the extension (``".png"`` for PIL and
    matplotlib, ``".npz"`` for ``np.savez``, which would otherwise append one). Creates the parent folder.

    >>> with atomic_path("out/grid.png", suffix=".png") as tmp:
    ...     image.save(tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(handle)
    tmp = Path(tmp)
    try:
        yield tmp
        publishable(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def replace_folder(tmp: str | os.PathLike, directory: str | os.PathLike) -> None:
    """Renames the complete folder ``tmp`` (a sibling of ``directory``, e.g. from ``tempfile.mkdtemp``) onto
    ``directory``. An existing ``directory`` is first renamed aside (``.<name>.old-<pid>``) and deleted only once
    ``tmp`` is in its place, so an interruption never destroys the previous version."""
    directory = Path(directory)
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old)
    else:
        os.replace(tmp, directory)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically (temporary file, fsync, rename)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Writes UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_append_text(path: str | os.PathLike, text: str) -> None:
    """Appends UTF-8 ``text`` to ``path`` (created if absent) by rewriting the whole file atomically: a reader sees
    it before or after the append, never a torn last line that a later append would run on into. Each call copies
    the file, so it is for small logs (a ``log.jsonl`` of one line per chunk of training), not for large ones."""
    path = Path(path)
    old = path.read_bytes() if path.exists() else b""
    atomic_write_bytes(path, old + text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2, sort_keys: bool = True) -> None:
    """Writes ``obj`` as JSON (with a final newline) to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object (a dict) in the file ``path``.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: naming ``path``, when it is not valid UTF-8 JSON (e.g. truncated) or not an object.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: corrupt JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


class _NotAnArchive(ValueError):
    """A file numpy reads, but not as a ``.npz`` archive (:func:`read_npz`)."""


def read_npz(path: str | os.PathLike) -> dict[str, Any]:
    """Every array of the ``.npz`` file ``path`` as ``{key: np.ndarray}`` (read now, the file closed; no pickles).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: naming ``path``, when it is not a readable ``.npz`` (a folder, a truncated or corrupt archive, a
        text file, object arrays), instead of numpy's ``BadZipFile`` or its advice about pickled data.
    """
    import zipfile
    import zlib

    import numpy as np

    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a folder, not a .npz file")
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):  # a .npy file: one array, no keys
            raise _NotAnArchive("a single .npy array, not a .npz archive")
        with archive:
            return {key: archive[key] for key in archive.files}
    except _NotAnArchive as err:
        raise ValueError(f"{path}: not a readable .npz file ({err})") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        # numpy falls back to unpickling what is neither a zip nor a .npy file, and refuses (allow_pickle=False)
        why = "not a .npz archive" if "pickled" in str(err) else f"truncated or corrupt: {type(err).__name__}: {err}"
        raise ValueError(f"{path}: not a readable .npz file ({why})") from None


class StagedResults:
    """A run's results dict, written atomically to ``path`` (JSON) after every stage.

    :meth:`stage` ``(name, fn)`` runs ``fn()`` and returns its value; when it raises, the error (``"Type: message"``,
    at most 3000 characters) goes to ``payload["errors"][name]``, the traceback to stderr, and it returns None: one
    failing stage does not end the run. Either way the payload is saved (:meth:`save`: with ``elapsed_s``, seconds
    since ``start``, a ``time.perf_counter()`` value, default now; ``before_save(payload)`` first, e.g. to update
    derived entries) and ``log`` gets ``"[elapsed s] name done"`` (default: printed and flushed, a progress line;
    ``None``: nothing).
    """

    def __init__(self, path: str | os.PathLike, payload: dict[str, Any], start: float | None = None, *,
                 before_save: Callable[[dict[str, Any]], None] | None = None,
                 log: Callable[[str], None] | None = functools.partial(print, flush=True)):
        self.path = Path(path)
        self.payload = payload
        self.start = time.perf_counter() if start is None else start
        self.before_save = before_save
        self.log = log
        payload.setdefault("errors", {})

    def save(self) -> None:
        self.payload["elapsed_s"] = time.perf_counter() - self.start
        if self.before_save is not None:
            self.before_save(self.payload)
        atomic_write_json(self.path, self.payload)

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            self.payload["errors"][name] = f"{type(err).__name__}: {err}"[:3000]
            traceback.print_exc()
            return None
        finally:
            self.save()
            if self.log is not None:
                self.log(f"[{time.perf_counter() - self.start:6.1f} s] {name} done")

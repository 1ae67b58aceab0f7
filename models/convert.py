"""Declarative diffusers <-> Flax checkpoint conversion.

Everything here works on plain numpy arrays; torch is never imported.

Data model
----------
* A **diffusers state** is a flat ``{key: np.ndarray}`` dict in torch layout, as stored in a diffusers directory
  (``config.json`` + ``diffusion_pytorch_model.safetensors``, or the sharded form
  ``diffusion_pytorch_model.safetensors.index.json`` + ``diffusion_pytorch_model-0000k-of-0000n.safetensors``).
* A **flax state** is a flat ``{dotted_path: np.ndarray}`` dict, e.g. ``"transformer_blocks.3.attn1.to_q.kernel"``.
  For an NNX model, the dotted path is ``".".join(map(str, path))`` of ``nnx.to_flat_state(nnx.state(model))``
  (see :func:`flat_state_dict` / :func:`merge_flat_state`).

The key map
-----------
A family describes its checkpoint with one :class:`KeyTable`: a tuple of :class:`KeyRule` s, each saying
"these diffusers key pattern(s) become these flax path pattern(s) through this named transform".
Patterns are literal strings with integer placeholders ``{i}``, ``{j}``, ``{k}`` (block indices), e.g.::

    rule("transformer_blocks.{i}.attn1.to_q.weight", "transformer_blocks.{i}.attn1.to_q.kernel", "linear")
    linear_rules("transformer_blocks.{i}.attn1.to_q")           # weight + bias in one call
    rule(("blocks.{i}.q.weight", "blocks.{i}.k.weight", "blocks.{i}.v.weight"),
         "blocks.{i}.qkv.kernel", "fuse_linear")                  # QKV fusion (many -> one)
    rule("blocks.{i}.qkv.weight", ("blocks.{i}.q.kernel", "blocks.{i}.k.kernel", "blocks.{i}.v.kernel"),
         "split_linear")                                          # QKV split (one -> many)
    rule("pos_embed.pos_embed", None)                             # a source key that is read and dropped

The first rule whose source pattern matches a key wins (regexes are anchored, keys are never rewritten by chained
``str.replace``). Named transforms live in :data:`TRANSFORMS` (each a forward and an exact inverse):

* ``identity``; ``linear``: torch ``W (o, d)`` -> flax kernel ``(d, o)``;
* ``conv1x1``: ``(o, d, 1, 1)`` -> ``(d, o)`` (a 1x1 convolution run as a linear layer);
* ``conv``: OIHW -> HWIO (also depthwise ``(C, 1, kh, kw)`` -> ``(kh, kw, 1, C)``);
* ``fuse_linear``: n tensors ``(o, d)`` -> kernel ``(d, n*o)`` (inverse splits in n equal parts);
* ``split_linear``: ``(n*o, d)`` -> n kernels ``(d, o)``; ``fuse_bias`` / ``split_bias`` for the biases.
Register more with :func:`register_transform`.

Entry points
------------
* :func:`read_safetensors` / :func:`write_safetensors`: a numpy safetensors reader/writer (bf16 via ml_dtypes,
  memory-mapped reads, atomic writes). A truncated or corrupt file raises :class:`CheckpointError` naming the file.
* :func:`read_diffusers_dir` -> ``(config dict, diffusers state)``; :func:`write_diffusers_dir` (single file or
  sharded, atomic per file, config.json written last).
* :meth:`KeyTable.to_flax` ``(diffusers_state, expected_shapes, dtype)`` -> flax state. Raises ONE
  :class:`ConversionError` that lists every missing, unexpected and mis-shaped key.
* :meth:`KeyTable.to_diffusers` ``(flax_state, dtype)`` -> diffusers state (the exact inverse: a round trip in the same
  dtype is bit-exact).
* :func:`save_flax_state` / :func:`load_flax_state`: orbax checkpoint of a flax state plus its config (written to a
  temporary directory, then renamed into place).
* :func:`flat_state_dict`, :func:`merge_flat_state`, :func:`abstract_shapes`: glue to NNX models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from kroquant_jax import fileio
from kroquant_jax.fileio import atomic_path, atomic_write_json, publishable, replace_folder

__all__ = [
    "CheckpointError",
    "ConversionError",
    "DiTConfig",
    "KeyRule",
    "KeyTable",
    "TRANSFORMS",
    "abstract_shapes",
    "flat_state_dict",
    "linear_rules",
    "load_flax_state",
    "merge_flat_state",
    "read_diffusers_config",
    "read_diffusers_dir",
    "read_safetensors",
    "register_transform",
    "resolve_dtype",
    "rule",
    "save_flax_state",
    "write_diffusers_dir",
    "write_safetensors",
]

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
    """A checkpoint file or directory is unreadable (missing, truncated, corrupt)."""


class ConversionError(ValueError):
    """The keys or shapes of a checkpoint do not match the model; the message lists every problem."""

    def __init__(self, missing: Sequence[str], unexpected: Sequence[str], mis_shaped: Sequence[str], context: str):
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mis_shaped = list(mis_shaped)
        lines = [f"{context}: {len(self.missing)} missing, {len(self.unexpected)} unexpected, "
                 f"{len(self.mis_shaped)} mis-shaped key(s)"]
        for title, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("mis-shaped", self.mis_shaped)):
            lines += [f"  {title}: {item}" for item in items]
        super().__init__("\n".join(lines))


# ----------------------------------------------------------------------------------------------------------------
# safetensors (numpy only)
# ----------------------------------------------------------------------------------------------------------------

_ST_TO_NP = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}


def is_float_dtype(dtype: np.dtype) -> bool:
    """A floating dtype, bfloat16 and float8 included (``np.issubdtype(bfloat16, np.floating)`` is False)."""
    return dtype.kind == "f" or dtype in (_ST_TO_NP["BF16"], _ST_TO_NP["F8_E4M3"], _ST_TO_NP["F8_E5M2"])


def resolve_dtype(dtype: Any) -> np.dtype | None:
    """'float32' | 'fp32' | 'bfloat16' | 'bf16' | 'float16' | 'fp16' | a numpy/jax dtype | None -> np.dtype | None."""
    if dtype is None:
        return None
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    if isinstance(dtype, str):
        name = aliases.get(dtype.lower(), dtype.lower())
        if name == "bfloat16":
            return np.dtype(ml_dtypes.bfloat16)
        if name not in ("float32", "float16", "float64"):
            raise ValueError(f"unsupported {dtype=}; use float32, bfloat16 or float16")
        return np.dtype(name)
    return np.dtype(dtype)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a .safetensors file into ``{key: np.ndarray}`` (read-only views of a memory map; nothing is copied).

    Raises:
        CheckpointError: naming ``path`` when the file is missing, truncated, or its header is corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"safetensors file not found: {path}")
    file_size = path.stat().st_size
    if file_size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({file_size} bytes, no header length)")
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        if header_len <= 0 or 8 + header_len > file_size:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {header_len} bytes, "
                                  f"file of {file_size} bytes)")
        try:
            header = json.loads(handle.read(header_len).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = file_size - 8 - header_len
    try:
        needed = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise CheckpointError(f"{path}: corrupt safetensors header (an entry without data_offsets: {err!r})") from None
    if needed > data_size:
        raise CheckpointError(f"{path}: truncated safetensors file: tensors need {needed} data bytes, "
                              f"the file holds {data_size}")
    buffer = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len, shape=(data_size,)) if data_size \
        else np.zeros((0,), np.uint8)
    tensors: dict[str, np.ndarray] = {}
    for key, info in header.items():
        try:
            dtype = _ST_TO_NP[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: corrupt header entry for {key!r}: {info!r}") from err
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {key!r} of shape {shape} {info['dtype']} has {end - begin} bytes")
        tensors[key] = buffer[begin:end].view(dtype).reshape(shape)
    return tensors


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``{key: array}`` as a .safetensors file, atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for key in sorted(tensors):
        array = np.ascontiguousarray(np.asarray(tensors[key]))
        if array.dtype not in _NP_TO_ST:
            raise ValueError(f"tensor {key!r}: dtype {array.dtype} has no safetensors equivalent")
        header[key] = {"dtype": _NP_TO_ST[array.dtype], "shape": list(array.shape),
                       "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(len(header_bytes).to_bytes(8, "little"))
            handle.write(header_bytes)
            for array in arrays:
                handle.write(array.tobytes())


def read_diffusers_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` dict of a diffusers model directory.

    Raises:
        CheckpointError: naming the directory without a config, or the corrupt file.
    """
    config_path = Path(directory) / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_NAME}")
    return read_json_object(config_path)


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object (a dict) in the file ``path``.

    Raises:
        CheckpointError: naming ``path`` when it is not valid UTF-8 JSON (e.g. truncated) or not an object.
    """
    try:
        return fileio.read_json_object(path)
    except ValueError as err:  # (a missing file stays FileNotFoundError)
        raise CheckpointError(str(err)) from None


def read_diffusers_dir(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read ``config.json`` and the (possibly sharded) safetensors weights of a diffusers model directory.

    Returns:
        ``(config, state)``: the config dict and ``{diffusers key: np.ndarray}`` in torch layout.
    Raises:
        CheckpointError: naming the file at fault (no config, no weights, truncated shard, bad index).
    """
    directory = Path(directory)
    config = read_diffusers_config(directory)
    index_path = directory / WEIGHTS_INDEX_NAME
    if (directory / WEIGHTS_NAME).is_file():
        return config, read_safetensors(directory / WEIGHTS_NAME)
    if not index_path.is_file():
        raise CheckpointError(f"{directory}: neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME} found")
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index_path}: corrupt index ({err!r})") from err
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index_path}: corrupt index (weight_map must map tensor names to shard files)")
    state: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        shard_tensors = read_safetensors(directory / shard)
        listed = {k for k, v in weight_map.items() if v == shard}
        if listed - set(shard_tensors):
            raise CheckpointError(f"{directory / shard}: keys listed in the index are absent: "
                                  f"{sorted(listed - set(shard_tensors))}")
        # only what the index assigns to this shard: a key it also holds but the index puts elsewhere (or nowhere)
        # would otherwise replace the listed tensor depending on the shards' order
        stray = sorted(set(shard_tensors) - listed)
        if stray:
            raise CheckpointError(f"{directory / shard}: holds tensors {stray[:5]}{' ...' if len(stray) > 5 else ''} "
                                  f"that {index_path.name} does not assign to it")
        state.update({k: shard_tensors[k] for k in listed})
    return config, state


def write_diffusers_dir(directory: str | os.PathLike, config: Mapping[str, Any], state: Mapping[str, np.ndarray],
                        max_shard_bytes: int | None = None) -> None:
    """Write a diffusers model directory: weights (one file, or shards + index when ``max_shard_bytes`` is given,
    each written atomically) and then ``config.json`` (written last, so a directory with a config is complete)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    stale_config = directory / CONFIG_NAME
    if stale_config.exists():  # the directory is incomplete until the new config.json lands
        stale_config.unlink()
    if max_shard_bytes is None:
        write_safetensors(directory / WEIGHTS_NAME, state)
        for stale in [directory / WEIGHTS_INDEX_NAME, *directory.glob("diffusion_pytorch_model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)
    else:
        (directory / WEIGHTS_NAME).unlink(missing_ok=True)
        for stale in directory.glob("diffusion_pytorch_model-*-of-*.safetensors"):
            stale.unlink()
        shards: list[list[str]] = [[]]
        size = 0
        for key in keys:
            nbytes = np.asarray(state[key]).nbytes
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(key)
            size += nbytes
        weight_map = {}
        for index, shard_keys in enumerate(shards):
            name = f"diffusion_pytorch_model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(directory / name, {k: state[k] for k in shard_keys})
            weight_map.update({k: name for k in shard_keys})
        total = int(sum(np.asarray(state[k]).nbytes for k in keys))
        atomic_write_json(directory / WEIGHTS_INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    atomic_write_json(directory / CONFIG_NAME, dict(config))


# ----------------------------------------------------------------------------------------------------------------
# named tensor transforms
# ----------------------------------------------------------------------------------------------------------------

TensorFn = Callable[[list[np.ndarray]], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class TensorTransform:
    """A named pair of pure functions: diffusers tensors -> flax tensors, and its exact inverse."""

    forward: TensorFn
    inverse: TensorFn


def _linear_kernel(w: np.ndarray) -> np.ndarray:
    if w.ndim != 2:
        raise ValueError(f"a Linear weight must be 2-D (o, d), got shape {w.shape}")
    return w.T


def _conv1x1_kernel(w: np.ndarray) -> np.ndarray:
    if w.ndim != 4 or w.shape[2:] != (1, 1):
        raise ValueError(f"a 1x1 conv weight must have shape (o, d, 1, 1), got {w.shape}")
    return w[:, :, 0, 0].T


def _conv_kernel(w: np.ndarray) -> np.ndarray:
    if w.ndim != 4:
        raise ValueError(f"a conv weight must be 4-D OIHW, got shape {w.shape}")
    return w.transpose(2, 3, 1, 0)


def _split(array: np.ndarray, parts: int, axis: int) -> list[np.ndarray]:
    if array.shape[axis] % parts:
        raise ValueError(f"cannot split shape {array.shape} in {parts} equal parts along axis {axis}")
    return list(np.split(array, parts, axis=axis))


TRANSFORMS: dict[str, TensorTransform] = {
    "identity": TensorTransform(lambda xs: list(xs), lambda ys: list(ys)),
    "linear": TensorTransform(lambda xs: [_linear_kernel(xs[0])], lambda ys: [ys[0].T]),
    "conv1x1": TensorTransform(lambda xs: [_conv1x1_kernel(xs[0])], lambda ys: [ys[0].T[:, :, None, None]]),
    "conv": TensorTransform(lambda xs: [_conv_kernel(xs[0])], lambda ys: [ys[0].transpose(3, 2, 0, 1)]),
    "fuse_linear": TensorTransform(lambda xs: [np.concatenate([_linear_kernel(x) for x in xs], axis=1)],
                                   lambda ys: [y.T for y in ys]),  # inverse completed in _invert (needs n)
    "split_linear": TensorTransform(lambda xs: [x.T for x in xs], lambda ys: [np.concatenate(ys, axis=1).T]),
    "fuse_bias": TensorTransform(lambda xs: [np.concatenate(xs, axis=0)], lambda ys: ys),
    "split_bias": TensorTransform(lambda xs: xs, lambda ys: [np.concatenate(ys, axis=0)]),
}


def register_transform(name: str, forward: TensorFn, inverse: TensorFn) -> None:
    """Add a named transform (``forward`` maps the rule's source tensors to its targets, ``inverse`` back)."""
    if name in TRANSFORMS:
        raise ValueError(f"transform {name!r} is already registered")
    TRANSFORMS[name] = TensorTransform(forward, inverse)


def _apply(rule_: KeyRule, tensors: list[np.ndarray], inverse: bool) -> list[np.ndarray]:
    """Run a rule's transform; the fuse/split transforms need the rule's arity, supplied here."""
    name = rule_.transform
    n_src, n_tgt = len(rule_.source), len(rule_.target or ())
    if name == "split_linear" and not inverse:
        return [x.T for x in _split(tensors[0], n_tgt, axis=0)]
    if name == "split_bias" and not inverse:
        return _split(tensors[0], n_tgt, axis=0)
    if name == "fuse_linear" and inverse:
        return [x.T for x in _split(tensors[0], n_src, axis=1)]
    if name == "fuse_bias" and inverse:
        return _split(tensors[0], n_src, axis=0)
    transform = TRANSFORMS[name]
    return (transform.inverse if inverse else transform.forward)(tensors)


# ----------------------------------------------------------------------------------------------------------------
# the key table
# ----------------------------------------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{([a-z])\}")


def _compile(pattern: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(pattern)
    regex = "".join(re.escape(p) if n % 2 == 0 else f"(?P<{p}>\\d+)" for n, p in enumerate(parts))
    return re.compile(f"^{regex}$")


def _fill(pattern: str, groups: Mapping[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: groups[m.group(1)], pattern)


@dataclasses.dataclass(frozen=True)
class KeyRule:
    """diffusers key pattern(s) -> flax path pattern(s) through the named transform.

    Attributes:
        source: diffusers key patterns (``{i}``-style integer placeholders).
        target: flax dotted-path patterns using the same placeholders, or None to drop the source keys.
        transform: a key of :data:`TRANSFORMS`.
    """

    source: tuple[str, ...]
    target: tuple[str, ...] | None
    transform: str = "identity"

    def __post_init__(self):
        if self.transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {self.transform!r}; known: {sorted(TRANSFORMS)}")
        names = {tuple(sorted(_PLACEHOLDER.findall(p))) for p in self.source + (self.target or ())}
        if len(names) > 1:
            raise ValueError(f"rule {self.source} -> {self.target}: all patterns must use the same placeholders")


def rule(source: str | Sequence[str], target: str | Sequence[str] | None, transform: str = "identity") -> KeyRule:
    """Build a :class:`KeyRule` from one pattern or a sequence of patterns on each side."""
    as_tuple = (lambda p: (p,) if isinstance(p, str) else tuple(p))
    return KeyRule(as_tuple(source), None if target is None else as_tuple(target), transform)


def linear_rules(prefix: str, target_prefix: str | None = None, bias: bool = True,
                 transform: str = "linear") -> list[KeyRule]:
    """Rules of one torch Linear (or 1x1 conv with ``transform="conv1x1"``): ``weight -> kernel``, ``bias -> bias``."""
    target_prefix = prefix if target_prefix is None else target_prefix
    rules = [rule(f"{prefix}.weight", f"{target_prefix}.kernel", transform)]
    if bias:
        rules.append(rule(f"{prefix}.bias", f"{target_prefix}.bias"))
    return rules


def param_rules(*names: str) -> list[KeyRule]:
    """Identity rules for parameters kept under the same name and layout (norm weights, tables, embeddings)."""
    return [rule(name, name) for name in names]


class KeyTable:
    """An ordered tuple of :class:`KeyRule` s describing one model family's checkpoint layout."""

    def __init__(self, rules: Iterable[KeyRule], name: str = "model"):
        self.rules = tuple(rules)
        self.name = name
        self._source_res = [[_compile(p) for p in r.source] for r in self.rules]
        self._target_res = [[_compile(p) for p in (r.target or ())] for r in self.rules]

    @staticmethod
    def _match(side: list[list[re.Pattern]], key: str) -> tuple[int, int, dict[str, str]] | None:
        """``(rule index, slot, captured groups)`` of the first pattern of one side (``_source_res`` or
        ``_target_res``) that matches ``key``; ``None`` if none does."""
        for rule_index, regexes in enumerate(side):
            for slot, regex in enumerate(regexes):
                found = regex.match(key)
                if found:
                    return rule_index, slot, found.groupdict()
        return None

    def _group_by_rule(self, side: list[list[re.Pattern]], keys: Iterable[str]
                       ) -> tuple[dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]], list[str]]:
        """The ``keys`` of one side grouped by the rule application they belong to:
        ``({(rule index, captured groups): {slot: key}}, [keys no rule matches])``."""
        groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]] = {}
        unmatched: list[str] = []
        for key in keys:
            found = self._match(side, key)
            if found is None:
                unmatched.append(key)
                continue
            rule_index, slot, captured = found
            groups.setdefault((rule_index, tuple(sorted(captured.items()))), {})[slot] = key
        return groups, unmatched

    def to_flax(self, state: Mapping[str, np.ndarray], expected_shapes: Mapping[str, tuple[int, ...]],
                dtype: Any = None) -> dict[str, np.ndarray]:
        """diffusers state -> flax state.

        Args:
            state: ``{diffusers key: array}`` in torch layout.
            expected_shapes: ``{flax path: shape}`` of the model being loaded (see :func:`abstract_shapes`).
            dtype: cast every floating tensor to this dtype (None keeps the checkpoint's dtype).
        Raises:
            ConversionError: listing every missing, unexpected and mis-shaped key at once.
        """
        target_dtype = resolve_dtype(dtype)
        groups, unmatched = self._group_by_rule(self._source_res, state)
        unexpected = [f"{key} {tuple(state[key].shape)} (no rule in the {self.name} key table)" for key in unmatched]
        missing: list[str] = []
        mis_shaped: list[str] = []
        produced: set[str] = set()
        result: dict[str, np.ndarray] = {}
        for (rule_index, captured_items), slots in groups.items():
            rule_ = self.rules[rule_index]
            captured = dict(captured_items)
            if rule_.target is None:
                continue
            absent = [_fill(p, captured) for n, p in enumerate(rule_.source) if n not in slots]
            if absent:
                missing += [f"{k} (needed with {', '.join(slots.values())})" for k in absent]
                continue
            sources = [np.asarray(state[slots[n]]) for n in range(len(rule_.source))]
            try:
                outputs = _apply(rule_, sources, inverse=False)
            except ValueError as err:
                mis_shaped.append(f"{', '.join(slots.values())}: {err}")
                produced.update(_fill(p, captured) for p in rule_.target)
                continue
            for pattern, array in zip(rule_.target, outputs):
                path = _fill(pattern, captured)
                source_names = ", ".join(slots[n] for n in range(len(rule_.source)))
                produced.add(path)
                if path not in expected_shapes:
                    unexpected.append(f"{source_names} (-> {path}, which the model does not have)")
                    continue
                if tuple(array.shape) != tuple(expected_shapes[path]):
                    mis_shaped.append(f"{source_names}: gives {path} of shape {tuple(array.shape)}, "
                                      f"the model expects {tuple(expected_shapes[path])}")
                    continue
                if not is_float_dtype(array.dtype):
                    mis_shaped.append(f"{source_names}: gives {path} of dtype {array.dtype}, the model's parameters "
                                      "are floating point")
                    continue
                if target_dtype is not None:
                    array = array.astype(target_dtype)
                result[path] = array
        for path in expected_shapes:
            if path in produced:
                continue
            found = self._match(self._target_res, path)
            if found is None:
                missing.append(f"{path} (the {self.name} key table has no rule producing it)")
            else:
                rule_index, _, captured = found
                sources = [_fill(p, captured) for p in self.rules[rule_index].source]
                if not any(s in m for s in sources for m in missing):
                    missing += [f"{s} (-> {path})" for s in sources if s not in state] or \
                        [f"{path} (from {sources})"]
        if missing or unexpected or mis_shaped:
            raise ConversionError(missing, unexpected, mis_shaped, f"cannot convert the {self.name} checkpoint")
        return result

    def to_diffusers(self, params: Mapping[str, np.ndarray], dtype: Any = None) -> dict[str, np.ndarray]:
        """flax state -> diffusers state (exact inverse of :meth:`to_flax`).

        Raises:
            ConversionError: for flax paths that no rule produces, or rules with only part of their targets.
        """
        target_dtype = resolve_dtype(dtype)
        groups, unmatched = self._group_by_rule(self._target_res, params)
        unexpected = [f"{path} (no rule in the {self.name} key table)" for path in unmatched]
        missing: list[str] = []
        state: dict[str, np.ndarray] = {}
        for (rule_index, captured_items), slots in groups.items():
            rule_ = self.rules[rule_index]
            captured = dict(captured_items)
            absent = [_fill(p, captured) for n, p in enumerate(rule_.target) if n not in slots]
            if absent:
                missing += absent
                continue
            outputs = _apply(rule_, [np.asarray(params[slots[n]]) for n in range(len(rule_.target))], inverse=True)
            for pattern, array in zip(rule_.source, outputs):
                array = np.ascontiguousarray(array)
                if target_dtype is not None and is_float_dtype(array.dtype):
                    array = array.astype(target_dtype)
                state[_fill(pattern, captured)] = array
        if missing or unexpected:
            raise ConversionError(missing, unexpected, [], f"cannot export the {self.name} parameters")
        return state


# ----------------------------------------------------------------------------------------------------------------
# NNX glue and orbax
# ----------------------------------------------------------------------------------------------------------------

def _dotted(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def flat_state_dict(model_or_state: Any) -> dict[str, Any]:
    """``{dotted path: array}`` of an NNX module or state (values are the raw arrays, or ShapeDtypeStructs)."""
    from flax import nnx

    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    flat = {}
    for path, variable in nnx.to_flat_state(state):
        flat[_dotted(path)] = variable.get_value() if hasattr(variable, "get_value") else variable.value
    return flat


def abstract_shapes(build: Callable[[], Any]) -> dict[str, tuple[int, ...]]:
    """``{dotted path: shape}`` of the NNX model ``build()`` would create, without allocating it."""
    from flax import nnx

    abstract = nnx.eval_shape(build)
    return {path: tuple(value.shape) for path, value in flat_state_dict(abstract).items()}


def merge_flat_state(build: Callable[[], Any], params: Mapping[str, Any]) -> Any:
    """Create the NNX model of ``build()`` abstractly and fill it with ``params`` (``{dotted path: array}``).

    Raises:
        ConversionError: when ``params`` and the model disagree on keys or shapes.
    """
    import jax.numpy as jnp
    from flax import nnx

    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    expected = {_dotted(path): (path, variable) for path, variable in flat}
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    mis_shaped = []
    new_leaves = []
    for key, (path, variable) in expected.items():
        if key in params:
            value = params[key]
            shape = tuple(variable.get_value().shape if hasattr(variable, "get_value") else variable.value.shape)
            if tuple(value.shape) != shape:
                mis_shaped.append(f"{key}: got {tuple(value.shape)}, the model expects {shape}")
            new_leaves.append((path, variable.replace(jnp.asarray(value))))
    if missing or unexpected or mis_shaped:
        raise ConversionError(missing, unexpected, mis_shaped, "cannot load parameters into the model")
    return nnx.merge(graphdef, nnx.from_flat_state(new_leaves))


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def save_flax_state(directory: str | os.PathLike, params: Mapping[str, Any],
                    config: Mapping[str, Any] | None = None) -> None:
    """Save a flax state (``{dotted path: array}``) and an optional config dict with orbax, atomically.

    The checkpoint is written into a temporary sibling directory and renamed to ``directory`` once complete; an
    existing ``directory`` is replaced only after the new one is whole.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    publishable(tmp)
    try:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "params", _nest({k: np.asarray(v) for k, v in params.items()}))
        checkpointer.wait_until_finished()
        (tmp / CONFIG_NAME).write_text(json.dumps(dict(config or {}), indent=2, sort_keys=True))
        replace_folder(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def load_flax_state(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Load what :func:`save_flax_state` wrote: ``(config dict, {dotted path: np.ndarray})``."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not (directory / "params").is_dir() or not (directory / CONFIG_NAME).is_file():
        raise CheckpointError(f"{directory}: not a complete flax checkpoint (needs params/ and {CONFIG_NAME})")
    restored = ocp.StandardCheckpointer().restore(directory / "params")
    config = json.loads((directory / CONFIG_NAME).read_text())
    return config, {k: np.asarray(v) for k, v in _flatten(restored).items()}


def convert_to_nnx(state: Mapping[str, np.ndarray], table: KeyTable, build: Callable[[], Any],
                   dtype: Any = None) -> Any:
    """diffusers state -> the NNX model ``build()`` (built abstractly, then filled). ``build`` must create its
    parameters in ``dtype``.

    Raises:
        ConversionError: listing every missing, unexpected and mis-shaped key.
    """
    params = table.to_flax(state, abstract_shapes(build), dtype)
    return merge_flat_state(build, params)


def export_nnx(model: Any, table: KeyTable, directory: str | os.PathLike, config: Mapping[str, Any],
               dtype: Any = None, max_shard_bytes: int | None = None) -> None:
    """NNX model -> diffusers directory (``config`` is written as config.json; see :func:`write_diffusers_dir`)."""
    params = {k: np.asarray(v) for k, v in flat_state_dict(model).items()}
    write_diffusers_dir(directory, config, table.to_diffusers(params, dtype), max_shard_bytes)


#: Metadata key of a config dataclass field that is a JAX-side choice, not a diffusers ``config.json`` field (e.g.
#: ``attention_impl``): :func:`dataclass_to_config` leaves it out and :func:`dataclass_from_config` refuses it in a
#: file (set it with ``dataclasses.replace`` or a loader's ``config_overrides``).
JAX_SIDE = "jax_side"


def jax_side_field(default: Any) -> Any:
    """A config dataclass field with ``default`` that is a JAX-side choice (:data:`JAX_SIDE`)."""
    return dataclasses.field(default=default, metadata={JAX_SIDE: True})


def _json_kind_of(default: Any) -> str | None:
    """The JSON kind a config field takes, from its default (``None`` when the default does not say)."""
    if isinstance(default, bool):
        return "a boolean"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, str):
        return "a string"
    if isinstance(default, tuple):
        return "a list"
    return None


def _is_json_kind(value: Any, kind: str) -> bool:
    if kind == "a boolean":
        return isinstance(value, bool)
    if kind == "an integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "a number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "a string":
        return isinstance(value, str)
    return isinstance(value, (list, tuple))


def dataclass_from_config(cls: type, config: Mapping[str, Any], ignored: Mapping[str, Any] = ()) -> Any:
    """Build the frozen config dataclass ``cls`` from a diffusers ``config.json`` dict.

    Keys starting with ``_`` (``_class_name``, ``_diffusers_version``, ...) are skipped; JAX-side fields
    (:data:`JAX_SIDE`) are unknown keys here. ``ignored`` maps keys the
    port accepts but does not model to the value the port implements (``None``: any value accepted), e.g.
    ``{"dropout": 0.0}``. Lists become tuples.

    Raises:
        ValueError: naming unknown keys, values of another JSON kind than the field's default (``"num_layers": "2"``),
            and ignored keys whose value the port does not implement.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get(JAX_SIDE)}
    kwargs: dict[str, Any] = {}
    problems = []
    for key, value in config.items():
        if key.startswith("_"):
            continue
        if key in fields:
            expected = _json_kind_of(fields[key].default)
            if expected == "an integer" and isinstance(value, float) and value.is_integer():
                value = int(value)  # e.g. a rope theta written as 5000000.0
            if expected is not None and value is not None and not _is_json_kind(value, expected):
                problems.append(f"{key}={value!r} (expected {expected})")
                continue
            kwargs[key] = tuple(value) if isinstance(value, list) else value
        elif key in ignored:
            if ignored[key] is not None and value != ignored[key] and value is not None:
                problems.append(f"{key}={value!r} (only {ignored[key]!r} is implemented)")
        else:
            problems.append(f"{key}={value!r} (unknown key)")
    if problems:
        raise ValueError(f"{cls.__name__}: unsupported config entries: {'; '.join(problems)}")
    return cls(**kwargs)


def dataclass_to_config(instance: Any, class_name: str) -> dict[str, Any]:
    """The diffusers ``config.json`` dict of a config dataclass (tuples become lists; JAX-side fields left out)."""
    config: dict[str, Any] = {"_class_name": class_name}
    for field in dataclasses.fields(instance):
        if field.metadata.get(JAX_SIDE):
            continue
        value = getattr(instance, field.name)
        config[field.name] = list(value) if isinstance(value, tuple) else value
    return config


class DiTConfig:
    """Base of the frozen config dataclasses of the DiT ports (PixArt-Σ, SANA, FLUX.1) that mirror a diffusers
    ``config.json`` field for field: the width properties and the config round trip they share.

    A subclass sets the class attributes ``diffusers_class`` (the config's ``_class_name``) and, if the port
    accepts keys it does not model, ``ignored_keys`` (see :func:`dataclass_from_config`); it has the fields
    ``num_attention_heads``, ``attention_head_dim``, ``in_channels`` and ``out_channels``.
    """

    diffusers_class: ClassVar[str]
    ignored_keys: ClassVar[Mapping[str, Any]] = {}

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def resolved_out_channels(self) -> int:
        return self.in_channels if self.out_channels is None else self.out_channels

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any]) -> Any:
        """From a diffusers config.json dict (unknown or unported settings raise, naming the key)."""
        return dataclass_from_config(cls, config, ignored=cls.ignored_keys)

    def to_diffusers_config(self) -> dict[str, Any]:
        return dataclass_to_config(self, self.diffusers_class)

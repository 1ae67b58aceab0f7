"""The stacked-stage driver of kroquant_jax/layerset.py: run_groups over shape groups (LoRaQ, SVDQuant, SmoothQuant)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kroquant_jax import layerset
from kroquant_jax.layerset import RunConfig


@pytest.mark.parametrize("max_per_program, pad_to, progress", [(1, 1, False), (8, 4, True)])
def test_run_groups_gives_each_name_its_own_outputs(max_per_program, pad_to, progress, capsys):
    arrays = {"a": np.ones((2, 3)), "b": np.full((4, 3), 2.0), "c": np.arange(6.0).reshape(2, 3)}
    calls = []

    def fn(x):  # (L, r, c) -> ((L,), (L, r, c))
        calls.append(x.shape)
        return x.sum(axis=(1, 2)), x * 2

    groups = layerset.group_by_shape(arrays)
    out = layerset.run_groups(jax.jit(fn), groups, lambda names: [np.stack([arrays[n] for n in names])],
                              max_per_program=max_per_program, run=RunConfig(shard=False, progress=progress),
                              pad_to=pad_to, desc="test stage")
    assert list(out) == ["a", "c", "b"]  # the order of the groups
    for name, x in arrays.items():
        total, doubled = out[name]
        assert isinstance(doubled, np.ndarray) and total == x.sum()
        np.testing.assert_array_equal(doubled, 2 * x)
    # every program (a trace of fn) is sized for min(pad_to, max_per_program) layers: padded up, or chunked
    assert {shape[0] for shape in calls} == {min(pad_to, max_per_program)}
    assert {shape[1:] for shape in calls} == {(2, 3), (4, 3)}
    assert ("test stage" in capsys.readouterr().err) == progress

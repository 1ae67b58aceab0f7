"""Atomic writes: the target is replaced whole or not at all, temporaries never linger, files are 0644."""

import json
import os
import stat

import pytest

from kroquant_jax import fileio


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_replaces_and_publishes(tmp_path):
    target = tmp_path / "sub" / "result.json"
    fileio.atomic_write_json(target, {"b": 2, "a": 1})
    assert json.loads(target.read_text()) == {"a": 1, "b": 2}
    assert target.read_text().endswith("\n")
    assert _mode(target) == fileio.FILE_MODE
    fileio.atomic_write_text(target, "second")
    assert target.read_text() == "second"
    assert os.listdir(target.parent) == ["result.json"]


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "table.md"
    fileio.atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with fileio.atomic_path(target) as tmp:
            tmp.write_bytes(b"half a fi")
            raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["table.md"]


def test_suffix_for_extension_sniffing_writers(tmp_path):
    np = pytest.importorskip("numpy")
    target = tmp_path / "state.npz"
    with fileio.atomic_path(target, suffix=".npz") as tmp:
        assert tmp.name.endswith(".npz") and tmp.parent == tmp_path
        np.savez(tmp, x=np.arange(3))
    assert np.load(target)["x"].tolist() == [0, 1, 2]
    assert os.listdir(tmp_path) == ["state.npz"]


def test_staged_results_save_after_each_stage_and_record_errors(tmp_path, capsys):
    path = tmp_path / "run.json"
    payload = {"done": []}
    lines = []
    results = fileio.StagedResults(path, payload, before_save=lambda p: p.__setitem__("count", len(p["done"])),
                                   log=lines.append)
    assert results.stage("first", lambda: payload["done"].append("first") or 7) == 7
    assert json.loads(path.read_text())["done"] == ["first"]

    def broken():
        raise ValueError("bad shape (3, 4)")

    assert results.stage("second", broken) is None  # recorded, not raised
    saved = json.loads(path.read_text())
    assert saved["errors"] == {"second": "ValueError: bad shape (3, 4)"} and saved["count"] == 1
    assert saved["elapsed_s"] >= 0 and "Traceback" in capsys.readouterr().err
    assert [line.split("] ")[1] for line in lines] == ["first done", "second done"]

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


def test_atomic_append_keeps_whole_lines_and_the_old_file_on_failure(tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    fileio.atomic_append_text(log, '{"step": 1}\n')
    fileio.atomic_append_text(log, '{"step": 2}\n')
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'

    def fail(*_):  # the rename that publishes the appended file never happens
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        fileio.atomic_append_text(log, '{"step": 3}\n')
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'  # no torn line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]  # nor a temporary left behind


def test_replace_folder_keeps_the_old_folder_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    target, new = tmp_path / "ckpt", tmp_path / "new"
    target.mkdir()
    (target / "a.txt").write_text("old")
    new.mkdir()
    (new / "a.txt").write_text("new")
    fileio.replace_folder(new, target)
    assert (target / "a.txt").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the old one deleted once replaced
    # interrupted between moving the old folder aside and moving the new one in: the old one is still on disk
    newer = tmp_path / "newer"
    newer.mkdir()
    real_replace = fileio.os.replace
    calls = []

    def second_rename_fails(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError("interrupted")
        real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", second_rename_fails)
    with pytest.raises(OSError, match="interrupted"):
        fileio.replace_folder(newer, target)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.old-")]
    assert len(aside) == 1 and (aside[0] / "a.txt").read_text() == "new"

"""The `kroquant` command's behaviour: --version, one-line errors (--debug shows the traceback), --help of every verb,
no BrokenPipeError when the reader stops."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import cli

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


def _kroquant(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "scripts.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=ENV, **kwargs)


def test_version_and_usage(capsys):
    import kroquant_jax

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kroquant {kroquant_jax.__version__}"
    assert cli.main([]) == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: kroquant") and all(verb in usage for verb in cli.VERBS)
    assert cli.main(["no-such-verb"]) == 2
    assert "unknown verb 'no-such-verb'" in capsys.readouterr().err


def _options(help_text: str) -> dict[str, str]:
    """``{flag: its help text}`` of an argparse help's options section."""
    section = help_text.split("options:\n", 1)[1].split("\n\n", 1)[0]
    entries, current = {}, None
    for line in section.splitlines():
        match = re.match(r"  (-[\w-]+(?:[ ,][^ ].*?)?)(?:  +(.*))?$", line)
        if match and line.startswith("  -"):
            current = match.group(1).split()[0].rstrip(",")
            entries[current] = match.group(2) or ""
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def _actions(help_text: str) -> dict[str, str]:
    """``{action: its help line}`` of a verb with actions (``kroquant <verb> {a,b,...}``); empty for other verbs."""
    match = re.search(r"^  \{([\w,-]+)\}\n((?:    .*\n)*)", help_text, re.M)
    if match is None:
        return {}
    lines = dict(re.findall(r"^    ([\w-]+)(?: +(.*))?$", match.group(2), re.M))
    return {name: lines.get(name) or "" for name in match.group(1).split(",")}


@pytest.mark.parametrize("verb", list(cli.VERBS))
def test_every_verb_help_names_the_verb_documents_every_option_and_gives_examples(verb, capsys):
    """Every verb, and each action of a verb with actions (``kroquant dmd2 train``): usage ``kroquant <command>``,
    every option documented, examples written as ``kroquant <command> ...``; a verb's actions each have a help line."""
    assert cli.main([verb, "--help"]) == 0
    text = capsys.readouterr().out
    actions = _actions(text)
    assert all(help_.strip() for help_ in actions.values()), actions
    commands = [(verb, text)]
    for action in actions:
        assert cli.main([verb, action, "--help"]) == 0
        commands.append((f"{verb} {action}", capsys.readouterr().out))
    for command, text in commands:
        assert text.startswith(f"usage: kroquant {command} ")
        options = _options(text)
        assert len(options) > 1 or (command == verb and actions)  # a verb with actions: its options are -h only
        undocumented = [flag for flag, help_ in options.items() if not help_.strip()]
        assert not undocumented, (command, undocumented)
        assert "examples:\n  kroquant " + command in text
        assert "python -m scripts" not in text


def test_quantize_checkpoint_help_shows_defaults(capsys):
    assert cli.main(["quantize-checkpoint", "--help"]) == 0
    options = _options(capsys.readouterr().out)
    assert "(default: 20)" in options["--steps"] and "(default: kroquant)" in options["--recipe"]
    assert "(default: keep-16bit)" in options["--unaligned"]


def test_demo_help_shows_the_demo_defaults(capsys):
    assert cli.main(["demo", "--help"]) == 0
    options = _options(capsys.readouterr().out)
    assert "(default: runs/demo)" in options["--out"] and "(default: 12)" in options["--steps"]


def test_qad_and_dmd2_actions_show_defaults_and_refuse_zero_counts(capsys, tmp_path):
    assert cli.main(["dmd2", "train", "--help"]) == 0
    options = _options(capsys.readouterr().out)
    assert "(default: 64)" in options["--batch-size"] and "(default: (0.02, 0.98))" in options["--dm-sigma-range"]
    assert cli.main(["qad", "--help"]) == 0
    assert "(default: 1000)" in _options(capsys.readouterr().out)["--steps"]
    for argv, command, flag in ((["dmd2", "train", "--data", "d", "--run", "r", "--cycles", "0"], "dmd2 train",
                                 "--cycles"),
                                (["dmd2", "evaluate", "--data", "d", "--run", "r", "--reference", "x", "--out", "o",
                                  "--student-steps", "1", "0"], "dmd2 evaluate", "--student-steps"),
                                (["qad", "--data", "d", "--out", str(tmp_path), "--steps", "0"], "qad", "--steps")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == f"kroquant {command}: error: argument {flag}: must be a positive integer, got 0"


@pytest.mark.parametrize("flag, argv", [
    ("--steps", ["--steps", "0"]),
    ("--batch-size", ["--batch-size", "0"]),
    ("--latent-hw", ["--latent-hw", "0", "0"]),
    ("--eval-prompts", ["--eval-prompts", "0"]),
    ("--rows-per-layer", ["--rows-per-layer", "-3"]),
])
def test_zero_counts_are_argparse_errors_naming_the_flag(flag, argv, capsys, tmp_path):
    code = cli.main(["quantize-checkpoint", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"),
                     "--synthetic-prompts", "1", *argv])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"kroquant quantize-checkpoint: error: argument {flag}: must be a positive integer, got " \
                  f"{argv[1]}"


def test_user_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    args = ["quantize-checkpoint", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "o"),
            "--synthetic-prompts", "1"]
    proc = _kroquant(*args)
    assert proc.returncode == 1
    assert proc.stderr == f"kroquant quantize-checkpoint: error: --checkpoint {tmp_path / 'missing'}: no such folder\n"
    proc = _kroquant("--debug", *args)
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert "UserError: --checkpoint" in proc.stderr


def test_no_broken_pipe_error_when_the_reader_stops():
    proc = subprocess.Popen([sys.executable, "-m", "scripts.cli", "norm-table"], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` exiting before the table is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    assert "BrokenPipeError" not in err and "Traceback" not in err and err == ""


def test_internal_error_is_one_line(monkeypatch, capsys):
    from scripts import norm_commutation

    def broken(argv):
        raise TypeError("unexpected\nsecond line")

    monkeypatch.setattr(norm_commutation, "main", broken)
    assert cli.main(["norm-table"]) == 1
    err = capsys.readouterr().err
    assert err == ("kroquant norm-table: internal error: TypeError: unexpected (rerun with --debug for the "
                   "traceback)\n")


def test_generate_refuses_what_is_not_a_quantized_folder(tmp_path, capsys):
    prompts = tmp_path / "p.npz"
    prompts.write_bytes(b"")
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompts", str(prompts), "--out",
                     str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == f"kroquant generate: error: --checkpoint {tmp_path / 'none'}: no such file or " \
                                      f"folder\n"
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text("{}")
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "q"), "--prompts", str(prompts), "--out",
                     str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == (f"kroquant generate: error: {tmp_path / 'q'}: no model.safetensors (not a "
                                       f"quantized checkpoint folder written by kroquant)\n")


def test_choice_list_keeps_the_choices_order_and_names_unknown_names():
    import argparse

    from scripts.common_args import choice_list

    parse = choice_list(("a", "b", "c"), "system")
    assert parse(" c, a ") == ("a", "c")
    for text, named in (("a,x", "['x']"), (",", "','")):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"unknown system\(s\) {re.escape(named)}; choose from "
                                                            r"a, b, c"):
            parse(text)

"""Shared command-line pieces of the ``kroquant`` verbs: the parser every verb builds, argument types, user errors.

Every verb builds its parser with :func:`verb_parser`, so ``--help`` says ``usage: kroquant <verb>``, shows each
option's default, and ends with examples written as ``kroquant <verb> ...``. Counts use :func:`positive_int`:
``--steps 0`` is an argparse error naming the flag instead of a ``ZeroDivisionError`` deep in the run; sampler floats
use :func:`finite_float` / :func:`positive_float` (``--guidance nan`` would sample NaN latents). Output paths are
checked with :func:`check_out_dir` / :func:`check_out_file` before any expensive work.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["HelpFormatter", "UserError", "action_parser", "add_quiet", "check_out_dir", "check_out_file", "choice_list",
           "finite_float", "nonnegative_int", "positive_float", "positive_int", "quantize_with_store", "require_paths",
           "verb_parser"]


class UserError(Exception):
    """A mistake in the user's input (a flag, a file, a folder): ``kroquant`` prints its message as one line and exits
    with status 1 (``--debug`` shows the traceback)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and appends ``(default: ...)`` to every option's help that has a default
    value (not for ``None``, where the help says what happens without the option, nor for a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser_options(command: str, doc: str | None, examples: Sequence[str]) -> dict:
    """The ``ArgumentParser`` keywords of ``kroquant <command>`` (see :func:`verb_parser`)."""
    epilog = None
    if examples:
        epilog = "examples:\n" + "\n".join(f"  kroquant {command} {example}" for example in examples)
    return dict(prog=f"kroquant {command}", description=(doc or "").strip(), epilog=epilog,
                formatter_class=HelpFormatter)


def verb_parser(verb: str, doc: str | None, examples: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser of ``kroquant <verb>``: ``doc`` as the description, ``examples`` (each a command
    line after ``kroquant <verb>``) as the epilog."""
    return argparse.ArgumentParser(**_parser_options(verb, doc, examples))


def action_parser(subparsers, verb: str, action: str, doc: str, examples: Sequence[str] = ()
                  ) -> argparse.ArgumentParser:
    """The parser of ``kroquant <verb> <action>``, a verb with actions (``subparsers`` from the verb parser's
    ``add_subparsers``): the same help as :func:`verb_parser` (usage ``kroquant <verb> <action>``, defaults,
    ``examples`` after ``kroquant <verb> <action>``); the first line of ``doc`` is the action's line in the verb's
    help."""
    return subparsers.add_parser(action, help=doc.strip().splitlines()[0],
                                 **_parser_options(f"{verb} {action}", doc, examples))


def _int_at_least(text: str, minimum: int, requirement: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An ``int >= 1`` (argparse ``type=``; the error names the flag)."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An ``int >= 0`` (argparse ``type=``; the error names the flag)."""
    return _int_at_least(text, 0, ">= 0")


def finite_float(text: str) -> float:
    """A finite ``float`` (argparse ``type=``): ``nan`` or ``inf`` is an error naming the flag, not NaN latents."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite ``float > 0`` (argparse ``type=``; the error names the flag)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def choice_list(choices: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type=``: a comma-separated non-empty subset of ``choices`` -> that subset in the order of
    ``choices`` (a run order); an unknown name is an error naming it, the ``what`` (e.g. ``"variant"``) and the
    choices."""
    choices = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in names if v not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {bad or text!r}; choose from {', '.join(choices)}")
        return tuple(v for v in choices if v in names)

    return parse


def require_paths(*flag_paths: tuple[str, object]) -> None:
    """Refuses the first ``(flag, path)`` whose path is given (not None) but does not exist, naming the flag."""
    for flag, path in flag_paths:
        if path is not None and not Path(path).exists():
            raise UserError(f"{flag} {path}: no such file or folder")


def check_out_dir(out: str | Path, flag: str = "--out") -> None:
    """Creates the output folder ``out`` and checks that it is a writable folder, before any expensive work (a
    :class:`UserError` naming ``flag``)."""
    import tempfile

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check."):
            pass
    except OSError as err:
        raise UserError(f"{flag} {out}: not writable ({err.strerror or err})") from None


def check_out_file(path: str | Path, flag: str = "--out") -> None:
    """Checks, before any expensive work, that the output file ``path`` can be written: not a folder, in a writable
    folder (created). A :class:`UserError` names ``flag``."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder, not a file name")
    check_out_dir(path.parent, f"{flag} {path}: its folder")


def quantize_with_store(layer_set, recipe, store, overwrite: bool, flag: str, label: str = ""):
    """``kroquant_jax.calibrate.quantize_layer_set`` for a verb: a stale ``store`` becomes a :class:`UserError`
    that says how to proceed (``--overwrite`` or another ``flag`` folder); layers that took the fallback row split
    (fewer rows than asked) and resumed layers are announced on stderr (``LABEL: resumed N of M layers from STORE
    ...``). Returns ``(qlayers, reports)``."""
    import sys

    from kroquant_jax import calibrate, provenance

    try:
        qlayers, reports = calibrate.quantize_layer_set(layer_set, recipe, store=store, overwrite=overwrite)
    except provenance.StaleResultError as err:
        raise UserError(f"{err}; rerun with --overwrite to recompute, or choose another {flag}") from None
    resumed = sum(bool(r.get("resumed")) for r in reports.values())
    run = (calibrate.get_recipe(recipe) if isinstance(recipe, str) else recipe).run
    short = calibrate.fallback_split_layers(reports, run)
    if short:
        named = ", ".join(f"{n} ({r['test']} test rows)" for n, r in list(short.items())[:3])
        print(f"{label + ': ' if label else ''}{len(short)} of {len(reports)} layers have fewer activation rows than "
              f"the {run.num_rows} + {run.num_validation} + {run.num_test} asked for, so a fifth of their rows "
              f"validate and a fifth test: {named}{', ...' if len(short) > 3 else ''}", file=sys.stderr)
    if resumed:
        where = store.directory if hasattr(store, "directory") else store
        print(f"{label + ': ' if label else ''}resumed {resumed} of {len(reports)} layers from {where} (their inputs "
              f"and settings match)", file=sys.stderr)
    return qlayers, reports


def add_compile_cache(parser: argparse.ArgumentParser, what: str = "", timing: str = "") -> None:
    """``--compile-cache DIR`` (default off): JAX's persistent compilation cache, which the entry point turns on with
    ``kroquant_jax.calibrate.enable_compile_cache(args.compile_cache)`` before it compiles. ``what``: the programs it
    caches; ``timing``: what the cache does to the entry point's reported times."""
    parser.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="JAX persistent compilation cache folder (default: off): a later run with the same shapes "
                             "and settings loads the compiled programs" + (f" ({what})" if what else "")
                             + " instead of compiling them" + (f"; {timing}" if timing else ""))


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bars (the last summary line and errors are still printed)."""
    parser.add_argument("--quiet", action="store_true", help="no progress bars")

"""The `kroquant` command: one entry point, one verb per script.

    kroquant demo                  # the main job (see README)
    kroquant norm-table            # paper appendix C: which normalisations commute with a rotation
    kroquant <verb> --help         # each verb's own options
    kroquant --version

Each verb is a thin wrapper around a module's ``main(argv)`` in ``scripts/`` or ``benchmarks/``.

Errors: a mistake in the input (a bad flag value, a missing or broken file, a stale result folder: ``ValueError``,
``KeyError``, ``OSError``, :class:`scripts.common_args.UserError`) ends in one line ``kroquant <verb>: error: ...`` and
exit status 1; any other exception in one line ``kroquant <verb>: internal error: ...``, also status 1. ``--debug``
anywhere on the command line (or ``KROQUANT_DEBUG=1``) lets the traceback through instead. Output piped into a
program that stops reading (``| head``) ends quietly.
"""

from __future__ import annotations

import importlib
import os
import sys

VERBS: dict[str, tuple[str, str]] = {
    "demo": ("scripts.demo", "the main job: calibrate and compare W4A4 methods on the embedded default"),
    "norm-table": ("scripts.norm_commutation", "paper appendix C table (normalisation vs rotation)"),
    "calibrate": ("scripts.calibrate_layers", "calibrate a layer set with every method; per-layer table + plot"),
    "quantize-checkpoint": ("scripts.quantize_checkpoint", "diffusers dir -> capture -> calibrate -> generate"),
    "encode-prompts": ("scripts.encode_prompts", "prompts -> embeddings .npz with a local diffusers pipeline"),
    "generate": ("scripts.generate",
                 "generate with a quantized checkpoint folder (GPU: served kernels, CPU: simulated)"),
    "build-emoji-dataset": ("scripts.build_emoji_dataset", "build the emoji testbed dataset from the Noto font"),
    "train-testbed": ("scripts.train_testbed", "train the emoji testbed DiT"),
    "evaluate": ("scripts.eval_testbed", "end-to-end W4A4 evaluation of every method on the testbed"),
    "qad": ("scripts.qad", "quantization-aware distillation with CFG folded into one branch, on the testbed"),
    "dmd2": ("scripts.dmd2", "DMD2 few-step distillation of the testbed DiT; FD / caption-accuracy evaluation"),
}


def _usage() -> str:
    width = max(map(len, VERBS))
    lines = ["usage: kroquant [--version] [--debug] <verb> [options]", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {help_}" for verb, (_, help_) in VERBS.items()]
    lines += ["", "`kroquant <verb> --help` lists a verb's options; --debug shows the traceback of an error."]
    return "\n".join(lines)


def _version() -> str:
    import kroquant_jax

    return f"kroquant {kroquant_jax.__version__}"


def _user_errors() -> tuple[type[BaseException], ...]:
    from scripts.common_args import UserError

    return (UserError, ValueError, KeyError, OSError)


def _message(error: BaseException) -> str:
    if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
        text = error.args[0]  # str(KeyError) quotes its message
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split("\n")[0].split()) if text.strip() else type(error).__name__


def _run(verb: str, rest: list[str], debug: bool) -> int:
    module_name = VERBS[verb][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            sys.exit(f"kroquant: verb {verb!r} is not available in this checkout ({module_name} is missing)")
        raise
    if debug:
        result = module.main(rest)
    else:
        try:
            result = module.main(rest)
        except BrokenPipeError:
            raise
        except _user_errors() as error:
            print(f"kroquant {verb}: error: {_message(error)}", file=sys.stderr)
            return 1
        except Exception as error:  # one line; --debug shows where
            print(f"kroquant {verb}: internal error: {type(error).__name__}: {_message(error)} "
                  f"(rerun with --debug for the traceback)", file=sys.stderr)
            return 1
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _dispatch(argv: list[str], debug: bool) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(_version())
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"kroquant: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return _run(verb, rest, debug)


def main(argv: list[str] | None = None) -> int | str | None:
    """Runs ``kroquant ARGV``; returns the exit status for ``sys.exit`` (an ``int``, or a message: status 1)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("KROQUANT_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        try:
            code = _dispatch(argv, debug)
        except SystemExit as exit_:  # argparse (--help, usage errors) and verbs that exit with a message
            code = exit_.code
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader (e.g. `| head`) stopped: silence the flush at exit, as the Python docs advise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())

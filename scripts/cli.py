"""The `kroquant` command: one entry point, one verb per script.

    kroquant demo                  # the main job (see README)
    kroquant norm-table            # paper appendix C: which normalisations commute with a rotation
    kroquant <verb> --help         # each verb's own options

Each verb is a thin wrapper around a module's ``main(argv)`` in ``scripts/`` or ``benchmarks/``.
"""

from __future__ import annotations

import importlib
import sys

VERBS: dict[str, tuple[str, str]] = {
    "demo": ("scripts.demo", "the main job: calibrate and compare W4A4 methods on the embedded default"),
    "norm-table": ("scripts.norm_commutation", "paper appendix C table (normalisation vs rotation)"),
    "calibrate": ("scripts.calibrate_layers", "calibrate a layer set with every method; per-layer table + plot"),
    "quantize-checkpoint": ("scripts.quantize_checkpoint", "diffusers dir -> capture -> calibrate -> generate"),
    "build-emoji-dataset": ("scripts.build_emoji_dataset", "build the emoji testbed dataset from the Noto font"),
    "train-testbed": ("scripts.train_testbed", "train the emoji testbed DiT"),
    "evaluate": ("scripts.eval_testbed", "end-to-end W4A4 evaluation of every method on the testbed"),
    "dmd2": ("scripts.dmd2", "DMD2 few-step distillation of the testbed DiT; FD / caption-accuracy evaluation"),
}


def _usage() -> str:
    width = max(map(len, VERBS))
    lines = ["usage: kroquant <verb> [options]", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {help_}" for verb, (_, help_) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        sys.exit(f"kroquant: unknown verb {verb!r}\n\n{_usage()}")
    module_name = VERBS[verb][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            sys.exit(f"kroquant: verb {verb!r} is not available in this checkout ({module_name} is missing)")
        raise
    module.main(rest)


if __name__ == "__main__":
    main()

"""Issue 17's goal (a) from a finished ``kroquant calibrate`` record: per layer type, the mean test error of each
method and how many layers the learned transforms win, plus the smoothed KroQuant choice restricted to a subset of
its starts (read from the same record, nothing is recalibrated).

The record's ``reports[<smoothed_kroquant method>][layer]`` holds every candidate of the safeguard (``init{k}`` /
``trained{k}``, ``k`` = the index of the start in ``Recipe.starts``) with its validation and test errors, so the
recipe with fewer starts is the safeguard's choice among that subset's candidates (the same rule as
``calibrate_layers``: lowest validation error, ties by label); each candidate's computation does not depend on the
others (one vmapped job each).

Usage::

    python benchmarks/calibration_goals.py runs/calib100_cal/calibration.json \
        --starts hadamard smoothquant_hadamard smoothquant --subset hadamard smoothquant_hadamard \
        --out benchmarks/results/x.json --markdown benchmarks/results/x.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kroquant_jax import headline  # noqa: E402
from kroquant_jax.fileio import atomic_write_bytes, atomic_write_json  # noqa: E402
from kroquant_jax.transforms import smoothed_kron  # noqa: E402


def start_index(label: str) -> int:
    """``"init2"`` / ``"trained2"`` -> 2 (the index of the candidate's start)."""
    match = re.fullmatch(r"(?:init|trained)(\d+)", label)
    if match is None:
        raise ValueError(f"unexpected candidate label {label!r}")
    return int(match.group(1))


def choice_among(report: dict, starts: list[str], subset: list[str]) -> tuple[str, float]:
    """``(label, test error)`` of the safeguard's choice among the candidates of the starts ``subset`` of a layer
    calibrated with ``starts``."""
    missing = [s for s in subset if s not in starts]
    if missing:
        raise ValueError(f"--subset names {missing}, which are not among the run's starts {starts}")
    keep = {starts.index(s) for s in subset}
    val = {lab: e for lab, e in report["candidates"].items() if start_index(lab) in keep and np.isfinite(e)}
    if not val:
        raise ValueError(f"no finite candidate among {sorted(report['candidates'])} for the starts {subset}")
    label = min(val, key=lambda lab: (val[lab], lab))
    return label, float(report["candidates_test"][label])


def layer_type(name: str) -> str:
    """``transformer_blocks.4.attn1.to_q`` -> ``attn1.to_q``."""
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] == "transformer_blocks" else name


def summarize(record: dict, starts: list[str], subset: list[str], smoothed: str = "smoothed_kroquant") -> dict:
    """Per-layer errors (with the subset column), per-type means and the goal counts."""
    errors = {m: dict(v) for m, v in record["errors"].items()}
    for needed in ("hadamard32", "smoothquant", "kroquant", smoothed):
        if needed not in errors:
            raise ValueError(f"the record has no method {needed!r} (it has {sorted(errors)})")
    sub_name = f"{smoothed} [{' + '.join(subset)}]"
    errors[sub_name] = {}
    chosen = {}
    for layer, rep in record["reports"][smoothed].items():
        label, err = choice_among(rep, starts, subset)
        errors[sub_name][layer] = err
        chosen[layer] = {"all_starts": rep["chosen"], "subset": label}
    layers = list(errors["hadamard32"])
    h, s = errors["hadamard32"], errors["smoothquant"]
    wins = {
        "kroquant_beats_hadamard": sum(errors["kroquant"][n] < h[n] for n in layers),
        "smoothed_beats_both": sum(errors[smoothed][n] < min(h[n], s[n]) for n in layers),
        "smoothed_subset_beats_both": sum(errors[sub_name][n] < min(h[n], s[n]) for n in layers),
        "smoothed_beats_smoothquant": sum(errors[smoothed][n] < s[n] for n in layers),
        "smoothed_ties_smoothquant": sum(errors[smoothed][n] == s[n] for n in layers),
    }
    by_type = defaultdict(list)
    for n in layers:
        by_type[layer_type(n)].append(n)
    methods = ["hadamard32", "smoothquant", "kroquant", sub_name, smoothed]
    per_type = {t: {"layers": len(ns), **{m: float(np.mean([errors[m][n] for n in ns])) for m in methods},
                    "kroquant < hadamard32": sum(errors["kroquant"][n] < h[n] for n in ns),
                    "subset < both": sum(errors[sub_name][n] < min(h[n], s[n]) for n in ns),
                    "all starts < both": sum(errors[smoothed][n] < min(h[n], s[n]) for n in ns)}
                for t, ns in sorted(by_type.items())}
    per_type["all"] = {"layers": len(layers), **{m: float(np.mean([errors[m][n] for n in layers])) for m in methods},
                       "kroquant < hadamard32": wins["kroquant_beats_hadamard"],
                       "subset < both": wins["smoothed_subset_beats_both"],
                       "all starts < both": wins["smoothed_beats_both"]}
    picks = defaultdict(int)
    for c in chosen.values():
        kind = " (trained)" if c["all_starts"].startswith("trained") else " (as started)"
        picks[starts[start_index(c["all_starts"])] + kind] += 1
    return {"starts": starts, "subset": subset, "methods": methods, "num_layers": len(layers), "wins": wins,
            "fractions": {k: v / len(layers) for k, v in wins.items()}, "per_type": per_type,
            "smoothed_kept": dict(sorted(picks.items())), "chosen": chosen, "errors": errors}


def markdown(summary: dict) -> str:
    methods = summary["methods"]
    counts = ["kroquant < hadamard32", "subset < both", "all starts < both"]
    head = ["layer type", "layers", *methods, *counts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, row in summary["per_type"].items():
        label = f"**{t}**" if t == "all" else t
        lines.append("| " + " | ".join([label, str(row["layers"]), *(f"{row[m]:.4f}" for m in methods),
                                        *(str(row[c]) for c in counts)]) + " |")
    kept = ", ".join(f"{k}: {v}" for k, v in summary["smoothed_kept"].items())
    lines += ["", f"Kept by the safeguard with all starts ({', '.join(summary['starts'])}): {kept}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", help="the JSON that kroquant calibrate --out wrote")
    parser.add_argument("--starts", nargs="+", required=True, choices=tuple(smoothed_kron.STARTS),
                        help="the smoothed KroQuant starts of that run, in order (--smoothed-starts)")
    parser.add_argument("--subset", nargs="+", required=True, choices=tuple(smoothed_kron.STARTS),
                        help="the starts of the recipe to compare with (e.g. the two the engine had before)")
    parser.add_argument("--out", help="write the summary JSON here")
    parser.add_argument("--markdown", help="write the per-type table here")
    headline.add_arguments(parser, "testbed_kroquant_beats_hadamard_fraction and "
                                   "testbed_smoothed_kroquant_beats_both_fraction (the record's smoothed KroQuant, all "
                                   "its starts)", "kroquant calibrate (see the record's meta.args)")
    args = parser.parse_args(argv)
    source = headline.checked_source(parser, args, REPO)
    try:
        with open(args.record) as f:
            record = json.load(f)
        summary = summarize(record, args.starts, args.subset)
    except (OSError, ValueError, KeyError) as err:
        parser.exit(2, f"calibration_goals: {args.record}: {err}\n")
    summary["source"] = args.record
    summary["meta"] = record.get("meta", {})
    table = markdown(summary)
    print(table)
    if args.out:
        atomic_write_json(args.out, summary)
    if args.markdown:
        atomic_write_bytes(args.markdown, table.encode())
    if args.headline:
        meta = summary["meta"]
        common = dict(unit="fraction", higher_is_better=True, device=args.device or str(meta.get("device", "?")),
                      jax=str(meta.get("jax_version", "?")), date_utc=str(meta.get("date_utc", "?")),
                      command=args.command, source=source)
        headline.update(args.headline, {
            "testbed_kroquant_beats_hadamard_fraction": headline.Figure(
                value=summary["fractions"]["kroquant_beats_hadamard"], **common),
            "testbed_smoothed_kroquant_beats_both_fraction": headline.Figure(
                value=summary["fractions"]["smoothed_beats_both"], **common)})
    return summary


if __name__ == "__main__":
    main()

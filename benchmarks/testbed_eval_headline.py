"""Issue 17's goal (c) from a finished ``kroquant evaluate`` report: the low-rank recipes' PSNR on one caption group
(default: the held-out captions), the best KroQuant-family recipe's margin over the baselines, and the headline keys.

Several reports of the same settings (one evaluation split over device calls) are joined first
(``models.testbed.evaluation.join_reports``): a method run in more than one part is taken from the first, and its PSNR
in each part is printed as the check of how far two runs of the same code part.

The KroQuant family is every method whose transform is learned (``kroquant...`` or ``smoothed_kroquant...``) and that
has a low-rank branch; the baselines of the goal are SVDQuant and SmoothQuant + LoRaQ (both must be in the report).
If the report also holds the baselines with GPTQ rounding (``svdquant+gptq``, ``smoothquant+gptq+loraq``), the margin
over the better of those is given too: it separates what the transform adds from what GPTQ adds.

Usage::

    python benchmarks/testbed_eval_headline.py runs/goal_c/report.json [runs/goal_c2/report.json] --group heldout \
        --out benchmarks/results/x.json --markdown benchmarks/results/x.md \
        --headline benchmarks/results/headline.json --command "kroquant evaluate ..." [--goal-keys]

The margins are written as ``PREFIX_best_kroquant_family_psnr_margin_db`` (+ ``_vs_gptq_baselines_db``); with
``--goal-keys`` also as issue 17's ``testbed_best_kroquant_family_psnr_margin_db`` (+ ``_vs_gptq_baselines_db``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kroquant_jax import headline  # noqa: E402
from kroquant_jax.fileio import atomic_write_bytes, atomic_write_json  # noqa: E402

BASELINES = ("svdquant", "smoothquant+loraq")
GPTQ_BASELINES = ("svdquant+gptq", "smoothquant+gptq+loraq")
PREFIX = "testbed_lowrank"
MARGIN_KEY = "best_kroquant_family_psnr_margin_db"
MARGIN_VS_GPTQ_KEY = "best_kroquant_family_psnr_margin_vs_gptq_baselines_db"


def _evaluation():
    """``models.testbed.evaluation``, imported where it is used: it imports jax, which a run that stops at an error
    in its one report need not."""
    from models.testbed import evaluation

    return evaluation


def is_kroquant_family(method: str, branch: str) -> bool:
    """A learned transform (KroQuant or smoothed KroQuant) with a low-rank branch."""
    return method.split("+")[0] in ("kroquant", "smoothed_kroquant") and branch != "none"


def paired(report: dict, group: str, method: str, baseline: str) -> dict:
    """The margin per caption (PSNR of ``method`` minus ``baseline`` on the same caption, mean over seeds): its
    standard error over the captions and on how many captions ``method`` is ahead; empty for a report without the
    per-caption PSNRs. The paired error is the margin's own: the captions' spread cancels out of it."""
    a, b = (report["results"][m]["groups"][group].get("psnr_per_caption_db") for m in (method, baseline))
    if a is None or b is None or len(a) != len(b) or len(a) < 2:
        return {}
    diff = np.asarray(a) - np.asarray(b)  # (captions,)
    return {"paired_sem_db": _evaluation().standard_error(diff), "captions_ahead": int((diff > 0).sum()),
            "captions": len(diff)}


def summarize(report: dict, group: str = "heldout") -> dict:
    """Per method: PSNR, its standard error over captions, the per-seed range, SSIM; then the margins (with their
    paired standard errors when the report has per-caption PSNRs)."""
    rows = {}
    for method, res in report["results"].items():
        if group not in res["groups"]:
            raise ValueError(f"method {method!r} has no caption group {group!r} (it has {sorted(res['groups'])})")
        g = res["groups"][group]
        rows[method] = {"low_rank_branch": res["low_rank_branch"], "psnr_db": g["psnr_db"],
                        "psnr_sem_db": g["psnr_sem_db"], "ssim": g["ssim"],
                        "psnr_seed_min_db": g.get("psnr_seed_min_db", g["psnr_db"]),
                        "psnr_seed_max_db": g.get("psnr_seed_max_db", g["psnr_db"]),
                        "layer_error_mean": res["layer_error_mean"]}
    missing = [m for m in BASELINES if m not in rows]
    if missing:
        raise ValueError(f"the report has no baseline {missing} (it has {sorted(rows)})")
    family = {m: r for m, r in rows.items() if is_kroquant_family(m, r["low_rank_branch"])}
    if not family:
        raise ValueError(f"the report has no KroQuant-family method with a low-rank branch (it has {sorted(rows)})")
    best = max(family, key=lambda m: family[m]["psnr_db"])
    baseline = max(BASELINES, key=lambda m: rows[m]["psnr_db"])
    summary = {"group": group, "rows": rows, "best_kroquant_family": best, "best_baseline": baseline,
               "margin_db": rows[best]["psnr_db"] - rows[baseline]["psnr_db"],
               # the best's worst seed against the baseline's best seed: does the spread over seeds overlap?
               "margin_worst_seed_db": rows[best]["psnr_seed_min_db"] - rows[baseline]["psnr_seed_max_db"],
               "margin_paired": paired(report, group, best, baseline)}
    if all(m in rows for m in GPTQ_BASELINES):
        gptq = max(GPTQ_BASELINES, key=lambda m: rows[m]["psnr_db"])
        summary["best_gptq_baseline"] = gptq
        summary["margin_vs_gptq_baselines_db"] = rows[best]["psnr_db"] - rows[gptq]["psnr_db"]
        summary["margin_vs_gptq_baselines_paired"] = paired(report, group, best, gptq)
    return summary


def _paired_text(p: dict) -> str:
    return (f"; paired over captions ± {p['paired_sem_db']:.2f} dB, ahead on {p['captions_ahead']} of "
            f"{p['captions']} captions" if p else "")


def markdown(summary: dict) -> str:
    lines = ["| method | low-rank branch | PSNR (dB) ↑ | per-seed range | SSIM ↑ | layer error mean |",
             "|---|---|---|---|---|---|"]
    for method, r in sorted(summary["rows"].items(), key=lambda kv: kv[1]["psnr_db"]):
        lines.append(f"| {method} | {r['low_rank_branch']} | {r['psnr_db']:.2f} ± {r['psnr_sem_db']:.2f} | "
                     f"{r['psnr_seed_min_db']:.2f}–{r['psnr_seed_max_db']:.2f} | {r['ssim']:.3f} | "
                     f"{r['layer_error_mean']:.4f} |")
    lines += ["", f"Best KroQuant-family recipe {summary['best_kroquant_family']} minus the better baseline "
                  f"{summary['best_baseline']}: {summary['margin_db']:+.2f} dB ({summary['group']} captions; its worst "
                  f"seed against the baseline's best seed: {summary['margin_worst_seed_db']:+.2f} dB"
                  f"{_paired_text(summary['margin_paired'])})."]
    if "margin_vs_gptq_baselines_db" in summary:
        lines.append(f"Against the better baseline with GPTQ rounding ({summary['best_gptq_baseline']}): "
                     f"{summary['margin_vs_gptq_baselines_db']:+.2f} dB"
                     f"{_paired_text(summary['margin_vs_gptq_baselines_paired'])}.")
    return "\n".join(lines) + "\n"


def margin_figures(summary: dict, report: dict, device: str, command: str, source: str, prefix: str,
                   goal_keys: bool) -> dict[str, headline.Figure]:
    """The margin keys ``{prefix}_`` :data:`MARGIN_KEY` (+ :data:`MARGIN_VS_GPTQ_KEY`), and with ``goal_keys`` the
    same figures under issue 17's names ``testbed_...`` (the per-method keys are
    ``models.testbed.evaluation.headline_figures``')."""
    common = dict(unit="dB", higher_is_better=True, device=device, jax=str(report["jax"]),
                  date_utc=str(report["date_utc"]), source=source)
    best, group = summary["best_kroquant_family"], summary["group"]
    margins = {MARGIN_KEY: headline.Figure(
        value=round(summary["margin_db"], 2), command=f"{command} [{best} minus {summary['best_baseline']}, "
                                                      f"{group} captions]", **common)}
    if "margin_vs_gptq_baselines_db" in summary:
        margins[MARGIN_VS_GPTQ_KEY] = headline.Figure(
            value=round(summary["margin_vs_gptq_baselines_db"], 2),
            command=f"{command} [{best} minus {summary['best_gptq_baseline']}, {group} captions]", **common)
    names = [prefix] + (["testbed"] if goal_keys else [])
    return {f"{name}_{key}": figure for name in names for key, figure in margins.items()}


def repeated_lines(report: dict, group: str) -> list[str]:
    """One line per method that more than one joined part ran (``join_reports``): its PSNR in each part."""
    return [f"{method} in each part: " + " / ".join(f"{p:.2f}" for p in parts[group]) + " dB"
            for method, parts in report.get("repeated", {}).items() if group in parts]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", nargs="+", help="the report.json that kroquant evaluate --out wrote; several: the "
                                                   "parts of one evaluation (same settings), joined")
    parser.add_argument("--group", default="heldout", help="caption group (default: heldout)")
    parser.add_argument("--out", help="write the summary JSON here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--prefix", default=PREFIX,
                        help="prefix of the per-method headline keys, PREFIX_psnr_db_GROUP_METHOD etc. "
                             "(models.testbed.evaluation.headline_figures; default: %(default)s, the README's "
                             "low-rank table; testbed_eval for the table of every method)")
    headline.add_arguments(parser, "the per-method keys (--prefix; replacing earlier ones) and "
                                   "PREFIX_best_kroquant_family_psnr_margin_db (+ _vs_gptq_baselines_db)",
                           "kroquant evaluate (see the report's args)")
    parser.add_argument("--goal-keys", action="store_true",
                        help="also write the margins as issue 17's testbed_best_kroquant_family_psnr_margin_db "
                             "(+ _vs_gptq_baselines_db)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", args.prefix):
        parser.error(f"--prefix {args.prefix!r} must be lower-case words joined by '_'")
    source = headline.checked_source(parser, args, REPO)
    try:
        reports = []
        for path in args.report:
            with open(path) as f:
                reports.append(json.load(f))
        report = reports[0] if len(reports) == 1 else _evaluation().join_reports(reports, args.report, repeated=True)
        summary = summarize(report, args.group)
    except (OSError, ValueError, KeyError) as err:
        parser.exit(2, f"testbed_eval_headline: {' '.join(args.report)}: {err}\n")
    summary.update(source=args.report if len(args.report) > 1 else args.report[0], settings=report.get("settings"),
                   device=report.get("device"), jax=report.get("jax"), date_utc=report.get("date_utc"),
                   seeds=report.get("seeds"), repeated=report.get("repeated"))
    table = markdown(summary)
    repeats = repeated_lines(report, args.group)
    if repeats:
        table += "\nMethods run in more than one part (the first part's result is used above):\n\n" + \
            "".join(f"- {line}\n" for line in repeats)
    print(table)
    figures = {}
    if args.headline:
        device = args.device or str(report.get("device", "?"))
        try:
            per_method = _evaluation().headline_figures(report, args.prefix, device=device, command=args.command,
                                                        source=source)
        except ValueError as err:
            parser.exit(2, f"testbed_eval_headline: {' '.join(args.report)}: {err}\n")
        margins = margin_figures(summary, report, device, args.command, source, args.prefix, args.goal_keys)
        figures = {**per_method, **margins}
        # every figure's value in the file it cites (--out): the rows above keep only a few fields per method
        summary["headline_figures"] = {key: figure.value for key, figure in sorted(figures.items())}
    if args.out:
        atomic_write_json(args.out, summary)
    if args.markdown:
        atomic_write_bytes(args.markdown, table.encode())
    if args.headline:
        headline.update(args.headline, per_method, replace_prefix=f"{args.prefix}_")
        headline.update(args.headline, margins)
    return summary


if __name__ == "__main__":
    main()

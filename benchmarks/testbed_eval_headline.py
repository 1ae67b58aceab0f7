"""Issue 17's goal (c) from a finished ``kroquant evaluate`` report: the low-rank recipes' PSNR on one caption group
(default: the held-out captions), the best KroQuant-family recipe's margin over the baselines, and the headline keys.

The KroQuant family is every method whose transform is learned (``kroquant...`` or ``smoothed_kroquant...``) and that
has a low-rank branch; the baselines of the goal are SVDQuant and SmoothQuant + LoRaQ (both must be in the report).
If the report also holds the baselines with GPTQ rounding (``svdquant+gptq``, ``smoothquant+gptq+loraq``), the margin
over the better of those is given too: it separates what the transform adds from what GPTQ adds.

Usage::

    python benchmarks/testbed_eval_headline.py runs/goal_c/report.json --group heldout \
        --out benchmarks/results/x.json --markdown benchmarks/results/x.md \
        --headline benchmarks/results/headline.json --command "kroquant evaluate ..."
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kroquant_jax import headline  # noqa: E402
from kroquant_jax.fileio import atomic_write_bytes, atomic_write_json  # noqa: E402
from models.testbed.evaluation import headline_figures  # noqa: E402

BASELINES = ("svdquant", "smoothquant+loraq")
GPTQ_BASELINES = ("svdquant+gptq", "smoothquant+gptq+loraq")
PREFIX = "testbed_lowrank"


def is_kroquant_family(method: str, branch: str) -> bool:
    """A learned transform (KroQuant or smoothed KroQuant) with a low-rank branch."""
    return method.split("+")[0] in ("kroquant", "smoothed_kroquant") and branch != "none"


def summarize(report: dict, group: str = "heldout") -> dict:
    """Per method: PSNR, its standard error over captions, the per-seed range, SSIM; then the margins."""
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
               "margin_worst_seed_db": rows[best]["psnr_seed_min_db"] - rows[baseline]["psnr_seed_max_db"]}
    if all(m in rows for m in GPTQ_BASELINES):
        gptq = max(GPTQ_BASELINES, key=lambda m: rows[m]["psnr_db"])
        summary["best_gptq_baseline"] = gptq
        summary["margin_vs_gptq_baselines_db"] = rows[best]["psnr_db"] - rows[gptq]["psnr_db"]
    return summary


def markdown(summary: dict) -> str:
    lines = ["| method | low-rank branch | PSNR (dB) ↑ | per-seed range | SSIM ↑ | layer error mean |",
             "|---|---|---|---|---|---|"]
    for method, r in sorted(summary["rows"].items(), key=lambda kv: kv[1]["psnr_db"]):
        lines.append(f"| {method} | {r['low_rank_branch']} | {r['psnr_db']:.2f} ± {r['psnr_sem_db']:.2f} | "
                     f"{r['psnr_seed_min_db']:.2f}–{r['psnr_seed_max_db']:.2f} | {r['ssim']:.3f} | "
                     f"{r['layer_error_mean']:.4f} |")
    lines += ["", f"Best KroQuant-family recipe {summary['best_kroquant_family']} minus the better baseline "
                  f"{summary['best_baseline']}: {summary['margin_db']:+.2f} dB ({summary['group']} captions; its worst "
                  f"seed against the baseline's best seed: {summary['margin_worst_seed_db']:+.2f} dB)."]
    if "margin_vs_gptq_baselines_db" in summary:
        lines.append(f"Against the better baseline with GPTQ rounding ({summary['best_gptq_baseline']}): "
                     f"{summary['margin_vs_gptq_baselines_db']:+.2f} dB.")
    return "\n".join(lines) + "\n"


def margin_figures(summary: dict, report: dict, device: str, command: str, source: str) -> dict[str, headline.Figure]:
    """The margin keys (the per-method keys are ``models.testbed.evaluation.headline_figures``')."""
    common = dict(unit="dB", higher_is_better=True, device=device, jax=str(report["jax"]),
                  date_utc=str(report["date_utc"]), source=source)
    best, group = summary["best_kroquant_family"], summary["group"]
    margins = {"testbed_best_kroquant_family_psnr_margin_db": headline.Figure(
        value=round(summary["margin_db"], 2), command=f"{command} [{best} minus {summary['best_baseline']}, "
                                                      f"{group} captions]", **common)}
    if "margin_vs_gptq_baselines_db" in summary:
        margins["testbed_best_kroquant_family_psnr_margin_vs_gptq_baselines_db"] = headline.Figure(
            value=round(summary["margin_vs_gptq_baselines_db"], 2),
            command=f"{command} [{best} minus {summary['best_gptq_baseline']}, {group} captions]", **common)
    return margins


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="the report.json that kroquant evaluate --out wrote")
    parser.add_argument("--group", default="heldout", help="caption group (default: heldout)")
    parser.add_argument("--out", help="write the summary JSON here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--prefix", default=PREFIX,
                        help="prefix of the per-method headline keys, PREFIX_psnr_db_GROUP_METHOD etc. "
                             "(models.testbed.evaluation.headline_figures; default: %(default)s, the README's "
                             "low-rank table; testbed_eval for the table of every method)")
    headline.add_arguments(parser, "the per-method keys (--prefix; replacing earlier ones) and "
                                   "testbed_best_kroquant_family_psnr_margin_db (+ _vs_gptq_baselines_db)",
                           "kroquant evaluate (see the report's args)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*", args.prefix):
        parser.error(f"--prefix {args.prefix!r} must be lower-case words joined by '_'")
    source = headline.checked_source(parser, args, REPO)
    try:
        with open(args.report) as f:
            report = json.load(f)
        summary = summarize(report, args.group)
    except (OSError, ValueError, KeyError) as err:
        parser.exit(2, f"testbed_eval_headline: {args.report}: {err}\n")
    summary.update(source=args.report, settings=report.get("settings"), device=report.get("device"),
                   jax=report.get("jax"), date_utc=report.get("date_utc"), seeds=report.get("seeds"))
    table = markdown(summary)
    print(table)
    if args.out:
        atomic_write_json(args.out, summary)
    if args.markdown:
        atomic_write_bytes(args.markdown, table.encode())
    if args.headline:
        device = args.device or str(report.get("device", "?"))
        try:
            per_method = headline_figures(report, args.prefix, device=device, command=args.command, source=source)
        except ValueError as err:
            parser.exit(2, f"testbed_eval_headline: {args.report}: {err}\n")
        headline.update(args.headline, per_method, replace_prefix=f"{args.prefix}_")
        headline.update(args.headline, margin_figures(summary, report, device, args.command, source))
    return summary


if __name__ == "__main__":
    main()

"""Records a `kroquant demo` run as the README's demo table: its report under benchmarks/results/, its figures in
headline.json (``models.testbed.evaluation.headline_figures``; every earlier ``demo_*`` key is replaced), and
optionally its grid for the docs. Then ``python benchmarks/render_readme.py`` renders the table.

    python -m scripts.cli demo                                   # writes runs/demo/
    python benchmarks/record_demo.py runs/demo --device "cpu (2 cores)" --grid-to docs/img/demo_grid.png
    python benchmarks/render_readme.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kroquant_jax import headline  # noqa: E402
from kroquant_jax.fileio import atomic_path, atomic_write_text  # noqa: E402
from models.testbed.evaluation import headline_figures  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the demo's output folder (its report.json and grid.png)")
    parser.add_argument("--device", required=True, help="the machine it ran on, in words (shown in the README)")
    parser.add_argument("--command", default="kroquant demo", help="the command that made the run")
    parser.add_argument("--results", default=str(ROOT / "benchmarks/results"),
                        help="where the report's copy goes; the figures name it benchmarks/results/NAME, so any "
                             "other folder is for trying it out (default: %(default)s)")
    parser.add_argument("--headline", default=str(ROOT / "benchmarks/results/headline.json"),
                        help="figures file (default: %(default)s)")
    parser.add_argument("--grid-to", default=None, help="also copy the run's grid.png here (e.g. docs/img/...)")
    args = parser.parse_args(argv)
    run = Path(args.run)
    report_path = run / "report.json"
    if not report_path.exists():
        parser.error(f"{report_path}: no report (run `kroquant demo --out {run}` first)")
    report = json.loads(report_path.read_text())
    if "date_utc" not in report:
        parser.error(f"{report_path}: no date_utc (written by an older kroquant demo): run the demo again")
    copy = Path(args.results) / f"demo_report_{report['date_utc'][:10]}.json"
    source = f"benchmarks/results/{copy.name}"
    figures = headline_figures(report, "demo", device=args.device, command=args.command, source=source)
    atomic_write_text(copy, json.dumps(report, indent=2))
    headline.update(args.headline, figures, replace_prefix="demo_")
    if args.grid_to:
        with atomic_path(args.grid_to, suffix=".png") as tmp:
            shutil.copyfile(run / "grid.png", tmp)
    print(f"wrote {copy} and {len(figures)} demo_* figures to {args.headline}"
          + (f"; copied the grid to {args.grid_to}" if args.grid_to else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

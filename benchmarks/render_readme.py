"""Renders the README's result tables from benchmarks/results/headline.json (``--check``: exit 1 if out of date).

    python benchmarks/render_readme.py            # rewrite README.md's headline blocks
    python benchmarks/render_readme.py --check    # CI-style check, prints the first differing block
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kroquant_jax import headline  # noqa: E402
from kroquant_jax.fileio import atomic_write_text  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that README.md is up to date")
    parser.add_argument("--readme", default=str(ROOT / "README.md"), help="README to render (default: %(default)s)")
    parser.add_argument("--headline", default=str(ROOT / "benchmarks/results/headline.json"),
                        help="figures file (default: %(default)s)")
    args = parser.parse_args(argv)
    text = Path(args.readme).read_text()
    rendered = headline.render_readme(text, headline.load(args.headline))
    if args.check:
        if rendered != text:
            print(f"{args.readme} is out of date: run python benchmarks/render_readme.py", file=sys.stderr)
            return 1
        return 0
    if rendered != text:
        atomic_write_text(args.readme, rendered)
        print(f"rewrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

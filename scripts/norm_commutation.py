"""Prints the paper's appendix C table: max |Norm(XR)R^T - Norm(X)| for a random orthogonal R (64x64), X (32, 64)."""

from __future__ import annotations

import argparse

from kroquant_jax.norm_commutation import deviations

COMMUTES_BELOW = 1e-4


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    rows = deviations(args.d, args.n, args.seed)
    print(f"| normalisation | max abs deviation | commutes with R in O({args.d})? |")
    print("|---|---|---|")
    for name, dev in rows.items():
        print(f"| {name} | {dev:.2e} | {'yes' if dev < COMMUTES_BELOW else 'no'} |")


if __name__ == "__main__":
    main()

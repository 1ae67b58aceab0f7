"""Prints the paper's appendix C table: max |Norm(XR)R^T - Norm(X)| for a random orthogonal R (64x64), X (32, 64)."""

from __future__ import annotations

from kroquant_jax.norm_commutation import deviations
from scripts.common_args import positive_int, verb_parser

COMMUTES_BELOW = 1e-4


def main(argv=None) -> None:
    parser = verb_parser("norm-table", __doc__, ("", "--d 128 --n 64"))
    parser.add_argument("--d", type=positive_int, default=64, help="width of X and of the rotation R")
    parser.add_argument("--n", type=positive_int, default=32, help="rows of X")
    parser.add_argument("--seed", type=int, default=42, help="seed of X and R")
    args = parser.parse_args(argv)
    rows = deviations(args.d, args.n, args.seed)
    print(f"| normalisation | max abs deviation | commutes with R in O({args.d})? |")
    print("|---|---|---|")
    for name, dev in rows.items():
        print(f"| {name} | {dev:.2e} | {'yes' if dev < COMMUTES_BELOW else 'no'} |")


if __name__ == "__main__":
    main()

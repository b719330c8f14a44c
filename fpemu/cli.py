"""The ``fpemu`` command line.

Exit codes: 0 success, 1 a divergence was found, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from fpemu.errors import FpemuInputError


def _add_run(sub) -> None:
    parser = sub.add_parser("run", help="the main job: format tables, scaler profiles and reports",
                            description="Write every report fpemu can produce in this environment.")
    parser.add_argument("--reports", type=pathlib.Path, default=pathlib.Path("reports"),
                        help="folder for the reports (default: reports/)")
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    from fpemu.reports import write_all
    for path in write_all(args.reports):
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fpemu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except FpemuInputError as error:
        print(f"fpemu {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

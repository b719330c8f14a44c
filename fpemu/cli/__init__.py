"""The ``fpemu`` command line.

Exit codes: 0 success, 1 a divergence, a behaviour change (audit), a job that failed (api
changed, cannot run) or nothing compared (every job skipped; audit: a baseline implementation
that cannot run here) unless --allow-skips, 2 bad usage or input (a broken spec, a tampered
trace: the message names the file, key or argument), 3 an internal error (a bug in fpemu):
never mistaken for a divergence.  Every job (spec x implementation) is isolated: a framework
that fails inside one job is one result line, and the other jobs still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
import typing

from fpemu.cli import emulate, environments, harness, output, questions
from fpemu.errors import FpemuInputError
from fpemu.framework_logs import quiet_framework_logs

# One module per command group, each adding its commands through the registry; help lists them in this order.
COMMAND_GROUPS = (harness, questions, emulate, environments)

SKIPS_HELP = ("exit 0 even when every job was skipped (a framework, environment or device missing here)"
              " instead of 1")
EXCLUDE_HELP = "implementations to leave out (a name leaves out every device; name@cuda only that one)"


@dataclasses.dataclass(frozen=True)
class Registry:
    """What a command group's ``add_commands`` adds its commands with.

    Attributes:
      subparsers: argparse's subcommand table (for a command with subcommands of its own, such as env).
      command: ``command(name, help, handler)``: a subcommand with --json and --quiet, run by ``handler``.
      specs_help: the help of a specs argument.
      impl_help: the help of --impl, naming every adapter by kind.
    """

    subparsers: typing.Any
    command: typing.Callable
    specs_help: str
    impl_help: str

    @staticmethod
    def selection(cmd, impl_text: str, skips_text: str = SKIPS_HELP) -> None:
        """--impl, --exclude and --allow-skips on ``cmd``."""
        cmd.add_argument("--impl", nargs="+", help=impl_text)
        cmd.add_argument("--exclude", nargs="+", help=EXCLUDE_HELP)
        cmd.add_argument("--allow-skips", action="store_true", help=skips_text)


def _impl_help() -> str:
    from fpemu.adapters import adapters_of_kind
    return (f"implementations to drive: {', '.join(adapters_of_kind('scaler'))}, and "
            f"{', '.join(adapters_of_kind('step'))} for [step] specs, "
            f"{', '.join(adapters_of_kind('recipe'))} for [recipe] specs, "
            f"{', '.join(adapters_of_kind('fp8_training'))} for [fp8_training] specs, "
            f"{', '.join(adapters_of_kind('ranks'))} for [ranks] specs (add @cuda for the GPU). A name runs on the "
            "specs that list it or whose profile is its own; +NAME adds it to the others it can run too (a scaler "
            "spec whose every parameter its profile takes, any step spec), compared with their golden: --impl "
            "torch +torch_sharded")


def build_parser() -> argparse.ArgumentParser:
    from fpemu.version import __version__
    epilog = output.epilog()
    parser = argparse.ArgumentParser(prog="fpemu", description="Bit-exact emulation of number formats and loss "
                                     "scaling, and a differential harness against real implementations.",
                                     epilog=epilog, formatter_class=output.Formatter)
    parser.add_argument("--version", action="version", version=f"fpemu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, help_text, handler):
        cmd = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                             formatter_class=output.Formatter)
        cmd.add_argument("--json", action="store_true", help="print a JSON result on stdout (for CI)")
        cmd.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
        cmd.set_defaults(handler=handler)
        return cmd

    registry = Registry(sub, command, "spec files or folders of *.toml specs", _impl_help())
    for group in COMMAND_GROUPS:
        group.add_commands(registry)
    return parser


def main(argv=None) -> int:
    quiet_framework_logs()
    parser = build_parser()
    args = parser.parse_args(argv)
    with output.stdout_for_results():
        try:
            return args.handler(args)
        except FpemuInputError as error:
            return output.fail(args, str(error))
        except OSError as error:  # an output path that cannot be written (a file where a folder must be, ...)
            where = f"{error.filename}: " if error.filename else ""
            return output.fail(args, f"cannot write {where}{error.strerror or error}")
        except Exception as error:  # noqa: BLE001 -- anything else is a crash, reported as one
            traceback.print_exc(file=sys.stderr)
            return output.fail(args, f"unexpected {type(error).__name__}: {error}", code=3)

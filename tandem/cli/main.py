"""The `tandem` command: parse the command line and run the chosen command (tandem.cli.commands lists them all).

Only the chosen command's module is imported and only its flags are built, so `tandem plan` starts without the
server's, the engine's or the other commands' imports. Every user error (bad names, deployments, workloads, files,
arguments) ends as one line `tandem: error: <message>` on stderr with exit status 2; Ctrl-C exits with 130.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tandem.cli.commands import COMMAND_HELP
from tandem.cli.common import PROG, CLIError, Parser, clear_notes
from tandem.workload.session import WorkloadError


# --------------------------------------------------------------------------- parser


# each module's `add_parser(sub)` registers its commands, in the order `tandem --help` lists them; a module is imported
# only when one of its commands runs
MODULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("simulate", "generate"), "tandem.cli.simulate_cmd"),
    (("experiment",), "tandem.cli.experiment_cmd"),
    (("plan",), "tandem.cli.plan_cmd"),
    (("tiny-model",), "tandem.cli.tiny_cmd"),
    (("profile",), "tandem.cli.profile_cmd"),
    (("serve", "demo"), "tandem.cli.serve_cmd"),
    (("bench",), "tandem.cli.bench_cmd"),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of every subcommand; with `command`, only its module is imported and only its module's
    commands get their flags (the others are listed with their help, as `tandem --help` shows them)."""
    p = Parser(prog=PROG, description="Multi-round LLM serving under PD disaggregation: simulator and experiments.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for names, module in MODULES:
        if command is None or command in names:
            importlib.import_module(module).add_parser(sub)
        else:
            for name in names:
                sub.add_parser(name, help=COMMAND_HELP[name])
    return p


def chosen_command(argv: Sequence[str]) -> str | None:
    """The command argparse will run for `argv`: its first word that names one (the top-level parser has no option
    that takes a value, so no earlier word can hide it); None when it names none (help, or a usage error)."""
    return next((a for a in argv if a in COMMAND_HELP), None)


# --------------------------------------------------------------------------- entry point


def _user_errors() -> tuple[type[BaseException], ...]:
    from tandem.bench.experiment import ExperimentError
    from tandem.core.deploy import DeploymentError
    from tandem.perf.errors import DoesNotFitError, ParallelismError, UnknownNameError
    from tandem.perf.profile_io import PerfFileError
    from tandem.sim.cluster import ConfigError

    return (CLIError, WorkloadError, DeploymentError, FileNotFoundError, PermissionError, IsADirectoryError,
            NotADirectoryError, UnknownNameError, DoesNotFitError, ParallelismError, ExperimentError, ConfigError,
            PerfFileError)


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        text = f"{err.filename}: {err.strerror or err}"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())  # one line, whatever the message


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tandem command line; returns the exit status (0 ok, 2 user error, 130 interrupted)."""
    clear_notes()
    try:
        if argv is None:
            argv = sys.argv[1:]
        args = build_parser(chosen_command(argv)).parse_args(argv)
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `tandem simulate ... | head`
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"{PROG}: error: {_message(e)}", file=sys.stderr)
        return 2

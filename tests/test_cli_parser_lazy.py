"""`tandem` builds only the chosen command's parser: the flags, defaults, help and errors are the full parser's, the
top-level help still lists every command, and `tandem plan` imports none of the server, the engine, the runtime or
the other commands."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tandem.cli.commands import COMMAND_HELP
from tandem.cli.main import MODULES, build_parser, chosen_command, main


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _actions(parser: argparse.ArgumentParser) -> list[tuple]:
    """What argparse does with each flag, and the field it came from."""
    return [(a.option_strings, a.dest, repr(a.default), a.help, a.required, a.choices, a.metavar, a.nargs,
             type(a).__name__, getattr(a.type, "__name__", None), getattr(a, "knob_source", None))
            for a in parser._actions]


def test_every_command_is_registered_by_one_module_in_the_help_order():
    """Protects `tandem --help`: the commands in COMMAND_HELP's order, each registered by exactly one module."""
    assert [n for names, _ in MODULES for n in names] == list(COMMAND_HELP)
    full = _subparsers(build_parser())
    assert list(full) == list(COMMAND_HELP)


@pytest.mark.parametrize("command", list(COMMAND_HELP))
def test_the_chosen_commands_parser_is_the_full_parsers(command):
    """Protects every flag's name, default, help, type and field: the lazily built parser equals the full one."""
    full, lazy = build_parser(), build_parser(command)
    assert lazy.format_help() == full.format_help()
    assert _actions(_subparsers(lazy)[command]) == _actions(_subparsers(full)[command])
    assert _subparsers(lazy)[command].format_help() == _subparsers(full)[command].format_help()


def test_the_top_level_help_lists_every_command_without_building_any(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMAND_HELP)
    assert out == build_parser().format_help()


@pytest.mark.parametrize("argv,command", [
    (["plan", "--workload", "simulate"], "plan"),
    (["--foo", "plan"], "plan"),
    (["--", "serve"], "serve"),
    (["--help"], None),
    (["bogus", "plan"], "plan"),
    (["--workload=plan"], None),
    ([], None),
])
def test_the_chosen_command_is_the_first_word_that_names_one(argv, command):
    assert chosen_command(argv) == command


@pytest.mark.parametrize("argv,message", [
    (["bogus"], "tandem: error: argument COMMAND: invalid choice: 'bogus' (choose from 'simulate', 'generate', "
                "'experiment', 'plan', 'tiny-model', 'profile', 'serve', 'demo', 'bench')"),
    ([], "tandem: error: the following arguments are required: COMMAND"),
    (["plan", "--gpus", "8"], "tandem: error: the following arguments are required: --workload"),
    (["plan", "--workload", "toolbench", "--gpus", "x"],
     "tandem: error: argument --gpus: expected an integer, got 'x'"),
    (["plan", "--workload", "toolbench", "--gpus", "8", "--ray-address", "bad host:1"],
     "tandem: error: argument --ray-address: 'bad host:1': 'bad host' is not a host name or IP address"),
])
def test_usage_errors_stay_one_line(argv, message, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == message + "\n"


def test_plan_imports_neither_the_server_nor_the_engine_nor_the_runtime():
    """Protects `tandem plan`'s start-up: its parser needs the simulator's, the planner's and the workload's options,
    not `serve`'s (runtime messages, state store, engine and server options), the other commands' modules, nor the
    factory of the cores (SimConfig's fields are not the simulator)."""
    probe = ("import contextlib, io, json, sys\nfrom tandem.cli.main import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n    main(['plan', '--help'])\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('tandem', 'msgspec')))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    unwanted = [m for m in loaded if m.startswith(("tandem.server", "tandem.engine", "msgspec", "tandem.core.factory",
                                                   "tandem.sim.cluster"))
                or (m.startswith("tandem.runtime.") and m != "tandem.runtime.ray_address")
                or (m.startswith("tandem.cli.") and m.endswith("_cmd") and m != "tandem.cli.plan_cmd")]
    assert unwanted == []

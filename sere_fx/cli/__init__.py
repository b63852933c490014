"""The ``sere-fx`` command line: one module per command, each with ``add_parser(sub)`` and
``run(args)``; what more than one command uses is in ``sere_fx.cli.common``."""

from __future__ import annotations

import argparse
import os
import sys

from sere_fx.cli import bench, calibrate, demo, eval, export, generate, inspect, tune
from sere_fx.cli.common import CliError, _error, _model_placement, _report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sere-fx",
        description="Batch-aware expert re-routing (SERE) for Mixture-of-Experts models: calibrate expert "
        "similarities, inspect them, evaluate and tune routing policies, export artifacts, benchmark.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in (demo, calibrate, eval, tune, export, generate, bench, inspect):  # the order --help lists them
        module.add_parser(sub)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
        command.set_defaults(options={o for a in command._actions for o in a.option_strings})
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "device"):  # where the model goes is checked with the first options
            args.placement = _model_placement(args)
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (`sere-fx inspect ... | head`): stop quietly, as Unix tools do.
        # Point stdout at devnull so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CliError as exc:
        return _error(args.command, str(exc))
    except KeyboardInterrupt:
        return _error(args.command, "interrupted")
    except Exception as exc:
        if args.debug:
            raise
        return _report(args.command, exc, args.options)

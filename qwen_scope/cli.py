"""The ``qwen-scope`` command line. Subcommands live in ``qwen_scope/commands/``, one module each.

Every error ends as one line on stderr and exit status 2 (``--traceback`` shows the trace instead); a closed pipe
(``qwen-scope releases --json | head``) ends quietly.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from qwen_scope import __version__
from qwen_scope.commands import app, classify, collect, demo, eval, explore, features, releases, steer

# One module per subcommand, in the order ``--help`` lists them.
COMMANDS = (app, classify, collect, demo, eval, explore, features, releases, steer)

# A value that starts with "-" but is a number or a list of numbers ("-100,-20,0"): argparse would take it for an
# option unless it is a single plain number.
_NEGATIVE_VALUE = re.compile(r"^-(\d|\.\d)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-scope", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"qwen-scope {__version__}")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full Python traceback of an error instead of its one-line message")
    parser.add_argument("--verbose", "-v", action="count", default=0,
                        help="log progress of the library (-v: info, -vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        # The module docstring holds the command's examples: --help shows it as written.
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Option strings (of the parser and its subcommands) that take one value."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out |= _value_options(child)
        elif action.option_strings and action.nargs is None:
            out.update(s for s in action.option_strings if s.startswith("--"))
    return out


def join_negative_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``["--sweep", "-100,-20"]`` -> ``["--sweep=-100,-20"]`` for options taking a value, so a negative number or
    list parses as that option's value (argparse alone reads ``-100,-20`` as an unknown option)."""
    takes_value = _value_options(parser)
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in takes_value and i + 1 < len(argv) and _NEGATIVE_VALUE.match(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _configure_logging(verbose: int) -> None:
    from qwen_scope.sources import quiet_reference_kernel_advice

    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(name)s: %(message)s")
    for name in ("qwen_scope", "saes", "hooks", "flashqla_kernels"):
        logging.getLogger(name).setLevel(level)
    quiet_reference_kernel_advice()


def _precheck(args: argparse.Namespace) -> None:
    """Settings every command shares, checked before any work: ``args.device``, and ``args.model`` (by that name,
    in every command, the model the command loads) unless ``--no-model``."""
    from qwen_scope.sources import check_device, model_config

    device = getattr(args, "device", None)
    if device is not None:
        check_device(device)
    model = getattr(args, "model", None)
    if isinstance(model, str) and model and not getattr(args, "no_model", False):
        model_config(model)


def _one_line(err: BaseException) -> str:
    if isinstance(err, KeyError) and err.args:
        text = str(err.args[0])
    elif isinstance(err, (ValueError, TypeError, OSError)):
        text = str(err) or type(err).__name__
    else:
        # Not one of the library's own messages: say what kind of error it was, and where the trace is.
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        text = f"{type(err).__name__}: {first} (run with --traceback for the full trace)"
    return " ".join(text.split())


def _quiet_broken_pipe() -> int:
    # The reader went away (`| head`): point stdout at /dev/null so the interpreter's final flush cannot raise again.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_negative_values(list(sys.argv[1:] if argv is None else argv), parser))
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    _configure_logging(args.verbose)
    try:
        _precheck(args)
        code = int(args._run(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt:
        print(f"qwen-scope {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as err:
        # The commands refuse bad settings with SystemExit(message): the same one line and status as any error.
        if not isinstance(err.code, str) or args.traceback:
            raise
        print(f"qwen-scope {args.command}: error: {' '.join(err.code.split())}", file=sys.stderr)
        return 2
    except Exception as err:
        if args.traceback:
            raise
        print(f"qwen-scope {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``qwen-scope`` command line. Subcommands live in ``qwen_scope/commands/``, one module each."""
from __future__ import annotations

import argparse
import sys

from qwen_scope import __version__
from qwen_scope.commands import collect, demo, explore, features, releases, steer

# One module per subcommand, in the order ``--help`` lists them.
COMMANDS = (collect, demo, explore, features, releases, steer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-scope", description=__doc__)
    parser.add_argument("--version", action="version", version=f"qwen-scope {__version__}")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full Python traceback of an error instead of its one-line message")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as err:
        # The library's errors already say what, expected, actual and the fix: show that, not a traceback.
        if args.traceback:
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"qwen-scope {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

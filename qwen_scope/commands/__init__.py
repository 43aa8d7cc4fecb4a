"""Subcommands of the ``qwen-scope`` CLI, one module each.

Each module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``;
``qwen_scope.cli.COMMANDS`` lists them (a new command is one module and one name there).
"""

"""Subcommands of the ``qwen-scope`` CLI, one module each.

Each module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
``qwen_scope.cli`` discovers them, so adding a command never touches a shared file.
"""

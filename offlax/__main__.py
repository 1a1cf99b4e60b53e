"""`python -m offlax plan|compile|inspect|rollback`: the planner, GPU compiler and store tools.

Each subcommand is a parser (`cli_parsers`) and a function that returns the exit
status (`cli_commands`); `COMMANDS` pairs them. Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from offlax._src import cli_commands, cli_parsers

Run = Callable[[argparse.Namespace, cli_parsers.Parsers], int]

# name -> (adds its parser to the subparsers, runs it), in `--help`'s order
COMMANDS: dict[str, tuple[Callable[[Any], argparse.ArgumentParser], Run]] = {
  "plan": (cli_parsers.add_plan, cli_commands.plan),
  "compile": (cli_parsers.add_compile, cli_commands.compile_step),
  "inspect": (cli_parsers.add_inspect, cli_commands.inspect),
  "rollback": (cli_parsers.add_rollback, cli_commands.rollback),
}


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m offlax` on `argv` (default: `sys.argv[1:]`); returns the exit status."""
  parser = argparse.ArgumentParser(prog="python -m offlax", description="offlax tools")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=cli_parsers.CommandParser)
  commands = {name: add(sub) for name, (add, _) in COMMANDS.items()}
  args = parser.parse_args(argv)
  run = COMMANDS[args.command][1]
  return run(args, cli_parsers.Parsers(parser, commands[args.command]))


if __name__ == "__main__":
  sys.exit(main())

"""`python -m offlax`: one small function per subcommand, paired in one table (issue 43.5).

What each command prints and returns is tested with the feature (test_planner.py,
test_gpu_compile.py, test_layer_store_crc.py, test_observability.py, ...).
"""

import ast
import pathlib

import pytest

import offlax.__main__ as cli

ROOT = pathlib.Path(__file__).parent.parent
MODULES = ["offlax/__main__.py", "offlax/_src/cli_parsers.py", "offlax/_src/cli_commands.py"]
MAX_FUNCTION_LINES = 30  # `main` was 116 lines: every parser, then an if per command


def test_every_function_of_the_command_line_is_small():
  long = {
    f"{module}::{node.name}": n
    for module in MODULES
    for node in ast.walk(ast.parse((ROOT / module).read_text()))
    if isinstance(node, ast.FunctionDef)
    and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
  }
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_table_holds_every_subcommand_in_the_help_order(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  assert "{plan,compile,inspect,rollback}" in capsys.readouterr().out
  assert list(cli.COMMANDS) == ["plan", "compile", "inspect", "rollback"]
  for name, (add, run) in cli.COMMANDS.items():
    assert add.__name__ == f"add_{name}" and run.__doc__.startswith(f"`{name}`")

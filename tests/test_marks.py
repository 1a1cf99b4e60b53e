"""The slow marks live on the tests: conftest names no test, and `slow_except` checks its ids.

A list of test names in conftest goes stale without a sound (a renamed test silently
joins the default run, a removed one stays listed); a mark on the test moves with it.
"""

import ast
import pathlib
import re

import pytest
from conftest import mark_slow_except

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")


def _docstrings(tree: ast.Module) -> set[int]:
  """The ids of the module's, classes' and functions' docstring nodes."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        found.add(id(body[0].value))
  return found


def test_conftest_names_no_test():
  tree = ast.parse(CONFTEST.read_text())
  docs = _docstrings(tree)
  named = [
    (node.lineno, node.value)
    for node in ast.walk(tree)
    if isinstance(node, ast.Constant)
    and isinstance(node.value, str)
    and id(node) not in docs
    and re.search(r"\btest_\w+", node.value)
  ]
  assert not named, (
    f"tests/conftest.py names tests {named}: mark the test itself "
    "(@pytest.mark.slow, pytest.param(..., marks=pytest.mark.slow) or @pytest.mark.slow_except)"
  )


class _Item:
  """What `mark_slow_except` reads of a collected test: its id, marker and case."""

  def __init__(self, nodeid, keep=None):
    self.nodeid, self.added = nodeid, []
    self._mark = None if keep is None else pytest.mark.slow_except(*keep).mark
    if "[" in nodeid:
      self.callspec = type("CallSpec", (), {"id": nodeid.partition("[")[2][:-1]})()

  def get_closest_marker(self, name):
    return self._mark if name == "slow_except" else None

  def add_marker(self, marker):
    self.added.append(marker.name)


def test_slow_except_marks_the_cases_it_does_not_keep():
  keep = ("native-adam", "plain-sgd")
  items = [_Item(f"t.py::test_a[{c}]", keep) for c in ("native-adam", "plain-adam", "plain-sgd")]
  items += [_Item("t.py::test_b[x]"), _Item("t.py::test_c", keep=("x",))]
  (problem,) = mark_slow_except(items)  # test_c is not parametrized: it has no case "x"
  assert problem.startswith("t.py::test_c: @pytest.mark.slow_except names ['x'], not among its")
  assert [i.added for i in items] == [[], ["slow"], [], [], ["slow"]]


def test_slow_except_names_an_id_its_test_lost():
  items = [_Item(f"t.py::test_a[{c}]", ("device", "hots")) for c in ("device", "host")]
  (problem,) = mark_slow_except(items)
  assert problem.startswith("t.py::test_a: @pytest.mark.slow_except names ['hots']")
  assert "['device', 'host']" in problem

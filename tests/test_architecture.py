"""The shape of `offlax._src`: an import graph without cycles, modules of a readable size."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "offlax" / "_src"
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(SRC.parent.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
  """The `offlax._src` modules `path` imports, at module level or inside functions.

  `from offlax._src import x` names module `offlax._src.x` when there is one;
  `from offlax._src.x import y` names `offlax._src.x.y` if that is a module,
  else `offlax._src.x`. Imports under `if TYPE_CHECKING:` run only for type
  checkers and do not count.
  """
  tree = ast.parse(path.read_text())
  skip: set[int] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      skip |= {id(n) for b in node.body for n in ast.walk(b)}
  out = set()
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name in modules}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        if full in modules:
          out.add(full)
        elif node.module in modules:
          out.add(node.module)
  return out - {"offlax._src"}


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {m: _imports(p, set(modules)) - {m} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` (its modules in import order, the first repeated), or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(m: str) -> list[str] | None:
    state[m] = 1
    path.append(m)
    for n in sorted(graph.get(m, ())):
      if state.get(n) == 1:
        return [*path[path.index(n) :], n]
      if n not in state:
        found = visit(n)
        if found:
          return found
    path.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


def test_the_parser_sees_imports():
  graph = _graph()
  assert "offlax._src.host_tier" in graph["offlax._src.transform"]
  assert "offlax._src.errors" in graph["offlax._src.telemetry"]
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_has_no_cycle():
  cycle = _cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_offload_knows_no_tier():
  """`transform` talks to tiers through the `Tier` protocol: no tier internals or isinstance."""
  imported = _graph()["offlax._src.transform"]
  tiers = {m for m in imported if "tier" in m.rsplit(".", 1)[-1] or ".nvme" in m}
  # (host_tier: `HostTier()` is the default tier)
  assert tiers <= {"offlax._src.tier", "offlax._src.host_tier"}, tiers
  tree = ast.parse((SRC / "transform.py").read_text())
  names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
  names |= {
    a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
  }
  assert not names & {"NVMeTier", "DiskIO", "HostIO", "DEFAULT_CHUNK", "DEFAULT_CHUNK_BYTES"}
  checks = [
    ast.unparse(n)
    for n in ast.walk(tree)
    if isinstance(n, ast.Call) and ast.unparse(n.func) == "isinstance" and "Tier" in ast.unparse(n)
  ]
  assert not checks, checks


def test_no_module_is_too_long():
  long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"

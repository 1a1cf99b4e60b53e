"""Paths into an NNX model's graph (`nnx.graph.iter_graph`'s): follow one, set at one, name one.

Shared by `offload_params` (the modules that fetch) and its `store=` (the
params it replaces with placeholders). No flax import: `import offlax` stays
free of it.
"""

from __future__ import annotations

from typing import Any


def at(root: Any, path: tuple[Any, ...]) -> Any:
  """The node at `path` below `root`: an int is a list index, a str an attribute."""
  for key in path:
    root = root[key] if isinstance(key, int) else getattr(root, key)
  return root


def set_at(root: Any, path: tuple[Any, ...], value: Any) -> None:
  """Replaces the node at `path` (not empty) below `root` with `value`."""
  parent, key = at(root, path[:-1]), path[-1]
  if isinstance(key, int):
    parent[key] = value
  else:
    setattr(parent, key, value)


def name(path: tuple[Any, ...]) -> str:
  """`path` as an error names it: ``model.layers[3].mlp``."""
  return "model" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def dotted(path: tuple[Any, ...]) -> str:
  """`path` as a user writes it, without the root: ``layers[3].mlp`` (what `parse` reads)."""
  return name(path).removeprefix("model").removeprefix(".")


def parse(text: str) -> tuple[Any, ...]:
  """The path ``dotted`` wrote: ``"decoder.layers"`` is ``("decoder", "layers")``, ``[3]`` an int.

  Raises `ValueError` on text that is no such path (``"a..b"``, ``"a[x]"``, ``""``).
  """
  keys: list[Any] = []
  for part in text.split("."):
    attribute, *indices = part.split("[")
    if not attribute.isidentifier() or not all(
      i.endswith("]") and i[:-1].isdigit() for i in indices
    ):
      raise ValueError(f"{text!r} is not a path such as 'layers' or 'decoder.blocks[0].layers'")
    keys += [attribute, *(int(i[:-1]) for i in indices)]
  return tuple(keys)

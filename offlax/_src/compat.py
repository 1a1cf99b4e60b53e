"""The one place that names JAX APIs whose names differ between versions, or that are private.

`compute_on`: JAX <= 0.10 calls the memory-space aware one ``compute_on2``.
`context_mesh`: the mesh of ``with jax.set_mesh(mesh):`` has a public getter,
that of the older ``with mesh:`` (which Tunix's command line enters) only a
deprecated one, so it is read from ``jax._src.mesh``. docs/patches.md lists
every module that reads ``jax._src``.
"""

from typing import Any

import jax

try:  # JAX <= 0.10 calls the memory-space aware `compute_on` `compute_on2`.
  from jax.experimental.compute_on import compute_on2 as _compute_on
except ImportError:  # pragma: no cover - JAX >= 0.11
  from jax.experimental.compute_on import compute_on as _compute_on  # type: ignore[no-redef,assignment]

compute_on: Any = _compute_on


def context_mesh() -> jax.sharding.Mesh | None:
  """The concrete mesh the caller is in (``jax.set_mesh`` or ``with mesh:``), or None.

  None inside a trace too (``jax.sharding.get_mesh`` refuses there).
  """
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # inside jit
    return None
  if mesh is None or mesh.empty:
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.thread_resources.env.physical_mesh
  return None if mesh is None or mesh.empty else mesh


__all__ = ["compute_on", "context_mesh"]

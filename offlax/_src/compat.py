"""The one place that names JAX APIs whose names differ between the versions offlax supports."""

from typing import Any

try:  # JAX <= 0.10 calls the memory-space aware `compute_on` `compute_on2`.
  from jax.experimental.compute_on import compute_on2 as _compute_on
except ImportError:  # pragma: no cover - JAX >= 0.11
  from jax.experimental.compute_on import compute_on as _compute_on  # type: ignore[no-redef,assignment]

compute_on: Any = _compute_on

__all__ = ["compute_on"]

"""Below the verbs: the tier protocol, the types offlax's functions return, the unfused pieces.

- For tier authors (``docs/adding_a_tier.md``): `Tier` and `TierIO`, the
  protocol `offlax.offload` drives, and what a tier builds: `OnDisk`
  placeholders, `ParamSpec`, `OffloadStats`.
- The classes the top-level functions return, for annotations and
  ``isinstance``: `OffloadStats` (`offlax.stats`), `Plan` (`offlax.plan`),
  `CompiledMemory` and `GpuTarget` (`offlax.compile_for_gpu`, with
  `gpu_compile_available`), `MasterWeightsState` (`offlax.master_weights`),
  `StoredParam` (`offlax.stack_layers`' placeholders).
- `apply_updates`: ``optax.apply_updates`` for params in host memory, for a
  step that needs the updates between update and apply; otherwise
  `offlax.update_and_apply` does both, fused.

Importing this module loads no JAX: each name loads its module on first use.

Example:
  >>> import offlax.extend
  >>> "Tier" in offlax.extend.__all__
  True
"""

import typing as _typing

from offlax._src import lazy as _lazy

_NAMES: dict[str, str | tuple[str, str]] = {
  "CompiledMemory": "offlax._src.gpu_compile",
  "GpuTarget": "offlax._src.gpu_compile",
  "MasterWeightsState": "offlax._src.master",
  "OffloadStats": "offlax._src.telemetry",
  "OnDisk": "offlax._src.layout",
  "ParamSpec": "offlax._src.layout",
  "Plan": "offlax._src.planner",
  "StoredParam": "offlax._src.nnx_layer_store",
  "Tier": "offlax._src.tier",
  "TierIO": "offlax._src.tier",
  "apply_updates": "offlax._src.apply",
  "gpu_compile_available": ("offlax._src.gpu_compile", "available"),
}

if _typing.TYPE_CHECKING:  # what the lazy names are, for type checkers and the API docs
  from offlax._src.apply import apply_updates
  from offlax._src.gpu_compile import CompiledMemory, GpuTarget
  from offlax._src.gpu_compile import available as gpu_compile_available
  from offlax._src.layout import OnDisk, ParamSpec
  from offlax._src.master import MasterWeightsState
  from offlax._src.nnx_layer_store import StoredParam
  from offlax._src.planner import Plan
  from offlax._src.telemetry import OffloadStats
  from offlax._src.tier import Tier, TierIO


__getattr__, __dir__ = _lazy.attributes(__name__, _NAMES)  # dir: no `_lazy`, `_typing`


__all__ = [
  "CompiledMemory",
  "GpuTarget",
  "MasterWeightsState",
  "OffloadStats",
  "OnDisk",
  "ParamSpec",
  "Plan",
  "StoredParam",
  "Tier",
  "TierIO",
  "apply_updates",
  "gpu_compile_available",
]

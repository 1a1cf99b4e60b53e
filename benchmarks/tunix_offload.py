"""Tunix's own models fully fine-tuned with their params off the device, compiled for a GPU.

Builds Tunix's Qwen3-14B, Llama3.1-8B and Llama3-70B from their configs
(``tunix.models.*.model.ModelConfig``), bf16 params, abstractly
(`nnx.eval_shape`: nothing is allocated), gives them to
`offlax.offload_params`, and compiles the whole train step (forward, backward,
``nnx.Optimizer.update`` with AdamW on an fp32 master, batch 1 x 2048 tokens,
the state donated) with XLA's GPU compiler (`offlax.compile_for_gpu`). The
optimizer is ``nnx.Optimizer(model, offlax.offload(offlax.master_weights(
optax.adamw(1e-5)), compute="host"), wrt=nnx.Param)``; its update runs offlax's
fused host update. Beside each, the same model trained the plain way (params,
gradients and AdamW state on the device).

Tunix's models loop over a Python list of layers, so XLA compiles every layer
unrolled: a 40-layer step takes minutes to compile (``offlax.scan_layers``
compiles a stacked model in seconds). So the peak's growth with depth is
measured at a few reduced depths (``dataclasses.replace(config,
num_layers=n)``) and extrapolated linearly to the full depth; ``--full``
compiles the full depth of the models named (the default: Qwen3-14B).

  python benchmarks/tunix_offload.py                          # all three, Qwen3-14B at full depth
  python benchmarks/tunix_offload.py --model qwen3_14b --depths 2 4 --full
  python benchmarks/tunix_offload.py --model tiny             # seconds: the smoke run

Writes ``benchmarks/results/tunix_offload.{json,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import _common  # noqa: E402

GB = 10**9
TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class Case:
  family: str  # "qwen3" or "llama3": the Tunix module
  config: str  # the ModelConfig class method
  target: str  # compile_for_gpu's target
  goal: float  # the offloaded step's device peak goal, bytes (issue 33)
  tokens: int = TOKENS


CASES = {
  "qwen3_14b": Case("qwen3", "qwen3_14b", "rtx4090", 8 * GB),
  "llama3p1_8b": Case("llama3", "llama3p1_8b", "rtx4090", 6 * GB),
  "llama3_70b": Case("llama3", "llama3_70b", "a100-80gb", 16 * GB),
  "llama3p1_405b": Case("llama3", "llama3p1_405b", "h200", 141 * GB),
  # The smoke run: Tunix's Qwen3 at tiny dims.
  "tiny": Case("qwen3", "tiny", "l4", 1 * GB, tokens=128),
}


def config(case: Case, layers: int | None = None) -> Any:
  """The Tunix config of `case`, with `layers` layers (default: its own)."""
  import jax.numpy as jnp

  module = _module(case)
  if case.config == "tiny":
    cfg = module.ModelConfig(
      num_layers=2, vocab_size=512, embed_dim=256, hidden_dim=1024, num_heads=4, head_dim=64,
      num_kv_heads=2, norm_eps=1e-6, rope_theta=1_000_000,
    )  # fmt: skip
  else:
    cfg = getattr(module.ModelConfig, case.config)()
  if layers is not None:
    cfg = dataclasses.replace(cfg, num_layers=layers)
  if "param_dtype" in {f.name for f in dataclasses.fields(cfg)}:  # Qwen3's; Llama3 has none
    cfg = dataclasses.replace(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  return cfg


def _module(case: Case) -> Any:
  if case.family == "qwen3":
    from tunix.models.qwen3 import model
  else:
    from tunix.models.llama3 import model
  return model


def abstract_model(case: Case, cfg: Any) -> Any:
  """The Tunix model of `cfg` as shapes, its params in bf16 (cast where the config has no dtype)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  module = _module(case)
  cls = module.Qwen3 if case.family == "qwen3" else module.Llama3
  model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
  bf16 = lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=s.sharding)
  nnx.update(model, jax.tree.map(bf16, nnx.state(model, nnx.Param)))
  return model


def abstract_optimizer(model: Any, tx: Any, offloaded: bool) -> Any:
  """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` as shapes that keep their memory kinds.

  `nnx.eval_shape` types every array as device memory; an offloaded state's
  specs come from `offlax.abstract_state`, leaf for leaf.
  """
  import jax
  from flax import nnx

  import offlax

  optimizer = nnx.eval_shape(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param), model)
  if offloaded:
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    specs = jax.tree.leaves(offlax.abstract_state(tx, params))
    variables = jax.tree.leaves(optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    # The NVMe tier's items on disk hold no array (`offlax.extend.OnDisk`): no spec of theirs.
    on_disk = lambda v: isinstance(v.get_value(), offlax.extend.OnDisk)
    variables = [v for v in variables if not on_disk(v)]
    assert len(specs) == len(variables), (len(specs), len(variables))
    for variable, spec in zip(variables, specs, strict=True):
      assert (variable.get_value().shape, variable.get_value().dtype) == (spec.shape, spec.dtype)
      variable.set_value(spec)
  return optimizer


def compile_step(
  case: Case,
  layers: int | None = None,
  *,
  offloaded: bool = True,
  offload_activations: bool = False,
  store: str | None = None,
  rest_tier: Any = None,
  cfg: Any = None,
  **compile_options: Any,
) -> tuple[Any, int]:
  """The compiled train step of `case` at `layers` layers: (`CompiledMemory`, parameter count).

  With `store` (a directory), the model's layers are read from a sparse
  `offlax.LayerStore` made there (``offload_params(model, store=...)``); the
  rest of the model is offloaded to host memory as without it. `rest_tier`, where given
  (an `offlax.NVMeTier`), holds the rest's optimizer state instead of host memory. `cfg`:
  a Tunix config of `case`'s family to compile instead of `case`'s own.

  The step is Tunix's without its logged `optax.global_norm(grads)`: with it,
  XLA's scheduler spends memory the card has to spare (Qwen3-14B at one layer:
  3.81 GB at the RTX 4090's memory, 2.25 GB without it, and 2.25 GB with it
  under ``device_memory_size=3e9``); its host bytes are the same.
  """
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import offlax

  cfg = config(case, layers) if cfg is None else cfg
  model = abstract_model(case, cfg)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  tx: Any = offlax.master_weights(optax.adamw(1e-5))
  layer_store = None
  if store is not None:  # sparse: nothing written, no space reserved (a compile only)
    layer_store = offlax.LayerStore.create(store, offlax.stack_layers(model.layers), progress=False)
  if offloaded:
    offlax.offload_params(model, offload_activations=offload_activations, store=layer_store)
    tx = offlax.offload(tx, compute="host") if rest_tier is None else offlax.offload(tx, rest_tier)
  optimizer = abstract_optimizer(model, tx, offloaded)
  graphdef, state = nnx.split((model, optimizer))

  def loss_fn(model, tokens, positions, mask):
    logits, _ = model(tokens, positions, None, mask)
    logits = logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(state, tokens, positions, mask):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, positions, mask)
    optimizer.update(model, grads)  # Flax's own call: offlax's fused host update when offloaded
    return nnx.state((model, optimizer)), loss

  t = case.tokens
  tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, t, t), jnp.bool_)
  try:
    compiled = offlax.compile_for_gpu(
      jax.jit(step, donate_argnums=0), state, tokens, tokens, mask,
      target=case.target, n_params=n_params, **compile_options,
    )  # fmt: skip
  finally:
    if layer_store is not None:
      layer_store.close()
  return compiled, n_params


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
  """Least-squares (intercept, slope) of peak bytes against depth."""
  n = len(points)
  mx = sum(x for x, _ in points) / n
  my = sum(y for _, y in points) / n
  sxx = sum((x - mx) ** 2 for x, _ in points)
  slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
  return my - slope * mx, slope


def plot(result: dict[str, Any], path) -> None:
  plt = _common.pyplot()
  fig, (bars, depth) = plt.subplots(1, 2, figsize=(12, 4.5))
  rows = result["summary"]
  x = range(len(rows))
  for k, (key, label) in enumerate((("plain_peak", "plain (all on the device)"),
                                    ("offlax_peak", "offlax.offload_params"))):  # fmt: skip
    bars.bar([i + (k - 0.5) * 0.38 for i in x], [r[key] / GB for r in rows], 0.38, label=label)
  for i, r in enumerate(rows):
    bars.plot([i - 0.45, i + 0.45], [r["target_memory"] / GB] * 2, "k--",
              label="the GPU's memory" if i == 0 else None)  # fmt: skip
    bars.plot([i + 0.02, i + 0.36], [r["goal"] / GB] * 2, "r:", label="goal" if i == 0 else None)
  bars.set_xticks(list(x), [f"{r['model']}\n{r['target'].split()[0]}" for r in rows])
  bars.set_yscale("log")
  bars.set_ylabel("device GB at the compiled peak (full depth)")
  bars.legend(fontsize=8)
  bars.grid(alpha=0.3, axis="y")
  for name in dict.fromkeys(r["model"] for r in result["runs"]):
    for offloaded, style in ((True, "o-"), (False, "s--")):
      pts = sorted((r["layers"], r["device_peak"]) for r in result["runs"]
                   if r["model"] == name and r["offloaded"] == offloaded)  # fmt: skip
      if pts:
        depth.plot([p[0] for p in pts], [p[1] / GB for p in pts], style,
                   label=f"{name} {'offlax' if offloaded else 'plain'}")  # fmt: skip
  depth.set_xscale("log", base=2)
  depth.set_yscale("log")
  depth.set_xlabel("layers (compiled)")
  depth.set_ylabel("device GB at the compiled peak")
  depth.legend(fontsize=7)
  depth.grid(alpha=0.3)
  _common.save_png(fig, path, "Tunix models, whole train step, XLA:GPU buffer assignment")


def summary_table(result: dict[str, Any]) -> str:
  lines = [
    f"{'model':>12} {'params':>7} {'target':>10} {'layers':>6} {'plain GB':>17} "
    f"{'offlax GB':>17} {'GB/layer':>8} {'goal':>5} {'met':>5} {'converted':>9}"
  ]
  for r in result["summary"]:
    how = lambda k, r=r: "measured" if r[f"{k}_measured"] else "extrapolated"
    lines.append(
      f"{r['model']:>12} {r['n_params'] / 1e9:>6.1f}B {r['target'].split()[0]:>10} "
      f"{r['layers']:>6} {r['plain_peak'] / GB:>6.1f} {how('plain'):>10} "
      f"{r['offlax_peak'] / GB:>6.2f} {how('offlax'):>10} {r['offlax_slope'] / GB:>8.3f} "
      f"{r['goal'] / GB:>5.0f} {str(r['met']):>5} {r['host_compute']:>9}"
    )
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(CASES), nargs="+",
                  default=["qwen3_14b", "llama3p1_8b", "llama3_70b"])  # fmt: skip
  ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8],
                  help="reduced depths compiled to fit the growth (2 4 8)")  # fmt: skip
  ap.add_argument("--full", nargs="*", default=["qwen3_14b"],
                  help="models also compiled at full depth, offloaded (qwen3_14b)")  # fmt: skip
  ap.add_argument(
    "--plain-full",
    nargs="*",
    default=[],
    help="models whose plain step is also compiled at full depth (none)",
  )
  ap.add_argument(
    "--offload-activations",
    action="store_true",
    help="offload_params(..., offload_activations=True)",
  )
  _common.add_out_argument(ap, "tunix_offload")
  args = ap.parse_args(argv)
  import offlax

  if not offlax.extend.gpu_compile_available():
    raise SystemExit("XLA's GPU compiler is not installed: pip install -e '.[gpu-compile]'")
  start = time.perf_counter()
  runs, summary = [], []
  for name in args.model:
    case = CASES[name]
    full = config(case).num_layers
    depths = sorted({d for d in args.depths if d < full})
    plan = [(d, o) for d in depths for o in (True, False)]
    if name in args.full or name == "tiny":
      plan.append((full, True))
    if name in args.plain_full or name == "tiny":
      plan.append((full, False))
    for layers, offloaded in plan:
      t = time.perf_counter()
      c, n = compile_step(case, layers, offloaded=offloaded,
                          offload_activations=args.offload_activations)  # fmt: skip
      wall = time.perf_counter() - t
      what = "offlax.offload_params" if offloaded else "plain (all on the device)"
      print(f"\n{name}, {layers} layers ({n / 1e9:.2f}B params), {what}, {wall:.0f} s")
      print(c.table(), flush=True)
      runs.append({
        "model": name, "layers": layers, "n_params": n, "target": c.target.name,
        "target_memory": c.target.device_memory_size, "offloaded": offloaded,
        "offload_activations": args.offload_activations and offloaded,
        "device": c.device, "host": c.host, "device_peak": c.device_peak,
        "host_peak": c.host_peak, "fits": c.fits, "host_compute": list(c.host_compute),
        "compile_s": wall,
      })  # fmt: skip
    summary.append(_summarize(name, case, full, runs))
  result = {
    **_common.environment(), "tokens": {n: CASES[n].tokens for n in args.model},
    "optimizer": "nnx.Optimizer(model, offlax.offload(offlax.master_weights(optax.adamw(1e-5)), "
                 "compute='host'), wrt=nnx.Param); plain: the same without offload",
    "runs": runs, "summary": summary, "wall_s": time.perf_counter() - start,
  }  # fmt: skip
  _common.write_outputs(result, args.out, "tunix_offload", plot, summary_table)
  return result


def _summarize(name: str, case: Case, full: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
  """The full-depth figures of `name`: measured where compiled, else the depth fit's."""
  mine = [r for r in runs if r["model"] == name]
  out: dict[str, Any] = {
    "model": name, "layers": full, "goal": case.goal,
    "target": mine[0]["target"], "target_memory": mine[0]["target_memory"],
  }  # fmt: skip
  for key, offloaded in (("offlax", True), ("plain", False)):
    rs = [r for r in mine if r["offloaded"] == offloaded]
    at_full = [r for r in rs if r["layers"] == full]
    fit = [(r["layers"], r["device_peak"]) for r in rs if r["layers"] < full]
    intercept, slope = fit_line(fit) if len(fit) > 1 else (0.0, 0.0)
    out[f"{key}_slope"] = slope
    out[f"{key}_extrapolated"] = intercept + slope * full if len(fit) > 1 else None
    out[f"{key}_measured"] = bool(at_full)
    out[f"{key}_peak"] = at_full[0]["device_peak"] if at_full else out[f"{key}_extrapolated"]
    if key == "offlax":
      full_n = at_full[0]["n_params"] if at_full else None
      out["n_params"] = full_n or _full_params(case)
      out["host_compute"] = sum(len(r["host_compute"]) for r in rs)
  out["met"] = out["offlax_peak"] is not None and out["offlax_peak"] <= case.goal
  out["met"] = out["met"] and out["host_compute"] == 0
  return out


def _full_params(case: Case) -> int:
  import jax
  from flax import nnx

  model = abstract_model(case, config(case))
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


if __name__ == "__main__":
  main()

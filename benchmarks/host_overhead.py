"""Step-time overhead of keeping AdamW state in host memory with `offlax.offload`.

What is measured: the wall time of one jitted train-step-like function,
`step(params, grads, opt_state) -> (new_params, new_opt_state)`, which runs
`tx.update(grads, opt_state, params)` and `optax.apply_updates`. No forward or
backward pass is timed: the optimizer update is the only work, so the numbers
isolate what offloading costs. Three variants run on the same parameters and
the same (shared, precomputed) gradients:

* `optax` - plain `optax.adamw(1e-3)`, state in device memory;
* `offlax` - `offlax.offload(optax.adamw(1e-3))`, state in `pinned_host`
  memory, streamed in slices of the default `chunk_bytes` (64 MiB);
* `offlax (one slice)` - the same with `chunk_bytes=2**40`, so the whole state
  moves as one slice;
* `optax (small leaves)` and `offlax (small leaves)` - the first two on a tree of
  many small leaves (issue 34): 100 kernels of (1024, 312) and 100 biases of
  (312,), about 32M parameters in 200 leaves, none cut, about 25 leaves a slice.
  Each offlax variant is compared with the optax variant of its own tree.

The parameters are a transformer-shaped pytree of fp32 leaves (about 64M
parameters in 202 leaves at full size): an embedding, `NUM_LAYERS` layers with
q/k/v/o kernels, an MLP with biases and two norm scales, and a final norm.
Each step function is jitted with `donate_argnums=(0, 2)` and its outputs are
fed back as the next inputs, so buffers are reused as in a training loop.

Every variant is compiled, then warmed up for `--warmup` steps, then timed for
`--steps` steps. The variants run round-robin, one step each in turn with the
order rotated every round, so drift of the machine (thermal, other load) hits
all of them alike. Each step is timed up to `jax.block_until_ready` on its
outputs. The summary gives the median, min and max step time per variant and
the ratio of medians offlax / optax; the goal is at most 1.05x. As a sanity
check it also reports how far each variant's final parameters are from plain
optax's (offlax promises identical results).

Results go to `<out>/host_overhead.json` and a bar plot `<out>/host_overhead.png`.

Reproduce (from the repository root):

  python benchmarks/host_overhead.py                  # full size, 10 timed steps
  python -m benchmarks.host_overhead --steps 20
  python benchmarks/host_overhead.py --size-scale 0.01 --steps 2 --out /tmp/bench

Memory: about 1 GiB per variant at full size (params plus the two AdamW moments)
plus the shared gradients, half that for the small-leaves tree, about 5 GiB peak
for the whole run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import offlax

# benchmarks/_common.py holds what the benchmark scripts share. It is imported as
# `benchmarks._common` however this file is run: `python -m benchmarks.<name>` has the repository
# root on sys.path already, while `python benchmarks/<name>.py` (only this directory on sys.path)
# and loading the file by path with importlib.util.spec_from_file_location (no parent package, so
# no relative import either) do not; hence the repository root, this directory's parent, is added
# when missing. Appended, not prepended, so installed packages (offlax itself) still come first.
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
  sys.path.append(_REPO_ROOT)
from benchmarks import _common  # noqa: E402

NUM_LAYERS = 20
BASE_D_MODEL = 512  # d_model at --size-scale 1.0: 64.0M parameters
VOCAB_PER_D_MODEL = 4  # vocab size = 4 * d_model
LEARNING_RATE = 1e-3
GOAL_RATIO = 1.05
ONE_SLICE_CHUNK_BYTES = 2**40
BASELINE = "optax"
# The many-small-leaves tree (issue 34): per-leaf costs show here first.
SMALL_LEAVES = 100  # kernels, and as many biases
SMALL_ROWS, SMALL_COLS = 1024, 312  # rows scale with --size-scale
SMALL = " (small leaves)"


# -- model -------------------------------------------------------------------


def d_model_for(size_scale: float) -> int:
  """d_model giving about `size_scale` times the full parameter count (multiple of 8)."""
  return max(8, 8 * round(BASE_D_MODEL * math.sqrt(size_scale) / 8))


def param_shapes(d: int) -> dict[str, Any]:
  """A transformer-shaped tree of parameter shapes with model width `d`."""

  def dense(n_in, n_out, bias):
    return {"kernel": (n_in, n_out), "bias": (n_out,)} if bias else {"kernel": (n_in, n_out)}

  def layer():
    return {
      "ln_attn": {"scale": (d,)},
      "attn": {name: dense(d, d, bias=False) for name in ("q", "k", "v", "o")},
      "ln_mlp": {"scale": (d,)},
      "mlp": {"up": dense(d, 4 * d, bias=True), "down": dense(4 * d, d, bias=True)},
    }

  return {
    "embed": {"embedding": (VOCAB_PER_D_MODEL * d, d)},
    "layers": {f"layer_{i:02d}": layer() for i in range(NUM_LAYERS)},
    "final_norm": {"scale": (d,)},
  }


def small_leaf_shapes(size_scale: float) -> dict[str, Any]:
  """`SMALL_LEAVES` (rows, 312) kernels and (312,) biases; 1024 rows at full size."""
  rows = max(8, round(SMALL_ROWS * size_scale))
  return {
    f"dense_{i:03d}": {"kernel": (rows, SMALL_COLS), "bias": (SMALL_COLS,)}
    for i in range(SMALL_LEAVES)
  }


def _is_shape(x: Any) -> bool:
  return isinstance(x, tuple)


def random_tree(shapes: dict[str, Any], seed: int, std: float) -> Any:
  """Normal(0, std) fp32 arrays of the given shapes, each in its own device buffer.

  Drawn with NumPy: `jax.random` under one jit takes minutes to compile for 200
  shapes on CPU.
  """
  rng = np.random.default_rng(seed)

  def draw(shape):
    return jnp.array(std * rng.standard_normal(shape, dtype=np.float32), copy=True)

  return jax.tree.map(draw, shapes, is_leaf=_is_shape)


# -- variants ----------------------------------------------------------------


@dataclasses.dataclass
class Variant:
  """One optimizer under test, with its own params and state (donated each step)."""

  name: str
  tx: optax.GradientTransformation
  chunk_bytes: int | None = None
  tree: str = "transformer"  # or "small": `small_leaf_shapes`
  step: Callable[..., Any] | None = None
  params: Any = None
  state: Any = None
  compile_s: float = 0.0
  times_s: list[float] = dataclasses.field(default_factory=list)

  def run(self, grads: Any) -> float:
    """One step; returns its wall time in seconds, outputs ready."""
    start = time.perf_counter()
    self.params, self.state = self.step(self.params, grads, self.state)
    jax.block_until_ready((self.params, self.state))
    return time.perf_counter() - start


def make_variants() -> list[Variant]:
  default_chunk = offlax.HostTier().chunk_bytes
  return [
    Variant(BASELINE, optax.adamw(LEARNING_RATE)),
    Variant("offlax", offlax.offload(optax.adamw(LEARNING_RATE)), default_chunk),
    Variant(
      "offlax (one slice)",
      offlax.offload(optax.adamw(LEARNING_RATE), chunk_bytes=ONE_SLICE_CHUNK_BYTES),
      ONE_SLICE_CHUNK_BYTES,
    ),
    Variant(BASELINE + SMALL, optax.adamw(LEARNING_RATE), tree="small"),
    Variant("offlax" + SMALL, offlax.offload(optax.adamw(LEARNING_RATE)), default_chunk, "small"),
  ]


def baseline_of(v: Variant) -> str:
  """The name of the plain-optax variant on `v`'s tree."""
  return BASELINE + (SMALL if v.tree == "small" else "")


def make_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
  def step(params, grads, opt_state):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 2))


def round_robin(
  variants: Sequence[Variant], rounds: int, grads: dict[str, Any], record: bool
) -> None:
  """`rounds` steps of every variant, interleaved; the order rotates each round.

  `grads`: the gradients of each tree, by `Variant.tree`.
  """
  n = len(variants)
  for r in range(rounds):
    for v in list(variants[r % n :]) + list(variants[: r % n]):
      elapsed = v.run(grads[v.tree])
      if record:
        v.times_s.append(elapsed)


# -- reporting ---------------------------------------------------------------


def max_abs_diff(a: Any, b: Any) -> float:
  diffs = jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)), a, b)
  return float(max(jax.tree.leaves(diffs)))


def summary_table(result: dict[str, Any]) -> str:
  header = (
    f"{'variant':<25} {'median ms':>10} {'min ms':>9} {'max ms':>9} "
    f"{'vs optax':>9} {'compile s':>10} {'max |dparams|':>14}"
  )
  small = result.get("small_leaves")
  lines = [
    f"host_overhead: AdamW step, {result['params']:,} fp32 params in {result['leaves']} leaves,"
    f" {result['steps']} timed steps per variant (+{result['warmup']} warm-up), round-robin"
    + (f"; {SMALL.strip()}: {small['params']:,} in {small['leaves']} leaves" if small else ""),
    f"backend {result['backend']}, jax {result['jax_version']}, {result['cpu_count']} CPUs,"
    f" peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB",
    header,
    "-" * len(header),
  ]
  for v in result["variants"]:
    ratio = result["ratios"].get(v["name"])
    ratio_s = "-" if ratio is None else f"{ratio:.3f}x"
    lines.append(
      f"{v['name']:<25} {v['median_s'] * 1e3:>10.1f} {v['min_s'] * 1e3:>9.1f}"
      f" {v['max_s'] * 1e3:>9.1f} {ratio_s:>9} {v['compile_s']:>10.1f}"
      f" {v['max_abs_diff_vs_optax']:>14.3g}"
    )
  verdicts = [
    f"{name}: {ratio:.3f}x {'<=' if ratio <= GOAL_RATIO else '>'} {GOAL_RATIO}x "
    f"({'OK' if ratio <= GOAL_RATIO else 'OVER GOAL'})"
    for name, ratio in result["ratios"].items()
  ]
  lines.append(
    f"ratio of medians vs optax on the same tree, goal <= {GOAL_RATIO:.2f}x: " + "; ".join(verdicts)
  )
  return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  variants = result["variants"]
  names = [v["name"] for v in variants]
  med = np.array([v["median_s"] for v in variants]) * 1e3
  lo = med - np.array([v["min_s"] for v in variants]) * 1e3
  hi = np.array([v["max_s"] for v in variants]) * 1e3 - med
  colors = ["tab:gray", "tab:blue", "tab:orange", "silver", "tab:cyan"][: len(names)]

  fig, ax = plt.subplots(figsize=(9.5, 5), dpi=120)
  x = np.arange(len(names))
  bars = ax.bar(x, med, yerr=[lo, hi], capsize=8, color=colors)
  # The goal over each tree's bars: GOAL_RATIO x its own optax median.
  for i, name in enumerate(names):
    if name.startswith(BASELINE):
      same = [j for j, n in enumerate(names) if n.endswith(SMALL) == name.endswith(SMALL)]
      ax.hlines(
        med[i] * GOAL_RATIO, min(same) - 0.4, max(same) + 0.4, color="tab:red",
        linestyle="--", linewidth=1,
        label=f"goal: {GOAL_RATIO:.2f}x optax median" if i == 0 else None,
      )  # fmt: skip
  for bar, v, top in zip(bars, variants, med + hi, strict=True):
    ratio = result["ratios"].get(v["name"])
    text = f"{v['median_s'] * 1e3:.1f} ms"
    if ratio is not None:
      text += f"\n{ratio:.3f}x optax"
    _common.label_above(ax, text, (bar.get_x() + bar.get_width() / 2, top), dy=4)
  ax.set_xticks(x, [n.replace(" (", "\n(") for n in names])
  ax.set_xlabel("optimizer (AdamW, lr 1e-3); bar: median, whiskers: min to max")
  ax.set_ylabel("time per step (ms)")
  ax.set_ylim(0, max(med + hi) * 1.25)
  ax.set_title(
    f"offlax host-memory overhead: {result['params'] / 1e6:.1f}M params, "
    f"{result['leaves']} leaves\n{result['steps']} steps each, "
    f"{result['backend']} backend, jax {result['jax_version']}",
    fontsize=11,
  )
  ax.legend(loc="lower right", fontsize=9, framealpha=0.9)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  _common.save_png(fig, path)


# -- main --------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  _common.add_steps_arguments(parser, steps=10, warmup_help="untimed steps after compiling (2)")
  parser.add_argument(
    "--size-scale",
    type=float,
    default=1.0,
    help="scale of the parameter count; 1.0 is about 64M params (1.0)",
  )
  _common.add_out_argument(parser, "host_overhead")
  args = parser.parse_args(argv)
  _common.check_steps_arguments(parser, args)
  if not args.size_scale > 0:
    parser.error("--size-scale must be > 0")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, writes the JSON and PNG, prints and returns the results."""
  args = parse_args(argv)
  wall_start = time.perf_counter()
  d = d_model_for(args.size_scale)
  shapes = param_shapes(d)
  leaves = jax.tree.leaves(shapes, is_leaf=_is_shape)
  n_params = sum(math.prod(s) for s in leaves)
  print(
    f"model: d_model={d}, {NUM_LAYERS} layers, {n_params:,} fp32 params "
    f"({n_params * 4 / 2**20:.0f} MiB) in {len(leaves)} leaves",
    flush=True,
  )

  trees = {"transformer": shapes, "small": small_leaf_shapes(args.size_scale)}
  small_leaves = jax.tree.leaves(trees["small"], is_leaf=_is_shape)
  # Shared by all variants of a tree, never donated.
  grads = {name: random_tree(t, seed=1, std=1e-3) for name, t in trees.items()}
  variants = make_variants()
  for v in variants:
    v.params = random_tree(trees[v.tree], seed=0, std=0.02)  # identical values, own buffers
    v.state = v.tx.init(v.params)
    start = time.perf_counter()
    v.step = make_step(v.tx).lower(v.params, grads[v.tree], v.state).compile()
    v.compile_s = time.perf_counter() - start
    print(f"compiled {v.name!r} in {v.compile_s:.1f} s", flush=True)

  round_robin(variants, args.warmup, grads, record=False)
  round_robin(variants, args.steps, grads, record=True)

  bases = {v.name: v for v in variants if v.name.startswith(BASELINE)}
  records = []
  for v in variants:
    base = bases[baseline_of(v)]
    records.append(
      {
        "name": v.name,
        "chunk_bytes": v.chunk_bytes,
        **_common.stats_of(v.times_s, suffix="_s"),
        "mean_s": statistics.fmean(v.times_s),
        "times_s": v.times_s,
        "compile_s": v.compile_s,
        "max_abs_diff_vs_optax": 0.0 if v is base else max_abs_diff(v.params, base.params),
      }
    )
  for v in variants:  # free every variant's params and state only now
    v.params = v.state = v.step = None
  del grads

  median = {r["name"]: r["median_s"] for r in records}
  result = {
    "benchmark": "host_overhead",
    **_common.environment(devices=True),
    "size_scale": args.size_scale,
    "d_model": d,
    "num_layers": NUM_LAYERS,
    "params": n_params,
    "leaves": len(leaves),
    "param_bytes": n_params * 4,
    "steps": args.steps,
    "warmup": args.warmup,
    "goal_ratio": GOAL_RATIO,
    "small_leaves": {
      "params": sum(math.prod(s) for s in small_leaves),
      "leaves": len(small_leaves),
      "shapes": sorted({str(s) for s in small_leaves}),
    },
    "variants": records,
    "ratios": {
      v.name: median[v.name] / median[baseline_of(v)]
      for v in variants
      if not v.name.startswith(BASELINE)
    },
    "peak_rss_bytes": _common.maxrss_bytes(),
  }
  result["wall_s"] = time.perf_counter() - wall_start

  _common.write_outputs(result, args.out, "host_overhead", plot, summary_table)
  return result


if __name__ == "__main__":
  main()

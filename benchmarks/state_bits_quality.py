"""Training quality with 8-bit vs fp32 Adam state: a small LM from one seed, both loss curves.

Issue 45's quality point: a small decoder-only LM trained with `offlax.adamw(..., state_bits=32)`
(optax's float32 moments) and with `state_bits=8` (blockwise-quantized moments,
docs/state_bits.md) from the same initial params, on the same batches, with the same schedule
(linear warmup, then cosine decay to a tenth); the final losses (each the mean training loss over
the last `--tail` of the steps) within 1% of each other, and both curves on one plot.

- The model is `examples/lm_nnx.py`'s `LM` (pre-norm blocks of `nnx.MultiHeadAttention` and a GELU
  MLP, run by `offlax.scan_layers`), trained in a plain `jax.jit` step:
  `value_and_grad`, `tx.update`, `optax.apply_updates`.
- The data is a synthetic language made here (no download): an order-2 Markov chain over
  `--vocab` tokens. After token `b` come `--successors` candidates of `b`'s own, weighted by one of
  4 Dirichlet(0.3) distributions chosen by the token before it (`a % 4`): a bigram model does not
  reach the floor, the chain's own entropy does. Recorded beside the curves: the unigram entropy
  (what a model that learned nothing about context scores) and the chain's conditional entropy
  (the floor), both measured on the held-out batches.
- The two runs step in turn (one step of each, then the next), so a slowdown of the shared machine
  falls on both; every `--eval-every` steps each is scored on the same held-out batches and the
  JSON is rewritten (a run cut short keeps its curves so far), and both runs' params, state and
  the data's generator are saved beside it: `--resume` goes on from there, with the batches
  and arrays an unbroken run would have had (the losses of a run killed and resumed equal an
  unbroken run's, to the bit).
- The step is the device path (`tx` used directly, no tier). Every tier gives the same 8-bit state
  bit for bit (tests/test_state_bits.py: streamed and host-compute `HostTier`, `NVMeTier`,
  `master_weights`), so the device path's curve is every tier's. On this CPU backend the jitted
  step calls offlax's native kernels (adam.cc, adam8.cc), which equal the JAX path bit for bit.

Writes `<out>/state_bits_quality.json` and `<out>/state_bits_quality.png` (training loss, smoothed,
and held-out loss of both runs; the 8-bit minus fp32 difference below).

  # the recorded run (25.5M params, 3000 steps of 4 x 64 tokens: 97 min on 2 shared cores)
  python benchmarks/state_bits_quality.py --dim 512 --layers 8 --seq 64 --batch 4 --steps 3000
  python benchmarks/state_bits_quality.py   # 3.3M params, 2000 steps of 8 x 64: about 25 min
  # the issue's larger batches (5000 steps of 32 x 128 tokens): a faster machine
  python benchmarks/state_bits_quality.py --dim 512 --layers 8 --seq 128 --batch 32 --steps 5000
  python benchmarks/state_bits_quality.py --quick --out /tmp/bench   # seconds: the code path
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _common  # noqa: E402

NAME = "state_bits_quality"
GOAL_REL_DIFF = 0.01  # issue 45: final loss within 1%
# Issue 45's size: tens of millions of params, a few thousand steps (25M params here).
FULL_SIZE = ("--dim", "512", "--layers", "8", "--seq", "128", "--batch", "32", "--steps", "5000")
CLASSES = 4  # the token before the last picks one of this many weightings of the successors
QUICK = ("--vocab", "64", "--dim", "32", "--layers", "1", "--seq", "16", "--batch", "4",
         "--steps", "30", "--eval-every", "10", "--eval-batches", "1",
         "--warmup-steps", "5")  # fmt: skip


# -- the language ------------------------------------------------------------------


class Chain:
  """An order-2 Markov chain: after `(a, b)` comes one of `b`'s successors, weighted by `a % 4`."""

  def __init__(self, vocab: int, successors: int, seed: int):
    rng = np.random.default_rng(seed)
    self.vocab = vocab
    # Each token's successors: distinct tokens, so a weighting is a distribution over them.
    self.next = np.stack([rng.choice(vocab, successors, replace=False) for _ in range(vocab)])
    probs = rng.dirichlet(np.full(successors, 0.3), size=(CLASSES, vocab))  # [class, b, k]
    self.probs = probs
    self.cum = np.cumsum(probs, axis=-1)

  def sample(self, rng: np.random.Generator, rows: int, length: int, burn: int = 8) -> np.ndarray:
    """`rows` sequences of `length` tokens, each after `burn` tokens from a uniform start."""
    a, b = rng.integers(0, self.vocab, rows), rng.integers(0, self.vocab, rows)
    out = np.empty((rows, burn + length), np.int32)
    for t in range(burn + length):
      u = rng.random(rows)
      k = (u[:, None] > self.cum[a % CLASSES, b]).sum(-1)
      k = np.minimum(k, self.next.shape[1] - 1)  # u beyond a cumsum's rounded last entry
      a, b = b, self.next[b, k]
      out[:, t] = b
    return out[:, burn:]

  def entropies(self, tokens: np.ndarray) -> dict[str, float]:
    """Nats a token on `tokens`: the unigram entropy and the chain's own loss (the floor)."""
    counts = np.bincount(tokens.ravel(), minlength=self.vocab) / tokens.size
    unigram = float(-(counts[counts > 0] * np.log(counts[counts > 0])).sum())
    a, b, c = tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]
    k = np.argmax(self.next[b] == c[..., None], axis=-1)
    p = self.probs[a % CLASSES, b, k]
    return {"unigram_entropy": unigram, "chain_entropy": float(-np.log(p).mean())}


# -- the model and the step ----------------------------------------------------------


def load_lm_example() -> Any:
  """examples/lm_nnx.py as a module (its `LM`), without running it."""
  path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "lm_nnx.py"
  spec = importlib.util.spec_from_file_location("offlax_example_lm_nnx", path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def make_run(args: argparse.Namespace, bits: int) -> dict[str, Any]:
  """A model from `args.seed`, its AdamW state of `bits`, and its jitted train and eval steps."""
  import jax
  import optax
  from flax import nnx

  import offlax

  lm = load_lm_example()
  model = lm.LM(args.vocab, args.dim, args.heads, args.layers, args.seq, nnx.Rngs(args.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, args.warmup_steps, args.steps, end_value=args.lr / 10
  )
  tx = offlax.adamw(schedule, weight_decay=args.weight_decay, state_bits=bits)
  opt_state = tx.init(params)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return {
    "params": params,
    "opt_state": opt_state,
    "train": jax.jit(train_step, donate_argnums=(0, 1)),
    "eval": jax.jit(loss_fn),
    "n_params": sum(x.size for x in jax.tree.leaves(params)),
    "state_bytes_per_param": sum(x.nbytes for x in jax.tree.leaves(opt_state))
    / sum(x.size for x in jax.tree.leaves(params)),
  }


# -- the run -------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=(__doc__ or NAME).split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="a tiny model, 30 steps: the code path")
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--successors", type=int, default=8, help="candidates after a token (8)")
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--warmup-steps", type=int, default=100)
  parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (2e-3)")
  parser.add_argument("--weight-decay", type=float, default=0.01)
  parser.add_argument("--eval-every", type=int, default=100)
  parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches (4)")
  parser.add_argument("--tail", type=float, default=0.05, help="final loss: mean of this share")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--resume", action="store_true",
    help="go on from <out>/state_bits_quality.resume.npz, saved at each evaluation",
  )  # fmt: skip
  _common.add_out_argument(parser, NAME)
  args = parser.parse_args(argv)
  if args.quick:  # the quick sizes, then anything given explicitly after them
    args = parser.parse_args([*QUICK, *(argv if argv is not None else sys.argv[1:])])
  if args.steps < 1 or args.eval_every < 1 or not 0 < args.tail <= 1:
    parser.error("--steps and --eval-every must be >= 1, --tail in (0, 1]")
  if not 0 <= args.warmup_steps < args.steps:
    parser.error(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse(argv)
  start = time.perf_counter()
  chain = Chain(args.vocab, args.successors, args.seed)
  data_rng = np.random.default_rng(args.seed + 1)
  held_out = chain.sample(
    np.random.default_rng(args.seed + 2), args.eval_batches * args.batch, args.seq + 1
  ).reshape(args.eval_batches, args.batch, args.seq + 1)
  runs = {bits: make_run(args, bits) for bits in (32, 8)}
  result: dict[str, Any] = {
    "benchmark": NAME,
    **_common.environment(),
    "command": " ".join(["python benchmarks/state_bits_quality.py", *(argv or sys.argv[1:])]),
    "config": {k: v for k, v in vars(args).items() if k not in ("out", "quick", "resume")},
    "model": "examples/lm_nnx.py LM (pre-norm attention + GELU MLP, scan_layers)",
    "n_params": runs[32]["n_params"],
    "tokens_per_step": args.batch * args.seq,
    "data": {
      "kind": f"order-2 Markov chain, {args.successors} successors a token, {CLASSES} weightings",
      **chain.entropies(held_out.reshape(-1, args.seq + 1)),
    },
    "state_bytes_per_param": {str(b): r["state_bytes_per_param"] for b, r in runs.items()},
    "goal_rel_diff": GOAL_REL_DIFF,
    "train_loss": {"32": [], "8": []},
    "eval": {"step": [], "32": [], "8": []},
    "train_s": {"32": 0.0, "8": 0.0},  # each run's train steps, compiles included
  }
  args.out.mkdir(parents=True, exist_ok=True)
  first = 1
  if args.resume and _resume_path(args).exists():
    first = resume(args, runs, result, data_rng) + 1
    result.setdefault("resumed_after", []).append(first - 1)
    print(f"resumed after step {first - 1} from {_resume_path(args)}", flush=True)
  print(f"{result['n_params']:,} params, {args.steps} steps of {result['tokens_per_step']} "
        f"tokens; held-out unigram entropy {result['data']['unigram_entropy']:.3f}, chain "
        f"{result['data']['chain_entropy']:.3f} nats", flush=True)  # fmt: skip
  for step in range(first, args.steps + 1):
    tokens = chain.sample(data_rng, args.batch, args.seq + 1)  # the same batch for both
    for bits, run in runs.items():
      t0 = time.perf_counter()
      run["params"], run["opt_state"], loss = run["train"](run["params"], run["opt_state"], tokens)
      loss = float(loss)
      result["train_s"][str(bits)] += time.perf_counter() - t0
      if not math.isfinite(loss):
        raise FloatingPointError(f"state_bits={bits}: loss {loss} at step {step}")
      result["train_loss"][str(bits)].append(loss)
    if step % args.eval_every == 0 or step == args.steps:
      result["eval"]["step"].append(step)
      for bits, run in runs.items():
        losses = [float(run["eval"](run["params"], batch)) for batch in held_out]
        result["eval"][str(bits)].append(sum(losses) / len(losses))
      print(f"step {step}: train {result['train_loss']['32'][-1]:.4f} / "
            f"{result['train_loss']['8'][-1]:.4f}, held-out {result['eval']['32'][-1]:.4f} / "
            f"{result['eval']['8'][-1]:.4f} (fp32 / 8-bit), {time.perf_counter() - start:.0f} s",
            flush=True)  # fmt: skip
      summarize(result, args, step, time.perf_counter() - start)
      _common.write_json(result, args.out / f"{NAME}.json")
      save_resume(args, runs, result, data_rng, step)
  if "final_loss" not in result:  # resumed from the last step: nothing ran
    summarize(result, args, args.steps, time.perf_counter() - start)
  plot(result, args.out / f"{NAME}.png")
  print(f"final loss (mean of the last {result['tail_steps']} steps): fp32 "
        f"{result['final_loss']['32']:.4f}, 8-bit {result['final_loss']['8']:.4f}, "
        f"8-bit / fp32 - 1 = {result['rel_diff']:+.2%} (goal within {GOAL_REL_DIFF:.0%}); "
        f"wrote {args.out / NAME}.json/.png", flush=True)  # fmt: skip
  return result


def _resume_path(args: argparse.Namespace) -> pathlib.Path:
  return args.out / f"{NAME}.resume.npz"


def save_resume(args: argparse.Namespace, runs: dict, result: dict, rng: Any, step: int) -> None:
  """Both runs' params and state, the data's generator and `result` after `step`, atomically.

  A run of a few thousand steps on a shared machine may be stopped: `--resume` goes on
  from here with the very batches and arrays an unbroken run would have (the file is
  renamed into place, so a kill while it is written leaves the previous one).
  """
  import jax

  arrays = {
    f"{bits}/{part}/{i}": np.asarray(x)
    for bits, run in runs.items()
    for part in ("params", "opt_state")
    for i, x in enumerate(jax.tree.leaves(run[part]))
  }
  meta = {"step": step, "config": result["config"], "rng": rng.bit_generator.state,
          "result": {k: result[k] for k in ("train_loss", "eval", "train_s", "resumed_after")
                     if k in result}}  # fmt: skip
  tmp = args.out / f"{NAME}.resume.tmp.npz"
  np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
  os.replace(tmp, _resume_path(args))


def resume(args: argparse.Namespace, runs: dict, result: dict, rng: Any) -> int:
  """Loads `save_resume`'s file into `runs`, `result` and `rng`; the step it was saved after."""
  import jax
  import jax.numpy as jnp

  with np.load(_resume_path(args)) as f:
    meta = json.loads(f["meta"].tobytes())
    if meta["config"] != result["config"]:
      changed = sorted(k for k in result["config"] if meta["config"].get(k) != result["config"][k])
      raise SystemExit(f"--resume: {_resume_path(args)} is of another run (differs in "
                       f"{', '.join(changed)}): give its options, or another --out")  # fmt: skip
    for bits, run in runs.items():
      for part in ("params", "opt_state"):
        leaves, tree = jax.tree.flatten(run[part])
        run[part] = jax.tree.unflatten(
          tree, [jnp.asarray(f[f"{bits}/{part}/{i}"]) for i in range(len(leaves))]
        )
  rng.bit_generator.state = meta["rng"]
  result.update(meta["result"])
  return int(meta["step"])


def summarize(result: dict[str, Any], args: argparse.Namespace, step: int, wall: float) -> None:
  """The headline figures of `result` after `step` steps, in place."""
  tail = max(1, round(args.tail * step))
  final = {b: float(np.mean(result["train_loss"][b][-tail:])) for b in ("32", "8")}
  rel = final["8"] / final["32"] - 1
  result.update({
    "steps_done": step,
    "wall_s": wall,
    "tail_steps": tail,
    "final_loss": final,
    "rel_diff": rel,
    "final_eval_loss": {b: result["eval"][b][-1] for b in ("32", "8")},
    "eval_rel_diff": result["eval"]["8"][-1] / result["eval"]["32"][-1] - 1,
    "met": abs(rel) <= GOAL_REL_DIFF,
    "seconds_per_step": {b: result["train_s"][b] / step for b in ("32", "8")},
    "short_of_the_issue": shortfall(result, step),
  })  # fmt: skip


def shortfall(result: dict[str, Any], steps: int) -> list[str]:
  """Where this run is smaller than issue 45's wording, and the command for its full size."""
  out = []
  if result["n_params"] < 10e6:
    out.append(f"{result['n_params'] / 1e6:.1f}M params, not tens of millions")
  if steps < 3000:
    tokens = steps * result["tokens_per_step"]
    out.append(f"{steps} steps of {result['tokens_per_step']} tokens ({tokens / 1e6:.1f}M in all): "
               "at most the low end of a few thousand steps")  # fmt: skip
  if out:
    out.append("the issue's size: python benchmarks/state_bits_quality.py " + " ".join(FULL_SIZE))
  return out


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  fig, (ax, dx) = plt.subplots(
    2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
  )
  styles = {"32": ("fp32 state", "tab:blue"), "8": ("8-bit state", "tab:orange")}
  window = max(1, len(result["train_loss"]["32"]) // 100)
  smooth = lambda x: np.convolve(x, np.ones(window) / window, mode="valid")
  steps = np.arange(window, len(result["train_loss"]["32"]) + 1)
  for bits, (label, color) in styles.items():
    final = result["final_loss"][bits]
    ax.plot(steps, smooth(result["train_loss"][bits]), color=color, lw=1,
            label=f"{label}, train (mean of {window}); final {final:.4f}")  # fmt: skip
    ax.plot(result["eval"]["step"], result["eval"][bits], "o--", color=color, ms=3, lw=1,
            label=f"{label}, held-out")  # fmt: skip
  data = result["data"]
  ax.axhline(data["unigram_entropy"], color="grey", ls=":", lw=1, label="unigram entropy")
  ax.axhline(data["chain_entropy"], color="black", ls=":", lw=1, label="chain entropy (floor)")
  ax.set_yscale("log")  # the late curve, near the floor, is where the two could part
  ticks = [t for t in (1, 1.25, 1.5, 2, 3, 4, 5, 6) if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
  ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
  ax.set_yticks([], minor=True)
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.legend(fontsize=8)
  ax.set_title(f"{result['n_params'] / 1e6:.1f}M-param LM, {result['steps_done']} steps: "
               f"final 8-bit / fp32 - 1 = {result['rel_diff']:+.2%}", fontsize=10)  # fmt: skip
  diff = smooth(np.array(result["train_loss"]["8"]) - np.array(result["train_loss"]["32"]))
  dx.plot(steps, diff, color="tab:green", lw=1, label="train, 8-bit - fp32")
  dx.axhline(0, color="black", lw=0.5)
  dx.set_xlabel("step")
  dx.set_ylabel("8-bit - fp32 (nats)")
  dx.legend(fontsize=8)
  _common.save_png(fig, path, "AdamW: fp32 vs 8-bit blockwise-quantized moments, same seed")


if __name__ == "__main__":
  main()

"""`python -m offlax plan`: the planner from the command line.

Every option is read and checked (`plan_options`) before anything is planned,
so that nonsense fails at once with one line that names the flag and its
range; the verdict is `offlax.plan`'s, printed as its table, and the exit
status says it (0: fits, 1: does not fit).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

from offlax._src import errors, plan_options
from offlax._src.units import format_bytes

INNER_CODE = {
  "adam": "optax.adam(1e-3)",
  "adamw": "optax.adamw(1e-3)",
  "sgd": "optax.sgd(1e-3, momentum=0.9)",
  "adafactor": "optax.adafactor(1e-3)",
}


class Options(NamedTuple):
  """The plan command's options, parsed and checked."""

  sizes: dict[str, int]  # offlax.plan's byte arguments
  rates: dict[str, Any]  # the rates given (bus, disk, host step)
  params: int | None  # --params
  layers: int | None
  tokens: int


def options(args: Any) -> Options:
  """`args`' values in `offlax.plan`'s units; raises `InvalidOptionError` on the first bad one."""
  given = [
    ("device_bytes", args.device_mem), ("host_bytes", args.host_mem), ("nvme_bytes", args.nvme),
    ("activation_bytes", args.activations or "0"), ("chunk_bytes", args.chunk),
  ]  # fmt: skip
  if getattr(args, "update_bytes", None) is not None:
    given.append(("update_bytes", args.update_bytes))
  sizes = {name: int(plan_options.parse(name, text)) for name, text in given}
  rates = {
    name: float(plan_options.parse(name, text))
    for name, text in (
      ("bus_bytes_per_s", args.bus_gbps),
      ("disk_bytes_per_s", args.disk_gbps),
      ("host_adam_params_per_s", args.host_adam_gps),
    )  # fmt: skip
    if text is not None
  }
  if getattr(args, "state_bits", 32) == 8 and args.optimizer not in ("adam", "adamw"):
    raise errors.InvalidOptionError(
      f"plan: --state-bits 8 is for Adam's moments (offlax.adam/adamw(..., state_bits=8)), "
      f"not --optimizer {args.optimizer}: give --optimizer adam or adamw, or leave --state-bits"
    )
  tokens = int(plan_options.parse("tokens", args.tokens))
  layers = None if args.layers is None else int(plan_options.parse("layers", args.layers))
  if args.hf_config is not None:
    _check_hf_config(args)
  if args.model is not None and args.params is not None:
    raise errors.InvalidOptionError(
      "plan: --params and --model: give one (--model counts the named model's params)"
    )
  if args.model is not None and layers is not None:
    raise errors.InvalidOptionError(
      "plan: --layers and --model: give one (--model gives the model's layers)"
    )
  if args.model is None and args.params is None and args.hf_config is None:
    raise plan_options.error(
      "params", "missing: give --params N (e.g. 7B), --model NAME or --hf-config PATH"
    )
  n = None if args.params is None else int(plan_options.parse("params", args.params))
  if args.compile is not None:
    from offlax._src import gpu_compile

    if args.compile not in gpu_compile.TARGETS:
      raise errors.InvalidOptionError(
        f"plan: --compile: unknown target {args.compile!r}; known: {', '.join(gpu_compile.TARGETS)}"
      )
  for flag, path in (("--measure-disk", args.measure_disk), ("--nvme-path", args.nvme_path)):
    if path is not None and not os.path.isdir(path):
      raise errors.InvalidOptionError(f"plan: {flag}: {path!r} is not a directory")
  return Options(sizes, rates, n, layers, tokens)


def _check_hf_config(args: Any) -> None:
  """``--hf-config PATH``: a checkpoint folder or its config.json, instead of --model/--params."""
  from offlax._src.hf import config as hf_config

  for flag, value in (("--model", args.model), ("--params", args.params),
                      ("--layers", args.layers)):  # fmt: skip
    if value is not None:
      raise errors.InvalidOptionError(
        f"plan: --hf-config and {flag}: give one (--hf-config gives the model's params and layers)"
      )
  if not hf_config.is_hf_config(args.hf_config):
    raise errors.InvalidOptionError(
      f"plan: --hf-config {args.hf_config}: not a Hugging Face checkpoint folder with a "
      "config.json, nor such a config.json (num_hidden_layers, hidden_size, ...)"
    )


def run(args: Any, opts: Options) -> int:
  """Plans and prints; the exit status (0: fits, 1: does not fit, 2: --compile failed)."""
  import jax.numpy as jnp
  import optax

  import offlax
  from offlax._src import plan_models, planner

  sizes, rates = dict(opts.sizes), dict(opts.rates)
  dtype = jnp.dtype(args.param_dtype)
  shape = None  # the model's shape, where the plan counts one
  if args.hf_config is not None:
    shape = plan_models.load(args.hf_config, opts.tokens, flag="--hf-config")
  elif args.model is not None:
    shape = plan_models.load(args.model, opts.tokens)
  elif opts.layers is not None:
    assert opts.params is not None
    shape = plan_models.with_layers(opts.params, opts.layers, opts.tokens)
  guess = None if opts.params is None else plan_models.guess(opts.params, opts.tokens)
  # --tokens checked before planning: its working set grows as its square.
  planned = shape if shape is not None else guess
  assert planned is not None  # options() asks for --params or --model
  need = working_set(planned)
  if shape is not None:
    print(f"shape: {shape.source}: {plan_models.describe(shape.model)}")
  rates.update(_measured(args))
  bits = getattr(args, "state_bits", 32)
  inner = {
    "adam": lambda: offlax.adam(1e-3, state_bits=bits) if bits == 8 else optax.adam(1e-3),
    "adamw": lambda: offlax.adamw(1e-3, state_bits=bits) if bits == 8 else optax.adamw(1e-3),
    "sgd": lambda: optax.sgd(1e-3, momentum=0.9),
    "adafactor": lambda: optax.adafactor(1e-3),
  }[args.optimizer]()
  if bits == 8 and "host_adam_params_per_s" not in rates:
    # The 8-bit host step does more arithmetic a param: slower where both are compute-bound.
    rates["host_adam_params_per_s"] = planner.HOST_ADAM8_PARAMS_PER_S
  tx = offlax.master_weights(inner) if args.master else inner
  if shape is not None:
    model, n, layers = shape.model, shape.model.n_params, shape.model.layers
    tree = plan_models.params(model, dtype)
    if args.activations is None:
      sizes["activation_bytes"] = need  # `planned` is `shape`
      how = "unrolled layers, each one's input saved" if shape.unrolled else "remat"
      print(
        f"working set on the device: {planner.format_bytes(sizes['activation_bytes'])} "
        f"(estimated for this shape and --tokens {opts.tokens}: XLA's attention, {how})"
      )
  else:
    assert opts.params is not None
    model, n, layers = None, opts.params, None
    tree = plan_models.flat(n, dtype)
  result = offlax.plan(tree, tx, **sizes, **rates, layers=layers, fused=args.fused)
  if (
    not result.fits
    and layers is None
    and args.activations is None
    and 2 * n * dtype.itemsize > sizes["device_bytes"] * (1 - planner.DEVICE_RESERVE)
  ):
    # Params and gradients too big for the device: a decoder of this size can keep them
    # in host memory or on disk, which the plan can only weigh knowing the model's shape;
    # that plan's verdict, fits or not, is the one to give (its advice counts those ways).
    assert guess is not None
    counted = {**sizes, "activation_bytes": working_set(guess)}
    guessed_tree = plan_models.params(guess.model, dtype)
    other = offlax.plan(guessed_tree, tx, **counted, **rates, layers=guess.model.layers, fused=True)
    print(
      f"assuming the shape of {guess.source}: {plan_models.describe(guess.model)}; pass "
      "--layers L, or --model NAME for a Tunix config or a JSON file of shapes, for exact "
      "figures:"
    )
    result, model, n = other, guess.model, guess.model.n_params
  inner_code = INNER_CODE[args.optimizer]
  if bits == 8:
    inner_code = f"offlax.{args.optimizer}(1e-3, state_bits=8)"
  if args.master:
    inner_code = f"offlax.master_weights({inner_code})"
  print(result.table(inner=inner_code))
  if result.mode == "params_nvme" and "disk_bytes_per_s" not in rates:
    print(f"- the disk's {planner.DISK_BYTES_PER_S / 1e9:g} GB/s is assumed (a datacenter NVMe "
          "SSD): --measure-disk PATH measures yours, --disk-gbps sets it")  # fmt: skip
  if result.fits and args.activations is None and shape is None and model is None:
    _with_layers(n, tx, sizes, rates, args, opts.tokens)
  return _compile(args, result, model, n, sizes)


def working_set(shape: Any) -> int:
  """`shape.device_bytes()`, the step's working set; `InvalidOptionError` naming --tokens past 1PB.

  XLA's attention holds scores that grow as the square of the tokens in one sequence.
  """
  m, need = shape.model, shape.device_bytes()
  if need > plan_options.LIMITS["activation_bytes"].high:
    raise plan_options.error(
      "tokens",
      f"{m.tokens} tokens in one sequence make a working set of {format_bytes(need)} "
      f"(XLA's attention, {m.heads} heads), past the planner's 1PB: give fewer",
    )
  return need


def _measured(args: Any) -> dict[str, Any]:
  """The rates `--measure` and `--measure-disk` measure here, printed."""
  rates: dict[str, Any] = {}
  if args.measure:
    from offlax._src import measure

    rates = measure.all(args.nvme_path)
    print("measured: " + ", ".join(f"{k} {v:.3g}" for k, v in rates.items()))
  if args.measure_disk is not None:
    from offlax._src import measure

    try:
      rates["disk_bytes_per_s"] = measure.disk(args.measure_disk, 512 * 2**20)
    except OSError as e:
      raise errors.InvalidOptionError(f"plan: --measure-disk {args.measure_disk}: {e}") from None
    print(f"measured: disk {rates['disk_bytes_per_s'] / 1e9:.2f} GB/s in {args.measure_disk}")
  return rates


def _with_layers(n: int, tx: Any, sizes: dict, rates: dict, args: Any, tokens: int) -> None:
  """Prints the plan with the working set of the model `--layers` would count."""
  import jax.numpy as jnp

  import offlax
  from offlax._src import plan_models, planner

  guess = plan_models.guess(n, tokens)
  m = guess.model
  counted = {**sizes, "activation_bytes": working_set(guess)}
  tree = plan_models.params(m, jnp.dtype(args.param_dtype))
  other = offlax.plan(tree, tx, **counted, **rates, layers=m.layers, fused=args.fused)
  fraction = f", fraction {other.fraction:.2f}" if other.mode == "host" else ""
  verdict = "fits" if other.fits else "DOES NOT FIT"
  print(
    f"- with the working set of {guess.source}, --tokens {tokens} (--layers L or --model NAME "
    f"count yours): {planner.format_bytes(counted['activation_bytes'])}; mode {other.mode} "
    f"({verdict})"
    f"{fraction}, device {planner.format_bytes(other.bytes['device'])}"
  )


def _compile(args: Any, result: Any, model: Any, n: int, sizes: dict) -> int:
  """`--compile`: the chosen mode's step compiled for the target; the exit status."""
  from offlax._src import gpu_compile, llama

  if args.compile is None:
    return 0 if result.fits else 1
  if result.mode == "params_host":
    try:
      compiled = llama.compile_step(model, args.compile)
    except ImportError as e:
      print(f"--compile: {e}", file=sys.stderr)
      return 2
    print(
      f"compiled (params_host, {args.compile}): device {compiled.device_peak / 1e9:.2f} GB "
      f"(plan {result.bytes['device'] / 1e9:.2f} GB), host {compiled.host_peak / 1e9:.1f} GB "
      f"(plan {result.bytes['host'] / 1e9:.1f} GB)" + ("" if compiled.fits else "; DOES NOT FIT")
    )
    return 0 if compiled.fits else 1
  mode = {"device": "plain", "host": "streamed", "host_compute": "host"}.get(result.mode)
  if mode is None:
    print(f"--compile: nothing to compile for mode {result.mode!r}", file=sys.stderr)
    return 0 if result.fits else 1
  import offlax

  if not offlax.extend.gpu_compile_available():
    print("error: XLA's GPU compiler is not installed: pip install 'offlax[gpu-compile]'",
          file=sys.stderr)  # fmt: skip
    return 2
  try:
    m = gpu_compile.compile_adamw_step(
      n, mode=mode, master=args.master, chunk_bytes=sizes["chunk_bytes"], layers=16,
      fraction=result.fraction, target=args.compile, fused=args.fused,
    )  # fmt: skip
  except offlax.errors.OffloadError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(
    f"compiled ({mode}, {args.compile}): device {m.device_peak / n:.2f} B/param "
    f"(plan {result.bytes['device'] / n:.2f}), host {m.host_peak / n:.2f} B/param"
  )
  return 0 if result.fits else 1

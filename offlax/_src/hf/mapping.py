"""Name mappings: which NNX param each checkpoint tensor fills, and how its layout changes.

A mapping is Tunix's format (``tunix.models.<family>.params``'s
``_get_key_and_transform_mapping(config)``): a dict from a regular expression
over the checkpoint's tensor names to ``(target, transform)``. The target is
the param's path in the model (``layers.\\1.attn.q_proj.w``, groups of the
expression filled in); a target ending in ``[i]`` places the tensor at index
``i`` of the param's first axis (several tensors stacked into one param: Gemma's
``kv_einsum``); a target starting with ``unused.`` marks a tensor the model does
not hold (read by nothing, copied as it is by `save_safetensors`). The
transform is None or ``(permute, reshape)``: a transpose, then a reshape (each
may be None), with an optional third element, a transpose after the reshape.
The steps are exact (no arithmetic), so `inverse` undoes them bit for bit.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import importlib
import os
import re
from typing import Any, NamedTuple

import numpy as np

from offlax._src import errors, ffi

UNUSED = "unused."
_INDEXED = re.compile(r"^(.*)\[(\d+)\]$")
# numpy's transpose (no native library): a tile (rows, columns of the source), a thread's rows.
_ROWS, _COLS, _BAND = 16, 1024, 256
_NATIVE_BYTES = 2**20  # matrices transposed by the native library from this size


class Entry(NamedTuple):
  """Where one checkpoint tensor goes: its param's path, its index there, and the steps."""

  name: str
  path: str
  at: int | None  # its index on the param's first axis, where several tensors stack
  steps: tuple[tuple[str, tuple[int, ...]], ...]  # ("transpose", perm) or ("reshape", shape)


def steps_of(transform: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
  """A mapping's transform as steps: transpose, reshape, transpose (each where given)."""
  if transform is None:
    return ()
  if not isinstance(transform, (tuple, list)) or not 2 <= len(transform) <= 3:
    raise errors.InvalidOptionError(
      f"load_safetensors: a mapping's transform is None or (permute, reshape[, permute]), got "
      f"{transform!r}."
    )
  kinds = ("transpose", "reshape", "transpose")
  return tuple((k, tuple(int(d) for d in s)) for k, s in zip(kinds, transform, strict=False) if s)


def resolve(mapping: dict[str, Any], name: str) -> Entry | None:
  """Where tensor `name` goes under `mapping`: an `Entry`, or None where nothing matches.

  Raises:
    InvalidOptionError: several expressions of `mapping` match `name`.
  """
  found = [(pattern, m) for pattern in mapping if (m := re.fullmatch(pattern, name))]
  if not found:
    return None
  if len(found) > 1:
    raise errors.InvalidOptionError(
      f"load_safetensors: tensor {name} matches {len(found)} expressions of the mapping "
      f"({', '.join(p for p, _ in found)}); make them exclusive."
    )
  pattern, m = found[0]
  target, transform = mapping[pattern]
  path = m.expand(target)
  index = None
  if indexed := _INDEXED.match(path):
    path, index = indexed.group(1), int(indexed.group(2))
  return Entry(name, path, index, steps_of(transform))


def shapes(shape: tuple[int, ...], steps: Any, name: str) -> list[tuple[int, ...]]:
  """The shape before each step and after the last, from the checkpoint's `shape`.

  Raises:
    CheckpointMismatchError: a step does not fit the shape (the wrong rank for a
      transpose, another size for a reshape).
  """
  out = [tuple(shape)]
  for kind, arg in steps:
    now = out[-1]
    if kind == "transpose":
      if sorted(arg) != list(range(len(now))):
        raise errors.CheckpointMismatchError(
          f"tensor {name} is {list(shape)}: the mapping transposes it by {arg}, which does not "
          f"fit its shape {list(now)} at that step."
        )
      out.append(tuple(now[a] for a in arg))
    else:
      if int(np.prod(arg, dtype=np.int64)) != int(np.prod(now, dtype=np.int64)):
        raise errors.CheckpointMismatchError(
          f"tensor {name} is {list(shape)}: the mapping reshapes it from {list(now)} to "
          f"{list(arg)}, another size; the checkpoint is of another model size."
        )
      out.append(tuple(arg))
  return out


def forward(x: np.ndarray, steps: Any, out: np.ndarray | None = None) -> np.ndarray:
  """`x` (a checkpoint tensor) in the param's layout, a new contiguous array or `x` itself.

  With `out` (C-contiguous, of the result's shape; its dtype may differ: a
  cast), the result is written into it and `out` returned; the last transpose
  writes straight into it where only reshapes follow and the dtypes agree.
  """
  ops = [(kind, tuple(arg)) for kind, arg in steps]
  return _apply(x, ops, out)


def inverse(
  x: np.ndarray, steps: Any, shape: tuple[int, ...], out: np.ndarray | None = None
) -> np.ndarray:
  """The inverse of `forward`: `x` (in the param's layout) as the checkpoint's `shape` (`out`: as
  for `forward`)."""
  before = shapes(shape, steps, "")
  ops = []
  for j in reversed(range(len(steps))):
    kind, arg = steps[j]
    if kind == "transpose":
      ops.append((kind, tuple(int(a) for a in np.argsort(arg))))
    else:
      ops.append((kind, before[j]))
  return _apply(x, ops, out)


def _apply(x: np.ndarray, ops: list[tuple[str, tuple[int, ...]]], out: np.ndarray | None) -> Any:
  """`x` through transposes and reshapes, on its bits (exact); into `out` where given."""
  bits = _bits(x)
  last = max((j for j, (kind, _) in enumerate(ops) if kind == "transpose"), default=-1)
  direct = out is not None and last >= 0 and out.dtype == x.dtype and out.flags.c_contiguous
  for j, (kind, arg) in enumerate(ops):
    if kind == "reshape":
      bits = bits.reshape(arg)
    elif direct and j == last:  # the last copy made, into `out` (only reshapes after it)
      shape = tuple(bits.shape[a] for a in arg)
      bits = transpose(bits, arg, out=out.view(bits.dtype).reshape(shape))  # type: ignore[union-attr]
    else:
      bits = transpose(bits, arg)
  result = contiguous(bits).view(x.dtype)
  if out is None or direct:
    return out if direct else result
  np.copyto(out, result.reshape(out.shape), casting="unsafe")  # a cast: as astype rounds
  return out


def transpose(x: np.ndarray, perm: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
  """`x.transpose(perm)`; a matrix's copied by offlax's native transpose, bands of rows on threads.

  Nearly every byte of a checkpoint is a Linear's weight, transposed on its
  way in and out ([out, in] in Hugging Face's files, [in, out] in NNX).
  numpy's plain ``x.T`` copy reads a column at a time (0.27 GB/s a core for
  bf16 on the benchmark's 2-core EPYC); `native/transpose.cc` moves 4-5 GB/s
  a core (bf16, fp32), faster than the disk. Without the native library
  (``OFFLAX_NATIVE=0``, no compiler), for 1-byte items or under 1 MiB, tiles of 16 rows by
  1024 columns are copied into the output's transposed view by numpy
  (1.0-1.2 GB/s a core). Either way, bit for bit ``x.T``; into `out` where
  given (C-contiguous, the result's shape and dtype), else a new array.
  """
  if tuple(perm) != (1, 0):
    if out is None:
      return x.transpose(perm)
    np.copyto(out, x.transpose(perm))
    return out
  n, m = x.shape
  x = contiguous(x)
  if out is None:
    out = np.empty((m, n), x.dtype)
  assert out.shape == (m, n) and out.dtype == x.dtype and out.flags.c_contiguous, out
  if out.size == 0:
    return out
  workers = 1 if x.nbytes < 4 * 2**20 else min(8, os.cpu_count() or 1)
  # Small matrices by numpy: no native build (seconds, once per machine) for a test's tiny model.
  native = ffi.library() if x.itemsize in (2, 4, 8) and x.nbytes >= _NATIVE_BYTES else None
  if native is not None:
    call = native.OfflaxTranspose
    call.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5
    rows = -(-n // workers // 128) * 128  # a thread's band: whole tiles of the kernel

    def band(i: int) -> None:
      code = call(x.ctypes.data, out.ctypes.data, n, m, x.itemsize, i, min(i + rows, n))
      assert code == 0, code  # an item size the kernel lacks: excluded above

  else:
    rows = _BAND

    def band(i: int) -> None:  # tile by tile (numpy's copies release the GIL)
      into = out.T
      for k in range(i, min(i + rows, n), _ROWS):
        for j in range(0, m, _COLS):
          np.copyto(into[k : k + _ROWS, j : j + _COLS], x[k : k + _ROWS, j : j + _COLS])

  starts = range(0, n, rows)
  if workers == 1 or len(starts) == 1:
    for i in starts:
      band(i)
  else:
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(starts)), "offlax-transpose") as p:
      list(p.map(band, starts))
  return out


def _bits(x: np.ndarray) -> np.ndarray:
  """`x` viewed as unsigned ints of its item size: numpy moves those far faster than bf16."""
  if x.dtype.itemsize not in (1, 2, 4, 8):
    return x
  return contiguous(x).view(f"u{x.dtype.itemsize}")


def contiguous(x: np.ndarray) -> np.ndarray:
  """`x`, or a C-contiguous copy (`np.ascontiguousarray` makes a 0-d array 1-d)."""
  return x if x.flags.c_contiguous else x.copy(order="C")


def tunix_family(model: Any) -> str | None:
  """The Tunix family (``llama3``, ``qwen3``, ``gemma3``, ...) of `model`'s class, or None."""
  for cls in type(model).__mro__:
    parts = cls.__module__.split(".")
    if parts[:2] == ["tunix", "models"] and len(parts) > 2:
      return parts[2]
  return None


def for_model(model: Any, config: Any) -> dict[str, Any]:
  """The mapping of a Tunix Llama3, Qwen3 or Gemma3 model: Tunix's own, as its loader uses it.

  Raises:
    InvalidOptionError: `model` is of another class (pass ``mapping=``).
  """
  family = tunix_family(model)
  if family in ("llama3", "qwen3"):
    params = importlib.import_module(f"tunix.models.{family}.params")
    # Tunix's own table (a private name of Tunix, the one its loader reads): the same regexes.
    mapping = dict(params._get_key_and_transform_mapping(config))
    for pattern, (target, transform) in list(mapping.items()):
      if isinstance(target, str) and ".mlp.experts." in target:
        # Tunix's loader stacks the experts into (experts, ...) params after mapping them
        # (`_stack_experts`): here, each expert goes to its index of the stacked param.
        mapping[pattern] = (r"layers.\1.mlp.\3_proj[\2]", transform)
    return mapping
  if family == "gemma3":
    return gemma3(config)
  raise errors.InvalidOptionError(
    f"load_safetensors: no mapping is known for {type(model).__name__} (Tunix's Llama3, Qwen3 "
    "and Gemma3 have theirs); pass mapping={regex over tensor names: (param path, transform)} "
    "as docs/pretrained.md shows."
  )


def gemma3(config: Any) -> dict[str, Any]:
  """Tunix's Gemma3 mapping with its q, k and v made direct targets.

  Tunix maps them to temporary names and a preprocessing step stacks them
  into ``qkv_einsum`` (as many kv heads as heads) or ``q_einsum`` and
  ``kv_einsum``, each in (heads, embed, head_dim) layout: here, Tunix's
  transpose and reshape to (embed, heads, head_dim), then the preprocessing's
  transpose, as one transform (the same steps, so the same values).
  """
  params = importlib.import_module("tunix.models.gemma3.params_safetensors")
  mapping = dict(params._get_key_and_transform_mapping(config))
  fused = config.num_heads == config.num_kv_heads
  d, h = config.embed_dim, config.head_dim
  q = ((1, 0), (d, config.num_heads, h), (1, 0, 2))
  kv = ((1, 0), (d, config.num_kv_heads, h), (1, 0, 2))
  targets = (
    {"q": ("qkv_einsum.w[0]", q), "k": ("qkv_einsum.w[1]", kv), "v": ("qkv_einsum.w[2]", kv)}
    if fused
    else {"q": ("q_einsum.w", q), "k": ("kv_einsum.w[0]", kv), "v": ("kv_einsum.w[1]", kv)}
  )
  for pattern, (target, transform) in list(mapping.items()):
    if isinstance(target, str) and target.startswith("tmp.layers."):
      which = target.rsplit(".", 1)[1]
      name, transform = targets[which]
      mapping[pattern] = (r"layers.\1.attn." + name, transform)
  return mapping

"""The planner's options: what each may be, checked alike for `offlax.plan` and `offlax plan`.

Each numeric option has a range (`LIMITS`); a value outside it, or not a
number, raises `InvalidOptionError` with one message that names the option
both ways (the command line's flag and the keyword of `offlax.plan`), the
range and the value, so the API and the command line say the same thing.
The ranges are wide, beyond any machine or model of today, and exist so that
nonsense fails at once instead of planning (a `--params 1e30` would count
forever) or dividing by zero.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, NamedTuple

from offlax._src import errors
from offlax._src.units import format_bytes

MAX_PARAMS = 10**14  # 100T: 250x Llama 3.1 405B


class Limit(NamedTuple):
  """One option's range: `low` (excluded where `open_low`) to `high`, both included."""

  what: str  # what the value is, in words
  flag: str  # the command line's flag
  low: float
  high: float
  text: str  # the range, in words
  kind: str  # "bytes", "int", "rate" (bytes/s), "speed" (params/s)
  open_low: bool = False


LIMITS = {
  "device_bytes": Limit("device memory", "--device-mem", 2**20, 10**15, "1MiB to 1PB", "bytes"),
  "host_bytes": Limit("host RAM", "--host-mem", 2**20, 10**15, "1MiB to 1PB", "bytes"),
  "nvme_bytes": Limit("free disk", "--nvme", 0, 10**18, "0 to 1EB", "bytes"),
  "activation_bytes": Limit("activations", "--activations", 0, 10**15, "0 to 1PB", "bytes"),
  "chunk_bytes": Limit("slice size", "--chunk", 2**12, 2**34, "4KiB to 16GiB", "bytes"),
  "update_bytes": Limit(
    "a LayerStore's update in flight", "--update-bytes", 2**20, 10**15, "1MiB to 1PB", "bytes"
  ),
  "bus_bytes_per_s": Limit(
    "bus speed", "--bus-gbps", 0, 1e13, "above 0 up to 10000 GB/s", "rate", open_low=True
  ),
  "disk_bytes_per_s": Limit(
    "disk speed", "--disk-gbps", 0, 1e12, "above 0 up to 1000 GB/s", "rate", open_low=True
  ),
  "host_adam_params_per_s": Limit(
    "host step speed",
    "--host-adam-gps",
    0,
    1e13,
    "above 0 up to 10000 G params/s",
    "speed",
    open_low=True,
  ),  # fmt: skip
  "layers": Limit("layers", "--layers", 1, 10_000, "1 to 10000", "int"),
  "tokens": Limit("tokens (batch x sequence)", "--tokens", 1, 10**8, "1 to 1e8", "int"),
  "params": Limit("parameters", "--params", 1, MAX_PARAMS, "1 to 1e14 (100T)", "int"),
}
# The command line takes these in G/s; `offlax.plan` in units per second.
_PER_S = {"rate": 1e9, "speed": 1e9}


def _shown(kind: str, value: Any) -> str:
  """`value` as the message shows it: bytes in units, rates as the flag takes them."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    return repr(value)
  value = float(value)
  if not math.isfinite(value):
    return str(value)
  if kind == "bytes":
    return format_bytes(value)
  if kind in _PER_S:
    return f"{value / _PER_S[kind]:g} G/s"
  return f"{value:g}" if abs(value) >= 1e6 else str(int(value))


def error(name: str, problem: str) -> errors.InvalidOptionError:
  """The error for option `name`: ``plan: --flag (name=): problem; what must be RANGE``."""
  lim = LIMITS[name]
  # plan() counts a tree's params; tokens are the command line's (its working set)
  keyword = "" if name in ("params", "tokens") else f" ({name}=)"
  return errors.InvalidOptionError(
    f"plan: {lim.flag}{keyword}: {problem}; {lim.what} must be {lim.text}"
  )


def check(name: str, value: Any) -> Any:
  """`value` if option `name` allows it; else raises `InvalidOptionError`.

  Args:
    name: a key of `LIMITS` (``offlax.plan``'s keyword).
    value: the value, in `offlax.plan`'s units (bytes, bytes per second).

  Returns:
    `value`, unchanged.

  Raises:
    InvalidOptionError: not a number (an int where one is needed), not finite,
      or outside the range.

  Example:
    >>> from offlax._src import plan_options
    >>> plan_options.check("layers", 80)
    80
    >>> try:
    ...   plan_options.check("layers", 0)
    ... except ValueError as e:
    ...   print(e)
    plan: --layers (layers=): got 0; layers must be 1 to 10000
  """
  lim = LIMITS[name]
  integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
  real = integral or (isinstance(value, numbers.Real) and not isinstance(value, bool))
  if not real or (lim.kind == "int" and not integral):
    raise error(name, f"got {value!r}, not {'an int' if lim.kind == 'int' else 'a number'}")
  v = float(value)
  low_ok = v > lim.low if lim.open_low else v >= lim.low
  if not (math.isfinite(v) and low_ok and v <= lim.high):
    raise error(name, f"got {_shown(lim.kind, value)}")
  return value


def parse(name: str, text: str) -> int | float:
  """The command line's text for option `name`, in `offlax.plan`'s units, checked.

  Sizes need a unit (``24GB``, ``128GiB``, ``512MiB``, ``100B``; a bare ``0``
  is 0 bytes): ``--device-mem 24`` is far more likely to mean 24GB than 24
  bytes. Counts take ``7B``, ``350M``, ``13e9``; rates are in G/s.
  """
  lim = LIMITS[name]
  if lim.kind == "bytes":
    try:
      value: int | float = parse_bytes(text, unit_required=True)
    except ValueError as e:
      raise error(name, str(e)) from None
  elif name == "params":
    try:
      value = parse_count(text)
    except ValueError as e:
      raise error(name, str(e)) from None
  elif lim.kind == "int":
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
      raise error(name, f"not a whole number: {text!r}")
    value = int(text)
  else:
    try:
      value = float(text) * _PER_S[lim.kind]
    except ValueError:
      raise error(name, f"not a number: {text!r}") from None
  return check(name, value)


def parse_bytes(text: str, unit_required: bool = False) -> int:
  """'24GB', '128GiB', '2TB', '512MiB', '100B' or (unless `unit_required`) a plain number of bytes.

  With `unit_required`, a bare number other than 0 is refused: ``--device-mem 24``
  is far more likely to mean 24GB than 24 bytes.

  Raises:
    ValueError: not a size, or (with `unit_required`) a bare number.
  """
  units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:E[+]?[0-9]+)?)\s*([KMGTPE]?)(I?)(B?)\s*", text.upper())
  if not m or (m.group(3) and not m.group(2)):
    raise ValueError(f"not a size: {text!r} (e.g. 24GB, 128GiB, 2TB)")
  if unit_required and not (m.group(2) or m.group(4)) and float(m.group(1)) != 0:
    raise ValueError(
      f"{text!r} has no unit: write e.g. {text.strip()}GB or {text.strip()}GiB "
      f"({text.strip()}B for bytes)"
    )
  scale = 1024 ** ("KMGTPE".index(m.group(2)) + 1) if m.group(3) else units[m.group(2)]
  value = float(m.group(1)) * scale
  if not value < 1e30:  # beyond any limit: no float -> int of inf
    raise ValueError(f"not a size: {text!r} is too large")
  return int(value)


def parse_count(text: str) -> int:
  """A number of parameters: '7B', '350M', '1.5T', '13e9' or '1000000'.

  Raises:
    ValueError: not a positive count.
  """
  scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:E[+]?[0-9]+)?)\s*([KMBGT]?)\s*", text.upper())
  value = float(m.group(1)) * scale[m.group(2)] if m else -1.0
  if not value >= 1:
    raise ValueError(f"not a number of parameters: {text!r} (e.g. 7B, 350M, 13e9)")
  if not math.isfinite(value):
    raise ValueError(f"not a number of parameters: {text!r} is too large")
  return int(value)

"""Byte counts as offlax prints them: no JAX here, so a command line can refuse bad input fast."""


def format_bytes(n: float | None) -> str:
  """`n` bytes in decimal units, as the planner and the inspector print them.

  >>> format_bytes(25.4e9), format_bytes(512), format_bytes(None)
  ('25.4 GB', '512 B', '-')
  """
  if n is None:
    return "-"
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{int(n)} B"

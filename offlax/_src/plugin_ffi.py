"""offlax's FFI handlers in the host computations of GPU programs.

JAX lowers a `compute_on("device_host")` region for the CPU, so a GPU
program's host computation can call offlax's native kernels. XLA:GPU compiles
that computation with its own copy of XLA:CPU, inside the PJRT plugin
(`jax-cuda12-plugin`), whose FFI registry is not the one
``jax.ffi.register_ffi_target(..., platform="cpu")`` fills: without this
module the GPU compiler aborts the process ("No FFI handler registered for
offlax_adam_step on a platform Host"). JAX's own route into the plugin
(``platform="CUDA"``) registers device handlers only, so the handlers are
registered for the plugin's ``Host`` platform through the PJRT C API's FFI
extension (``PJRT_FFI_Register_Handler``), whose ABI is versioned by struct
sizes: a plugin that lays it out differently answers with an error, and then
offlax runs plain JAX everywhere rather than risk an abort.

The host computation runs the handler without XLA:CPU's intra-op pool when the
plugin gives it none; the kernels then run on the calling thread.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping
from typing import Any

import jax

_LOG = logging.getLogger("offlax")

_EXTENSION_TYPE_FFI = 5  # PJRT_Extension_Type_FFI in pjrt_c_api.h
_HOST = b"Host"  # XLA's name of the CPU platform


class _ExtensionBase(ctypes.Structure):
  pass


_ExtensionBase._fields_ = [
  ("struct_size", ctypes.c_size_t),
  ("type", ctypes.c_int),
  ("next", ctypes.POINTER(_ExtensionBase)),
]


class _RegisterArgs(ctypes.Structure):  # PJRT_FFI_Register_Handler_Args
  _fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("target_name", ctypes.c_char_p),
    ("target_name_size", ctypes.c_size_t),
    ("handler", ctypes.c_void_p),
    ("platform_name", ctypes.c_char_p),
    ("platform_name_size", ctypes.c_size_t),
    ("traits", ctypes.c_int),
  ]


_REGISTER_ARGS_SIZE = _RegisterArgs.traits.offset + ctypes.sizeof(ctypes.c_int)
_Register = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_RegisterArgs))


class _FfiExtension(ctypes.Structure):  # PJRT_FFI_Extension
  _fields_ = [
    ("base", _ExtensionBase),
    ("type_register", ctypes.c_void_p),
    ("user_data_add", ctypes.c_void_p),
    ("register_handler", _Register),
  ]


def register_for_plugin_hosts(handlers: Mapping[str, int]) -> bool:
  """Registers `handlers` (FFI target name -> handler address) for every PJRT plugin's host.

  Returns:
    True when every plugin JAX loaded (none: CPU only) took every handler.
  """
  try:
    jax.devices()  # discovers the plugins
  except RuntimeError:
    pass  # a requested platform is missing: the plugins were still discovered
  from jax._src import xla_bridge

  failures: list[str] = []

  def register(c_api: Any) -> None:
    try:
      _register(c_api, handlers)
    except (OSError, ValueError) as e:
      failures.append(str(e))

  xla_bridge.register_plugin_callbacks(register)
  if failures:
    _LOG.warning(
      "offlax: native library not registered for GPU programs' host computations, "
      "using plain JAX: %s",
      "; ".join(failures),
    )
  return not failures


def _register(c_api: Any, handlers: Mapping[str, int]) -> None:
  get = ctypes.pythonapi.PyCapsule_GetPointer
  get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
  api = get(c_api, b"pjrt_c_api")
  # PJRT_Api starts {size_t struct_size; PJRT_Extension_Base* extension_start; ...}.
  extension = ctypes.cast(
    ctypes.c_void_p.from_address(api + ctypes.sizeof(ctypes.c_size_t)),
    ctypes.POINTER(_ExtensionBase),
  )
  while extension and extension.contents.type != _EXTENSION_TYPE_FFI:
    extension = extension.contents.next
  if not extension:
    raise ValueError("the PJRT plugin has no FFI extension")
  if extension.contents.struct_size < ctypes.sizeof(_FfiExtension):
    raise ValueError(
      f"the PJRT plugin's FFI extension is {extension.contents.struct_size} bytes, "
      f"expected at least {ctypes.sizeof(_FfiExtension)}"
    )
  ffi = ctypes.cast(extension, ctypes.POINTER(_FfiExtension)).contents
  for name, handler in handlers.items():
    target = name.encode()
    args = _RegisterArgs(_REGISTER_ARGS_SIZE, target, len(target), handler, _HOST, len(_HOST), 0)
    if ffi.register_handler(ctypes.byref(args)):  # a PJRT_Error*: the layout or the call failed
      raise ValueError(f"the PJRT plugin refused the FFI handler {name!r} for {_HOST.decode()}")

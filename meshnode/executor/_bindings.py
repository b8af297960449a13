"""Layer 1: raw bindings — llama-cpp-python's ctypes layer, and native/capture.c.

Quotes of the C side this module relies on:

* ``typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t,
  bool ask, void * user_data);`` (ggml-backend.h)
* ``const char * ggml_get_name(const struct ggml_tensor * tensor);``,
  ``size_t ggml_nbytes(const struct ggml_tensor * tensor);`` (ggml.h)
* ``void ggml_backend_tensor_get(const struct ggml_tensor * tensor,
  void * data, size_t offset, size_t size);`` and ``void
  ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data,
  size_t offset, size_t size);`` (ggml-backend.h)
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import llama_cpp

from meshnode.errors import ExecutorError

LIB_DIR = Path(llama_cpp.__file__).parent / "lib"


def running_library(stem: str, maps: str | None = None) -> Path:
    """The file of ggml's ``stem`` (``libggml-cpu``) that llama.cpp itself runs on.

    A wheel stores ``libggml-cpu.so``, ``.so.0`` and ``.so.0.25.3`` as three copies, not links, and
    libllama loads the one its DT_NEEDED names (``.so.0``). dlopen of another of the three maps a second
    ggml with state of its own: a ggml pool made there computes on tables ``ggml_cpu_init`` never
    filled and repacked weights it does not know (NaN in Gemma 3's Q4_K layers, issue 23). So: the file
    already mapped into this process (``maps``: /proc/self/maps' text), else the one named by its SONAME
    (the shortest ``stem.so.N``), else ``stem.so``."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            maps = ""
    mapped = sorted({Path(fields[5]) for fields in (line.split(maxsplit=5) for line in maps.splitlines())
                     if len(fields) == 6 and fields[5].startswith("/")
                     and (Path(fields[5]).name == f"{stem}.so" or Path(fields[5]).name.startswith(f"{stem}.so."))},
                    key=lambda p: (p.parent.resolve() != LIB_DIR.resolve(), len(p.name), str(p)))
    if mapped:
        return mapped[0]
    versioned = sorted(LIB_DIR.glob(f"{stem}.so.*"), key=lambda p: (len(p.name), p.name))
    return versioned[0] if versioned else LIB_DIR / f"{stem}.so"


class CaptureState(ctypes.Structure):
    """Mirrors ``struct mn_capture`` in native/capture.c, field for field."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("target", ctypes.c_char * 64),
        ("dst", ctypes.c_void_p),
        ("capacity", ctypes.c_size_t),
        ("written", ctypes.c_size_t),
        ("hits", ctypes.c_int32),
        ("overflow", ctypes.c_int32),
        ("stop", ctypes.c_int32),
        ("tensor_set", ctypes.c_void_p),
        ("restore", ctypes.c_char * 64),
        ("src", ctypes.c_void_p),
        ("src_size", ctypes.c_size_t),
        ("src_read", ctypes.c_size_t),
        ("restores", ctypes.c_int32),
    ]


def native_library(stem: str) -> Path:
    """The built file of native/'s ``stem`` (``_capture``, ``_linger``), beside this module."""
    here = Path(__file__).parent
    found = sorted(here.glob(f"{stem}*.so"))
    if not found:
        raise ExecutorError(
            f"the native library {stem} is not built (no {stem}*.so in {here}); "
            "reinstall meshnode with `pip install .` so setup.py compiles native/"
        )
    return found[0]


@functools.cache
def capture_library() -> ctypes.CDLL:
    return ctypes.CDLL(str(native_library("_capture")))


@functools.cache
def ggml_base() -> ctypes.CDLL:
    # the instance libllama runs on (not a second copy): the pointers below are the running ggml
    return ctypes.CDLL(str(running_library("libggml-base")))


def _addr(fn: Any) -> int:
    value = ctypes.cast(fn, ctypes.c_void_p).value
    if value is None:
        raise ExecutorError(f"could not resolve native function {fn}")
    return value


def new_capture_state(target: str = "", restore: str = "") -> CaptureState:
    """State for ``mn_capture_eval``: capture ``target`` and stop there (if given), and overwrite
    ``restore`` with the step's input rows once computed (if given)."""
    base = ggml_base()
    state = CaptureState()
    state.get_name = _addr(base.ggml_get_name)
    state.nbytes = _addr(base.ggml_nbytes)
    state.tensor_get = _addr(base.ggml_backend_tensor_get)
    state.tensor_set = _addr(base.ggml_backend_tensor_set)
    state.target = target.encode()
    state.stop = 1 if target else 0
    state.restore = restore.encode()
    return state


def capture_callback() -> Any:
    """``mn_capture_eval`` as a ggml_backend_sched_eval_callback for context params."""
    return ctypes.cast(capture_library().mn_capture_eval, llama_cpp.ggml_backend_sched_eval_callback)


@functools.cache
def backend_init() -> None:
    llama_cpp.llama_backend_init()


_LOG_CB = None


def silence_llama_logs() -> None:
    """Route llama.cpp's log lines to nowhere (its loader is very chatty)."""
    global _LOG_CB

    def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        return None

    _LOG_CB = llama_cpp.llama_log_callback(_quiet)  # keep a reference: llama.cpp holds the pointer
    llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p())


# -- ggml backend devices (ggml-backend.h; not wrapped by llama-cpp-python) ----------
#   size_t ggml_backend_dev_count(void);
#   ggml_backend_dev_t ggml_backend_dev_get(size_t index);
#   const char * ggml_backend_dev_name(ggml_backend_dev_t device);
#   const char * ggml_backend_dev_description(ggml_backend_dev_t device);
#   void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
#   enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@functools.cache
def ggml() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(running_library("libggml")))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)
    ]
    return lib


def backend_devices() -> list[dict[str, Any]]:
    """Every device llama.cpp's ggml backends report (a GPU build lists its GPUs here)."""
    backend_init()
    lib = ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({
            "name": (lib.ggml_backend_dev_name(dev) or b"").decode(),
            "description": (lib.ggml_backend_dev_description(dev) or b"").decode(),
            "type": DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "unknown"),
            "memory_free_bytes": free.value,
            "memory_total_bytes": total.value,
        })
    return out


def system_info() -> str:
    return str(llama_cpp.llama_print_system_info().decode())


@functools.cache
def openmp() -> bool:
    """Whether this llama.cpp runs its threads as an OpenMP team (libgomp) rather than ggml's own pool."""
    return "OPENMP = 1" in system_info()


class _PoolParams(ctypes.Structure):
    """``struct ggml_threadpool_params`` (ggml.h; GGML_MAX_N_THREADS = 512)."""
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


@functools.cache
def ggml_cpu() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(running_library("libggml-cpu")))
    lib.ggml_threadpool_new.restype = ctypes.c_void_p
    lib.ggml_threadpool_new.argtypes = [ctypes.POINTER(_PoolParams)]
    lib.ggml_threadpool_free.restype = None
    lib.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
    base = ggml_base()
    base.ggml_threadpool_params_init.restype = None
    base.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(_PoolParams), ctypes.c_int]
    attach = llama_cpp.llama_cpp._lib.llama_attach_threadpool
    attach.restype = None
    attach.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    detach = llama_cpp.llama_cpp._lib.llama_detach_threadpool
    detach.restype = None
    detach.argtypes = [ctypes.c_void_p]
    return lib


def attach_threadpool(ctx: Any, n_threads: int, poll: int) -> int:
    """Give a context a ggml thread pool of its own, kept across graphs (the caller frees it with
    ``free_threadpool`` after the context). Without one, a llama.cpp built without OpenMP starts and
    joins fresh threads for every graph. ``poll`` (0..100) is how long an idle pool thread polls for the
    next graph before it sleeps on the pool's condition variable: 0 sleeps at once."""
    lib = ggml_cpu()
    p = _PoolParams()
    ggml_base().ggml_threadpool_params_init(ctypes.byref(p), n_threads)
    p.poll = poll
    pool = lib.ggml_threadpool_new(ctypes.byref(p))
    if not pool:
        raise ExecutorError(f"ggml could not start a pool of {n_threads} threads")
    llama_cpp.llama_cpp._lib.llama_attach_threadpool(ctx, pool, pool)
    return int(pool)


def free_threadpool(ctx: Any, pool: int) -> None:
    """Detach a pool from its context and stop its threads (before the context is freed)."""
    llama_cpp.llama_cpp._lib.llama_detach_threadpool(ctx)
    ggml_cpu().ggml_threadpool_free(pool)

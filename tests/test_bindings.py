"""meshnode's own ctypes handles on ggml reach the ggml that llama.cpp runs on, not a second copy.

A wheel stores ``libggml-cpu.so``, ``.so.0`` and ``.so.0.25.3`` as three copies of one file, and libllama
loads the ``.so.0`` its DT_NEEDED names. Opening ``libggml-cpu.so`` by path mapped a second ggml-cpu with
state of its own; a ggml pool made there computed Gemma 3's repacked Q4_K layers on tables
``ggml_cpu_init`` never filled, and a node on a llama.cpp built without OpenMP returned NaN (issue 23).
"""

from __future__ import annotations

from pathlib import Path

from meshnode.executor import _bindings

LIB = _bindings.LIB_DIR


def _mapped(stem: str) -> set[str]:
    """Files of ``stem`` mapped into this process (each a separate instance of the library)."""
    with open("/proc/self/maps") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    return {p for p in paths if Path(p).name == f"{stem}.so" or Path(p).name.startswith(f"{stem}.so.")}


def test_every_ggml_library_meshnode_opens_is_the_instance_llama_cpp_runs_on() -> None:
    _bindings.ggml_base()
    _bindings.ggml()
    _bindings.ggml_cpu()
    _bindings.capture_library()
    for stem in ("libggml-base", "libggml", "libggml-cpu"):
        assert len(_mapped(stem)) == 1, f"{stem} is mapped more than once: {sorted(_mapped(stem))}"


def test_the_running_library_is_the_mapped_file_else_the_soname() -> None:
    maps = (f"7f00-7f10 r-xp 00000000 08:01 11 {LIB}/libggml-cpu.so.0\n"
            f"7f10-7f20 r-xp 00000000 08:01 12 {LIB}/libggml-base.so.0\n"
            "7f20-7f30 rw-p 00000000 00:00 0 \n"
            "7f30-7f40 r-xp 00000000 08:01 13 /opt/other dir/libggml-cpu.so\n")
    assert _bindings.running_library("libggml-cpu", maps) == LIB / "libggml-cpu.so.0"
    assert _bindings.running_library("libggml-base", maps) == LIB / "libggml-base.so.0"
    # not mapped yet: the file its SONAME names (the shortest versioned name), as the loader would pick
    fresh = _bindings.running_library("libggml", "")
    assert fresh.name in ("libggml.so.0", "libggml.so")
    assert fresh.exists()
    # a library elsewhere (a path with a space) is taken only when none is mapped from llama_cpp's own lib/
    assert _bindings.running_library("libggml-cpu", maps.splitlines()[3]) == Path("/opt/other dir/libggml-cpu.so")

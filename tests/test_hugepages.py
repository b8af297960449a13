"""Weights and KV cache in transparent huge pages (meshnode/executor/hugepages.py; docs/performance.md,
"Weights in huge pages").

Where the kernel gives huge pages only when asked (THP ``madvise``), a node starts itself again with glibc's
``glibc.malloc.hugetlb=1``, so that llama.cpp's buffers fault in as 2 MB pages; ``--no-huge-pages``
(``huge_pages = false``) leaves it as started. Numerics do not move: every route test runs on such nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from meshnode import config, errors
from meshnode.executor import hugepages as hp

GLIBC = ("glibc", "2.36")


def test_the_choice_of_the_kernel_is_the_bracketed_word() -> None:
    assert hp.thp_mode("always [madvise] never\n") == "madvise"
    assert hp.thp_mode("[always] madvise never") == "always"
    assert hp.thp_mode("always madvise [never]") == "never"
    assert hp.thp_mode("") == ""


def test_the_tunable_is_asked_for_only_where_it_changes_something() -> None:
    assert hp.wants_tunable({}, "madvise", GLIBC)
    assert hp.wants_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC)
    assert not hp.wants_tunable({}, "always", GLIBC)  # malloc's big chunks get huge pages anyway
    assert not hp.wants_tunable({}, "never", GLIBC)
    assert not hp.wants_tunable({}, "madvise", ("glibc", "2.34"))  # no such tunable yet
    assert not hp.wants_tunable({}, "madvise", ("", ""))  # musl
    # already there (the second start), or the user's own value, 0 included, wins
    assert not hp.wants_tunable({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", GLIBC)
    assert not hp.wants_tunable({"GLIBC_TUNABLES": "x=1:glibc.malloc.hugetlb=0"}, "madvise", GLIBC)


def test_the_tunable_joins_those_given() -> None:
    assert hp.with_tunable({"A": "b"}) == {"A": "b", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    got = hp.with_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"]
    assert got == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_huge_bytes_reads_smaps_rollup() -> None:
    assert hp.huge_bytes("Rss: 10 kB\nAnonHugePages:    4096 kB\n") == 4096 * 1024
    assert hp.huge_bytes("Rss: 10 kB\n") == 0


def test_the_config_file_may_turn_it_off(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text("huge_pages = false\n")
    assert config.load(f)["huge_pages"] is False
    f.write_text('huge_pages = "no"\n')
    with pytest.raises(errors.InputError, match="huge_pages"):
        config.load(f)


def _environ(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")


def test_a_node_holds_its_weights_in_huge_pages_and_not_when_told(node_factory: Callable[..., object]) -> None:
    if hp.env_here({}) is None:
        pytest.skip("this kernel gives huge pages without asking, or not at all: nothing to ask for")
    on = node_factory("0:15")
    off = node_factory("15:30", extra=("--no-huge-pages",))
    pid_on, pid_off = on.proc.pid, off.proc.pid  # type: ignore[attr-defined]
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in _environ(pid_on)  # the same PID, started again
    assert not any(v.startswith("GLIBC_TUNABLES=") for v in _environ(pid_off))
    # the weights were read into memory (executor/weights.py) and faulted in as 2 MB pages
    assert hp.huge_bytes(Path(f"/proc/{pid_on}/smaps_rollup").read_text()) >= 16 << 20
    assert hp.huge_bytes(Path(f"/proc/{pid_off}/smaps_rollup").read_text()) == 0

"""A range keeps its CPU awake between steps for a while, and no longer (executor/linger.py, native/linger.c).

* the window is twice the last gap between steps, at most the cap, none before a gap is known;
* the native spinner ends when the next step comes, or at its deadline, and then uses no CPU;
* ``MESHNODE_LINGER`` and ``--linger`` are checked: a bad value is a typed error naming it (at serve:
  tests/test_openmp.py);
* a range decodes the same tokens lingering or not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from meshnode.errors import InputError
from meshnode.executor import linger
from meshnode.executor.linger import REST, Linger, window, worth
from meshnode.runtime.launch import taskset


def test_the_window_is_twice_the_last_gap_at_most_the_cap() -> None:
    assert window(None, 1.0) == 0.0  # the first step: no gap known
    assert window(0.08, 1.0) == pytest.approx(0.16)
    assert window(3.0, 1.0) == 1.0
    assert window(0.08, 0.0) == 0.0  # lingering off
    assert window(-0.5, 1.0) == 0.0  # a clock step backwards is no gap


def test_a_linger_is_worth_it_only_where_it_had_its_core() -> None:
    assert worth(0.0, 0.001) is None  # too little measured
    assert worth(0.095, 0.1) is True
    assert worth(0.01, 0.1) is False  # other work had the core: it would not have idled


def _wait_for(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_the_spinner_ends_at_the_next_step_or_its_deadline_and_then_rests() -> None:
    lg = Linger(0.2)
    try:
        lg.busy()
        lg.idle()  # no gap known yet: no linger
        time.sleep(0.05)
        assert lg.counts() == (0, 0)
        lg.busy()  # a gap of ~0.05 s: the next linger lasts ~0.1 s
        lg.idle()
        assert _wait_for(lambda: lg.counts() == (0, 1)), lg.counts()  # it reached its deadline
        lg.busy()  # the gap now exceeds the cap's half: the next linger is the cap, 0.2 s
        lg.idle()
        lg.busy()  # the next step came before the deadline
        assert _wait_for(lambda: lg.counts()[0] == 1), lg.counts()
        lg.idle()
        lg.busy()
        spun = sum(lg.counts())
        time.sleep(0.3)  # past any deadline: the thread sleeps, and uses no CPU
        c0 = time.thread_time(), time.process_time()
        time.sleep(0.5)
        used = time.process_time() - c0[1] - (time.thread_time() - c0[0])
        assert used < 0.1, f"{used:.3f} s of CPU in 0.5 s with no linger due"
        assert sum(lg.counts()) >= spun
    finally:
        lg.close()
    lg.close()  # twice is harmless


def test_a_spinner_that_shares_its_core_with_other_work_rests() -> None:
    """A busy process of normal priority on the spinner's only CPU: the spinner (SCHED_IDLE) gets next
    to none of its lingers' time, and the range stops lingering for REST steps."""
    mine = os.sched_getaffinity(0)
    cpu = min(mine)
    hog = subprocess.Popen([*taskset((cpu,)), sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(0, {cpu})  # this thread's; the spinner's thread inherits it
    lg = Linger(1.0)
    try:
        lg.busy()
        lg.idle()

        def cycle() -> bool:
            time.sleep(0.05)
            lg.busy()
            lg.idle()
            return lg.resting > 0

        assert _wait_for(cycle, timeout=60), lg.cpu_share()
        assert lg.resting == REST - 1  # this step's linger skipped already
        share = lg.cpu_share()
        assert share is not None
        assert share < 0.5, share
    finally:
        lg.close()
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait()


def test_no_cap_no_thread() -> None:
    lg = Linger(0.0)
    lg.busy()
    lg.idle()
    assert lg.counts() == (0, 0)
    lg.close()


@pytest.mark.parametrize("value", ["fast", "-1", "11", "nan", ""])
def test_a_malformed_linger_is_a_typed_error(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHNODE_LINGER", value)
    with pytest.raises(InputError, match="MESHNODE_LINGER must be seconds from 0"):
        linger.cap_from_env()


def test_the_linger_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHNODE_LINGER", raising=False)
    assert linger.cap_from_env() == linger.CAP
    monkeypatch.setenv("MESHNODE_LINGER", "0.25")
    assert linger.cap_from_env() == 0.25


def test_a_range_decodes_the_same_lingering_or_not(model: Path) -> None:
    from meshnode.executor._llama import LlamaRange
    from meshnode.executor.config import ExecConfig
    from meshnode.gguf.slicer import ensure_range

    art = ensure_range(model, 0, 30)
    got = []
    for cap in (0.0, 1.0):
        r = LlamaRange(art, ExecConfig(n_ctx_per_session=128, max_sessions=1, n_threads=1, linger=cap))
        try:
            out = r.forward(0, 0, tokens=np.array([1, 2, 3, 4], dtype=np.int32))
            ids = [int(np.argmax(out.logits))]
            for k in range(6):
                out = r.forward(0, 4 + k, tokens=np.array(ids[-1:], dtype=np.int32))
                ids.append(int(np.argmax(out.logits)))
            got.append(ids)
            if cap:
                assert _wait_for(lambda r=r: sum(r.linger.counts()) > 0), r.linger.counts()
            else:
                assert r.linger.counts() == (0, 0)
        finally:
            r.close()
    assert got[0] == got[1]


def test_the_linger_flag_and_config_key_are_checked(tmp_path: Path) -> None:
    import argparse

    from meshnode import config
    from meshnode.cli.flags import exec_config

    def ns(value: object) -> argparse.Namespace:
        return argparse.Namespace(ctx_size=0, max_sessions=0, threads=0, threads_batch=0, linger=value)

    assert exec_config(ns("0.5")).linger == 0.5
    assert exec_config(ns(None)).linger == linger.cap_from_env()
    with pytest.raises(InputError, match="--linger must be seconds from 0"):
        exec_config(ns("20"))
    f = tmp_path / "node.toml"
    f.write_text("linger = 0\n")
    assert config.load(f) == {"linger": 0.0}
    f.write_text('linger = "soon"\n')
    with pytest.raises(InputError, match="linger must be float"):
        config.load(f)

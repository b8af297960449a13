"""The route check: a pure function over peers' capabilities."""

from __future__ import annotations

import pytest

from meshnode.errors import RouteError
from meshnode.routing.chain import PeerView, check_chain

NUM = (("n_batch", 512),)


def p(ep: str, a: int, b: int, fp: str = "f" * 64, n: int = 30, num=NUM) -> PeerView:
    return PeerView(ep, fp, n, a, b, num)


def test_exact_chains_pass():
    check_chain([p("a", 0, 30)])
    check_chain([p("a", 0, 15), p("b", 15, 30)])
    check_chain([p("a", 0, 7), p("b", 7, 19), p("c", 19, 30)])


@pytest.mark.parametrize(
    ("peers", "match"),
    [
        ([], "at least one"),
        ([p("a", 0, 12), p("b", 18, 30)], "layers 12-17 are not served"),
        ([p("a", 0, 16), p("b", 15, 30)], "overlap"),
        ([p("a", 15, 30), p("b", 0, 15)], "layers 0-14 are not served"),
        ([p("a", 0, 15), p("b", 15, 29)], "layers 29-29 are not served"),
        ([p("a", 0, 15), p("b", 15, 30, fp="e" * 64)], "one model"),
        ([p("a", 0, 15), p("b", 15, 30, num=(("n_batch", 256),))], "numerics"),
    ],
)
def test_bad_chains_are_refused_with_the_reason(peers, match):
    with pytest.raises(RouteError, match=match):
        check_chain(peers)

"""Speculative decoding's decisions, as pure functions (issue 23; the route side is not built yet).

* ``ngram.propose``: prompt lookup drafting: the tokens that followed the most recent earlier
  occurrence of the text's last n-gram (n from ``max_n`` down to ``min_n``), no model needed;
* ``verify.accept``: given the tokens the tail sampled at each drafted position (each with the
  chain and random state it would have had without drafting), the accepted prefix and the one
  token that follows it, so the text is exactly the text without drafting;
* ``length.DraftLength``: how many tokens to draft next, shrinking while drafts keep failing.
"""

from collections.abc import Iterable

from meshnode.drafting.length import DraftLength
from meshnode.drafting.ngram import propose
from meshnode.drafting.verify import Verdict, accept

__all__ = ["DraftLength", "Verdict", "accept", "can_draft", "propose"]


def can_draft(archs: Iterable[str]) -> bool:
    """Whether a route of models of these architectures may draft: not when a hop keeps a recurrent
    state (it cannot drop a rejected draft's positions; meshnode/gguf/arch.py ``recurrent``)."""
    from meshnode.gguf.archtable import POLICIES

    return not any(POLICIES[a].recurrent for a in archs if a in POLICIES)

"""One generation as ``meshnode generate`` and ``meshnode chat`` run it: flags -> settings -> a route
(given with ``--peer``, found with ``--mesh``) or the whole model in this process (``--model``).

``Runner.from_flags`` checks every flag first (one-line ``InputError``s naming the flag); ``run``
is blocking: a route runs on an asyncio thread of its own under ``trio.run``, and Ctrl-C there
releases the session on every hop before the ``KeyboardInterrupt`` goes on (initiator.generate).
A route found with ``--mesh`` is found once and reused by later runs (a chat's turns).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from meshnode import errors
from meshnode.audit.policy import DEFAULT_AUDIT, AuditPolicy
from meshnode.executor.config import ExecConfig
from meshnode.executor.sampler import SamplingParams
from meshnode.proto import node_pb2 as pb
from meshnode.session.initiator import GenerateConfig, GenerationResult, check_generate

OnToken = Callable[[int | None, bytes], None]


def sampling_from_flags(ns: argparse.Namespace) -> SamplingParams:
    """The sampling flags, checked (one-line InputErrors naming the flag); the seed as given or 0."""
    from meshnode.session.sampling import check_sampling

    p = SamplingParams(temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p, min_p=ns.min_p,
                       typical_p=ns.typical_p, repeat_penalty=ns.repeat_penalty,
                       frequency_penalty=ns.frequency_penalty, presence_penalty=ns.presence_penalty,
                       seed=ns.seed if ns.seed is not None else 0)
    try:
        check_sampling(p)
    except errors.InputError as e:  # "top_p must be ..." -> "--top-p must be ..."
        name, rest = e.message.split(" ", 1)
        raise errors.InputError(f"--{name.replace('_', '-')} {rest}") from None
    return p


@dataclass
class Runner:
    """Where and how generations run, from the flags of generate or chat."""

    #: the route's hops in layer order (given, or found once with ``mesh``); empty: the whole model here
    peers: list[str]
    spares: list[str]
    #: a model to find a route for (``--mesh``), with ``mdns``/``tracker``
    mesh: str | None
    mdns: str | None
    #: the trackers given (--tracker, repeatable): none, one or several
    tracker: list[str] | None
    discover_timeout: float
    #: the whole model here (``--model``, or the default model): used when there is no route
    model: str | None
    exec_config: ExecConfig
    sampling: SamplingParams
    #: the seed given (None: each sampling run draws one and says so on stderr)
    seed: int | None
    stop: tuple[str, ...]
    max_tokens: int
    wire_dtype: int
    rejoin_wait: float
    step_timeout: float
    #: spot checks of the route's hops (docs/security.md, "A hop that lies")
    audit: AuditPolicy = DEFAULT_AUDIT
    #: speculative decoding across the route: "" (off) or "ngram", and the most tokens a step drafts
    draft: str = ""
    draft_max: int = 8
    #: the draft model's GGUF ("": none)
    model_draft: str = ""
    #: live nodes to learn the mesh from (--bootstrap): their directories (no tracker needed)
    bootstrap: list[str] = field(default_factory=list)
    #: what each run reports on stderr (the seed it drew)
    say: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))

    @classmethod
    def from_flags(cls, ns: argparse.Namespace) -> Runner:
        from meshnode.cli.flags import check_endpoints, exec_config

        if ns.max_tokens < 1:
            raise errors.InputError("--max-tokens must be at least 1")
        if ns.rejoin_wait < 0:
            raise errors.InputError("--rejoin-wait must be >= 0")
        if not 0 < ns.step_timeout <= 3600:
            raise errors.InputError(f"--step-timeout must be above 0 and at most 3600 seconds, not {ns.step_timeout:g}")
        if sum(map(bool, (ns.peer, ns.model, ns.mesh))) > 1:
            raise errors.InputError("give one of --peer (a route), --mesh (find one) or --model (the whole model here)")
        if ns.mesh and not (ns.mdns or ns.tracker or ns.bootstrap):
            raise errors.InputError("--mesh needs a way to find peers: --mdns ADDR, --tracker URL and/or "
                                    "--bootstrap HOST:PORT")
        if ns.spare and not ns.peer:
            raise errors.InputError("--spare goes with --peer (with --mesh every other peer found is a spare)")
        check_endpoints(ns)
        try:
            audit = AuditPolicy(rate=ns.audit_rate, every=ns.audit_every, probation=ns.audit_probation)
        except ValueError as e:
            raise errors.InputError(f"--audit-*: {e}") from None
        runner = cls(peers=list(ns.peer), spares=list(ns.spare), mesh=ns.mesh, mdns=ns.mdns, tracker=ns.tracker,
                     bootstrap=list(ns.bootstrap),
                     discover_timeout=ns.discover_timeout, model=ns.model, exec_config=exec_config(ns),
                     sampling=sampling_from_flags(ns), seed=ns.seed, stop=tuple(ns.stop), max_tokens=ns.max_tokens,
                     wire_dtype=pb.DTYPE_F16 if ns.wire_dtype == "f16" else pb.DTYPE_F32,
                     rejoin_wait=ns.rejoin_wait, step_timeout=ns.step_timeout, audit=audit,
                     draft="model" if ns.model_draft else "" if ns.draft == "none" else ns.draft,
                     draft_max=ns.draft_max, model_draft=ns.model_draft or "")
        runner.config(prompt="", messages=(), announce=False)  # every setting checked before any work
        return runner

    def config(self, *, prompt: str, messages: tuple[tuple[str, str], ...],
               announce: bool = True) -> GenerateConfig:
        """The settings of one run; a sampling run without ``--seed`` draws its seed (and says so)."""
        from meshnode.session.sampling import with_seed

        sampling, drawn = with_seed(self.sampling, self.seed)
        if drawn and announce:  # on stderr: stdout stays the text (or the one JSON object)
            self.say(f"meshnode: sampling with seed {sampling.seed} (repeat this run with --seed {sampling.seed})")
        cfg = GenerateConfig(prompt=prompt, messages=messages, max_tokens=self.max_tokens, sampling=sampling,
                             stop=self.stop, wire_dtype=self.wire_dtype, rejoin_wait=self.rejoin_wait,
                             step_timeout=self.step_timeout, audit=self.audit,
                             report_to=tuple(self.tracker or ()), draft=self.draft,
                             draft_max=self.draft_max, model_draft=self.model_draft)
        check_generate(cfg)
        return cfg

    @property
    def local(self) -> bool:
        return not (self.peers or self.mesh)

    def run(self, cfg: GenerateConfig, on_token: OnToken | None = None) -> GenerationResult:
        """One generation (blocking). Ctrl-C: KeyboardInterrupt, after the route's session was released."""
        if self.local:
            from meshnode.executor._bindings import silence_llama_logs
            from meshnode.models import pull
            from meshnode.session.local import generate_local

            silence_llama_logs()
            model = Path(self.model) if self.model else pull()
            return generate_local(model, cfg, self.exec_config, on_token=on_token)
        return trio.run(self._on_route, cfg, on_token)

    async def _on_route(self, cfg: GenerateConfig, on_token: OnToken | None) -> GenerationResult:
        from meshnode.session.initiator import generate
        from meshnode.transport.aiothread import open_aio_thread

        async with open_aio_thread(name="meshnode-initiator") as aio:
            if not self.peers:
                from meshnode.session.mesh import discover

                assert self.mesh is not None
                found = await discover(self.mesh, mdns_interface=self.mdns, tracker=self.tracker,
                                       bootstrap=self.bootstrap, timeout=self.discover_timeout, aio=aio.run)
                self.peers, self.spares = found.route, found.spares
            try:
                return await aio.run(functools.partial(generate, self.peers, cfg, spares=self.spares,
                                                       on_token=on_token))
            except errors.PeerError:
                if self.mesh:  # the route found may be gone: look again next time
                    self.peers, self.spares = [], []
                raise

"""Running the API: the gateway's mesh view, its asyncio thread and its HTTP server in one nursery."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator

import trio

from meshnode import errors
from meshnode.api.app import ApiConfig, Gateway
from meshnode.api.mesh import MeshSource, MeshView
from meshnode.http.serve import ServeLimits, serve_asgi
from meshnode.http.tls import base_url, check_plain, is_loopback, pin_note
from meshnode.transport.aiothread import AioThread, open_aio_thread
from meshnode.transport.server import split_hostport

log = logging.getLogger("meshnode.api")
#: the API's answers take as long as their generation: no read bound while a request is answered
#: (a client that hangs up is noticed by its disconnect, which cancels the generation)
LIMITS = ServeLimits(read_timeout=None)


def check_exposure(config: ApiConfig) -> tuple[str, int]:
    """The listen address; InputError if it is not loopback and no API key guards it, or the key
    would cross the network in plain HTTP (no TLS and no ``--insecure``)."""
    host, port = check_key(config.listen, config.api_key)
    if config.tls is None:
        check_plain(host, "the API", insecure=config.insecure)
    return host, port


def check_key(listen: str, api_key: str | None) -> tuple[str, int]:
    """The listen address; InputError if it is not loopback and no API key guards it."""
    host, port = split_hostport(listen)
    if api_key is None and not is_loopback(host):
        raise errors.InputError(f"--api {listen} is not a loopback address: give --api-key KEY "
                                "(clients send it as 'Authorization: Bearer KEY')")
    return host, port


@contextlib.asynccontextmanager
async def _aio(aio: AioThread | None) -> AsyncIterator[AioThread]:
    if aio is not None:
        yield aio
    else:
        async with open_aio_thread(name="meshnode-api") as own:
            yield own


async def run_api(config: ApiConfig, source: MeshSource, *, aio: AioThread | None = None,
                  task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the API until cancelled; reports ``HOST:PORT`` once it listens and the mesh was read once.

    ``aio``: the asyncio thread to run sessions on (a node passes its own; None: one of its own).
    Cancellation cancels every running generation (each releases its session) and closes the server.
    """
    host, port = check_exposure(config)
    async with _aio(aio) as thread, trio.open_nursery() as nursery:
        mesh = MeshView(source, thread.run)
        await nursery.start(mesh.run)
        gateway = Gateway(mesh, thread, config)
        gateway.nursery = nursery
        try:
            bound = await nursery.start(functools.partial(serve_asgi, gateway.asgi(), host, port, limits=LIMITS,
                                                          tls=config.tls))
        except OSError as e:
            raise errors.InputError(f"cannot listen on {config.listen}: {e.strerror or e}") from None
        log.info("API on %s/v1 (%d models known)%s", base_url(host, bound, config.tls), len(mesh.models()),
                 pin_note(config.tls, "clients pin", host, bound))
        task_status.started(f"{host}:{bound}")

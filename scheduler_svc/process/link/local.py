"""The core and a frontend in one process (`--frontends 0`): calls, no wire."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import generate_latest

from scheduler_svc.contract import CoreRequestSpec
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.frontend.frontend import Frontend
from scheduler_svc.process.link.core_side import core_request, core_server_info
from stepahead.v1 import generation_pb2


class LocalCore:
    """The core in the frontend's own process."""

    def __init__(
        self, core: EngineCore, frontend: Frontend, exposition: Callable[[], bytes] | None = None
    ) -> None:
        self._core = core
        self._frontend = frontend
        self._exposition = exposition or (lambda: generate_latest(core.telemetry.registry))
        frontend.core = self
        core.attach(frontend)

    def add(self, spec: CoreRequestSpec) -> None:
        self._core.add([core_request(spec, self._frontend)])

    def abort(self, handle: int) -> None:
        self._core.abort_handles(self._frontend, [handle])

    async def abort_request(self, rid: str) -> bool:
        return self._core.abort(rid)

    async def server_info(self) -> generation_pb2.GetServerInfoResponse:
        return core_server_info(self._core)

    async def exposition(self) -> bytes:
        return await asyncio.to_thread(self._exposition)  # as a scrape of --metrics-port renders it

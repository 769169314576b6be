"""Many requests on one call (GenerateMany): their streams wake one reader, which sends the news
of every request that has some in one message.

A client holding many requests at once (a router, a gateway, a batch job) pays gRPC's cost of a
call and of a message once for all of them: a frontend serving 256 requests on one call sends
one message a step, not one a request. Requests are admitted in the order they come (an abort
after its request finds it live), each under the client's request_id; a request that cannot be
served is reported as a `RequestFailure` and the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TypeAlias

import grpc

from scheduler_svc.frontend.frontend import ApiError, Frontend
from scheduler_svc.frontend.streams import Completions, OutputChunk
from stepahead.v1 import generation_pb2

REQUEST_ID_REQUIRED = "generate.request_id: required on GenerateMany (responses are told apart by it)"


@dataclass(frozen=True)
class RequestFailure:
    """A request that is over without a finish: refused at admission, or failed while running."""

    rid: str
    code: grpc.StatusCode
    message: str


# A request's news: its completions, and (completion index, what is new) in index order
News: TypeAlias = tuple[Completions, list[tuple[int, OutputChunk]]]


class Multiplexed:
    """The requests of one call: `generate` and `abort` as they come, `close` once the client has
    sent its last; the reader waits for `ready`, then `take()`s what is new, until `over`.
    `cancel()` aborts every request still live (the client went away)."""

    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend
        self.ready = asyncio.Event()
        self._live: dict[str, Completions] = {}
        self._failures: list[RequestFailure] = []
        self._closed = False

    @property
    def over(self) -> bool:
        """The client sent its last request, and everything has been taken."""
        return self._closed and not self._live and not self._failures

    async def generate(self, request: generation_pb2.GenerateRequest) -> None:
        rid = request.request_id
        if not rid:
            self._fail(RequestFailure(rid, grpc.StatusCode.INVALID_ARGUMENT, REQUEST_ID_REQUIRED))
            return
        if rid in self._live:  # its last message not yet taken: the server may have forgotten it
            exists = f"request_id: {rid!r} is already live"
            self._fail(RequestFailure(rid, grpc.StatusCode.ALREADY_EXISTS, exists))
            return
        try:
            completions = await self._frontend.admit(request, ready=self.ready)
        except ApiError as exc:
            self._fail(RequestFailure(rid, exc.code, str(exc)))
            return
        self._live[rid] = completions

    async def abort(self, rid: str) -> None:
        """Ends a live request (of this call or another); nothing when none has that id."""
        with contextlib.suppress(ConnectionError):  # the engine core is gone: its requests fail anyway
            await self._frontend.abort(rid)

    def close(self) -> None:
        self._closed = True
        self.ready.set()

    def take(self) -> tuple[list[News], list[RequestFailure]]:
        """Every live request's news, and the failures since the last take; a request whose
        finish or failure is taken is no longer live."""
        self.ready.clear()
        news: list[News] = []
        ended: list[str] = []
        for rid, completions in self._live.items():
            streams = completions.clients
            if len(streams) == 1 and (stream := streams[0].stream).error is None:
                if stream.has_news:  # the common case: one completion, running
                    news.append((completions, [(0, stream.take())]))
                    if stream.done:
                        ended.append(rid)
                continue
            error = completions.error
            if error is not None:
                self._frontend.cancel(completions)  # its other completions end with it
                self._failures.append(RequestFailure(rid, *error))
                ended.append(rid)
                continue
            chunks = completions.take()
            if chunks:
                news.append((completions, chunks))
                if completions.done:
                    ended.append(rid)
        for rid in ended:
            del self._live[rid]
        failures, self._failures = self._failures, []
        return news, failures

    def cancel(self) -> None:
        for completions in self._live.values():
            self._frontend.cancel(completions)
        self._live.clear()

    def _fail(self, failure: RequestFailure) -> None:
        self._failures.append(failure)
        self.ready.set()

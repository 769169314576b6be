"""The link between the engine core and its frontends (`codec`: the wire forms, framed on the
socket by `stepahead.framing`; `core_side`: what the core serves; `frontend_side`: what a frontend
process attaches with; `local`: both in one process).

In one process (`--frontends 0`) `LocalCore` calls the core directly and the core calls the
`Frontend` directly. Across processes the core listens on a unix socket and each frontend
process holds one connection to it (`RemoteCore` on its side, `RemoteFrontend` on the core's),
carrying length-prefixed `stepahead.v1` core messages. Either way one message per step goes to
each frontend (all of its rows, packed) and new requests and aborts come back in batches.
"""

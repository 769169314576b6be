"""The link between the engine core and its frontends (`codec`: the wire forms; `core_side`:
what the core serves; `frontend_side`: what a frontend process attaches with; `local`: both in
one process).

In one process (`--frontends 0`) `LocalCore` calls the core directly and the core calls
the `Frontend` directly. Across processes the core serves `stepahead.v1.EngineCore` on a
unix socket: each frontend process attaches one bidirectional stream (`RemoteCore` on its
side, `RemoteFrontend` on the core's). Either way one message per step goes to each
frontend (all of its rows, packed) and new requests and aborts come back in batches.
"""

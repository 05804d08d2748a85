"""The one interface between a protocol's stream and the SSE response that sends it.

A route builds a `StreamSource` (server.api.generation.stream.ChoiceStream for the OpenAI
routes and lightning's batch routes, server.api.tasks.stream.TaskStream for the task routes) and
returns `SSEResponse(source)` (server.api.streaming.sse). The response sends the source's bytes
one of two ways:

- on the event loop: `preamble`, then every chunk of `rest()` (one write per wake-up);
- written straight to the socket by the source's notifications (server.api.streaming.direct,
  when Settings.direct_stream is on and the connection allows it): `preamble` through the
  server, then at every notification `take()` until it returns None, and after a hand-back
  (a slow reader) `rest()` on the loop from where `take()` stopped.

Either way the bytes are the same. The source renders them from pre-encoded templates: the
per-token cost of a stream is one `take()` (or one step of `rest()`) and one write.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import orjson

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
SHUTDOWN = (
    b'data: {"error":{"message":"the server is shutting down","type":"service_unavailable",'
    b'"param":null,"code":"shutting_down"}}\n\n'
)
INTERNAL_ERROR = (
    b'data: {"error":{"message":"internal error while streaming","type":"server_error",'
    b'"param":null,"code":"internal_error"}}\n\n'
)


def event(obj: Any) -> bytes:
    """One SSE event: `data: <compact JSON>` and a blank line."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class StreamSource(Protocol):
    """One SSE stream's bytes, produced on demand."""

    @property
    def path(self) -> str | None:
        """The metrics' name of this stream's direct writes (`<path>_<why direct mode ended>`);
        None when it cannot be written directly (it stays on the event loop)."""
        ...

    @property
    def foreign_thread(self) -> bool:
        """True when `listen`'s callback runs on another thread than the event loop (the engine's)."""
        ...

    @property
    def preamble(self) -> list[bytes]:
        """The chunks sent before any other (they never wait)."""
        ...

    @property
    def ended(self) -> bool:
        """The stream's last bytes (its final event and [DONE]) were produced."""
        ...

    def take(self) -> tuple[bytes, bool] | None:
        """Without waiting: the bytes of everything pending now (after the preamble and what was
        taken before) and whether they end the stream; None when nothing is pending."""
        ...

    def rest(self) -> AsyncGenerator[bytes, None]:
        """On the event loop: the chunks after the preamble and after what `take()` returned,
        one per wake-up, until the stream's end."""
        ...

    def listen(self, fn: Callable[[], None] | None) -> None:
        """Call fn() whenever new bytes may be ready (None: stop). It runs on the engine thread
        when `foreign_thread`, else on the event loop; it must not block."""
        ...

    @property
    def stops_work(self) -> bool:
        """Whether the client leaving stops work (a run only this stream wanted): False for a
        stream that only watches a run (a task's, a stored response's); its leaving is no abort."""
        ...

    def abort(self) -> None:
        """The client is gone: stop the work only this stream wanted (any thread)."""
        ...

    def close(self) -> None:
        """The stream is over, however it ended (event loop; called once)."""
        ...

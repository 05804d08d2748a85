"""The one streaming layer: an SSE response (server.api.streaming.sse) that sends any
`StreamSource` (server.api.streaming.source) on the event loop or, where the connection allows
it, by direct writes from the source's notifications (server.api.streaming.direct); and waits
that watch the client and the server's drain (server.api.streaming.watch)."""

"""rwkv_lightning's error shape, `{"error": "<text>"}` (plus the fields some of its errors carry,
e.g. `request_bsz` / `max_bsz`), for the errors lightning itself defines: a missing or wrong
password, a batch beyond the bound, a missing `session_id` / `dialogue_idx`, an unknown state.
Everything else on these routes (field validation, 413, 429, 503) keeps our error shape, whose
`error` key lightning's clients read as well."""

from __future__ import annotations

from typing import Any

from server.api.errors import ApiError

UNAUTHORIZED = "Unauthorized: invalid or missing password"


class LightningError(ApiError):
    """Raise from a lightning route; the app's ApiError handler sends `body()`."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(status, message, headers=headers)
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.message, **self.extra}


def bsz_overflow(requested: int, bound: int) -> LightningError:
    """lightning's answer to a batch larger than it can hold, in its words exactly (clients match
    the text); the bound is the server's max_queue: a request's prompts all wait in that queue."""
    return LightningError(400, f"bsz overflow, Max bsz={bound}", request_bsz=requested, max_bsz=bound)

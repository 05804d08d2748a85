"""What a caller gives a task operation (TaskManager.create, fork, continue_), checked against the
model: a prompt (text, or token ids) as token ids, and its parameters as a task stores them."""

from __future__ import annotations

import asyncio

from server.tasks.config import TokenizerLike
from server.tasks.errors import TaskInvalid
from server.tasks.params import GivenParams, TaskParams, clean_params

__all__ = ["Inputs", "Prompt", "TokenIds"]

TokenIds = list[int]
Prompt = str | TokenIds
"""Text, or token ids."""
THREAD_CHARS = 20000
"""A text prompt longer than this is encoded on a worker thread (the event loop goes on)."""


class Inputs:
    """A caller's prompts and parameters, for the model of `tokenizer` and `vocab_size`."""

    def __init__(self, tokenizer: TokenizerLike, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def params(self, params: GivenParams | None) -> TaskParams:
        """The parameters given (None: none), checked (clean_params: TaskInvalid)."""
        return clean_params(params or {}, self.vocab_size)

    async def encode(self, prompt: Prompt) -> TokenIds:
        """The prompt's token ids: a text's (valid UTF-8), or the ids given (each in the
        vocabulary); TaskInvalid otherwise."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")  # the stored prompt and its text must be valid UTF-8
            except UnicodeEncodeError as exc:
                raise TaskInvalid(
                    f"prompt is not valid text at character {exc.start} (a lone surrogate?)", param="prompt"
                ) from None
            if len(prompt) > THREAD_CHARS:
                return list(await asyncio.to_thread(self.tokenizer.encode, prompt))
            return list(self.tokenizer.encode(prompt))
        ids = [int(x) for x in prompt]
        bad = next((x for x in ids if not 0 <= x < self.vocab_size), None)
        if bad is not None:
            raise TaskInvalid(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return ids

"""The prompt of lightning's OpenAI-style route (/openai/v1/chat/completions), in its format:

    System: <system texts, one per line>\\n\\nUser: ...\\n\\nAssistant: ...\\n\\n
    User: ...\\n\\nAssistant: <think>\\n</think>\\n   (one line, wrapped here)

(ending `Assistant: <think` when `enable_think`). The system texts are the `system` field and
the system / developer messages; the first of `contents` is one more user message. In every
text, lines are stripped and blank lines dropped (so no text can fake a turn boundary); empty
texts make no turn; other roles are ignored. No system and no turn: 400 "Empty prompt".

The prompt comes in two parts: the system block (the part the chat-prefix cache keeps a state
for when `use_prefix_cache`) and the rest, always tokenized separately so the tokens are the
same whether the block's state is cached or not.
"""

from __future__ import annotations

from typing import Any

from server.api.lightning.errors import LightningError
from server.api.lightning.schemas import ChatStyleBody

THINK_OFF = "Assistant: <think>\n</think>\n"
THINK_ON = "Assistant: <think"


def content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list (other parts ignored)."""
    if isinstance(content, str):
        return content
    parts = []
    for p in content or ():
        if isinstance(p, str):
            parts.append(p)
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            parts.append(p["text"])
    return "".join(parts)


def clean(text: str | None) -> str:
    lines = (ln.strip() for ln in (text or "").replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    return "\n".join(ln for ln in lines if ln)


USED_ROLES = ("system", "developer", "user", "assistant")


def main_field(body: ChatStyleBody) -> str:
    """The field most of the prompt's text came from (`messages`, `contents` or `system`): the
    one a prompt that is too long is named by."""
    sizes = {
        "messages": sum(len(content_text(m.content)) for m in body.messages if m.role.lower() in USED_ROLES),
        "contents": len(body.contents[0]) if body.contents else 0,
        "system": len(body.system or ""),
    }
    return max(sizes, key=lambda k: sizes[k])


def build(body: ChatStyleBody) -> tuple[str, str]:
    """(system block, rest) of the request's prompt; 400 when it has no text at all."""
    system = [clean(body.system)]
    turns = []
    for m in body.messages:
        role, text = m.role.lower(), clean(content_text(m.content))
        if role in ("system", "developer"):
            system.append(text)
        elif role in ("user", "assistant") and text:
            turns.append(f"{role.capitalize()}: {text}")
    if body.contents and (text := clean(body.contents[0])):
        turns.append(f"User: {text}")
    system_text = "\n".join(s for s in system if s)
    if not system_text and not turns:
        raise LightningError(400, "Empty prompt")
    prefix = f"System: {system_text}\n\n" if system_text else ""
    end = THINK_ON if body.enable_think else THINK_OFF
    return prefix, "".join(t + "\n\n" for t in turns) + end

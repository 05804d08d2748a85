"""OpenAI chat messages -> an RWKV chat prompt.

Format (the one RWKV World / RWKV-7 chat models are trained on):

    System: <system text>\\n\\nUser: <question>\\n\\nAssistant: <answer>\\n\\nUser: ...\\n\\nAssistant:

Turns are separated by one blank line ("\\n\\n"), so a blank line inside a message would read as a
turn boundary: inside a message every run of blank lines becomes a single "\\n" (and "\\r\\n"
becomes "\\n"). The prompt ends with "Assistant:" and the reply is cut at the next "\\n\\n" (the
default chat stop string). When the last message is from the assistant, the prompt ends with that
text instead (no separator), and the model continues it.

The prompt is split in two: the *prefix* (few-shot block + leading system turns) whose state is
prefilled once and cached, and the *rest*. Both halves are always tokenized separately, so the
tokens are the same whether the prefix state came from the cache or not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
"""A tool message is a "Tool:" turn (server.api.openai.tools writes its text)."""
TURN_SEP = "\n\n"
CHAT_STOP = ("\n\n",)
_BLANK_RUNS = re.compile(r"\n(?:[ \t]*\n)+")


@dataclass
class ChatPrompt:
    prefix: str  # "" or text ending in "\n\n"
    rest: str  # ends with "Assistant:" (or the assistant text being continued)
    continues: bool = False
    """The prompt ends inside the last message, the assistant's, which the reply continues (its
    leading whitespace is part of the text, not the gap after "Assistant:")."""

    @property
    def text(self) -> str:
        return self.prefix + self.rest


def normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _BLANK_RUNS.sub("\n", text).strip()


def build_prompt(messages: list[tuple[str, str]], few_shot: str = "") -> ChatPrompt:
    """messages: (role, text) with role in ROLES; few_shot: dialogue text (may be empty)."""
    prefix = few_shot if not few_shot or few_shot.endswith(TURN_SEP) else few_shot.rstrip("\n") + TURN_SEP
    i = 0
    while i < len(messages) and ROLES[messages[i][0]] == "System":
        prefix += f"System: {normalize(messages[i][1])}{TURN_SEP}"
        i += 1
    turns = [f"{ROLES[role]}: {normalize(text)}" for role, text in messages[i:]]
    if messages and i < len(messages) and messages[-1][0] == "assistant":
        return ChatPrompt(prefix, TURN_SEP.join(turns), continues=True)  # continue the assistant's message
    return ChatPrompt(prefix, "".join(t + TURN_SEP for t in turns) + "Assistant:")


class FewShotUnreadable(Exception):
    """The few-shot file cannot be read as UTF-8 text; the message says why ("No such file or
    directory", "not UTF-8 text", ...)."""


def load_few_shot(path: str | Path) -> str:
    """A few-shot file: RWKV dialogue text; lines starting with '#' are comments.
    FewShotUnreadable when it cannot be read."""
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise FewShotUnreadable(exc.strerror or str(exc)) from None
    except UnicodeDecodeError:
        raise FewShotUnreadable("not UTF-8 text") from None
    lines = [ln for ln in raw.replace("\r\n", "\n").split("\n") if not ln.startswith("#")]
    text = "\n".join(lines).strip()
    dialog = [normalize(block) for block in re.split(r"\n(?:[ \t]*\n)+", text) if block.strip()]
    return "".join(block + TURN_SEP for block in dialog)


def default_few_shot_path() -> Path:
    """The project's few_shot.txt (next to pyproject.toml)."""
    return Path(__file__).resolve().parents[3] / "few_shot.txt"

"""How an API whose bodies are mapped onto a chat completion's (the Responses API, Anthropic's
Messages API) names the chat body's fields back: a check of the chat path names a chat field
(`messages[2].content`, `max_completion_tokens`), and the client is told the field of its own
body that holds it (`input[1].content`, `max_output_tokens`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

CHAT_MESSAGE = re.compile(r"^messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?")


@dataclass
class FieldNames:
    """Where each chat message (and each call of one) came from in the body; a subclass gives
    the API's names of the other chat fields (`RENAMES`), of the messages as a whole (`MESSAGES`)
    and of the length bound (`MAX_TOKENS`)."""

    RENAMES: ClassVar[tuple[tuple[re.Pattern[str], str], ...]] = ()
    MESSAGES: ClassVar[str] = "messages"
    MAX_TOKENS: ClassVar[str] = "max_tokens"

    messages: list[str] = field(default_factory=list)
    calls: dict[tuple[int, int], str] = field(default_factory=dict)

    def rename(self, name: str) -> str:
        """The body's name of a chat body's field."""
        if (match := CHAT_MESSAGE.match(name)) is not None:
            index = int(match.group(1))
            if match.group(2) is not None and (at := self.calls.get((index, int(match.group(2))))):
                return at + name[match.end() :]
            if index < len(self.messages):
                return self.messages[index] + name[match.end() :]
        if name == "messages" or name.startswith("messages."):
            return self.MESSAGES + name[len("messages") :]
        for pattern, replacement in self.RENAMES:
            if (match := pattern.match(name)) is not None:
                return match.expand(replacement) + name[match.end() :]
        return name

    def message(self, message: str, name: str | None) -> str:
        """An error message that starts with the chat field `name`, with the field renamed (and
        the length bound, which messages name after the prompt's tokens)."""
        if name is not None and message.startswith(name):
            message = self.rename(name) + message[len(name) :]
        return message.replace("max_completion_tokens", self.MAX_TOKENS)

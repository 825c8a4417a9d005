"""SmolLM2's tokenizer with the chat template that shows the model its tools (the embedded
model's default, engine/model/chat_templates/smollm2-tools.jinja; SmolLM2's own template has none),
for tests that load the model directory directly."""

from __future__ import annotations

import copy
from typing import Any

from engine.model.loader import EMBEDDED_CHAT_TEMPLATE

TOOLS_TEMPLATE = EMBEDDED_CHAT_TEMPLATE.read_text()


def with_tools_template(tokenizer: Any) -> Any:
    """A copy of `tokenizer` whose chat template renders tools (the original is unchanged)."""
    tools_tokenizer = copy.deepcopy(tokenizer)
    tools_tokenizer.chat_template = TOOLS_TEMPLATE
    return tools_tokenizer

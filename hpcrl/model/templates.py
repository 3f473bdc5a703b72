"""Chat templates the project ships."""

from __future__ import annotations

__all__ = ["PLAIN_CHAT_TEMPLATE"]

# One line per message, ``role: content``, the tokenizer's eos token closes each turn; tools are listed as JSON
# in a first system line and an assistant's tool calls are written Qwen-style, <tool_call>{...}</tool_call>.
# The tiny models' character tokenizer carries it; the agent proxy uses it for a tokenizer without a template.
PLAIN_CHAT_TEMPLATE = (
    "{% if tools %}system: tools {{ tools | tojson }}{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for t in m['tool_calls'] %}<tool_call>"
    "{\"name\": {{ t['function']['name'] | tojson }}, \"arguments\": {{ t['function']['arguments'] }}}"
    "</tool_call>{% endfor %}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

"""A Hermes-style chat template that renders tools, tool calls and tool results (as Qwen2.5's
and Hermes 2 Pro's do, in short), for the tiny models' tokenizers, whose own template has no
tools; vLLM's ``hermes`` tool parser reads the ``<tool_call>`` blocks it asks for.

``SERVED_TEMPLATE`` is the shared test server's: Hermes when a request has tools, the tiny
models' own ChatML otherwise, so a request without tools renders to the same token ids as on the
tiny model itself (the offline engine's references stay valid for the server's answers)."""

from guardrail.testing.tiny_models import CHATML_TEMPLATE

HERMES_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nCall a function in <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{ message.content }}{%- endif %}"
    '{%- for call in message.tool_calls %}{{ \'<tool_call>\\n{"name": "\' + call.function.name'
    " + '\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

SERVED_TEMPLATE = (
    "{%- if tools %}" + HERMES_TEMPLATE + "{%- else %}" + CHATML_TEMPLATE + "{%- endif %}"
)

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
"""One tool definition, OpenAI's form, for the tools tests."""

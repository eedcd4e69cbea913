"""``guardrail-serve --chat-template``: read as ``vllm serve`` reads it, refused at start-up when
it cannot render. (The running server rendering with it: tests/engine/test_serving.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from guardrail.integrations._serve_args import chat_template_text
from guardrail.integrations.serving import parse_command

from guardrail.errors import ConfigError

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_a_file_is_read_and_a_template_is_taken_as_given(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert chat_template_text(str(path)) == TEMPLATE
    assert chat_template_text(TEMPLATE) == TEMPLATE
    assert chat_template_text(None) is None


def test_the_flag_reaches_the_server_and_not_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    args, engine = parse_command(["/models/m", "--chat-template", str(path)])
    assert args.chat_template == str(path)
    assert engine == {}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("no/such/template.jinja", "no such file, and not a Jinja template"),
        ("{% for m in messages %}{{ m.content }}", "does not parse"),
        ("{{ messages[0].content ", "does not parse"),
    ],
)
def test_a_template_that_cannot_render_is_refused_naming_the_flag(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        chat_template_text(value)
    assert str(refused.value).startswith("--chat-template ")
    assert says in str(refused.value)


def test_the_template_renders_on_the_engine_s_tokenizer(tiny_llama_dir: Path) -> None:
    """The engine's tokenizer (vLLM's renderer's) renders on copies of itself made at start-up,
    so a template set on it afterwards is never used: the template is passed to each render.
    The skeletons cached per tokenizer are kept apart per template."""
    from guardrail.integrations._openai_tools import normalised_tools
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer, maybe_make_thread_pool

    from guardrail.probe.prompts import ChatWithTools, prepare_prompt
    from tests.tool_templates import SERVED_TEMPLATE, TOOL

    engine_tokenizer = maybe_make_thread_pool(get_tokenizer(str(tiny_llama_dir)), 2)
    reference = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    reference.chat_template = SERVED_TEMPLATE
    chat = ChatWithTools(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=normalised_tools([TOOL]),
    )
    own = prepare_prompt(chat, engine_tokenizer)
    given = prepare_prompt(chat, engine_tokenizer, chat_template=SERVED_TEMPLATE)
    expected = prepare_prompt(chat, reference)
    assert "get_weather" not in own.text and '"name": "get_weather"' in given.text
    assert given.token_ids == expected.token_ids
    assert given.instruction_spans == expected.instruction_spans
    assert prepare_prompt(chat, engine_tokenizer).token_ids == own.token_ids  # not the cached

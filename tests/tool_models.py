"""Tiny tool-capable models for tests: a Hermes-style chat template and mlx-lm's ``json_tools`` format.

Random weights never write a tool call by themselves; tests force one with a
grammar (``tool_choice`` ``required`` or a named function).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

_TOOL_TEMPLATE = """\
{%- if tools %}{OPEN}system
Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call>{CLOSE}
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}{OPEN}assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tool_call in message.tool_calls %}
{%- set tool_call = tool_call.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{% endfor %}{CLOSE}
{% elif message.role == "tool" %}{OPEN}tool
{{ message.content }}{CLOSE}
{% else %}{OPEN}{{ message.role }}
{{ message.content }}{CLOSE}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{OPEN}assistant
{% endif %}"""


def tool_template(open_token: str, close_token: str) -> str:
    """A Hermes-style template (tools in the system turn, ``<tool_call>`` JSON calls, ``tool`` turns).

    It names ``<tool_call>`` and ``tool_call.name``, so mlx-lm's loader infers
    its ``json_tools`` parser from it.
    """
    return _TOOL_TEMPLATE.replace("{OPEN}", open_token).replace("{CLOSE}", close_token)


def tool_tokenizer() -> Any:
    """The tiny ASCII tokenizer (``tests.tiny_models``) with the tool template and ``json_tools`` format."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from mlx_lm.tool_parsers import json_tools

    from tests.tiny_models import tiny_tokenizer

    hf = copy.deepcopy(tiny_tokenizer()._tokenizer)
    hf.chat_template = tool_template("<s>", "</s>")
    return TokenizerWrapper(
        hf,
        detokenizer_class=BPEStreamingDetokenizer,
        tool_call_start=json_tools.tool_call_start,
        tool_call_end=json_tools.tool_call_end,
        tool_parser=json_tools.parse_tool_call,
    )


def tool_model_dir(root: Path) -> Path:
    """A random-weight tiny llama as an mlx-lm directory whose template calls tools.

    The converted tiny GGUF model (``tests.model_fixtures.tiny_llama_gguf``)
    with the tool template in ``tokenizer_config.json`` and a 4,096-token
    context (tool definitions make long prompts; the weights are random anyway).
    """
    from kernels import convert_gguf
    from tests.model_fixtures import tiny_llama_gguf

    tiny_llama_gguf(root / "tiny.gguf")
    model = convert_gguf(root / "tiny.gguf", root / "tiny-tools", dequantize=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = tool_template("<|im_start|>", "<|im_end|>")
    cfg["model_max_length"] = 4096
    cfg_path.write_text(json.dumps(cfg))
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 4096
    config_path.write_text(json.dumps(config))
    return model

"""Chat templates for tests that need a template other than the tiny tokenizer's own."""

from __future__ import annotations

import copy
from typing import Any

from tests.tiny_models import tiny_tokenizer

THINKING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<s>assistant\n{{ m['content'].split('</think>')[-1] }}</s>\n"
    "{% else %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n<think>\n{% endif %}"
)
"""A thinking template: the generation prompt opens a ``<think>`` block, and past assistant
turns are rendered without their reasoning (the text up to ``</think>`` is dropped), so the
opener never reappears in the next turn's rendering."""


def thinking_tokenizer() -> Any:
    """The tiny ASCII tokenizer with :data:`THINKING_TEMPLATE`."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

    hf = copy.deepcopy(tiny_tokenizer()._tokenizer)
    hf.chat_template = THINKING_TEMPLATE
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer)

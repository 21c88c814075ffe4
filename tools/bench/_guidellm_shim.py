"""Run guidellm's CLI with chat requests that a strict OpenAI server accepts.

guidellm adds vLLM's extensions to every streamed chat request:
``ignore_eos``, ``stop: null`` and ``stream_options.continuous_usage_stats``.
``kvtier serve`` validates request bodies strictly and answers 400 to the
unknown fields; ``mlx_lm.server`` ignores them. This shim removes the three
from the body that guidellm's chat handler builds, so both servers receive
the same requests, then runs guidellm's CLI unchanged.

NOTE: guidellm's workers start with the ``spawn`` method, which imports this
file again as ``__mp_main__`` in each worker: the patch below runs at import
time so it applies in the workers too, and the CLI only under ``__main__``.

Usage (with the Python of the environment guidellm is installed in)::

    python tools/bench/_guidellm_shim.py run --scenario scenario.json
"""

from __future__ import annotations

from typing import Any

from guidellm.backends.openai.request_handlers import ChatCompletionsRequestHandler

_format = ChatCompletionsRequestHandler.format


def _strict_format(self: Any, *args: Any, **kwargs: Any) -> Any:
    arguments = _format(self, *args, **kwargs)
    body = arguments.body or {}
    body.pop("ignore_eos", None)
    if "stop" in body and body["stop"] is None:
        del body["stop"]
    options = body.get("stream_options")
    if isinstance(options, dict):
        options.pop("continuous_usage_stats", None)
    return arguments


ChatCompletionsRequestHandler.format = _strict_format  # type: ignore[method-assign]

if __name__ == "__main__":
    from guidellm.__main__ import cli

    cli()

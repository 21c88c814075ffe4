"""kvtier's OpenAI-compatible HTTP server (FastAPI), built on :class:`actors.engine.Engine`.

``create_app(engine, settings)`` returns the ASGI app; ``kvtier serve``
(``actors.cli.serve``) runs it under uvicorn with graceful shutdown.
"""

from __future__ import annotations

from ._app import begin_shutdown, create_app
from ._convert import Defaults
from ._errors import ApiError
from ._middleware import BodyTooLarge
from ._port import EnginePort, StreamPort
from ._state import HttpSettings, HttpState

__all__ = [
    "ApiError",
    "BodyTooLarge",
    "Defaults",
    "EnginePort",
    "HttpSettings",
    "HttpState",
    "StreamPort",
    "begin_shutdown",
    "create_app",
]

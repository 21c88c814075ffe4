"""kvtier's OpenAI-compatible HTTP server (FastAPI), built on :class:`actors.engine.Engine`.

``create_app(engine, settings)`` returns the ASGI app; ``kvtier serve``
(``actors.cli.serve``) runs it under uvicorn with graceful shutdown.
"""

from __future__ import annotations

from ._app import begin_shutdown, create_app, cut_streams
from ._convert import Defaults
from ._errors import ApiError
from ._middleware import BodyTooLarge
from ._port import EnginePort, StreamPort
from ._server import ServerLimits, exposure_warning, serve
from ._state import HttpSettings, HttpState

__all__ = [
    "ApiError",
    "BodyTooLarge",
    "Defaults",
    "EnginePort",
    "HttpSettings",
    "HttpState",
    "ServerLimits",
    "StreamPort",
    "begin_shutdown",
    "create_app",
    "cut_streams",
    "exposure_warning",
    "serve",
]

"""kvtier's actors: everything that receives messages.

Import the public pieces from their modules: ``actors.engine.Engine`` (the
embedding API), ``actors.runtime`` (the actor runtime), ``actors.http`` (the
OpenAI-compatible app) and ``actors.cli`` (the ``kvtier`` command).
"""

from __future__ import annotations

__all__: list[str] = []

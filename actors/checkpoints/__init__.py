"""In-flight generation checkpoints (docs/cold-tier.md, "Generation checkpoints").

``key``: the request key that decides which later request may resume a
checkpoint, and which requests are not checkpointed in v1.
"""

from __future__ import annotations

from .key import KEY_VERSION, checkpoint_refusal, request_key

__all__ = ["KEY_VERSION", "checkpoint_refusal", "request_key"]

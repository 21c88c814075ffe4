"""The environment variables kvtier reads outside ``EngineConfig``, and the one on/off parser.

``EngineConfig`` (``actors/engine/config.py``) owns every server setting and
its ``KVTIER_*`` variable. A few knobs sit below it: they are read where the
work happens (in ``kernels``, often on the engine thread, with no settings
object at hand), or before any settings exist. Each is read through this
module, so the list below is every variable that is not an ``EngineConfig``
field:

============================  ==========================================  =====================
variable                      what it sets                                read by
============================  ==========================================  =====================
``KVTIER_HOME``               root of kvtier's caches                     ``kernels._paths``
``KVTIER_FEW_ROW``            switch: the few-row product on the CPU      ``kernels.native``
``KVTIER_FEW_ROW_THREADS``    threads of one few-row product (1-16)       ``kernels.native``
``KVTIER_NATIVE_SOFTMAX``     switch: CPU attention's native softmax      ``kernels.native``
``KVTIER_FUSED_PROJECTIONS``  switch: q/k/v and gate/up fused at load     ``kernels.model``
``KVTIER_BATCH_BLAS_TUNE``    switch: the batch lane's BLAS thread count  ``kernels.engine``
``KVTIER_BATCH_SSM``          switch: recurrent models on the batch lane  ``kernels.engine``
``KVTIER_BATCH_SLOT_REUSE``   switch: a leaving row's slot is reused    ``kernels.engine``
``KVTIER_BATCH_FIRST_TOKEN_FIRST``  switch: no prefill in the turn that ``kernels.engine``
                              hands out rows' first tokens
``KVTIER_BATCH_PREFILL_BUCKET``  a warm row's prefill forward rounded ``kernels.engine``
                              up to a multiple of N tokens (default 32 on
                              CUDA, else 0: off)
``KVTIER_BATCH_ALIGN_SUFFIXES``  switch: a joining group's suffixes     ``kernels.engine``
                              aligned, not padded and rolled
``KVTIER_BATCH_PREFILL_CLEAR``  switch (default off): MLX's buffer cache ``kernels.engine``
                              emptied after each batch-lane prefill forward
``KVTIER_BATCH_CLEAR_EVERY``  MLX's buffer cache emptied after every   ``kernels.engine``
                              N-th batch step (default 256; 0: never)
``KVTIER_BATCH_RESERVE``      switch: a prefill's batch cache gets its  ``kernels.engine``
                              room once, not grown chunk by chunk
``KVTIER_READ_FIRST``         switch (CPU only): a decode step computes   ``kernels``
                              its tokens before it queues the next forward
``KVTIER_CUDA_FEW_ROW``       switch (default off; ``tile`` / ``quad``):  ``kernels.model``
                              2-8 row bf16 products on tensor cores (CUDA)
``KVTIER_CUDA_FEW_ROW_QKV``   switch (default off): q|k|v as one launch   ``kernels.model``
                              of that product (CUDA)
``KVTIER_LANDING_THREADS``    threads that land a restored KV file        ``actors.ssd_writer``
``KVTIER_LANDING_FILL_STREAMS``  MLX streams that fill landed arrays      ``kernels.cache``
``KVTIER_CHECKPOINT_DELTA``   switch (default: CUDA only): a checkpoint  ``kernels.cache``
                              reads back only its answer's new tokens
``KVTIER_CHECKPOINT_READ_AHEAD``  switch (default on): a batch step's  ``kernels.cache``
                              checkpoints read back together (CUDA)
``KVTIER_CUDA_HOST_READ``     diagnostic: ``direct`` / ``host`` reads (CUDA) ``kernels.cache``
``KVTIER_CUDA_RELEASE_CACHE`` switch (default off): clear MLX's buffer    ``kernels.cache``
                              cache after host reads (CUDA)
``KVTIER_CUDA_MASKED_ATTENTION``  switch: masked decode attention as      ``kernels.model``
                              folded products (CUDA)
``KVTIER_CUDA_PREFILL_FOLD``  switch (default off): prefill attention  ``kernels.model``
                              of a shape new to cuDNN folded (CUDA)
``KVTIER_CUDA_SUFFIX_FOLD``  switch (default on): a short prefill  ``kernels.model``
                              over a cached prefix folded over the
                              cache's buffer (CUDA)
``KVTIER_CUDA_ATTENTION_BUCKETS``  switch (default off): prefill     ``kernels.model``
                              attention at padded shapes (CUDA)
``KVTIER_COMPILED_DECODE``    switch (default off): the batch lane's      ``kernels.model``
                              one-token forward compiled (mx.compile)
``KVTIER_LOG_FORMAT``         ``console`` or ``json`` logs                ``actors.runtime``
``CC``, ``CXX``               compilers for the few-row module            ``kernels.native``
============================  ==========================================  =====================

(``kvtier cache`` also reads ``KVTIER_SSD_CACHE``, an ``EngineConfig``
field, through :func:`env_text`, to find the directory ``kvtier serve``
would use.)

A switch is on unless its variable says off (:data:`OFF_WORDS`).

NOTE: nothing here imports MLX, but importing ``kernels._env`` runs
``kernels/__init__`` (which does); ``actors/engine/config.py`` stays free of
``kernels`` and keeps its own strict on/off flag parser.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["OFF_WORDS", "env_switch", "env_text"]

OFF_WORDS = frozenset({"off", "false", "0", "no"})
"""Words that switch something off (any case)."""


def env_text(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, stripped (``None``: unset or blank). ``env`` defaults to the process's."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def env_switch(name: str, env: Mapping[str, str] | None = None, *, default: bool = True) -> bool:
    """Whether the switch ``name`` is on: unless its value is an off word (unset: ``default``)."""
    value = env_text(name, env)
    if value is None:
        return default
    return value.lower() not in OFF_WORDS

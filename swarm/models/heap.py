"""Keep what loading made out of the garbage collector's full collections.

A process that has imported torch, transformers and hivemind and loaded a model holds ~400,000 objects the
collector tracks. CPython's full (generation 2) collection walks every one of them: ~190 ms on one idle EPYC
core, and 300-990 ms traced in peers and clients of a local swarm on 2 cores. It runs whenever enough objects
outlived the younger generations, which a serving loop's per-step objects do now and then, and it holds the
GIL throughout: a peer's event loop stopped for ~0.5 s held every session's next step, and a client's held its
tokens (traced: one step reached its first hop 480 ms after the client sent it, during such a collection).

``freeze_loaded()`` collects once, then moves every surviving object into the permanent generation, which later
collections skip. Objects made after it are collected as before; an object frozen now that becomes cyclic
garbage later is not (loading's temporaries are gone after the first collection, so little can).
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_loaded() -> int:
    """Collect, then freeze every object alive now (gc.freeze); return how many are frozen in all."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "froze %d loaded objects out of full garbage collections (%.0f ms)",
        frozen,
        1e3 * (time.perf_counter() - started),
    )
    return frozen

"""Keep what loading made out of the garbage collector's full collections.

A process that has imported torch, transformers and hivemind and loaded a model holds hundreds of thousands of
objects the collector tracks, and CPython's full (generation 2) collection walks every one of them. It runs
whenever enough objects outlived the younger generations, which a serving loop's per-step objects do now and
then, and it holds the GIL throughout: a peer's event loop stops, holding every session's next step, and a
client's holds its tokens (traced pauses: docs/benchmarks.md).

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

"""Threads named in the OS: per-thread CPU (top -H, /proc) then says which work each thread does."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from swarm.models.threads import MAX_NAME_BYTES, name_os_thread

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="thread names are read from /proc"
)


def _name_in_a_thread(name: str) -> str:
    seen: list[str] = []

    def run() -> None:
        name_os_thread(name)
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_takes_its_name_in_the_os() -> None:
    assert _name_in_a_thread("swarm-decode") == "swarm-decode"


def test_a_long_name_is_cut_to_what_the_kernel_keeps() -> None:
    assert _name_in_a_thread("swarm-a-much-longer-name") == "swarm-a-much-longer-name"[:MAX_NAME_BYTES]


def test_naming_a_thread_leaves_the_others_alone() -> None:
    before = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    _name_in_a_thread("swarm-other")
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text() == before

"""swarm.transport.streams framing: a frame goes to the daemon in one write, and reads back whole."""

from __future__ import annotations

import asyncio

import pytest

from swarm.errors import ProtocolError
from swarm.transport.streams import HEADER_BYTES, read_frame, send_frame
from swarm.wire import MAX_MESSAGE_BYTES


class _Writes:
    """What a stream writer was asked to send, one entry per call that sends (write or writelines)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sent.append(bytes(data))

    def writelines(self, data: list[bytes]) -> None:
        self.sent.append(b"".join(data))

    async def drain(self) -> None:
        return None


@pytest.mark.parametrize("size", [0, 1, 2604, 70_000])
def test_a_frame_is_one_write_of_its_length_prefix_and_its_bytes_and_reads_back_whole(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)

    async def go() -> bytes:
        writes = _Writes()
        await send_frame(writes, data)  # type: ignore[arg-type]
        assert len(writes.sent) == 1  # hivemind's send_raw_data writes the prefix apart: a send of its own
        reader = asyncio.StreamReader()
        reader.feed_data(writes.sent[0])
        reader.feed_eof()
        return await read_frame(reader)

    assert asyncio.run(go()) == data


def test_a_frame_over_the_limit_is_refused_before_its_bytes_are_read() -> None:
    async def go() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data((MAX_MESSAGE_BYTES + 1).to_bytes(HEADER_BYTES, "big"))
        await read_frame(reader)

    with pytest.raises(ProtocolError, match="over the"):
        asyncio.run(go())

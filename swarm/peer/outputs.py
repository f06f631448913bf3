"""What a session's hop sent on: the log that lets a failover replay only the stages it replaced.

The client never sees the hidden states between two hops of its route (each hop pushes its output to the next
one itself), so it cannot keep each stage's inputs the way Petals' client does. The hop that computed them
keeps them instead: each session on a peer logs the outputs it sent on, in the dtype it sent them in (16 bits
for a model that runs in 16 bits; the bytes the next hop received, so a replay from the log is bit-identical
to the first pass). When a failover replaces the stages after this hop, the client asks this hop to send
positions [0, P) of its log again, as one step at position 0, to the new stages only (a "resend" step, see
swarm.wire.StepRequest): their caches fill without any stage before them computing again.

Like the KV cache, the log is cut back to a step's position when a step arrives below its length (a retried
or replayed step), and it never holds more than the session's max_length_tokens positions, so it costs at
most ``max_length_tokens x hidden_size x element size`` bytes per session, on the device that computed them
(SmolLM2-135M in 16 bits: 1,152 bytes a token, about a seventh of the KV cache of a 10-layer range). It lives
and dies with the session.
"""

from __future__ import annotations

import torch

from swarm.errors import SessionError


class OutputLog:
    """Outputs [0, length) of one session's layers up to ``end``, as sent to the next hop."""

    def __init__(self) -> None:
        self.end = -1  # the last layer (exclusive) whose output is logged; -1 until the first record
        self._parts: list[tuple[int, torch.Tensor]] = []  # (position, hidden[T, H]), consecutive, in order

    @property
    def length(self) -> int:
        if not self._parts:
            return 0
        position, hidden = self._parts[-1]
        return position + hidden.shape[0]

    def record(self, position: int, end: int, hidden: torch.Tensor) -> None:
        """Log ``hidden`` [T, H], this session's output after layer ``end`` for positions [position, +T).

        A step below the log's length cuts it back first (a retry or a replay). A step past it leaves a gap:
        we cannot vouch for what is missing, so the log restarts empty and a resend from it fails (the client
        then replays from its own tokens). A new ``end`` (the session now runs other layers here) also
        restarts it."""
        if end != self.end:
            self.end, self._parts = end, []
        self.truncate(position)
        if position != self.length:
            self._parts = []
            return
        # a copy on the step's own device: a copy to the host would wait for the GPU on every step
        self._parts.append((position, hidden.detach().clone()))

    def truncate(self, position: int) -> None:
        """Forget the outputs from ``position`` on."""
        while self._parts and self._parts[-1][0] >= position:
            self._parts.pop()
        if self._parts and self.length > position:
            start, hidden = self._parts[-1]
            self._parts[-1] = (start, hidden[: position - start].clone())

    def read(self, position: int, tokens: int, end: int) -> torch.Tensor:
        """Outputs [position, position + tokens) after layer ``end``; SessionError if the log lacks them."""
        if end != self.end or position + tokens > self.length or tokens <= 0:
            raise SessionError(
                f"this hop has no log of outputs [{position}, {position + tokens}) after layer {end} "
                f"(it holds [0, {self.length}) after layer {self.end}): replay from the tokens"
            )
        parts = [h for p, h in self._parts if p < position + tokens and p + h.shape[0] > position]
        first = next(p for p, h in self._parts if p + h.shape[0] > position)
        joined = torch.cat(parts)  # [covering T, H], starting at `first`
        return joined[position - first : position - first + tokens]

"""What a peer accepts on the wire: anything past these limits is a ProtocolError, not an allocation."""

from __future__ import annotations

import torch

from swarm.types import DTYPE_BYTES

MAX_TENSOR_BYTES = 192 * 1024**2  # one tensor's raw data
MAX_TOKENS = 65_536  # tokens in one step (the T of hidden[T, H])
MAX_HIDDEN_SIZE = 65_536
MAX_LENGTH_TOKENS = 1 << 20  # a session longer than this is absurd for any model we serve
MAX_POSITION = MAX_LENGTH_TOKENS
MAX_LAYER = 10_000
MAX_ROUTE_HOPS = 256
MAX_MADDRS = 32
MAX_TEXT_CHARS = 4096
MAX_PROBE_BYTES = 64 * 1024**2
MAX_BATCH_STEPS = 1024  # a client's decode steps sent together (StepRequest.batch_size)
# how a peer refuses a message kind it does not know (one of a later release): the sender may then send as before
UNKNOWN_KIND = "unexpected message kind"
MAX_FORWARDED_STEPS = 256  # steps in one StepBatch (under the request's longest list, _REQUEST_ARRAY_LEN)
MAX_MAP_FIELDS = 32  # the widest message, InfoReply, has 16 fields
MAX_TRAFFIC_CAUSES = 16  # InfoReply.background_bytes entries
# Everything of a message but its tensor data or probe payload: the biggest legitimate one is a full route
# (MAX_ROUTE_HOPS hops of MAX_MADDRS multiaddrs of 512 characters: about 4.3 MB).
MAX_STRUCTURE_BYTES = 8 * 1024**2
MAX_MESSAGE_BYTES = MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES  # whole encoded message, streams included
# Container elements in one message: a full route has about 9,500, an ErrorReply up to MAX_LAYER layers.
# msgpack builds one Python object per element (~60 bytes for an empty list), so this bounds what a frame can
# make the decoder allocate beyond its own bytes.
MAX_OBJECTS = 4 * MAX_LAYER
DEFAULT_STEP_TIMEOUT_S = 60.0  # a step's deadline when its sender names none
MAX_STEP_TIMEOUT_S = 3600.0
# What each kind of message may weigh, checked against the frame's size before it is unpacked.
_MAX_KIND_BYTES = {
    "step": MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES,
    "step_reply": MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES,
    "steps": MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES,  # the steps' tensors together
    "steps_reply": MAX_TENSOR_BYTES + MAX_STRUCTURE_BYTES,
    "probe": MAX_PROBE_BYTES + MAX_STRUCTURE_BYTES,
    "probe_reply": MAX_PROBE_BYTES + MAX_STRUCTURE_BYTES,
}
# msgpack's own limits, from the ones above: a string, bin, array or map past them is refused by its header,
# before anything is allocated for it. msgpack allocates a declared array before reading its elements and
# nests up to 1024 deep, so the array limit is the longest list each direction carries: requests at most a
# route (MAX_ROUTE_HOPS), replies ErrorReply.missing_layers (MAX_LAYER).
_UNPACK_LIMITS: dict[str, int] = {
    "max_bin_len": max(MAX_TENSOR_BYTES, MAX_PROBE_BYTES),
    "max_str_len": 4 * MAX_TEXT_CHARS,  # UTF-8 bytes of the longest text field
    "max_map_len": MAX_MAP_FIELDS,
    "max_ext_len": 0,  # no message uses ext types
}
_REQUEST_ARRAY_LEN = MAX_ROUTE_HOPS + 1
_REPLY_ARRAY_LEN = MAX_LAYER + 1  # one past, so a too-long list gets its field's own error

WIRE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}

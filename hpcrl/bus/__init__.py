"""The message bus: msgspec files on the shared filesystem plus a ZMQ doorbell (docs/architecture.md §3).

Light on purpose: numpy, msgspec and pyzmq only, never torch.
"""

from hpcrl.bus.api import Bus, endpoint_name
from hpcrl.bus.errors import BusError, BusTimeout, CorruptMessageError, ShutdownRequested
from hpcrl.bus.files import read_message, write_message
from hpcrl.bus.messages import (
    Endpoint,
    Message,
    PolicyReady,
    Ring,
    ServerInfo,
    Shutdown,
    TrainBatch,
    WeightGroupAddress,
    decode,
    encode,
)

__all__ = [
    "Bus",
    "BusError",
    "BusTimeout",
    "CorruptMessageError",
    "Endpoint",
    "Message",
    "PolicyReady",
    "Ring",
    "ServerInfo",
    "Shutdown",
    "ShutdownRequested",
    "TrainBatch",
    "WeightGroupAddress",
    "decode",
    "encode",
    "endpoint_name",
    "read_message",
    "write_message",
]

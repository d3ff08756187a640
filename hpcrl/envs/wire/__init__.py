"""The env-server wire protocol: msgspec messages and their framing over ZMQ."""

"""Every type that crosses the bus, and the one binary format they travel in.

A bus message is a msgspec Struct. Numpy fields are declared as `np.ndarray` and are plain numpy
arrays on both sides: roles never see a wire wrapper. On the wire a message is one frame:

    offset 0   header (48 bytes, little endian, see HEADER)
               magic "HPCRLBUS" | schema version u16 | type tag u16 | checksum algo u8 | flags u8 |
               reserved u16 | meta_len u64 | blob_len u64 | checksum u64 | pad u32 | header crc32 u32
    offset 48  meta: the Struct as msgpack; each array is [dtype, shape, offset, nbytes] into the blob
               zero padding up to a multiple of 64
    blob_off   blob: the raw array bytes, each array starting on a 64-byte boundary

`checksum` covers everything after the header; `header crc32` covers the header fields before it, so
a flipped length can not send the reader off reading garbage. Keeping array bytes out of the msgpack
body (rather than as msgpack `bin` values) is what lets the writer hand numpy buffers straight to the
kernel (no encode copy of a 64 MiB batch) and lets the reader return *aligned* zero-copy views into
the one buffer it read the file into.

No pickle: only msgpack/JSON and raw numeric bytes of a whitelisted dtype ever get decoded.
"""

from __future__ import annotations

import struct
import time
import zlib
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

from hpcrl.bus.errors import CorruptMessageError
from hpcrl.bus.images import ImageBatch

SCHEMA_VERSION = 1
MAGIC = b"HPCRLBUS"
HEADER = struct.Struct("<8sHHBBHQQQ4xI")
HEADER_SIZE = HEADER.size  # 48
_HEADER_CRC_SPAN = HEADER_SIZE - 4  # everything before the header crc (the last field)
ALIGN = 64

CRC32 = 1
XXH3_64 = 2
_ALGO_NAMES = {"crc32": CRC32, "xxh3": XXH3_64}

# Numeric kinds only: bool, signed, unsigned, float. Object/void/string dtypes would let a file smuggle
# in something that is not plain bytes.
_ALLOWED_KINDS = frozenset("biuf")


# ------------------------------------------------------------------------------------------------
# Messages
# ------------------------------------------------------------------------------------------------
def _now() -> float:
    return time.time()


# The sample fields of a TrainBatch, named once for both sides of the bus: the orchestrator packs
# them (hpcrl/orchestrator/packing.py), a cp group's ranks merge their shards (trainer/context_parallel.py).
TOKEN_FIELDS = (  # one entry per token, samples back to back
    "input_ids",
    "position_ids",
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "teacher_logprobs",
    "reference_logprobs",
    "ce_weights",
)
SAMPLE_FIELDS = ("seq_lens", "policy_versions", "temperatures", "example_ids", "rewards")  # one per sample
ROW_FIELDS = ("env_names", "routed_experts")  # per sample as a list / per token as a [T, k] table


class TrainBatch(msgspec.Struct, kw_only=True, eq=False):
    """One trainer rank's share of one step: samples packed back to back into T tokens.

    Arrays may be passed as anything numpy accepts; they are stored as the dtypes below.
    """

    step: int
    rank: int
    world_size: int
    input_ids: np.ndarray  # int32 [T]
    position_ids: np.ndarray  # int32 [T], restarts at 0 for each sample
    seq_lens: np.ndarray  # int32 [S], sums to T
    loss_mask: np.ndarray  # bool [T], True on trainable completion tokens
    advantages: np.ndarray  # float32 [T]
    inference_logprobs: np.ndarray  # float32 [T], 0 where loss_mask is False
    policy_versions: np.ndarray  # int32 [S], oldest policy step that produced any token of the sample
    temperatures: np.ndarray  # float32 [S]
    env_names: list[str]  # [S]
    example_ids: np.ndarray  # int64 [S], task/prompt id: proves no prompt is skipped or repeated
    rewards: np.ndarray  # float32 [S]
    total_loss_tokens: int  # loss tokens across ALL ranks of this step (global normalisation)
    teacher_logprobs: np.ndarray | None = None  # float32 [T]
    reference_logprobs: np.ndarray | None = None  # float32 [T]
    # echo: the cross-entropy weight of each token (0 = none; env-provided tokens, outside loss_mask),
    # and how many tokens of the whole step (all ranks) have one: that term's normalisation.
    ce_weights: np.ndarray | None = None  # float32 [T]
    total_ce_tokens: int = 0
    # MoE router replay: [T, layers*k] expert ids per token, uint8 (255 = none) when every id fits,
    # else int16 (-1 = none); none on prompt tokens. route_ids() reads either as int64 with -1.
    routed_experts: np.ndarray | None = None
    created_at: float = msgspec.field(default_factory=_now)
    images: ImageBatch | None = None  # vision-language RL: the samples' images (hpcrl.bus.images)

    def __post_init__(self) -> None:
        # Runs on construction (ValueError for the caller) and on decode (msgspec turns it into a
        # ValidationError, which the codec reports as a corrupt message).
        for name, dtype in _TOKEN_FIELDS + _SAMPLE_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            arr = np.asarray(value, dtype=dtype)  # no copy when the dtype already matches
            if arr.ndim != 1:
                raise ValueError(f"TrainBatch.{name} must be 1-D, got shape {arr.shape}")
            setattr(self, name, arr)
        num_tokens = len(self.input_ids)
        num_samples = len(self.seq_lens)
        if self.routed_experts is not None:
            self.routed_experts = compact_routes(self.routed_experts)
            if self.routed_experts.ndim != 2 or len(self.routed_experts) != len(self.input_ids):
                raise ValueError(
                    f"TrainBatch.routed_experts must be [tokens, layers*k] for {len(self.input_ids)} tokens, "
                    f"got shape {self.routed_experts.shape}"
                )
        for name, _ in _TOKEN_FIELDS:
            arr = getattr(self, name)
            if arr is not None and len(arr) != num_tokens:
                raise ValueError(f"TrainBatch.{name} has {len(arr)} tokens, input_ids has {num_tokens}")
        for name, _ in _SAMPLE_FIELDS:
            if len(getattr(self, name)) != num_samples:
                raise ValueError(
                    f"TrainBatch.{name} has {len(getattr(self, name))} samples, seq_lens has {num_samples}"
                )
        if len(self.env_names) != num_samples:
            raise ValueError(
                f"TrainBatch.env_names has {len(self.env_names)} samples, expected {num_samples}"
            )
        if int(self.seq_lens.sum(dtype=np.int64)) != num_tokens:
            raise ValueError(f"TrainBatch.seq_lens sums to {int(self.seq_lens.sum())}, expected {num_tokens}")
        if num_samples and int(self.seq_lens.min()) <= 0:
            raise ValueError("TrainBatch.seq_lens must be positive")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"TrainBatch.rank {self.rank} outside world_size {self.world_size}")
        if self.step < 0:
            raise ValueError(f"TrainBatch.step must be >= 0, got {self.step}")
        if self.images is not None and len(self.images.images_per_sample) != num_samples:
            raise ValueError(
                f"TrainBatch.images has {len(self.images.images_per_sample)} samples, expected {num_samples}"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_samples(self) -> int:
        return len(self.seq_lens)

    @property
    def num_loss_tokens(self) -> int:
        """Loss tokens of this rank (compare `total_loss_tokens`, which spans every rank)."""
        return int(np.count_nonzero(self.loss_mask))

    def route_ids(self) -> np.ndarray:
        """routed_experts as int64 with -1 where a token has no route."""
        assert self.routed_experts is not None
        r = self.routed_experts.astype(np.int64)
        if self.routed_experts.dtype == np.uint8:
            r[r == 255] = -1
        return r

    def sample_offsets(self) -> np.ndarray:
        """int64 [S+1]: sample i occupies tokens offsets[i]:offsets[i+1]."""
        out = np.zeros(len(self.seq_lens) + 1, dtype=np.int64)
        np.cumsum(self.seq_lens, out=out[1:])
        return out


def compact_routes(routes: Any) -> np.ndarray:
    """Expert ids (-1 = none) in the smallest wire dtype: uint8 with 255 = none when every id < 255
    (up to 254 experts), else int16. Arrays already uint8 (decoded from the wire) stay as they are."""
    arr = np.asarray(routes)
    if arr.dtype == np.uint8:
        return arr
    arr = arr.astype(np.int16, copy=False)
    if arr.size == 0 or int(arr.max()) < 255:
        return np.where(arr < 0, 255, arr).astype(np.uint8)
    return arr


_TOKEN_FIELDS: tuple[tuple[str, Any], ...] = (
    ("input_ids", np.int32),
    ("position_ids", np.int32),
    ("loss_mask", np.bool_),
    ("advantages", np.float32),
    ("inference_logprobs", np.float32),
    ("teacher_logprobs", np.float32),
    ("reference_logprobs", np.float32),
    ("ce_weights", np.float32),
)
_SAMPLE_FIELDS: tuple[tuple[str, Any], ...] = (
    ("seq_lens", np.int32),
    ("policy_versions", np.int32),
    ("temperatures", np.float32),
    ("example_ids", np.int64),
    ("rewards", np.float32),
)


# LoRA RL: the name every server holds the policy's adapter under (each step replaces it in place).
# vLLM applies an adapter only to requests naming it, so the orchestrator's requests then say this name;
# vLLM refuses an adapter named like a served base model (e.g. `--served-model-name policy`).
ADAPTER_NAME = "policy-lora"


class PolicyReady(msgspec.Struct, kw_only=True):
    """Trainer -> orchestrator: the weights of policy `step` are ready to be loaded."""

    step: int
    transport: Literal["collective", "filesystem"]
    path: str | None = None  # weights dir, required for the filesystem transport
    checksum: str
    # LoRA runs: only the adapter travels and `checksum` is over its tensors. Filesystem: `path` holds it
    # (peft format: adapter_model.safetensors + adapter_config.json), servers load it with
    # /load_lora_adapter. Collective: the broadcast header says "adapter" and /update_weights merges it.
    adapter: bool = False
    num_params: int
    num_bytes: int
    # A delta sync (hpcrl.weights.delta) applies on top of policy `base_step`; None: the full weights.
    # `checksum` is always that of the FULL new weights, whatever was sent.
    base_step: int | None = None
    sync_bytes: int | None = None  # bytes actually sent (full: num_bytes); None in older files
    created_at: float = msgspec.field(default_factory=_now)

    def __post_init__(self) -> None:
        if self.base_step is not None and not 0 <= self.base_step < self.step:
            raise ValueError(
                f"PolicyReady.base_step must be in [0, step), got {self.base_step} for step {self.step}"
            )
        if self.transport == "filesystem" and not self.path:
            raise ValueError("PolicyReady.path is required when transport is 'filesystem'")
        if self.transport not in ("collective", "filesystem"):
            raise ValueError(
                f"PolicyReady.transport must be 'collective' or 'filesystem', got {self.transport!r}"
            )


class Shutdown(msgspec.Struct, kw_only=True):
    """Control: every role should stop cleanly. Never consumed, so every role sees it."""

    reason: str
    origin: str  # e.g. "orchestrator", "trainer_0", "launcher"
    created_at: float = msgspec.field(default_factory=_now)


class SlurmTask(msgspec.Struct, kw_only=True, frozen=True):
    """Where a process runs inside a SLURM job: what reaches it from another node of the job.

    `job_id` is SLURM_JOB_ID (a hetjob's leader: `srun --jobid` takes it, with `het_group`);
    `step` is `<component job id>.<step id>` (what `scancel` takes: a hetjob component has its own
    job id, SLURM_JOB_ID_HET_GROUP_<i>); `step_tasks` counts the tasks sharing that step; `supervised`:
    a supervisor in the same step restarts the process (hpcrl.launch.keepalive), so ending the step
    would end the supervisor too."""

    job_id: str
    step: str
    node: str
    het_group: int | None = None
    step_tasks: int = 1
    supervised: bool = False

    @classmethod
    def from_env(cls, env: Any) -> SlurmTask | None:
        """The task this environment belongs to; None outside a SLURM step."""
        job, step, node = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID"), env.get("SLURMD_NODENAME")
        if not (job and step and node):
            return None
        group = env.get("HPCRL_COMPONENT_INDEX") if env.get("SLURM_HET_SIZE") else None
        het_group = int(group) if group not in (None, "") else None
        step_job = env.get(f"SLURM_JOB_ID_HET_GROUP_{het_group}", job) if het_group is not None else job
        return cls(
            job_id=job,
            step=f"{step_job}.{step}",
            node=node,
            het_group=het_group,
            step_tasks=int(env.get("SLURM_STEP_NUM_TASKS") or 1),
            supervised=env.get("HPCRL_SUPERVISED") == "1",
        )


class ServerInfo(msgspec.Struct, kw_only=True):
    """Inference server address announcement (written as JSON to RunPaths.server_file(index))."""

    index: int
    base_url: str
    host: str
    port: int
    pid: int
    model: str
    # Processes of this server that join the collective weight group (hpcrl.weights.rendezvous):
    # vLLM runs one worker per tensor-/pipeline-parallel rank and each one receives; the embedded hf
    # engine receives once however many GPUs it spans. Files written before this field read as 1.
    weight_receivers: int = 1
    created_at: float = msgspec.field(default_factory=_now)
    # Its SLURM task when it runs under srun (None elsewhere): a server frozen on another node is
    # ended through SLURM (hpcrl.orchestrator.server_end).
    slurm: SlurmTask | None = None

    def __post_init__(self) -> None:
        if self.weight_receivers < 1:
            raise ValueError(f"ServerInfo.weight_receivers must be >= 1, got {self.weight_receivers}")


class WeightGroupAddress(msgspec.Struct, kw_only=True):
    """The weight-broadcast group trainer rank 0 hosts (JSON in RunPaths.endpoint_file("weights")).

    The layout it was sized for travels with it, so whoever joins servers to it can check that the
    servers it sees are the ones the group counts: server `server_indices[i]` brings `receivers[i]`
    ranks after the `senders` trainer ranks (group ranks 0..senders-1), and
    world_size = senders + sum(receivers).
    """

    host: str
    port: int
    world_size: int
    server_indices: list[int]
    receivers: list[int]
    senders: int = 1  # trainer ranks in the group: every one sends its own pieces
    created_at: float = msgspec.field(default_factory=_now)

    def __post_init__(self) -> None:
        if len(self.server_indices) != len(self.receivers):
            raise ValueError("WeightGroupAddress: server_indices and receivers differ in length")
        if self.senders < 1:
            raise ValueError(f"WeightGroupAddress.senders must be >= 1, got {self.senders}")
        if self.world_size != self.senders + sum(self.receivers):
            raise ValueError(
                f"WeightGroupAddress.world_size {self.world_size} != senders + sum(receivers) "
                f"= {self.senders + sum(self.receivers)}"
            )


class Endpoint(msgspec.Struct, kw_only=True):
    """Doorbell address of one listening bus (JSON in RunPaths.endpoint_file(name))."""

    name: str
    address: str  # tcp://host:port
    pid: int
    hostname: str
    nonce: str  # tells a restarted reader's file apart from its predecessor's
    created_at: float = msgspec.field(default_factory=_now)


class Ring(msgspec.Struct, array_like=True):
    """Doorbell payload: 'a file for (topic, step, rank) was just renamed into place'. A hint only."""

    topic: str  # "rollouts" | "policy" | "control"
    step: int = -1
    rank: int = 0
    sent_at: float = 0.0


Message = TrainBatch | PolicyReady | Shutdown | ServerInfo
M = TypeVar("M", TrainBatch, PolicyReady, Shutdown, ServerInfo)

# Type tags are part of the file format: never renumber, only append.
MESSAGE_TAGS: dict[type, int] = {TrainBatch: 1, PolicyReady: 2, Shutdown: 3, ServerInfo: 4}
_TYPE_OF_TAG = {tag: cls for cls, tag in MESSAGE_TAGS.items()}


# ------------------------------------------------------------------------------------------------
# Checksums
# ------------------------------------------------------------------------------------------------
def _xxhash():
    try:
        import xxhash  # a dependency of wandb; ~6x faster than crc32 on 64 MiB
    except ImportError:
        return None
    return xxhash


DEFAULT_CHECKSUM = "xxh3" if _xxhash() is not None else "crc32"


def _checksum(algo: int, parts: list) -> int:
    if algo == XXH3_64:
        xxhash = _xxhash()
        if xxhash is None:
            raise CorruptMessageError("written with xxh3 checksums but the xxhash package is not installed")
        h = xxhash.xxh3_64()
        for p in parts:
            h.update(p)
        return h.intdigest()
    if algo == CRC32:
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        return crc
    raise CorruptMessageError(f"unknown checksum algorithm id {algo}")


# ------------------------------------------------------------------------------------------------
# Codec
# ------------------------------------------------------------------------------------------------
def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _wire_array(obj: np.ndarray) -> np.ndarray:
    if obj.dtype.kind not in _ALLOWED_KINDS:
        raise ValueError(f"bus arrays must be bool/int/uint/float, got dtype {obj.dtype}")
    return np.ascontiguousarray(obj)


def encode_parts(msg: Message, *, checksum: str = DEFAULT_CHECKSUM) -> list:
    """The frame of `msg` as a list of buffers (header first), ready for a vectored write.

    Array parts are views of the caller's arrays: nothing large is copied.
    """
    tag = MESSAGE_TAGS.get(type(msg))
    if tag is None:
        raise ValueError(
            f"{type(msg).__name__} is not a bus message type ({', '.join(c.__name__ for c in MESSAGE_TAGS)})"
        )
    algo = _ALGO_NAMES.get(checksum)
    if algo is None:
        raise ValueError(f"checksum must be one of {sorted(_ALGO_NAMES)}, got {checksum!r}")
    arrays: list[tuple[int, np.ndarray]] = []
    blob_len = 0

    def enc_hook(obj: Any) -> Any:
        nonlocal blob_len
        if isinstance(obj, np.ndarray):
            arr = _wire_array(obj)
            offset = _align(blob_len)
            arrays.append((offset, arr))
            blob_len = offset + arr.nbytes
            return [arr.dtype.str, list(arr.shape), offset, arr.nbytes]
        if isinstance(obj, np.generic):  # numpy scalars in int/float fields
            return obj.item()
        raise NotImplementedError(f"cannot put {type(obj).__name__} on the bus")

    meta = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode(msg)
    blob_off = _align(HEADER_SIZE + len(meta))
    body: list = [meta, bytes(blob_off - HEADER_SIZE - len(meta))]
    pos = 0
    for offset, arr in arrays:
        if offset > pos:
            body.append(bytes(offset - pos))
        if arr.nbytes:
            body.append(memoryview(arr.reshape(-1).view(np.uint8)))
        pos = offset + arr.nbytes
    assert pos == blob_len
    header = bytearray(HEADER_SIZE)
    HEADER.pack_into(
        header, 0, MAGIC, SCHEMA_VERSION, tag, algo, 0, 0, len(meta), blob_len, _checksum(algo, body), 0
    )
    struct.pack_into("<I", header, _HEADER_CRC_SPAN, zlib.crc32(memoryview(header)[:_HEADER_CRC_SPAN]))
    return [bytes(header), *body]


def encode(msg: Message, *, checksum: str = DEFAULT_CHECKSUM) -> bytes:
    """`msg` as one framed byte string (the exact bytes a bus file holds)."""
    return b"".join(encode_parts(msg, checksum=checksum))


def peek_type(buf: Any) -> type:
    """The message type named by a frame's header (checks magic and header crc only)."""
    return _parse_header(_as_bytes_view(buf))[1]


def decode(buf: Any, type: type[M] | None = None) -> M:
    """Decode one frame. Arrays are zero-copy views into `buf` (writable iff `buf` is).

    Raises CorruptMessageError (without a path) for anything truncated, flipped, foreign, of a
    newer schema, or of another type than `type`.
    """
    mv = _as_bytes_view(buf)
    (meta_len, blob_len, algo, checksum), cls = _parse_header(mv)
    if type is not None and cls is not type:
        raise CorruptMessageError(f"holds a {cls.__name__}, expected a {type.__name__}")
    blob_off = _align(HEADER_SIZE + meta_len)
    total = blob_off + blob_len
    if len(mv) != total:
        what = "truncated" if len(mv) < total else "has trailing bytes"
        raise CorruptMessageError(f"{what}: header says {total} bytes, got {len(mv)}")
    if _checksum(algo, [mv[HEADER_SIZE:]]) != checksum:
        raise CorruptMessageError("payload checksum mismatch (bit flip or torn write)")
    blob = mv[blob_off:]

    def dec_hook(tp: Any, obj: Any) -> Any:
        if tp is np.ndarray:
            return _array_from_wire(obj, blob)
        raise NotImplementedError(f"no decoder for {tp}")

    try:
        return msgspec.msgpack.Decoder(cls, dec_hook=dec_hook).decode(
            mv[HEADER_SIZE : HEADER_SIZE + meta_len]
        )
    except msgspec.DecodeError as e:
        raise CorruptMessageError(f"invalid {cls.__name__}: {e}") from None


def _as_bytes_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _parse_header(mv: memoryview) -> tuple[tuple[int, int, int, int], type]:
    if len(mv) < HEADER_SIZE:
        raise CorruptMessageError(f"truncated: {len(mv)} bytes, the header alone is {HEADER_SIZE}")
    magic, version, tag, algo, _flags, _reserved, meta_len, blob_len, checksum, header_crc = (
        HEADER.unpack_from(mv)
    )
    if magic != MAGIC:
        raise CorruptMessageError(f"not a bus file (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if zlib.crc32(mv[:_HEADER_CRC_SPAN]) != header_crc:
        raise CorruptMessageError("header checksum mismatch")
    if version != SCHEMA_VERSION:
        raise CorruptMessageError(f"schema version {version}, this build reads version {SCHEMA_VERSION}")
    cls = _TYPE_OF_TAG.get(tag)
    if cls is None:
        raise CorruptMessageError(f"unknown message type tag {tag}")
    return (meta_len, blob_len, algo, checksum), cls


def _array_from_wire(obj: Any, blob: memoryview) -> np.ndarray:
    # Every check raises ValueError, which msgspec reports (with the field path) as a ValidationError.
    if not (isinstance(obj, list) and len(obj) == 4):
        raise ValueError("array must be [dtype, shape, offset, nbytes]")
    dtype_str, shape, offset, nbytes = obj
    try:
        dtype = np.dtype(dtype_str)
    except TypeError:
        raise ValueError(f"bad dtype {dtype_str!r}") from None
    if dtype.kind not in _ALLOWED_KINDS or dtype.fields is not None:
        raise ValueError(f"dtype {dtype_str!r} not allowed on the bus")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"bad shape {shape!r}")
    count = 1
    for d in shape:
        count *= d
    if not (isinstance(offset, int) and isinstance(nbytes, int)) or nbytes != count * dtype.itemsize:
        raise ValueError(f"nbytes {nbytes!r} does not match shape {shape} of {dtype}")
    if count == 0:
        return np.empty(shape, dtype=dtype)
    if offset < 0 or offset % ALIGN or offset + nbytes > len(blob):
        raise ValueError(f"array bytes [{offset}, {offset + nbytes}) outside the {len(blob)}-byte blob")
    return np.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(shape)


# ------------------------------------------------------------------------------------------------
# JSON side files (endpoint and server addresses: small, human-readable)
# ------------------------------------------------------------------------------------------------
def encode_json(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg) + b"\n"


def decode_json(buf: bytes, type: type[M] | type[Endpoint] | type[WeightGroupAddress]) -> Any:
    try:
        return msgspec.json.decode(buf, type=type)
    except msgspec.DecodeError as e:
        raise CorruptMessageError(f"invalid {type.__name__} JSON: {e}") from None


__all__ = [
    "DEFAULT_CHECKSUM",
    "HEADER_SIZE",
    "MESSAGE_TAGS",
    "SCHEMA_VERSION",
    "Endpoint",
    "Message",
    "PolicyReady",
    "Ring",
    "ServerInfo",
    "Shutdown",
    "SlurmTask",
    "TrainBatch",
    "WeightGroupAddress",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
    "encode_parts",
    "peek_type",
]

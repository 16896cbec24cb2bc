"""Every byte that crosses a process boundary: versioned msgspec Structs, decoded in two steps (header first)."""

from __future__ import annotations

import enum
import hashlib
import hmac

import msgspec

from kv_connectors.compatinfo import WIRE_VERSION as WIRE_VERSION  # re-exported: peers import them from here
from kv_connectors.compatinfo import CompatInfo as CompatInfo
from kv_connectors.counters import Counters
from kv_connectors.errors import HandshakeError, IncompatiblePeerError, UnauthenticatedPeerError
from kv_connectors.layout import Cells, KVLayout, Part, Region

MAX_ADDRESS = 2**63  # planned addresses are int64
_MAX_HEADS = 2**16  # KV heads a peer may claim to hold (head indices are planned as int64)


class Header(msgspec.Struct, frozen=True, array_like=True):
    """Decoded first: version and compatibility are checked before the body is touched."""

    wire_version: int
    compat_hash: str
    kind: str


class RegionMsg(msgspec.Struct, frozen=True, array_like=True):
    base: int
    block_stride: int
    seg_len: int


class PartMsg(msgspec.Struct, frozen=True, array_like=True):
    offset: int
    rows: int
    row_stride: int
    token_stride: int
    cell_bytes: int


class CellsMsg(msgspec.Struct, frozen=True, array_like=True):
    heads: int
    head_stride: int
    tokens: int
    parts: list[PartMsg]
    first_head: int
    token_addressable: bool


_MAX_PARTS = 4  # K, V, or both: a peer's cells hold no more
_MAX_ROWS = 2**16  # rows of a part (head_size at most, for a transposed K)


class LayoutMsg(msgspec.Struct, frozen=True):
    num_blocks: int
    block_size: int
    regions: list[RegionMsg]
    cells: CellsMsg | None = None  # the blocks' tokens and heads, where the sender could tell them

    @classmethod
    def from_layout(cls, layout: KVLayout) -> LayoutMsg:
        c = layout.cells
        cells = None
        if c is not None:
            parts = [PartMsg(p.offset, p.rows, p.row_stride, p.token_stride, p.cell_bytes) for p in c.parts]
            cells = CellsMsg(c.heads, c.head_stride, c.tokens, parts, c.first_head, c.token_addressable)
        return cls(
            layout.num_blocks, layout.block_size, [RegionMsg(r.base, r.block_stride, r.seg_len) for r in layout.regions], cells
        )

    def _cells(self) -> Cells | None:
        """The peer's cells, checked: every cell of a block lies inside the block's segment."""
        m = self.cells
        if m is None:
            return None
        parts = tuple(Part(p.offset, p.rows, p.row_stride, p.token_stride, p.cell_bytes) for p in m.parts)
        bad = (
            m.heads < 1
            or m.first_head < 0
            or m.first_head + m.heads > _MAX_HEADS
            or m.head_stride < 0
            or m.tokens != self.block_size
            or not 1 <= len(parts) <= _MAX_PARTS
            or any(
                p.offset < 0 or not 1 <= p.rows <= _MAX_ROWS or p.row_stride < 0 or p.token_stride < 1 or p.cell_bytes < 1
                for p in parts
            )
        )
        if not bad:
            c = Cells(m.heads, m.head_stride, m.tokens, parts, m.first_head, m.token_addressable)
            if all(c.extent <= r.seg_len for r in self.regions):
                return c
        raise HandshakeError(f"peer advertised invalid KV cells {m} for {self.block_size}-token blocks")

    def to_layout(self) -> KVLayout:
        """The peer's layout, checked: addresses a peer advertises are used to plan transfers."""
        if self.num_blocks < 1 or self.block_size < 1 or not self.regions:
            raise HandshakeError(f"peer advertised an empty KV layout ({self.num_blocks} blocks, {len(self.regions)} regions)")
        for r in self.regions:
            if (
                r.base < 0
                or r.seg_len < 1
                or r.block_stride < r.seg_len
                or (r.base + (self.num_blocks - 1) * r.block_stride + r.seg_len >= MAX_ADDRESS)
            ):
                raise HandshakeError(
                    f"peer advertised an invalid KV region (base {r.base}, stride "
                    f"{r.block_stride}, segment {r.seg_len}, {self.num_blocks} blocks)"
                )
        regions = tuple(Region(r.base, r.block_stride, r.seg_len, self.num_blocks) for r in self.regions)
        return KVLayout(self.num_blocks, self.block_size, regions, self._cells())


class HandshakeRequest(msgspec.Struct, frozen=True, tag="handshake"):
    """D -> P. D also describes itself so that P can connect back (push writes, staged replies)."""

    engine_id: str
    rank: int
    compat: CompatInfo
    agent_name: str = ""
    agent_metadata: bytes = b""
    layout: LayoutMsg | None = None
    tp_size: int = 1  # D's tensor-parallel size; D rank r hand-shakes with P rank r
    # D rank's own side-channel address ("host:port"): a new agent hand-shaking from it replaces the
    # previous one (that process is gone: its port is the new one's), so P keeps one entry per D rank
    address: str = ""


class HandshakeReply(msgspec.Struct, frozen=True, tag="handshake_reply"):
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: LayoutMsg
    epoch: str = ""  # new for every start of the producer: a restarted peer is a new peer
    rank: int = 0  # the producer's tensor-parallel rank and size (D checks it reached its own rank)
    tp_size: int = 1
    # Where the producer's lease words live in its registered memory (kv_connectors.fence): one
    # 64-bit word per block from this address; 0: none (D claims every read).
    lease_words: int = 0


class StatsRequest(msgspec.Struct, frozen=True, tag="stats"):
    pass


class StatsReply(Counters, frozen=True, tag="stats_reply", kw_only=True):
    """The engine's counters (fields: `counters.Counters`, one definition) and whose they are."""

    engine_id: str
    rank: int = 0  # the answering worker's tensor-parallel rank and size (any rank answers: a D
    tp_size: int = 1  # that does not know P's TP size asks P's rank 0 this way)
    ranks: tuple[str, ...] = ()  # each rank's side channel by rank ("host:port"); (): at port + rank


class ErrorCode(str, enum.Enum):
    """Why a side-channel server refused a request (encoded as its value: the strings peers always sent)."""

    INCOMPATIBLE = "incompatible"  # another model, layout, transport or wire version
    BAD_REQUEST = "bad_request"  # malformed, unexpected or unacceptable request
    NOT_READY = "not_ready"  # the KV cache is not registered yet
    UNAUTHENTICATED = "unauthenticated"  # missing or wrong MAC (answered unsealed)
    INTERNAL = "internal"  # the handler failed (a bug on the server)


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    code: ErrorCode
    message: str


class PushRequest(msgspec.Struct, frozen=True, tag="push"):
    """D -> P (push mode): write your blocks of producer_request_id into my block_ids.

    P writes the tail of its blocks (D's own prefix-cache hits are not sent); empty block_ids
    only releases P's blocks. P answers with PushAck, then a TransferDone(consumer_request_id)
    notification reaches D when the data is in place.
    """

    producer_request_id: str
    consumer_engine_id: str
    consumer_agent: str
    consumer_request_id: str
    block_ids: list[int]
    consumer_rank: int = 0  # D's tensor-parallel rank (P frees its blocks once every reader is written)
    # The prompt tokens [first_token, first_token + num_tokens) D loads, block_ids[0] beginning at
    # consumer_first_token: P maps them token by token where its block size differs from D's.
    first_token: int = 0
    num_tokens: int = 0
    consumer_first_token: int = 0
    # params.prompt_digest of D's prompt tokens P's KV is to cover (all of them in the transfer-id
    # flow): P refuses to write another prompt's KV, e.g. under a transfer id a router reused.
    prompt_digest: str = ""
    attempt: str = ""  # names this request (unique per D task): an AbortPush for it refuses it at P for good
    budget_s: float = 0.0  # how long D waits for the write from P's answer on (0: P's own timeout)
    # A hybrid model's D: its block_ids per KV cache group, side by side (P pairs its own group by group);
    # [] for one group.
    group_sizes: list[int] = []


class AbortPush(msgspec.Struct, frozen=True, tag="abort_push"):
    """D -> P: D gives up on a push request (any copy of it, arrived or still to come). P never
    starts a write for it from now on, and answers `PushSettled(settled=True)` once no write of it
    is in flight; until then D keeps the blocks from vLLM and asks again."""

    producer_request_id: str
    consumer_agent: str
    consumer_request_id: str
    attempt: str


class PushSettled(msgspec.Struct, frozen=True, tag="push_settled"):
    settled: bool  # no write of the aborted request is in flight at P, and none can start
    epoch: str = ""  # the answering producer process


class ClaimItem(msgspec.Struct, frozen=True, array_like=True):
    key: str  # what P holds the blocks under: its request id or the transfer id
    block_ids: list[int]  # P's blocks the consumer reads


class ClaimRequest(msgspec.Struct, frozen=True, tag="claim"):
    """D -> P (pull): the fence. D reads P's blocks only under leases P confirms live; P holds each
    granted lease for D until D's notice or hold_s from now, and refuses leases that already ended."""

    consumer_engine_id: str
    items: list[ClaimItem]
    epoch: str = ""  # the producer's epoch from the handshake D's read descriptors came from
    consumer_rank: int = 0  # D's tensor-parallel rank: each rank reading P's blocks claims them


class ClaimResult(enum.Enum):
    """P's answer to a consumer that is about to read (or has just read) a lease's blocks: a ClaimReply
    carries each as its value."""

    GRANTED = "granted"  # live: held for the consumer until its claim deadline
    PENDING = "pending"  # not known yet (P's worker has not stepped since the prefill finished): ask again
    GONE = "gone"  # expired or released: the blocks may hold another prompt's KV now
    MISMATCH = "mismatch"  # the lease does not hold the blocks the consumer names


class ClaimReply(msgspec.Struct, frozen=True, tag="claim_reply"):
    results: list[str]  # ClaimResult values, one per item, in order
    reasons: list[str]
    hold_s: float  # how long from P's receipt a granted claim holds the blocks
    epoch: str = ""  # the producer's: differs from the handshake's when it restarted since


class RenewRequest(msgspec.Struct, frozen=True, tag="renew"):
    """D -> P (heartbeat): these requests still wait in D's queue; keep their leases alive."""

    consumer_engine_id: str
    keys: list[str]


class RenewReply(msgspec.Struct, frozen=True, tag="renew_reply"):
    known: list[bool]  # per key: a live lease was extended
    lease_s: float  # P's lease: renew well within it


class PushAck(msgspec.Struct, frozen=True, tag="push_ack"):
    accepted: bool
    message: str = ""
    epoch: str = ""  # the answering producer process: D hand-shakes again with a new one


class TransferDone(msgspec.Struct, frozen=True, tag="done"):
    """Notification. D -> P (pull): the blocks of P's request are no longer needed (read, or
    abandoned). P -> D (push): D's request's blocks are written, or error says why not."""

    request_id: str
    engine_id: str
    error: str = ""
    runs: int = 0  # push: descriptors (coalesced runs) P wrote
    rank: int = 0  # the sender's tensor-parallel rank (P frees blocks once every reading D rank is done)
    attempt: str = ""  # push: the PushRequest.attempt this answers (a notice of another attempt is not ours)


Body = (
    HandshakeRequest
    | HandshakeReply
    | StatsRequest
    | StatsReply
    | ErrorReply
    | PushRequest
    | PushAck
    | TransferDone
    | ClaimRequest
    | ClaimReply
    | RenewRequest
    | RenewReply
    | AbortPush
    | PushSettled
)

# Message kinds that carry no compatibility check (monitoring tools do not know the hash).
UNCHECKED = frozenset({"stats", "stats_reply", "error"})
# A server checks every request's hash but a handshake's, whose CompatInfo it compares field by field.
SERVER_UNCHECKED = UNCHECKED | {"handshake"}

_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(tuple[Header, msgspec.Raw])
_body_decoder = msgspec.msgpack.Decoder(Body)


MAC_MAGIC = b"KVCMAC1\x00"  # a sealed frame: magic, HMAC-SHA256 of the frame, the frame
MAC_LEN = 32


def seal(frame: bytes, secret: bytes | None) -> bytes:
    """Authenticate a side-channel frame with the shared secret (no-op without one).

    Integrity and origin only: frames are not encrypted, and a captured frame can be replayed
    (each one is idempotent or refused the second time); isolate the network for confidentiality."""
    if not secret:
        return frame
    return MAC_MAGIC + hmac.new(secret, frame, hashlib.sha256).digest() + frame


def unseal(data: bytes, secret: bytes | None) -> bytes:
    """The frame inside a sealed message, checked; UnauthenticatedPeerError if it is not ours."""
    sealed = data.startswith(MAC_MAGIC)
    if not secret:
        if sealed:
            raise UnauthenticatedPeerError(
                "peer authenticates its side-channel messages with a shared secret and we have none: "
                "set side_channel_secret_env on both sides to a variable holding the same secret"
            )
        return data
    if not sealed:
        raise UnauthenticatedPeerError("unauthenticated side-channel message (no MAC; is the peer's secret set?)")
    mac, frame = data[len(MAC_MAGIC) : len(MAC_MAGIC) + MAC_LEN], data[len(MAC_MAGIC) + MAC_LEN :]
    if not hmac.compare_digest(mac, hmac.new(secret, frame, hashlib.sha256).digest()):
        raise UnauthenticatedPeerError("side-channel message with a wrong MAC (the peer has another secret)")
    return frame


def is_stats_request(frame: bytes) -> bool:
    """An unsealed stats query (monitoring tools without the secret may read counters)."""
    try:
        header, _raw = _header_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return header.kind == "stats"


def encode(body: Body, compat_hash: str) -> bytes:
    """One frame: (header, body)."""
    kind = str(type(body).__struct_config__.tag)
    return _encoder.encode((Header(WIRE_VERSION, compat_hash, kind), body))


def decode(frame: bytes, expected_hash: str | None, unchecked: frozenset[str] = UNCHECKED) -> Body:
    """Check version and hash from the header, then decode the body.

    expected_hash None accepts any hash (the receiver checks it itself, e.g. to explain a mismatch);
    kinds in `unchecked` are not hash-checked.
    """
    try:
        header, raw = _header_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandshakeError(f"malformed message: {e}") from e
    if header.wire_version != WIRE_VERSION:
        raise IncompatiblePeerError(
            f"peer speaks wire version {header.wire_version}, we speak {WIRE_VERSION}; "
            "upgrade both sides to the same kv-connectors release"
        )
    if expected_hash is not None and header.kind not in unchecked and header.compat_hash != expected_hash:
        raise IncompatiblePeerError(
            f"peer compatibility hash {header.compat_hash} differs from ours {expected_hash} "
            "(model, dtype, KV layout or block size differ)"
        )
    try:
        body = _body_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandshakeError(f"malformed {header.kind!r} message: {e}") from e
    if type(body).__struct_config__.tag != header.kind:
        raise HandshakeError(f"header kind {header.kind!r} does not match body")
    return body

"""A fuzz of a live server's side channel: random and mutated frames (wrong hash, unknown keys,
impossible ids), then oversize ones, and what came back."""

from __future__ import annotations

import random
import time

import msgspec
import zmq

from kv_connectors import wire


def server_hash(port: int) -> str:
    """Any reply's header carries the server's compatibility hash (as a peer would learn it)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(wire.encode(wire.StatsRequest(), ""))
        assert sock.poll(5000), "side channel did not answer"
        header = msgspec.msgpack.decode(sock.recv(), type=tuple[wire.Header, msgspec.Raw])[0]
        return header.compat_hash
    finally:
        sock.close(0)


def frames(rng: random.Random, good_hash: str, compat: wire.CompatInfo | None) -> list[bytes]:
    def ids() -> list[int]:
        return [rng.choice([0, 1, 2**31, 2**63 - 1, -1, rng.randrange(10**6)]) for _ in range(rng.randrange(8))]

    def key() -> str:
        return rng.choice(["", "x" * 300, f"cmpl-{rng.random()}", "kvc-fuzz"])

    h = rng.choice([good_hash, good_hash, "0" * 32, ""])
    bodies: list[wire.Body] = [
        wire.ClaimRequest(key(), [wire.ClaimItem(key(), ids()) for _ in range(rng.randrange(5))], epoch=rng.choice(["", "stale"])),
        wire.PushRequest(key(), key(), key(), key(), rng.choice([[], ids(), list(range(100_000))])),
        wire.RenewRequest(key(), [key() for _ in range(rng.randrange(5))]),
        wire.StatsRequest(),
        wire.TransferDone(key(), key()),
    ]
    if compat is not None:
        bodies.append(wire.HandshakeRequest(key(), 0, msgspec.structs.replace(compat, num_layers=rng.randrange(9))))
    frame = bytearray(wire.encode(rng.choice(bodies), h))
    mutated = bytearray(frame)
    for _ in range(rng.randrange(1, 5)):
        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
    return [bytes(frame), bytes(mutated), rng.randbytes(rng.randrange(1, 200))]


def fuzz(port: int, rng: random.Random, n: int) -> dict[str, int]:
    """n frames through one DEALER socket (no lock-step), then oversize ones; count what came back."""
    good_hash = server_hash(port)
    compat = wire.CompatInfo(
        architecture="LlamaForCausalLM",
        num_layers=2,
        hidden_size=128,
        num_kv_heads=2,
        head_size=32,
        vocab_size=1024,
        dtype="float32",
        block_size=32,
        layout=(32, 2, 4096),
    )
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sent = answered = 0
    try:
        while sent < n:
            for frame in frames(rng, good_hash, compat):
                sock.send_multipart([b"", frame])
                sent += 1
            while sock.poll(0):
                sock.recv_multipart()
                answered += 1
        deadline = time.monotonic() + 60
        while answered < sent and time.monotonic() < deadline:
            if sock.poll(1000):
                sock.recv_multipart()
                answered += 1
    finally:
        sock.close(0)
    # Oversize frames (beyond side_channel_max_msg_kib): dropped unread, the connection closed.
    for _ in range(3):
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(f"tcp://127.0.0.1:{port}")
        big.send_multipart([b"", b"\x01" * (24 << 20)])
        time.sleep(0.2)
        big.close(0)
    return {"sent": sent, "answered": answered}

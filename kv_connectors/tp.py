"""Tensor parallelism, the one place of its arithmetic and checks: which KV heads a rank holds, which
prefill (P) ranks a decode (D) rank reads its heads from, how many D ranks read one P rank, and
whether a P and a D TP size (or a D rank hand-shaking with a P rank) can be paired at all.

TP sizes come from requests and peers: every size is bounded (MAX_TP_SIZE) before anything is sized
by it. Pure: numbers in, numbers or a refusal out."""

from __future__ import annotations

from kv_connectors.errors import ConfigError, TransferParamsError

MAX_TP_SIZE = 4096  # tensor-parallel sizes a request or a peer may name: larger ones are refused


def _check_tp(*sizes: int) -> None:
    """TP sizes come from requests and peers, and size lists and loops below: bounded first."""
    for tp in sizes:
        if not 1 <= tp <= MAX_TP_SIZE:
            raise ConfigError(f"tensor_parallel_size {tp} is outside 1..{MAX_TP_SIZE}")


def rank_heads(total_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first head, heads) a tensor-parallel rank holds: a slice of total_heads / tp_size heads, or,
    with fewer heads than ranks (GQA replication), one head shared by tp_size / total_heads ranks."""
    _check_tp(tp_size)
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise ConfigError(f"{total_heads} KV heads cannot be split over tensor_parallel_size {tp_size}")
        per = total_heads // tp_size
        return rank * per, per
    if tp_size % total_heads:
        raise ConfigError(f"tensor_parallel_size {tp_size} is not a multiple of the {total_heads} KV heads")
    return rank // (tp_size // total_heads), 1


def source_ranks(total_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """The prefill ranks a decode rank reads its heads from: one per slice of its heads that one
    prefill rank holds (several when P runs more ranks than D; one when D runs as many or more).
    Where P replicates a head over ranks (fewer heads than ranks), D ranks spread over the copies."""
    _check_tp(p_tp, d_tp)
    first, count = rank_heads(total_heads, d_tp, d_rank)
    out: list[int] = []
    for head in range(first, first + count):
        if p_tp <= total_heads:
            p = head // (total_heads // p_tp)
        else:
            copies = p_tp // total_heads
            p = head * copies + d_rank % copies
        if p not in out:
            out.append(p)
    return out


def reader_count(total_heads: int, p_tp: int, d_tp: int, p_rank: int) -> int:
    """How many decode ranks read from prefill rank p_rank (each notifies it once it is done);
    a ConfigError where some prefill rank would never be read (its KV would wait for its lease)."""
    _check_tp(p_tp, d_tp)
    counts = [0] * p_tp
    for d in range(d_tp):
        for p in source_ranks(total_heads, p_tp, d_tp, d):
            counts[p] += 1
    if 0 in counts:
        raise ConfigError(
            f"with {total_heads} KV heads, prefill tensor_parallel_size {p_tp} and decode {d_tp}, prefill "
            f"rank {counts.index(0)}'s KV would never be read (it replicates heads other ranks hold)"
        )
    return counts[p_rank]


def rank_sources(total_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """D's side of a load: the P ranks a decode rank reads: P's rank of its number where P runs the
    same TP size, else those holding its heads (source_ranks)."""
    if p_tp == d_tp:
        return [d_rank]
    return source_ranks(total_heads, p_tp, d_tp, d_rank)


def check_pairing(total_heads: int, p_tp: int, d_tp: int, tells_heads: bool) -> None:
    """D's check of a load from a P of another TP size (a TransferParamsError, which fails the load):
    each D rank loads the heads of each P rank holding some of its own, which needs a layout that
    tells heads apart (tells_heads) and a split where every P rank's KV is read."""
    where = f"prefill tensor_parallel_size {p_tp}, decode {d_tp}"
    if not tells_heads:
        raise TransferParamsError(f"{where}: this instance's KV layout does not tell heads apart (only the same TP size)")
    try:
        reader_count(total_heads, p_tp, d_tp, 0)
    except ConfigError as e:
        raise TransferParamsError(str(e)) from e


def handshake_refusal(total_heads: int, p_rank: int, p_tp: int, d_rank: int, d_tp: int, tell_heads: bool) -> str:
    """P's check of a hand-shaking D rank: why it may not read from this P rank ("" if it may). It
    must hold some of our heads, and both layouts must tell heads apart (tell_heads) where the TP
    sizes differ."""
    if (d_rank, d_tp) == (p_rank, p_tp):
        return ""
    sizes = f"server rank {p_rank} of tensor_parallel_size {p_tp}, client rank {d_rank} of {d_tp}"
    if d_tp == p_tp:
        return f"tensor-parallel ranks differ: {sizes} (each decode rank reads the prefill rank of its number)"
    if not tell_heads:
        return f"tensor parallelism differs ({sizes}) and a KV layout does not tell heads apart"
    try:
        reader_count(total_heads, p_tp, d_tp, p_rank)
        sources = source_ranks(total_heads, p_tp, d_tp, d_rank)
    except ConfigError as e:
        return f"tensor parallelism cannot be mapped ({sizes}): {e}"
    if p_rank not in sources:
        return f"tensor parallelism differs ({sizes}): that decode rank reads prefill ranks {sources}"
    return ""

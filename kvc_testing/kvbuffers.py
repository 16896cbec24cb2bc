"""KV caches for the transport tests, the transport contract suite and the transport benchmarks, and the
checks of the bytes a transfer moved into them.

- The tests' patterned profiles (`Profile`, `make_kv`, `layout_of`, `block_copy`, `storage_digest`,
  `same_bytes`; "mla" and "mla32" are MLA's latent, with cells, `token_copy` their token reference):
  numpy storage arrays of random bits, compared byte for byte against a reference copy.
- The benchmarks' word pattern over vLLM-shaped tensors (`Shape`, `bench_kv`, `fill_pattern`,
  `check_pattern`, `check_tokens`, `check_heads`): every 64-bit word unique, so a destination is
  checked against its source's block ids without a copy of the source.

The peers that hold them (processes, the caller's own side) are in kvc_testing/peers.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kv_connectors.layout import Cells, KVLayout, Part, TensorInfo, build_layout, cells_of_tensor
from kv_connectors.plan import BlockTable


# KV caches (tests) ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Profile:
    """A KV cache of storage arrays of dtype (random bits, compared byte for byte). Array i has its
    blocks on dimension block_dims[i]; where kv_cols[i] is set, only the first kv_cols[i] words of a
    block are KV (the rest is padding that must stay untouched). heads > 0: the layout has cells,
    read from the first array's shape with that many KV heads (cells_of_tensor)."""

    num_blocks: int
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    block_dims: tuple[int, ...]
    kv_cols: tuple[int | None, ...]
    dtype: str = "uint32"
    heads: int = 0


SMALL_BLOCKS = 32  # "small": five regions, packed and padded ones, 512-byte segments
BIG_BLOCKS = 8192  # "big": one region of 4 KiB blocks, 32 MiB (long enough to be killed mid-read)
STAGED_BLOCKS = 320  # "staged": 16 KiB blocks over 4 regions (packed, K/V-split packed, padded)
MLA_LATENT = 576  # MLA's cache: kv_lora_rank 512 + qk_rope_head_dim 64 values per token, no head dimension
MLA_LAYERS = 2
MLA_HEADS = 1  # the latent is one KV head, replicated on every tensor-parallel rank
MLA_BLOCKS = 24  # "mla": (24, 16, 576) float16 per layer, 18 KiB blocks; "mla32": (12, 32, 576), 36 KiB


def _mla(num_blocks: int, block_size: int) -> Profile:
    shape = (num_blocks, block_size, MLA_LATENT)
    return Profile(num_blocks, block_size, (shape,) * MLA_LAYERS, (0,) * MLA_LAYERS, (None,) * MLA_LAYERS, "float16", MLA_HEADS)


PROFILES = {
    "small": Profile(
        SMALL_BLOCKS, 4, ((32, 2, 4, 16), (32, 2, 4, 16), (2, 32, 4, 2, 8), (32, 160)), (0, 0, 1, 0), (None, None, None, 128)
    ),
    "big": Profile(BIG_BLOCKS, 4, ((BIG_BLOCKS, 1024),), (0,), (None,)),
    "staged": Profile(STAGED_BLOCKS, 16, ((320, 2, 8, 64), (2, 320, 1024), (320, 1024 + 64)), (0, 1, 0), (None, None, 1024)),
    "mla": _mla(MLA_BLOCKS, 16),
    "mla32": _mla(MLA_BLOCKS // 2, 32),
}


def make_kv(seed: int, profile: str = "small") -> list[np.ndarray]:
    """Storage arrays filled with a pattern unique to seed (random bits: as floats, some are NaNs)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown KV profile {profile!r}")
    rng = np.random.default_rng(seed)
    prof = PROFILES[profile]
    if prof.dtype == "uint32":
        return [rng.integers(0, 2**32, size=s, dtype=np.uint32) for s in prof.shapes]
    size = np.dtype(prof.dtype).itemsize
    return [rng.integers(0, 256, size=int(np.prod(s)) * size, dtype=np.uint8).view(prof.dtype).reshape(s) for s in prof.shapes]


def profile_of(storage: Sequence[Any]) -> Profile:
    shapes = tuple(tuple(a.shape) for a in storage)
    for prof in PROFILES.values():
        if prof.shapes == shapes:
            return prof
    raise ValueError(f"storage of shapes {shapes} matches no KV profile")


def kv_views(storage: Sequence[Any]) -> list[Any]:
    """The KV tensors of the layout (numpy or torch); a padded tensor is a strided view of its storage."""
    return [a if cols is None else a[:, :cols] for a, cols in zip(storage, profile_of(storage).kv_cols)]


def _info(name: str, v: Any) -> TensorInfo:
    if isinstance(v, np.ndarray):
        return TensorInfo(name, v.ctypes.data, tuple(v.shape), tuple(s // v.itemsize for s in v.strides), v.itemsize)
    return TensorInfo(name, v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.element_size())


def layout_of(storage: Sequence[Any]) -> KVLayout:
    """The layout of a profile's storage arrays, numpy (host) or torch (any device); with the
    profile's cells where it names its heads (one rank's, from head 0: MLA's latent on every rank)."""
    prof = profile_of(storage)
    infos = [_info(f"t{i}", v) for i, v in enumerate(kv_views(storage))]
    layout = build_layout(infos, prof.num_blocks, block_size=prof.block_size)
    if not prof.heads:
        return layout
    return dataclasses.replace(layout, cells=cells_of_tensor(infos[0], prof.num_blocks, prof.block_size, prof.heads))


def block_copy(dst: Sequence[np.ndarray], src: Sequence[np.ndarray], src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Reference copy (in place on dst): what a transfer of src_ids -> dst_ids must produce."""
    s, d = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    prof = profile_of(dst)
    for i, (dim, cols) in enumerate(zip(prof.block_dims, prof.kv_cols)):
        tail = () if cols is None else (slice(0, cols),)  # padding is not part of the KV
        dst[i][(slice(None),) * dim + (d,) + tail] = src[i][(slice(None),) * dim + (s,) + tail]


def token_copy(
    dst: Sequence[np.ndarray], src: Sequence[np.ndarray], src_table: BlockTable, dst_table: BlockTable, first: int, count: int
) -> None:
    """Reference copy (in place on dst) for token-major profiles (blocks on dim 0, tokens on dim 1,
    every array: MLA): tokens [first, first + count) of a sequence from src's blocks (src_table) to
    dst's, a numpy gather, each side on its own block size (the arrays' dim 1)."""
    tokens = np.arange(first, first + count, dtype=np.int64)
    for d, s in zip(dst, src):
        s_blk, s_slot = np.divmod(tokens - src_table.first_token, s.shape[1])
        d_blk, d_slot = np.divmod(tokens - dst_table.first_token, d.shape[1])
        d[np.asarray(dst_table.ids)[d_blk], d_slot] = s[np.asarray(src_table.ids)[s_blk], s_slot]


def same_bytes(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether two lists of storage arrays hold the same bytes (floats compared as bits: NaNs too)."""
    return len(a) == len(b) and all(x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def storage_digest(storage: Sequence[np.ndarray]) -> str:
    """SHA-256 of all storage bytes, in order (what a peer had when a notification arrived)."""
    h = hashlib.sha256()
    for a in storage:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# KV caches (benchmarks) ----------------------------------------------------------------------
KV_HEADS = 2
HEAD_DIM_X2 = 64  # K and V fused in the last dim, as vLLM's CPU layout (num_blocks, heads, block_size, 2*head)
F32 = 4
SENTINEL = -0x2152411021524111  # 0xDEADBEEFDEADBEEF as int64: "not copied"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A KV cache of `layers` tensors (num_blocks, heads, block_size, HEAD_DIM_X2) float32: a
    tensor-parallel rank holding `heads` of the model's KV heads from first_head on."""

    size_mib: int
    block_kib: int
    layers: int
    heads: int = KV_HEADS
    first_head: int = 0

    @property
    def block_size(self) -> int:  # tokens per block giving block_kib KiB per layer segment
        return self.block_kib * 1024 // (self.heads * HEAD_DIM_X2 * F32)

    @property
    def num_blocks(self) -> int:
        return self.size_mib * 1024 // (self.block_kib * self.layers)

    def cells(self) -> Cells:
        """vLLM's CPU layout ("vec" kernels): per head, K transposed, then V token by token."""
        head = HEAD_DIM_X2 // 2
        k = Part(0, head, self.block_size * F32, F32, F32)
        v = Part(self.block_size * head * F32, 1, 0, head * F32, head * F32)
        return Cells(self.heads, 2 * self.block_size * head * F32, self.block_size, (k, v), self.first_head)

    @property
    def words_per_block(self) -> int:  # 64-bit words in one block segment
        return self.block_kib * 1024 // 8

    def check(self) -> None:
        if self.block_kib * 1024 % (self.heads * HEAD_DIM_X2 * F32) or self.block_size < 1:
            raise SystemExit(f"--block-kib must be a multiple of {self.heads * HEAD_DIM_X2 * F32 / 1024:g} KiB")
        if self.num_blocks < 1 or self.num_blocks * self.block_kib * self.layers != self.size_mib * 1024:
            raise SystemExit("--size-mib must be a multiple of --block-kib x --layers")


def bench_kv(shape: Shape, device: str = "cpu", fill: str = "") -> list[Any]:
    """The benchmark KV cache as torch tensors on device; fill "pattern", "sentinel" or "" (as allocated)."""
    import torch

    kv = [
        torch.empty((shape.num_blocks, shape.heads, shape.block_size, HEAD_DIM_X2), dtype=torch.float32, device=device)
        for _ in range(shape.layers)
    ]
    if fill == "pattern":
        fill_pattern(kv)
    elif fill == "sentinel":
        fill_sentinel(kv)
    elif fill:
        raise ValueError(f"unknown fill {fill!r}")
    return kv


def words(t: Any) -> Any:
    """A layer tensor as (num_blocks, words_per_block) int64: pattern and checks ignore floats."""
    import torch

    return t.view(t.shape[0], -1).view(torch.int64)


def fill_pattern(kv: Sequence[Any]) -> None:
    """Word w of block b of layer l holds (l << 40) | (b * words_per_block + w): every word is unique."""
    import torch

    for layer, t in enumerate(kv):
        w = words(t)
        w.copy_(torch.arange(w.numel(), dtype=torch.int64, device=t.device).view(w.shape) | (layer << 40))


def fill_sentinel(kv: Sequence[Any]) -> None:
    """Every word "not copied" (also prefaults the pages)."""
    for t in kv:
        words(t).fill_(SENTINEL)


def check_pattern(kv: Sequence[Any], src_ids: Any, dst_ids: Any) -> str | None:
    """None if destination block dst_ids[i] of every layer holds source block src_ids[i]; else what is wrong."""
    import torch

    for layer, t in enumerate(kv):
        w = words(t)
        wpb = w.shape[1]
        src = torch.as_tensor(np.asarray(src_ids), dtype=torch.int64, device=t.device)
        want = (src[:, None] * wpb + torch.arange(wpb, device=t.device)) | (layer << 40)
        if not torch.equal(w[torch.as_tensor(np.asarray(dst_ids), device=t.device)], want):
            return f"VERIFY FAILED: layer {layer} holds wrong bytes after the transfer"
    return None


def _tokens(kv: Sequence[Any], shape: Shape, ids: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, (K, V) of the sequence held in blocks ids, as (heads, tokens, head) float32 arrays:
    vLLM's CPU layout, K transposed then V token by token inside each head's block."""
    head = HEAD_DIM_X2 // 2
    bs, out = shape.block_size, []
    for t in kv:
        seg = t.cpu().numpy().reshape(shape.num_blocks, shape.heads, 2, bs * head)[np.asarray(ids)]
        k = seg[:, :, 0].reshape(-1, shape.heads, head, bs).transpose(1, 0, 3, 2).reshape(shape.heads, -1, head)
        v = seg[:, :, 1].reshape(-1, shape.heads, bs, head).transpose(1, 0, 2, 3).reshape(shape.heads, -1, head)
        out.append((k, v))
    return out


def check_tokens(dst_kv: Sequence[Any], dst: Shape, dst_ids: Any, src_kv: Sequence[Any], src: Shape, src_ids: Any) -> str | None:
    """None if the destination sequence (blocks dst_ids) holds the source sequence's (blocks
    src_ids) K and V token for token, for every head both hold; the block sizes may differ."""
    lo, hi = max(src.first_head, dst.first_head), min(src.first_head + src.heads, dst.first_head + dst.heads)
    n = min(len(src_ids) * src.block_size, len(dst_ids) * dst.block_size)
    for layer, (got, want) in enumerate(zip(_tokens(dst_kv, dst, dst_ids), _tokens(src_kv, src, src_ids))):
        for part, g, w in (("K", got[0], want[0]), ("V", got[1], want[1])):
            a = g[lo - dst.first_head : hi - dst.first_head, :n].view(np.int32)
            b = w[lo - src.first_head : hi - src.first_head, :n].view(np.int32)
            if not np.array_equal(a, b):
                return f"VERIFY FAILED: layer {layer} {part} differs token by token after the transfer"
    return None


def bench_layout(kv: Sequence[Any], shape: Shape) -> KVLayout:
    """The layout with its cells (which heads of the model it holds)."""
    infos = [_info(f"layer{i}", t) for i, t in enumerate(kv)]
    return dataclasses.replace(build_layout(infos, shape.num_blocks, shape.block_size, block_dim=0), cells=shape.cells())


def check_heads(kv: Sequence[Any], src_ids: Any, dst_ids: Any, src: Shape, dst: Shape) -> str | None:
    """None if every destination block dst_ids[i] holds, for each head both shapes hold, that
    head's words of source block src_ids[i] (fill_pattern's, on the source's own block size)."""
    import torch

    lo, hi = max(src.first_head, dst.first_head), min(src.first_head + src.heads, dst.first_head + dst.heads)
    head_words = src.block_size * HEAD_DIM_X2 * F32 // 8
    for layer, t in enumerate(kv):
        w = words(t).view(t.shape[0], dst.heads, head_words)
        s = torch.as_tensor(np.asarray(src_ids), dtype=torch.int64, device=t.device)
        d = torch.as_tensor(np.asarray(dst_ids), device=t.device)
        for h in range(lo, hi):
            first = s * src.words_per_block + (h - src.first_head) * head_words
            want = (first[:, None] + torch.arange(head_words, device=t.device)) | (layer << 40)
            if not torch.equal(w[d, h - dst.first_head], want):
                return f"VERIFY FAILED: layer {layer} head {h} holds wrong bytes after the transfer"
    return None

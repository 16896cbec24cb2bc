"""KV layout: registered KV tensors (shape, stride, element size) -> byte addresses of every block."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kv_connectors.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What the layout needs of one KV tensor; built from a torch.Tensor by the host adapter."""

    name: str
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements, as torch reports it
    element_size: int


@dataclasses.dataclass(frozen=True)
class Region:
    """One contiguous segment per block: block b lives at base + b * block_stride, seg_len bytes long."""

    base: int
    block_stride: int
    seg_len: int
    num_blocks: int

    @property
    def span(self) -> int:
        """Bytes from base to the end of the last block's segment (what a transport registers)."""
        return (self.num_blocks - 1) * self.block_stride + self.seg_len

    def addr(self, block_id: int) -> int:
        return self.base + block_id * self.block_stride


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of a KV head's data inside a block (K, V, or both side by side): `rows` rows
    `row_stride` bytes apart from `offset`, each holding every token's `cell_bytes` at
    `token_stride`. K stored transposed (vLLM's CPU kernels: one row per element of the head) is
    head_size rows of one element per token; a token-major K or V is one row of head_size elements."""

    offset: int
    rows: int
    row_stride: int
    token_stride: int
    cell_bytes: int

    def extent(self, tokens: int) -> int:
        return self.offset + (self.rows - 1) * self.row_stride + (tokens - 1) * self.token_stride + self.cell_bytes


@dataclasses.dataclass(frozen=True)
class Cells:
    """What a block holds, token by token: every region's per-block segment has `heads` KV heads
    `head_stride` bytes apart, each made of `parts` (Part). The same description covers every
    layout (vLLM's CPU cache, CUDA NHD and HND with K and V in regions of their own, MLA's single
    latent), so the planner maps tokens and heads between any two without special cases.

    A rank holds heads [first_head, first_head + heads) of the model's KV heads (tensor
    parallelism); MLA's latent is one head, replicated on every rank. token_addressable=False: only
    whole blocks of a head can be moved (the inside of a head's segment is not known)."""

    heads: int
    head_stride: int  # bytes; 0 when heads == 1 (no head dimension)
    tokens: int  # tokens per block
    parts: tuple[Part, ...]
    first_head: int = 0
    token_addressable: bool = True

    @property
    def extent(self) -> int:
        """Bytes from a segment's start to the end of its last cell."""
        return (self.heads - 1) * self.head_stride + max(p.extent(self.tokens) for p in self.parts)

    def signature(self) -> tuple[int, ...]:
        """What two peers' cells must share to map tokens: each part's rows and cell size."""
        return tuple(x for p in self.parts for x in (p.rows, p.cell_bytes))

    def with_first_head(self, first_head: int) -> Cells:
        return dataclasses.replace(self, first_head=first_head)


def token_major(heads: int, head_stride: int, tokens: int, token_stride: int, cell_bytes: int, first_head: int = 0) -> Cells:
    """Cells with one part: each token's cell_bytes contiguous at token * token_stride."""
    return Cells(heads, head_stride, tokens, (Part(0, 1, 0, token_stride, cell_bytes),), first_head)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """All regions of one worker's KV cache, in a fixed order both peers agree on."""

    num_blocks: int
    block_size: int  # tokens per block
    regions: tuple[Region, ...]
    cells: Cells | None = None  # None: the blocks' inside is unknown (only whole blocks can be planned)

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies over all layers."""
        return sum(r.seg_len for r in self.regions)

    def select(self, indices: Sequence[int]) -> KVLayout:
        """The same blocks over a subset of the regions (e.g. one layer's, for a layer-wise write)."""
        return KVLayout(self.num_blocks, self.block_size, tuple(self.regions[i] for i in indices), self.cells)

    def shape_signature(self) -> tuple[int, ...]:
        """Address-free description of the blocks: two peers with the same one move whole blocks."""
        return (self.block_size, len(self.regions), *(r.seg_len for r in self.regions))

    def compat_signature(self) -> tuple[int, ...]:
        """What two peers must share (part of the compatibility hash): with cells, the regions and
        a cell's size (the rest, a TP rank's head slice and the block size, is planned); without,
        the shape."""
        if self.cells is None:
            return self.shape_signature()
        return (len(self.regions), *self.cells.signature())


def _find_block_dim(info: TensorInfo, num_blocks: int, block_dim: int | None) -> int:
    if block_dim is not None:
        if not 0 <= block_dim < len(info.shape) or info.shape[block_dim] != num_blocks:
            raise ConfigError(
                f"KV tensor {info.name} shape {info.shape}: dim {block_dim} is not the block dim (num_blocks={num_blocks})"
            )
        return block_dim
    candidates = [d for d, size in enumerate(info.shape) if size == num_blocks]
    if not candidates:
        raise ConfigError(f"no dimension of KV tensor {info.name} shape {info.shape} has num_blocks={num_blocks} entries")
    # Other dims may happen to equal num_blocks (e.g. 2*head_size == 128 blocks); the block dim
    # is the outermost of them, since every known layout keeps a whole block contiguous inside it.
    return max(candidates, key=lambda d: info.stride[d])


def regions_of_tensor(info: TensorInfo, num_blocks: int, block_dim: int | None = None) -> list[Region]:
    """Split one tensor into regions: one per index of the dims outside the block (e.g. K and V).

    Dims with a stride smaller than the block dim's must form one contiguous segment per block;
    dims with a larger stride (e.g. a leading K/V dim of size 2) each give separate regions.
    """
    bdim = _find_block_dim(info, num_blocks, block_dim)
    bstride = info.stride[bdim]
    inner = sorted(
        (d for d in range(len(info.shape)) if d != bdim and info.stride[d] < bstride),
        key=lambda d: -info.stride[d],
    )
    outer = [d for d in range(len(info.shape)) if d != bdim and info.stride[d] >= bstride]
    expected = 1
    for d in reversed(inner):
        if info.shape[d] > 1 and info.stride[d] != expected:
            raise ConfigError(
                f"KV tensor {info.name} shape {info.shape} stride {info.stride} is not "
                "block-contiguous; cannot describe its blocks as byte segments"
            )
        expected *= info.shape[d]
    seg_elems = math.prod(info.shape[d] for d in inner)
    if seg_elems > bstride:
        raise ConfigError(f"KV tensor {info.name}: blocks overlap (stride {info.stride})")
    esz = info.element_size
    offsets = [0]
    for d in outer:
        offsets = [o + i * info.stride[d] for o in offsets for i in range(info.shape[d])]
    return [
        Region(
            base=info.data_ptr + off * esz,
            block_stride=bstride * esz,
            seg_len=seg_elems * esz,
            num_blocks=num_blocks,
        )
        for off in offsets
    ]


def build_layout(
    tensors: Sequence[TensorInfo],
    num_blocks: int,
    block_size: int,
    block_dim: int | None = None,
) -> KVLayout:
    """Layout of a whole KV cache; tensors in layer order. Tensors sharing storage are kept once."""
    if not tensors:
        raise ConfigError("no KV cache tensors were registered")
    regions: list[Region] = []
    seen: set[tuple[int, int, int]] = set()
    for info in tensors:
        for region in regions_of_tensor(info, num_blocks, block_dim):
            key = (region.base, region.block_stride, region.seg_len)
            if key not in seen:
                seen.add(key)
                regions.append(region)
    return KVLayout(num_blocks=num_blocks, block_size=block_size, regions=tuple(regions))


def layer_regions(
    tensors: Sequence[TensorInfo], layout: KVLayout, block_dim: int | None = None, last_owns: bool = False
) -> dict[str, tuple[int, ...]]:
    """Tensor (layer) name -> indices of its regions in layout; storage shared with an earlier
    tensor belongs to that earlier tensor (its KV is complete once that layer has run: a layer that
    reuses another's KV), or with `last_owns` to the last tensor sharing it (a hybrid's KV cache groups
    overlay one tensor, each block holding the layer of the group that owns it: complete once every
    layer sharing it has run). Tensors come in layer order."""
    index = {(r.base, r.block_stride, r.seg_len): i for i, r in enumerate(layout.regions)}
    owned: set[int] = set()
    result: dict[str, tuple[int, ...]] = {}
    if last_owns:
        return {k: v for k, v in reversed(layer_regions(list(reversed(tensors)), layout, block_dim).items())}
    for info in tensors:
        ids = []
        for region in regions_of_tensor(info, layout.num_blocks, block_dim):
            i = index[(region.base, region.block_stride, region.seg_len)]
            if i not in owned:
                owned.add(i)
                ids.append(i)
        result[info.name] = tuple(ids)
    return result


def cells_of_tensor(info: TensorInfo, num_blocks: int, block_size: int, heads: int, block_dim: int | None = None) -> Cells:
    """The cells of one KV tensor's blocks, read from its shape and strides: the token dimension has
    block_size entries, the head dimension `heads` (absent or of size 1 with one head), and the
    dimensions inside both form one contiguous cell. A ConfigError where that cannot be told apart
    (e.g. as many heads as tokens per block): such a layout is planned only block for block."""
    bdim = _find_block_dim(info, num_blocks, block_dim)
    bstride = info.stride[bdim]
    inner = [d for d in range(len(info.shape)) if d != bdim and info.stride[d] < bstride and info.shape[d] > 1]
    # The innermost dimension is always inside a cell (a token's values), whatever its size.
    outer = [d for d in inner if info.stride[d] != 1]
    tok = [d for d in outer if info.shape[d] == block_size]
    hd = [d for d in outer if info.shape[d] == heads] if heads > 1 else []
    if len(tok) != 1 or len(hd) > 1 or (heads > 1 and (not hd or hd == tok)):
        raise ConfigError(
            f"KV tensor {info.name} shape {info.shape}: cannot tell its token dimension ({block_size}) "
            f"from its head dimension ({heads})"
        )
    tdim, hdim = tok[0], (hd[0] if hd else None)
    cell_dims = [d for d in inner if d not in (tdim, hdim)]
    outer_stride = min(info.stride[d] for d in (tdim, hdim) if d is not None)
    if any(info.stride[d] > outer_stride for d in cell_dims):
        raise ConfigError(f"KV tensor {info.name} shape {info.shape} stride {info.stride}: a token's values are not contiguous")
    expected = 1
    for d in sorted(cell_dims, key=lambda d: info.stride[d]):
        if info.stride[d] != expected:
            raise ConfigError(f"KV tensor {info.name} shape {info.shape} stride {info.stride}: a token's values are not contiguous")
        expected *= info.shape[d]
    esz = info.element_size
    head_stride = info.stride[hdim] * esz if hdim is not None else 0
    return token_major(heads, head_stride, block_size, info.stride[tdim] * esz, expected * esz)


def cells_of_cpu_tensor(info: TensorInfo, num_blocks: int, block_size: int, heads: int, head_size: int, isa: str | None) -> Cells:
    """vLLM's CPU attention cache `(num_blocks, heads, block_size, 2 * head_size)`, which its kernels
    view as `(num_blocks, heads, 2 * block_size, head_size)` and split in halves (K, then V; see
    vllm/v1/attention/backends/cpu_attn.py). Its "vec" kernels store K transposed (element d of
    every token in row d: d * block_size + token) and V token by token (measured with
    cpu_attn_reshape_and_cache). The shape alone tells none of this, so the adapter names the
    layout and the kernel ISA; other ISAs are known only down to a head's whole segment."""
    shape = (num_blocks, heads, block_size, 2 * head_size)
    contiguous = (heads * block_size * 2 * head_size, block_size * 2 * head_size, 2 * head_size, 1)
    if info.shape != shape or info.stride[1:] != contiguous[1:] or info.stride[0] < contiguous[0]:
        raise ConfigError(f"KV tensor {info.name} shape {info.shape} stride {info.stride} is not vLLM's CPU layout {shape}")
    esz = info.element_size
    head_stride = contiguous[1] * esz
    if isa != "vec":
        half = head_stride // block_size
        return Cells(heads, head_stride, block_size, (Part(0, 1, 0, half, half),), token_addressable=False)
    k = Part(0, head_size, block_size * esz, esz, esz)
    v = Part(block_size * head_size * esz, 1, 0, head_size * esz, head_size * esz)
    return Cells(heads, head_stride, block_size, (k, v))

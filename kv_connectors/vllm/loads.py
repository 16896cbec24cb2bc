"""D's load of one request, from vLLM's objects: P's params checked against the request, D's blocks
paired with P's (group by group for a hybrid model), the digest of the prompt P's KV covers."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kv_connectors.errors import TransferParamsError
from kv_connectors.groups import CacheGroups, GroupKind, flatten, pair_tails, split
from kv_connectors.params import (
    REMOTE_BLOCK_IDS,
    REMOTE_PROMPT_DIGEST,
    RemotePrefill,
    RequestParams,
    prompt_digest,
)
from kv_connectors.plan import blocks_for_tokens
from kv_connectors.vllm.compat import unhashed_block_ids

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Checked:
    """A D request's params: P's address when usable, and what is wrong with them, if anything."""

    remote: RemotePrefill | None
    error: TransferParamsError | None


def check_load(request: Any, params: RequestParams, block_size: int, groups: CacheGroups) -> Checked:
    """Params checked against the request; a bad request keeps P's address when it is usable,
    so that P can still be told to free its blocks."""
    rp = params.prefill
    if rp is None:
        logger.debug("request %s: %s", request.request_id, params.prefill_error)
        return Checked(params.release, params.prefill_error)  # P can still be told to free its blocks
    prompt = request.prompt_token_ids or ()
    num_prompt = len(prompt)
    covered = rp.covered_tokens(num_prompt)
    needed = blocks_for_tokens(covered, rp.remote_block_size or block_size)
    error = None
    if rp.push_only:
        pass  # P's blocks are unknown until P writes them: P checks the count then (group by group)
    elif rp.remote_num_tokens is not None and rp.remote_num_tokens > num_prompt:
        error = TransferParamsError(
            f"prefill had {rp.remote_num_tokens} prompt tokens, this request has {num_prompt}: "
            "the decode request must carry the prefill request's prompt"
        )
    elif rp.remote_prompt_digest is not None and prompt_digest(list(prompt[:covered])) != rp.remote_prompt_digest:
        error = TransferParamsError(
            f"the decode request's first {covered} prompt tokens differ from the prefill request's prompt: "
            "the decode request must carry the prefill request's prompt"
        )
    elif covered < num_prompt and rp.remote_prompt_digest is None:
        error = TransferParamsError(
            f"prefill had {covered} prompt tokens, this request has {num_prompt}: a longer decode prompt needs "
            f"the prefill's {REMOTE_PROMPT_DIGEST}"
        )
    elif groups.hybrid:
        error = _check_groups(rp, needed, block_size, groups)
    elif rp.remote_group_sizes:
        error = TransferParamsError(f"{REMOTE_BLOCK_IDS} names {len(rp.remote_group_sizes)} KV cache groups; this model has one")
    elif len(rp.remote_block_ids) != needed:
        error = TransferParamsError(f"{REMOTE_BLOCK_IDS} has {len(rp.remote_block_ids)} blocks, the prompt fills {needed}")
    if error is not None:
        logger.debug("request %s: %s", request.request_id, error)
    return Checked(rp, error)


def _check_groups(rp: RemotePrefill, needed: int, block_size: int, groups: CacheGroups) -> TransferParamsError | None:
    """A hybrid model's load: P states each group's blocks (a full group's cover the prompt; a sliding
    window's, those inside it), in blocks as large as ours."""
    if rp.remote_block_size not in (None, block_size):
        return TransferParamsError(
            f"a model with several KV cache groups needs the same block size on prefill and decode: "
            f"the prefill's is {rp.remote_block_size}, ours {block_size}"
        )
    if len(rp.remote_group_sizes) != len(groups.groups):
        return TransferParamsError(
            f"{REMOTE_BLOCK_IDS} names {len(rp.remote_group_sizes) or 1} KV cache group(s); this model has {len(groups.groups)}"
        )
    for i, (g, n) in enumerate(zip(groups.groups, rp.remote_group_sizes)):
        if (g.kind is GroupKind.FULL and n != needed) or n > needed:
            return TransferParamsError(f"{REMOTE_BLOCK_IDS}[{i}] ({g.kind.value}) has {n} blocks, the prompt fills {needed}")
    return None


def pair_blocks(
    blocks: Any, rp: RemotePrefill, first: int, block_size: int, groups: CacheGroups
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(D's blocks to load, P's they load from, D's per KV cache group: () for one group), one to one
    where P's block size is ours, else P's from the one holding token `first` on (planned token by
    token); P's none where only P knows them (the transfer-id flow: P pairs them when it writes). A
    hybrid's groups are paired each from its tail (a sliding window's null blocks neither read nor
    written); a TransferParamsError names a group whose blocks P no longer holds."""
    if groups.hybrid:
        per_group = [unhashed_block_ids(blocks, g) for g in range(len(groups.groups))]
        if rp.push_only:
            local, sizes = flatten(per_group)
            return local, (), sizes
        return pair_tails(per_group, split(rp.remote_block_ids, rp.remote_group_sizes))
    mine = tuple(unhashed_block_ids(blocks))
    p_bs = rp.remote_block_size or block_size
    if p_bs == block_size:
        return mine, (rp.remote_block_ids[len(rp.remote_block_ids) - len(mine) :] if rp.remote_block_ids else ()), ()
    return mine, rp.remote_block_ids[first // p_bs :], ()


def covered_digest(request: Any, rp: RemotePrefill) -> str:
    """prompt_digest of the request's prompt tokens P's KV covers: what a push request or release
    states, so that P neither writes nor frees another prompt's KV for it."""
    prompt = request.prompt_token_ids
    if prompt is None or getattr(request, "abort_immediately", False):
        # Prompt embeddings (P states none either), or vLLM's stand-in for a request that failed
        # before admission: a one-token placeholder prompt sent only to free P's blocks.
        return ""
    return prompt_digest(list(prompt[: rp.covered_tokens(len(prompt))]))

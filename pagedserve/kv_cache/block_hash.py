"""Chained block hashes: equal hashes mean equal token prefixes up to the end of a block."""

import hashlib
from array import array
from collections.abc import Sequence

from pagedserve.multimodal import MultiModalFeature

BlockHash = bytes

ROOT_HASH: BlockHash = b"pagedserve-root"


def root_hash(cache_salt: str | None = None) -> BlockHash:
    """The parent hash of a request's first block: ROOT_HASH, or with a `cache_salt` (vLLM's
    request field) a hash of the salt. The salt thus enters the first block's hash only and
    the chain carries it on: requests with different salts share no block, requests with the
    same salt (or none) share as usual. Its own prefix keeps it apart from every block hash."""
    if cache_salt is None:
        return ROOT_HASH
    return hashlib.sha256(b"pagedserve-salt:" + cache_salt.encode()).digest()


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """SHA-256 of (parent hash, this block's token ids, extra keys such as a LoRA id).

    A cryptographic hash makes collisions (which would silently give wrong K/V) negligible,
    so a hit needs no token-by-token verification.
    """
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_keys)
    return digest.digest()


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    known: list[BlockHash],
    extra_keys: bytes = b"",
    cache_salt: str | None = None,
    mm_features: Sequence[MultiModalFeature] = (),
) -> list[BlockHash]:
    """Extend `known` (hashes of the first full blocks) to every full block of `token_ids`;
    `cache_salt` salts the first block (`root_hash`). A block holding tokens of an image
    (`mm_features`) adds the image's identifier to its extra keys (as vLLM's
    `_gen_mm_extra_hash_keys`): an image's placeholder tokens are the same for every image,
    so only its content tells two prompts apart; the chain carries it to later blocks."""
    num_full_blocks = len(token_ids) // block_size
    parent = known[-1] if known else root_hash(cache_salt)
    for i in range(len(known), num_full_blocks):
        start, end = i * block_size, (i + 1) * block_size
        keys = extra_keys + b"".join(
            f.identifier.encode() for f in mm_features if f.overlaps(start, end)
        )
        parent = hash_block_tokens(parent, token_ids[start:end], keys)
        known.append(parent)
    return known

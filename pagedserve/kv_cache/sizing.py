"""How many blocks a request holds, and whether it can ever fit the cache (kept apart from
the manager, so that the API server's process checks requests without the engine's code)."""

from pagedserve.errors import InvalidRequestError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_blocks_held(
    num_tokens: int,
    block_size: int,
    sliding_window: int | None = None,
    max_step_tokens: int | None = None,
) -> int:
    """Most blocks a request of `num_tokens` tokens holds at once.

    Without a window, all of them. With a sliding window W (every layer's), a step that feeds
    n tokens from position c holds only the blocks of positions c - W + 1 .. c + n - 1 (the
    first new token's window, then the new tokens): at most cdiv(W - 1 + n, block_size) + 1
    blocks, the + 1 for a window that straddles block edges; n is at most `max_step_tokens`
    (the step's token budget; None: the whole request in one step)."""
    num_blocks = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return num_blocks
    step = num_tokens if max_step_tokens is None else min(max_step_tokens, num_tokens)
    return min(num_blocks, cdiv(sliding_window - 1 + step, block_size) + 1)


def check_fits_cache(
    num_prompt_tokens: int,
    max_tokens: int,
    num_blocks: int,
    block_size: int,
    sliding_window: int | None = None,
    max_step_tokens: int | None = None,
) -> None:
    """Raise InvalidRequestError when a request could never fit a cache of `num_blocks` blocks
    (with a sliding window, one of them is the null block and the request needs only
    `max_blocks_held` of the rest). Here, beside the cache, so that the API server's process
    checks before it sends the request without importing the engine core (and its model
    code)."""
    num_tokens = num_prompt_tokens + max_tokens
    usable = num_blocks - (sliding_window is not None)
    needed = max_blocks_held(num_tokens, block_size, sliding_window, max_step_tokens)
    if needed > usable:
        at_once = "" if sliding_window is None else " at once"
        raise InvalidRequestError(
            f"the request needs up to {min(num_tokens, needed * block_size)} tokens of KV "
            f"cache{at_once} but the whole cache holds {usable * block_size}; lower max_tokens "
            f"or shorten the prompt",
            "max_tokens",
        )

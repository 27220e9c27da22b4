"""Environment variables that pagedserve reads (all named PAGEDSERVE_*), in one place."""

import os


def api_key() -> str | None:
    """PAGEDSERVE_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("PAGEDSERVE_API_KEY") or None


def max_n_sequences() -> int:
    """PAGEDSERVE_MAX_N_SEQUENCES: the largest `n` (and `best_of`) one request may ask for,
    default 16384 (vLLM's VLLM_MAX_N_SEQUENCES). Each sequence is an engine request with its
    own state, so an unbounded n lets one request exhaust host memory. Raises ValueError when
    the variable is not a positive integer."""
    raw = os.environ.get("PAGEDSERVE_MAX_N_SEQUENCES") or "16384"  # empty: unset
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"PAGEDSERVE_MAX_N_SEQUENCES must be a positive integer, got {raw!r}")
    return value

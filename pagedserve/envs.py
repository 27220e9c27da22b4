"""Environment variables that pagedserve reads (all named PAGEDSERVE_*), in one place."""

import os


def api_key() -> str | None:
    """PAGEDSERVE_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("PAGEDSERVE_API_KEY") or None

"""Model and tokenizer folders from Hugging Face Hub ids, through `huggingface_hub`.

`--model meta-llama/Llama-3.1-8B-Instruct` (or `LLM("Qwen/Qwen3-0.6B")`) names a Hub
repository; `resolve_model_folder` turns it into a local folder once, where the engine config
is built, so that the tokenizer, the workers and the server read files and never the network.
A local folder of that name wins. Otherwise `huggingface_hub.snapshot_download` fetches only
what pagedserve reads (configs, tokenizer and chat template files, the safetensors weights)
into the Hugging Face cache, with its progress bar, or finds them there.

The Hugging Face variables are read when a model is resolved (not when huggingface_hub was
imported, as its own constants are), so that setting them in a running program works:
`HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=1`): the cache only, no network; `HF_HUB_CACHE`,
else `HF_HOME`/hub: the cache (the `download_dir` option wins over both); `HF_ENDPOINT`: the
Hub's address (a mirror); `HF_TOKEN`: the token for gated and private repositories (else the
one `hf auth login` stored). Errors are one line (UnsupportedModelError, a ValueError).
"""

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from pagedserve.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

# What pagedserve reads from a model repository besides the weights; other files (PyTorch
# .bin and GGUF copies of the weights, ONNX exports, "original/" checkpoints) stay on the Hub.
CONFIG_FILES = [
    "config.json",
    "generation_config.json",
    "quantize_config.json",  # GPTQ/AWQ checkpoints that keep it out of config.json
    "quant_config.json",
    "model.safetensors.index.json",  # which shards hold the weights (fetched in a 2nd step)
]
TOKENIZER_FILES = [
    "config.json",  # AutoTokenizer reads the model type from it when tokenizer_config lacks it
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*",
]
REMOTE_CODE_FILES = ["*.py"]  # fetched only with trust_remote_code
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a true variable


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to 1/on/yes/true."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def hub_cache_dir(download_dir: str | None) -> str | None:
    """The Hugging Face cache to use: `download_dir`, else $HF_HUB_CACHE, else $HF_HOME/hub;
    None leaves huggingface_hub's default (~/.cache/huggingface/hub)."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def is_local(model: str, tokenizer: str | None) -> bool:
    """Whether the model and the tokenizer (None: the model's) are local folders: nothing to
    resolve on the Hub."""
    return os.path.isdir(model) and (tokenizer is None or os.path.isdir(tokenizer))


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` can be a Hub id (`NAME` or `ORG/NAME`): absolute and ./ ../ ~ paths and
    names with two slashes cannot, and are taken as folders."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model_folder(
    name: str,
    revision: str | None,
    download_dir: str | None,
    *,
    what: str = "model",
    weights: bool = True,
    trust_remote_code: bool = False,
) -> str:
    """The local folder of a model (or tokenizer, `what="tokenizer"`) named `name`.

    A folder that exists is returned as given, and so is a name that cannot be a Hub id (the
    caller's missing-folder error then names it). Otherwise `name` is a Hub repository at
    `revision` (default: its main branch): its snapshot folder in the cache, after
    downloading what is missing (the configs and tokenizer files; with `weights`, the
    safetensors files that `model.safetensors.index.json` lists, else `model.safetensors`;
    with `trust_remote_code`, the repository's Python files).

    Raises UnsupportedModelError in one line: offline (HF_HUB_OFFLINE=1) and not in the
    cache; a gated, private or missing repository or revision (the Hub's reason); the Hub
    unreachable and nothing cached.
    """
    if os.path.isdir(name) or not looks_like_repo_id(name):
        return name
    patterns = CONFIG_FILES + TOKENIZER_FILES if what == "model" else list(TOKENIZER_FILES)
    if trust_remote_code:
        patterns += REMOTE_CODE_FILES
    folder = _snapshot(name, revision, download_dir, what, patterns)
    if weights:
        commit = Path(folder).name  # the same commit for the weights, whatever the branch does
        pinned = commit if _COMMIT.fullmatch(commit) else revision
        folder = _snapshot(name, pinned, download_dir, what, weight_files(folder))
    return folder


def weight_files(folder: str) -> list[str]:
    """The safetensors files the loader reads (`models.loader.find_safetensors_files`): the
    shards of `model.safetensors.index.json`, else `model.safetensors`."""
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    return ["model.safetensors"]


def _snapshot(
    name: str, revision: str | None, download_dir: str | None, what: str, patterns: list[str]
) -> str:
    """snapshot_download of the files matching `patterns`, its errors as one line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        folder: str = snapshot_download(
            name,
            revision=revision,
            cache_dir=hub_cache_dir(download_dir),
            local_files_only=offline,
            allow_patterns=patterns,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise UnsupportedModelError(
            f"{what} {name!r}{at} is not a local folder, and the Hub answered: {_hub_reason(e)}"
        ) from None
    except LocalEntryNotFoundError as e:
        cache = hub_cache_dir(download_dir) or "the default Hugging Face cache"
        if offline:
            raise UnsupportedModelError(
                f"{what} {name!r}{at} is neither a local folder nor in the Hugging Face cache "
                f"({cache}), and HF_HUB_OFFLINE=1 forbids downloading it"
            ) from None
        cause = e.__cause__ or e
        raise UnsupportedModelError(
            f"{what} {name!r}{at} is neither a local folder nor in the Hugging Face cache "
            f"({cache}), and the Hub could not be reached: {_one_line(cause)}"
        ) from None
    except HfHubHTTPError as e:  # a file the listing named failed (5xx, 403, ...)
        raise UnsupportedModelError(
            f"downloading {what} {name!r}{at} from the Hub failed: {_hub_reason(e)}"
        ) from None
    return folder


def _hub_reason(error: Any) -> str:
    """The Hub's own words for a refusal (its X-Error-Message), with the HTTP status."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    message = getattr(error, "server_message", None) or _first_line(str(error))
    reason = "; ".join(line.strip() for line in message.splitlines() if line.strip())
    return f"{reason} (HTTP {status})" if status else reason


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {_first_line(str(error))}"

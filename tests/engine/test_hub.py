"""Hub ids (ORG/NAME) as --model and --tokenizer: resolved through huggingface_hub to a folder
of the Hugging Face cache, offline from a cache built here, online from a stand-in of the
Hub's HTTP API on loopback (tests/engine/hub_stand_in.py)."""

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest

from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.hub import resolve_model_folder
from pagedserve.entrypoints.llm import LLM
from pagedserve.errors import UnsupportedModelError
from pagedserve.sampling_params import SamplingParams
from tests.engine.hub_stand_in import HubRepo, build_hub_cache, folder_files, serve_hub

REPO = "testorg/stories"
COMMIT = "1" * 40
OTHER_COMMIT = "2" * 40
STORIES = folder_files(Path(DEFAULT_MODEL))
SMALL = {"device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": 4 << 20}


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache (HF_HUB_CACHE) holding REPO at COMMIT (branch main), HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub"
    build_hub_cache(cache, REPO, STORIES, COMMIT, ("main",))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """HF_ENDPOINT and HF_TOKEN for the stand-in Hub, an empty HF_HUB_CACHE, network on."""
    cache = tmp_path / "hub"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    # huggingface_hub read HF_HUB_OFFLINE when it was imported; a CI that sets it must not
    # turn the download test into a cache lookup.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield cache


def test_offline_hub_id_resolves_to_the_cached_snapshot(offline_cache: Path) -> None:
    config = EngineArgs(model=REPO, **SMALL).create_engine_config().model_config
    snapshot = offline_cache / "models--testorg--stories" / "snapshots" / COMMIT
    assert Path(config.model) == snapshot and Path(config.tokenizer) == snapshot
    assert config.model_name == REPO  # the user's name stays (served name, metrics)
    # --revision: a tag of another commit, whose config differs.
    other = dict(STORIES)
    other_config = json.loads(STORIES["config.json"])
    other_config["max_position_embeddings"] = 256
    other["config.json"] = json.dumps(other_config).encode()
    build_hub_cache(offline_cache, REPO, other, OTHER_COMMIT, ("v2",))
    config = EngineArgs(model=REPO, revision="v2", device="cpu").create_engine_config()
    assert Path(config.model_config.model).name == OTHER_COMMIT
    assert config.model_config.max_model_len == 256


def test_download_dir_and_hf_home_name_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    build_hub_cache(tmp_path / "home" / "hub", REPO, STORIES, COMMIT, ("main",))
    assert Path(resolve_model_folder(REPO, None, None)).is_relative_to(tmp_path / "home" / "hub")
    build_hub_cache(tmp_path / "mine", REPO, STORIES, OTHER_COMMIT, ("main",))
    config = EngineArgs(model=REPO, download_dir=str(tmp_path / "mine"), **SMALL)
    assert Path(config.create_engine_config().model_config.model).is_relative_to(tmp_path / "mine")


def test_a_local_folder_wins_over_the_cache(
    offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "work" / REPO
    shutil.copytree(DEFAULT_MODEL, folder)
    monkeypatch.chdir(tmp_path / "work")
    assert EngineArgs(model=REPO, **SMALL).create_engine_config().model_config.model == REPO


def test_tokenizer_hub_id_at_its_revision(offline_cache: Path) -> None:
    tokenizer_files = {k: v for k, v in STORIES.items() if k.startswith(("tokenizer", "special"))}
    build_hub_cache(offline_cache, "testorg/tok", tokenizer_files, OTHER_COMMIT, ("tokrev",))
    args = EngineArgs(tokenizer="testorg/tok", tokenizer_revision="tokrev", **SMALL)
    config = args.create_engine_config().model_config
    assert config.model == DEFAULT_MODEL and Path(config.tokenizer).name == OTHER_COMMIT
    # Without --tokenizer-revision the tokenizer takes --revision, as in vLLM (the model, a
    # folder, has no revision to follow).
    args = EngineArgs(tokenizer="testorg/tok", revision="tokrev", **SMALL)
    assert Path(args.create_engine_config().model_config.tokenizer).name == OTHER_COMMIT
    with pytest.raises(UnsupportedModelError, match="tokenizer 'testorg/tok'"):
        EngineArgs(tokenizer="testorg/tok", **SMALL).create_engine_config()  # no main branch


@pytest.mark.parametrize("tokenizer", ["/no/such/tokenizer", "./tok", "a/b/c"])
def test_a_missing_tokenizer_folder_is_named(tokenizer: str) -> None:
    """Names that cannot be Hub ids are folders; a missing one was transformers' OSError
    calling it a malformed repo id, after the config had been built."""
    with pytest.raises(UnsupportedModelError, match=f"tokenizer folder '{tokenizer}' does not"):
        EngineArgs(tokenizer=tokenizer, **SMALL).create_engine_config()


def test_offline_unknown_id_is_one_line_naming_it_and_the_variable(offline_cache: Path) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        EngineArgs(model="testorg/missing", **SMALL).create_engine_config()
    message = str(info.value)
    assert "\n" not in message
    assert "'testorg/missing'" in message and "HF_HUB_OFFLINE=1" in message
    assert str(offline_cache) in message


def test_llm_runs_a_hub_id_as_its_folder(offline_cache: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM(REPO, **SMALL) as llm:
        from_hub = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    with LLM(DEFAULT_MODEL, **SMALL) as llm:
        local = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert from_hub.token_ids == local.token_ids and from_hub.text == local.text


def test_download_from_the_hub_api_fetches_only_what_is_read(online: Path) -> None:
    files = dict(STORIES)
    files["pytorch_model.bin"] = b"\0" * 64  # another copy of the weights: not fetched
    files["original/consolidated.safetensors"] = b"\0" * 64
    files["README.md"] = b"# stories\n"
    files["chat_template.jinja"] = b"{{ messages }}"
    sharded = {  # a sharded checkpoint: only the shards its index lists
        "config.json": STORIES["config.json"],
        "model.safetensors.index.json": json.dumps(
            {
                "weight_map": {
                    "a": "model-00001-of-00002.safetensors",
                    "b": "model-00002-of-00002.safetensors",
                }
            }
        ).encode(),
        "model-00001-of-00002.safetensors": b"1" * 10,
        "model-00002-of-00002.safetensors": b"2" * 10,
        "consolidated.safetensors": b"3" * 10,
    }
    repos = {REPO: HubRepo(files, COMMIT), "testorg/sharded": HubRepo(sharded, OTHER_COMMIT)}
    with serve_hub(repos) as hub, pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ENDPOINT", hub.endpoint)
        folder = Path(resolve_model_folder(REPO, None, None))
        assert folder == online / "models--testorg--stories" / "snapshots" / COMMIT
        expected = sorted(
            {"chat_template.jinja", *STORIES} - {"model.safetensors", "SOURCE.md"}
        ) + ["/cdn/model.safetensors"]
        assert hub.downloaded() == sorted(expected)
        for name, data in STORIES.items():
            if name != "SOURCE.md":
                assert (folder / name).read_bytes() == data, name
        # The token goes to the Hub, never to the CDN that serves the LFS files.
        to_hub = [t for _, p, t in hub.requests if p.startswith(("/api/models/", f"/{REPO}/"))]
        assert to_hub and set(to_hub) == {"Bearer hf_test_token"}
        assert [t for _, p, t in hub.requests if p.startswith("/cdn/")] == [None]
        # Offline again, the same id comes from the cache, without a request.
        asked = len(hub.requests)
        patch.setenv("HF_HUB_OFFLINE", "1")
        assert Path(resolve_model_folder(REPO, None, None)) == folder
        assert len(hub.requests) == asked
        patch.delenv("HF_HUB_OFFLINE")
        sharded_folder = Path(resolve_model_folder("testorg/sharded", None, None))
        assert sorted(p.name for p in sharded_folder.glob("*.safetensors")) == [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ]


@pytest.mark.parametrize(
    ("name", "revision", "reason"),
    [
        ("testorg/gated", None, "Access to model testorg/gated is restricted"),
        ("testorg/nope", None, "Repository not found (HTTP 401)"),
        (REPO, "v9", "Invalid rev id: v9 (HTTP 404)"),
    ],
)
def test_gated_missing_and_unknown_revision_give_the_hubs_reason(
    online: Path, name: str, revision: str | None, reason: str
) -> None:
    repos = {REPO: HubRepo(STORIES, COMMIT), "testorg/gated": HubRepo(STORIES, COMMIT, gated=True)}
    with serve_hub(repos) as hub, pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(UnsupportedModelError) as info:
            EngineArgs(model=name, revision=revision, **SMALL).create_engine_config()
    message = str(info.value)
    assert "\n" not in message and reason in message and repr(name) in message

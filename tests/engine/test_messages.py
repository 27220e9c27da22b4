"""The messages between the API server and the engine core (pagedserve/messages.py): every
kind survives the codec, and the server's side loads no model code."""

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pagedserve import RequestOutputKind, SamplingParams
from pagedserve.engine.core_proc import feature_from_data, feature_to_data
from pagedserve.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreError,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishRequests,
    MultiModalFeatureData,
    PromptLogprobsData,
    SampleLogprobsData,
    SchedulerStats,
    Shutdown,
    ToCore,
    ToServer,
    decode_to_core,
    decode_to_server,
    encode,
)
from pagedserve.multimodal import MultiModalFeature, hash_pixels
from pagedserve.sampling_params import DEFAULT_MAX_TOKENS, is_default_max_tokens

REPO = Path(__file__).resolve().parents[2]


def test_sampling_params_survive_the_wire() -> None:
    params = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["a", "bc"], stop_token_ids=[7],
        max_tokens=9, logprobs=2, output_kind=RequestOutputKind.DELTA, eos_token_ids=(1, 2),
        logit_bias={"5": 3.5}, bad_words=["x y"], bad_words_token_ids=[[4, 5]],
        allowed_token_ids=[1, 2, 3], prompt_logprobs=1, truncate_prompt_tokens=4,
    )  # fmt: skip
    message = AddRequests([EngineCoreRequest("r", [1, 2, 3], params, "g", -7, "salt")])
    decoded = decode_to_core(encode(message))
    assert decoded == message
    assert isinstance(decoded, AddRequests)
    assert (decoded.requests[0].priority, decoded.requests[0].cache_salt) == (-7, "salt")
    received = decoded.requests[0].sampling_params
    assert received.output_kind is RequestOutputKind.DELTA
    assert received.eos_token_ids == (1, 2) and received.logit_bias == {5: 3.5}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_images_survive_the_wire(dtype: type) -> None:
    """A request's images cross as bytes + shape + dtype name and come back equal: the same
    pixels (bit for bit), placeholder range and content hash, in prompt order."""
    rng = np.random.default_rng(0)
    pixels = [rng.standard_normal((3, 5, 7)).astype(dtype) for _ in range(2)]
    features = [
        MultiModalFeature(p, offset, 4, hash_pixels(p))
        for p, offset in zip(pixels, (2, 9), strict=True)
    ]
    # Qwen2-VL's: flattened patches of its own grid (t, h, w)
    patches = rng.standard_normal((16, 12)).astype(dtype)
    grid = (1, 4, 4)
    features.append(MultiModalFeature(patches, 11, 4, hash_pixels(patches, grid), grid_thw=grid))
    request = EngineCoreRequest("r", [1] * 16, SamplingParams(max_tokens=3))
    request.mm_features = [feature_to_data(f) for f in features]
    decoded = decode_to_core(encode(AddRequests([request])))
    assert isinstance(decoded, AddRequests)
    [received] = decoded.requests
    assert all(isinstance(d, MultiModalFeatureData) for d in received.mm_features)
    rebuilt = [feature_from_data(d) for d in received.mm_features]
    for got, sent in zip(rebuilt, features, strict=True):
        assert got.pixel_values.dtype == sent.pixel_values.dtype
        np.testing.assert_array_equal(got.pixel_values, sent.pixel_values)
        assert got.pixel_values.flags.writeable  # torch.from_numpy shares it without a warning
        assert (got.offset, got.length, got.identifier, got.modality, got.grid_thw) == (
            sent.offset, sent.length, sent.identifier, "image", sent.grid_thw,
        )  # fmt: skip
    assert rebuilt[-1].grid_thw == (1, 4, 4) and rebuilt[0].grid_thw is None
    assert hash_pixels(patches, grid) != hash_pixels(patches, (1, 2, 8))


def test_default_max_tokens_crosses_as_a_plain_int() -> None:
    """The unchosen-default marker (an int subclass) crosses as its value, as msgpack sent it."""
    params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    decoded = decode_to_core(encode(AddRequests([EngineCoreRequest("r", [1], params)])))
    assert isinstance(decoded, AddRequests)
    max_tokens = decoded.requests[0].sampling_params.max_tokens
    assert max_tokens == 16 and not is_default_max_tokens(max_tokens)


# Values SamplingParams accepts in a field typed otherwise: truthy values for the flags, as
# the fields were only ever read for their truth. msgpack carried them as they were; msgspec
# decodes against the annotations, so a 1 for `ignore_eos` failed in the engine core and
# killed it. They are now bools from construction on.
FLAG_VALUES = [1, 0, None, "yes", np.bool_(True)]
FLAGS = [
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
]


@pytest.mark.parametrize("value", FLAG_VALUES, ids=repr)
@pytest.mark.parametrize("name", FLAGS)
def test_truthy_flags_cross_as_bools(name: str, value: object) -> None:
    params = SamplingParams(**{name: value})
    assert getattr(params, name) is bool(value)
    decoded = decode_to_core(encode(AddRequests([EngineCoreRequest("r", [1], params)])))
    assert isinstance(decoded, AddRequests)
    assert decoded.requests[0].sampling_params == params


@pytest.mark.parametrize(
    "message",
    [AbortRequests(["a", "b"]), FinishRequests(["c"]), Shutdown()],
    ids=["abort", "finish", "shutdown"],
)
def test_control_messages_survive_the_wire(message: ToCore) -> None:
    assert decode_to_core(encode(message)) == message


def test_core_outputs_survive_the_wire() -> None:
    logprobs = SampleLogprobsData([5, 1, 2], [-0.1, -0.05, -3.0], 2)
    prompt_logprobs = PromptLogprobsData(1, [[3, 4], [6, 7]], [[-1.0, -0.5], [-0.2, -0.1]], [2, 1])
    outputs = [
        EngineCoreOutput("r", [5], logprobs, "stop", 7, 16),
        EngineCoreOutput("0_r", [9], None, None, None, 0),
        EngineCoreOutput("r2", [3], None, "stop", "the end", 0),
        EngineCoreOutput("r3", [], None, None, None, 0, prompt_logprobs),
    ]
    message = EngineCoreOutputs(
        outputs, SchedulerStats(2, 1, 0.25, 3, 64, 32), [("r", 0.5)], 1.5, 2.5, 6.5e9, 2.25e12
    )
    decoded = decode_to_server(encode(message))
    assert decoded == message
    assert isinstance(decoded, EngineCoreOutputs)
    assert isinstance(decoded.stats.kv_cache_usage, float)
    assert (decoded.step_bytes, decoded.step_flops) == (6.5e9, 2.25e12)
    error = EngineCoreError("Traceback ...")
    assert decode_to_server(encode(error)) == error


@pytest.mark.parametrize(
    ("message", "decode"),
    [(Shutdown(), decode_to_server), (EngineCoreError("x"), decode_to_core)],
    ids=["to-core-read-by-server", "to-server-read-by-core"],
)
def test_a_message_for_the_other_side_is_rejected(
    message: ToCore | ToServer, decode: Callable[[bytes], object]
) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(encode(message))


def test_api_server_loads_no_model_code() -> None:
    """The API server's process talks to the engine core through messages only: neither
    importing it nor its start-up work (the engine config, the tokenizer) loads model code
    (only the registry's list of architecture names). torch itself does get imported at
    start-up, by transformers' AutoConfig."""
    code = (
        "import sys\n"
        "import pagedserve.entrypoints.openai.api_server\n"
        "import pagedserve.engine.async_engine\n"  # what `serve` imports to start the engine
        "print(' '.join(sorted(sys.modules)))\n"
        "from pagedserve.engine.arg_utils import EngineArgs\n"
        "from pagedserve.engine.llm_engine import build_processors\n"
        "build_processors(EngineArgs(device='cpu').create_engine_config())\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    after_import, after_start = (line.split() for line in result.stdout.splitlines()[-2:])
    assert "pagedserve.entrypoints.openai.api_server" in after_import
    assert "pagedserve.engine.core_client" in after_import
    assert "torch" not in after_import
    model_code = ("models", "layers", "attention", "worker", "executor", "distributed")
    for modules in (after_import, after_start):
        loaded = [
            m
            for m in modules
            if m.split(".")[:2] in (["pagedserve", p] for p in model_code)
            and m not in ("pagedserve.models", "pagedserve.models.registry")
        ]
        assert not loaded, f"the API server imports {loaded}"
    assert "pagedserve.models" not in after_import

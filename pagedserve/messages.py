"""The messages between the API server's process and the engine core, and their one codec.

A torch-free leaf: it imports msgspec and `sampling_params` only, so that the API server's
process (which encodes requests and decodes outputs) loads no model code. The messages are
msgspec structs; a step's outputs are built by the scheduler in the core (`EngineCoreOutput`)
and read by the OutputProcessor, in-process (`LLMEngine`) or after crossing the socket
(`AsyncLLMEngine`).

Every message crosses as a msgpack array whose first item is its tag (see `core_proc` for the
protocol); structs are arrays of their fields in order (array_like: no field names on the
wire), and SamplingParams, a dataclass, a map of its fields by name:

    server -> core (`ToCore`):  AddRequests, AbortRequests, FinishRequests, ResetPrefixCache,
                                Shutdown
    core -> server (`ToServer`): EngineCoreOutputs, EngineCoreError

`encode` encodes either direction; `decode_to_core` / `decode_to_server` decode one direction
and raise msgspec.DecodeError (a ValueError) for anything else: its subclass
msgspec.ValidationError for well-formed msgpack that is not such a message.
"""

from typing import Any

import msgspec

from pagedserve.sampling_params import SamplingParams


class SampleLogprobsData(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Logprobs of one sampled position: the sampled token first, then the top-k."""

    token_ids: list[int]  # [1 + k]
    logprobs: list[float]  # [1 + k] natural log (after penalties and temperature: see Sampler)
    sampled_rank: int  # 1 = the most likely token


class PromptLogprobsData(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Logprobs of the prompt tokens scored in one step (a prefill chunk), from the raw logits.

    Row i is prompt token `first_position + i` (>= 1: the first prompt token has no logprob):
    that token first, then the top-k, as in SampleLogprobsData.
    """

    first_position: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # of each prompt token (1 = the most likely)


class EngineCoreOutput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What one step produced for one request (vLLM's `EngineCoreOutput`): its new token and,
    if it ended, why (finish_reason "stop", "length" or "abort"; stop_reason the stop token
    id that matched). `prompt_logprobs`: of the prompt chunk computed this step."""

    request_id: str
    new_token_ids: list[int]  # 0 or 1 tokens (nothing when only prompt logprobs came)
    logprobs: SampleLogprobsData | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobsData | None = None


class SchedulerStats(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A snapshot of the scheduler for metrics and logs (vLLM's `SchedulerStats`)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use, [0, 1]
    num_preemptions_total: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found (in the CPU tier too)
    num_swap_outs_total: int = 0  # preemptions that swapped the request out (preemption_mode)
    num_swap_ins_total: int = 0  # swapped-out requests resumed
    cpu_prefix_cache_hits: int = 0  # tokens found in the prefix cache's CPU tier (kv_offload_gb)


class MultiModalFeatureData(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One image of a request on the wire: `multimodal.MultiModalFeature` with its pixels as
    raw bytes (msgspec holds no arrays; `engine.core_proc.feature_to_data` and
    `feature_from_data` convert, where numpy is loaded anyway)."""

    pixel_bytes: bytes  # the C-order bytes of pixel_values
    pixel_shape: list[int]  # MultiModalFeature.pixel_values' shape
    pixel_dtype: str  # numpy dtype name, e.g. "float32"
    offset: int  # position of the image's first placeholder token in the prompt
    length: int  # number of placeholder tokens
    identifier: str  # content hash (sha256 hex of the pixels)
    modality: str = "image"
    grid_thw: list[int] | None = None  # Qwen2-VL's patch grid (t, h, w); None: LLaVA's


class EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    """One engine-core request to add (vLLM's `EngineCoreRequest`). `sampling_params` has
    max_tokens resolved; `sharing_group` (parallel sampling), `priority` (lower is
    scheduled earlier), `cache_salt` (prefix-cache isolation) and `mm_features` (the
    prompt's images, in prompt order) as in `Request`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    sharing_group: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    mm_features: list[MultiModalFeatureData] = []


class AddRequests(msgspec.Struct, tag="add", array_like=True, gc=False):
    """Server -> core: queue these requests."""

    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    """Server -> core: free these requests now; the server has forgotten them."""

    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish", array_like=True, gc=False):
    """Server -> core: a stop string matched (found on the server's side); finish these
    requests as FINISHED_STOPPED."""

    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True, gc=False):
    """Server -> core: forget the prefix cache's blocks that no request holds (vLLM's
    `reset_prefix_cache`); requests sent after it find no earlier prefix."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, gc=False):
    """Server -> core: stop the loop and exit."""


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True, gc=False):
    """Core -> server, after each step or handled input: the step's outputs and the
    scheduler's state after it (vLLM's `EngineCoreOutputs`)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    # request id, seconds from arrival in the core to first scheduling (at `scheduled_at`)
    queue_times: list[tuple[str, float]]
    scheduled_at: float  # the core's time.monotonic() when the step began
    timestamp: float  # the core's time.monotonic() when the step's outputs were made
    # The roofline cost of the forward whose outputs these are, on one rank (0: none ran;
    # see `roofline.step_cost`): bytes it must read, FLOPs it must compute.
    step_bytes: float = 0.0
    step_flops: float = 0.0
    # That forward's seconds on the device (EngineCore.step_seconds: CUDA events on a GPU).
    step_seconds: float = 0.0


class EngineCoreError(msgspec.Struct, tag="error", array_like=True, gc=False):
    """Core -> server: the loop failed (its traceback); the core exits right after."""

    traceback: str


ToCore = AddRequests | AbortRequests | FinishRequests | ResetPrefixCache | Shutdown
ToServer = EngineCoreOutputs | EngineCoreError


def _enc_hook(value: Any) -> Any:
    """Subclasses of int, float and str cross as the plain type (msgspec encodes only the exact
    types): `DEFAULT_MAX_TOKENS` (an int subclass that marks the unchosen default, which the
    core does not need to tell apart), numpy.float64 as a temperature."""
    for base in (int, float, str):
        if isinstance(value, base):
            return base(value)
    raise NotImplementedError(f"cannot encode a {type(value).__name__} in an engine message")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_to_core_decoder = msgspec.msgpack.Decoder(ToCore)
_to_server_decoder = msgspec.msgpack.Decoder(ToServer)


def encode(message: ToCore | ToServer) -> bytes:
    """The message as msgpack bytes. Raises NotImplementedError for a value of a type msgpack
    cannot hold (from `_enc_hook`), OverflowError for an int outside [-2**63, 2**64)."""
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    """A server -> core message. Raises msgspec.ValidationError for another message or invalid
    fields (decoding runs SamplingParams' validation too), msgspec.DecodeError (its base) for
    bytes that are not msgpack."""
    return _to_core_decoder.decode(data)


def decode_to_server(data: bytes) -> ToServer:
    """A core -> server message. Raises msgspec.ValidationError for another message,
    msgspec.DecodeError (its base) for bytes that are not msgpack."""
    return _to_server_decoder.decode(data)

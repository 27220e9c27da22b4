"""LLMEngine: the synchronous, in-process engine (add_request / abort_request / step)."""

import dataclasses
from typing import Any

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagedserve.engine.mm_processor import MultiModalProcessor
from pagedserve.engine.model_files import log_diff_sampling_param, remote_code_error
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.errors import InvalidRequestError, RequestFailedError
from pagedserve.kv_cache.manager import check_fits_cache
from pagedserve.multimodal import MultiModalFeature, image_token_id
from pagedserve.outputs import RequestOutput
from pagedserve.request import Request, RequestStatus
from pagedserve.roofline import StepRecord
from pagedserve.sampling_params import SamplingParams


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer (transformers' AutoTokenizer, local files only; the folder's own
    tokenizer code runs only with `trust_remote_code`), with the BPE word cache off where
    whole texts are its words (`drop_whole_text_word_cache`)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except ValueError as e:
        raise remote_code_error(e, "tokenizer", path, "tokenizer_config.json") from None
    drop_whole_text_word_cache(tokenizer)
    return tokenizer


def drop_whole_text_word_cache(tokenizer: Any) -> bool:
    """Turn off the `tokenizers` BPE cache (10,000 "words" of up to 256 bytes, in Rust) when
    the pre-tokenizer does not split the text (none, or Metaspace with split=False, as in
    Llama 2 and the bundled stories260k): every short prompt is then one word, cached whole,
    so the cache only ever hits an identical prompt. Encoding such prompts from several
    threads (the server tokenizes in a thread pool) grew the API server by ~2.8 KB per
    request without bound (benchmarks/soak_memory.py, BENCHMARKS.md); with the cache off it
    stays flat. Returns whether the cache was turned off."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    model: Any = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or not hasattr(model, "_resize_cache"):
        return False
    pre_tokenizer = backend.pre_tokenizer
    if pre_tokenizer is not None and getattr(pre_tokenizer, "split", True):
        return False  # it splits into words: caching them pays
    model._resize_cache(0)
    return True


def build_processors(config: EngineConfig) -> tuple[Any, InputProcessor, OutputProcessor]:
    """The caller-side parts of an engine: the tokenizer (None with skip_tokenizer_init), the
    InputProcessor (tokenize, validate) and the OutputProcessor (detokenize, stop strings)."""
    model_config = config.model_config
    tokenizer = None
    if not model_config.skip_tokenizer_init:
        tokenizer = load_tokenizer(model_config.tokenizer, model_config.trust_remote_code)
    vocab_size = int(getattr(model_config.hf_text_config, "vocab_size", 0))
    if not vocab_size and tokenizer is not None:
        vocab_size = len(tokenizer)
    # Imported here: importing the API server loads no pagedserve.models module.
    from pagedserve.models.registry import MULTIMODAL_ARCHITECTURES

    mm_processor = None
    architectures = getattr(model_config.hf_config, "architectures", None) or []
    if any(a in MULTIMODAL_ARCHITECTURES for a in architectures):
        mm_processor = MultiModalProcessor(
            model_config.model,
            image_token_id(model_config.hf_config),
            model_config.trust_remote_code,
            model_config.mm_limit("image"),
        )
    input_processor = InputProcessor(
        tokenizer,
        model_config.max_model_len,
        vocab_size,
        model_config.eos_token_ids,
        model_config.max_logprobs,
        config.scheduler_config.scheduling_policy,
        mm_processor,
    )
    return tokenizer, input_processor, OutputProcessor(tokenizer)


def log_generation_defaults(model_config: ModelConfig) -> None:
    """Say once, when an engine starts, which sampling defaults the model's generation
    config sets (vLLM warns the same way)."""
    source = model_config.generation_config
    if source in ("auto", "vllm"):
        source = f"{model_config.model_name or model_config.model}'s generation_config.json"
    log_diff_sampling_param(model_config.diff_sampling_param, source)


def child_requests(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    arrival_time: float | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    mm_features: tuple[MultiModalFeature, ...] = (),
) -> list[Request]:
    """The engine-core requests of one user request (`params` resolved by the
    InputProcessor: max_tokens an int), each with its `priority`, `cache_salt` and images
    (`mm_features`): one, or
    `best_of` (default
    n) named "{i}_{request_id}" (seeded children get seed + i, as in vLLM). They share the
    prompt's full blocks through the prefix cache. With best_of > n the children compute the
    sampled token's logprob, which ranks them."""
    num_children = params.best_of or params.n
    if num_children == 1:
        return [
            Request(
                request_id,
                prompt_token_ids,
                params,
                arrival_time,
                priority=priority,
                cache_salt=cache_salt,
                mm_features=mm_features,
            )
        ]
    logprobs = params.logprobs
    if num_children > params.n and logprobs is None:
        logprobs = 0
    children = []
    for i in range(num_children):
        # seed + i as vLLM, wrapped so that a seed near the 64-bit limit stays valid.
        seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
        child_params = dataclasses.replace(params, n=1, best_of=None, seed=seed, logprobs=logprobs)
        children.append(
            Request(
                f"{i}_{request_id}",
                prompt_token_ids,
                child_params,
                arrival_time,
                sharing_group=request_id,
                priority=priority,
                cache_salt=cache_salt,
                mm_features=mm_features,
            )
        )
    return children


def check_child_ids_free(
    request_id: str, children: list[Request], child_to_parent: dict[str, Any]
) -> None:
    """Raise InvalidRequestError when an engine-core id of `children` is taken: "0_x" of a
    request "x" with n=2 and a request named "0_x" would mix up their outputs."""
    for child in children:
        if child.request_id in child_to_parent:
            raise InvalidRequestError(
                f"request id {request_id!r} needs the engine request id {child.request_id!r}, "
                f"which is already in use; choose another request id"
            )


def register_request(
    input_processor: InputProcessor,
    output_processor: OutputProcessor,
    request_id: str,
    prompt: PromptType,
    params: SamplingParams,
    num_blocks: int,
    block_size: int,
    arrival_time: float | None = None,
    core_request_id: str | None = None,
    sliding_window: int | None = None,
    max_step_tokens: int | None = None,
    priority: int = 0,
) -> tuple[ProcessedPrompt, list[Request]]:
    """The caller's side of adding a request, shared by LLMEngine and AsyncLLMEngine:
    tokenize and validate, check that it can fit a cache of `num_blocks` blocks, make its
    engine-core requests and register them with the output processor. Returns them, for the
    caller to hand to the engine core. Raises InvalidRequestError (nothing registered).

    `core_request_id` (default: `request_id`) names the engine-core requests; AsyncLLMEngine
    gives each request a fresh one, so that outputs of an aborted request still on their way
    from the core process never reach a new request that reuses its id. `sliding_window`
    (every layer's, else None) and `max_step_tokens` (the step's token budget) bound the
    blocks a request holds at once (`check_fits_cache`). `priority`: see
    `InputProcessor.check_priority`."""
    input_processor.check_priority(priority)
    processed = input_processor.process(prompt, params)
    max_tokens = processed.sampling_params.max_tokens
    assert max_tokens is not None  # resolved by the input processor
    check_fits_cache(
        len(processed.prompt_token_ids),
        max_tokens,
        num_blocks,
        block_size,
        sliding_window,
        max_step_tokens,
    )
    children = child_requests(
        request_id if core_request_id is None else core_request_id,
        processed.prompt_token_ids,
        processed.sampling_params,
        arrival_time,
        priority,
        processed.cache_salt,
        processed.mm_features,
    )
    check_child_ids_free(request_id, children, output_processor.child_to_parent)
    output_processor.add_request(
        request_id,
        processed.prompt,
        processed.prompt_token_ids,
        processed.sampling_params,
        [child.request_id for child in children],
    )
    return processed, children


class LLMEngine:
    """Tokenizes requests, runs them on an in-process EngineCore and returns their outputs.

    Mirrors vLLM's `LLMEngine`: `add_request`, `abort_request`, `step`,
    `has_unfinished_requests`. With `data_parallel_size` N > 1 the engine core is N
    engine-core processes (`DataParallelEngineCore`), built from `engine_args` (the options
    `config` came from; ValueError without them), and `scheduler`/`kv_cache` raise
    NotImplementedError.
    """

    def __init__(self, config: EngineConfig, engine_args: EngineArgs | None = None) -> None:
        # Imported here: AsyncLLMEngine in the API server's process uses this module's helpers
        # (build_processors, register_request) and must not load the model code.
        from pagedserve.engine.core import EngineCore
        from pagedserve.engine.dp_engine_core import DataParallelEngineCore

        dp_size = config.parallel_config.data_parallel_size
        if dp_size > 1 and engine_args is None:
            raise ValueError(
                f"LLMEngine with data_parallel_size {dp_size} starts its cores from the engine "
                f"options: use LLMEngine.from_engine_args (or pass engine_args)"
            )
        self.config = config
        self.tokenizer, self.input_processor, self.output_processor = build_processors(config)
        log_generation_defaults(config.model_config)
        self.engine_core: EngineCore | DataParallelEngineCore
        if dp_size > 1:
            assert engine_args is not None
            self.engine_core = DataParallelEngineCore(config, engine_args)
        else:
            self.engine_core = EngineCore(config)
        # Set to [] to time every step into it (`bench throughput --plot`); None: not kept.
        self.step_records: list[StepRecord] | None = None

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: str = "engine_context"
    ) -> "LLMEngine":
        return cls(engine_args.create_engine_config(usage_context), engine_args)

    @property
    def scheduler(self):  # type: ignore[no-untyped-def]
        return self.engine_core.scheduler

    @property
    def kv_cache(self):  # type: ignore[no-untyped-def]
        return self.engine_core.kv_cache

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request (vLLM's `LLMEngine.add_request`; `priority`: lower is
        scheduled earlier, non-zero only with scheduling_policy "priority"). Raises
        InvalidRequestError (a ValueError) for bad input, and when the request could never
        fit the whole KV cache."""
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        _, children = register_request(
            self.input_processor,
            self.output_processor,
            request_id,
            prompt,
            params,
            self.engine_core.num_blocks,
            self.config.cache_config.block_size,
            arrival_time,
            sliding_window=self.engine_core.sliding_window,
            max_step_tokens=self.config.scheduler_config.max_num_batched_tokens,
            priority=priority,
        )
        for child in children:
            self.engine_core.add_request(child)

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache's blocks that no request holds (vLLM's)."""
        self.engine_core.reset_prefix_cache()

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; unknown or finished ids are ignored.

        Returns the final RequestOutput of each aborted request (`finished=True`, and
        finish_reason "abort" on each completion that had not finished), the output vLLM
        hands out for an abort. vLLM's `LLMEngine.abort_request` returns None; the list is
        extra, so callers that ignore it are unaffected."""
        outputs = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            output = self.output_processor.abort_output(request_id)
            if output is not None:
                outputs.append(output)
            self.engine_core.abort_requests(self.output_processor.abort_request(request_id))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the RequestOutputs it produced. With `step_records` a
        list, append the step's `StepRecord` (the forwards it applied: their tokens, cost and
        seconds on the device, `EngineCore.step_seconds`)."""
        core = self.engine_core
        core_outputs = core.step()
        if self.step_records is not None:
            self.step_records.append(
                StepRecord(core.step_seconds, core.step_tokens, *core.step_cost)
            )
        request_outputs, stopped = self.output_processor.process_outputs(core_outputs)
        self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        failed = self.output_processor.pop_failed()
        for request in failed:
            self.engine_core.abort_requests(request.child_ids)
        if failed:  # offline, the caller sees the error (the failed requests are forgotten)
            first = failed[0]
            message = f"request {first.request_id} failed: {first.error!r}"
            raise RequestFailedError(message) from first.error
        return request_outputs

    def shutdown(self) -> None:
        self.engine_core.shutdown()

"""LLMEngine: the synchronous engine loop (add_request / abort_request / step)."""

import dataclasses
import logging
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.errors import InvalidRequestError
from pagedserve.kv_cache.manager import KVCacheManager, cdiv
from pagedserve.outputs import RequestOutput
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.worker.executor import UniprocExecutor

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class LLMEngine:
    """Tokenizes requests, schedules them, runs the model and returns their outputs.

    Mirrors vLLM's `LLMEngine`: `add_request`, `abort_request`, `step`,
    `has_unfinished_requests`. A request with n > 1 runs as n engine-core requests named
    "{i}_{request_id}", which share the prompt's full blocks through the prefix cache.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.tokenizer = load_tokenizer(model_config.tokenizer)
        self.executor = UniprocExecutor(config)
        block_size = config.cache_config.block_size
        num_blocks = self.executor.determine_num_blocks()
        blocks_per_max_request = cdiv(model_config.max_model_len, block_size)
        if num_blocks < blocks_per_max_request:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens) but "
                f"one request of max_model_len ({model_config.max_model_len}) tokens needs "
                f"{blocks_per_max_request}; give more memory (kv_cache_memory_bytes, "
                f"gpu_memory_utilization) or lower max_model_len"
            )
        self.executor.initialize_cache(num_blocks)
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB); maximum concurrency for "
            "%d-token requests: %.2fx",
            num_blocks, block_size, num_blocks * block_size,
            num_blocks * self.executor.block_bytes / 2**20,
            model_config.max_model_len, num_blocks / blocks_per_max_request,
        )
        self.kv_cache = KVCacheManager(
            num_blocks, block_size, config.cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler_config, self.kv_cache, model_config.max_model_len
        )
        vocab_size = int(getattr(model_config.hf_config, "vocab_size", 0)) or len(self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, model_config.max_model_len, vocab_size, model_config.eos_token_ids
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises InvalidRequestError (a ValueError) for bad
        input, and when the request could never fit the whole KV cache."""
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process(prompt, params)
        num_tokens = len(processed.prompt_token_ids) + processed.max_tokens
        block_size = self.config.cache_config.block_size
        if cdiv(num_tokens, block_size) > self.num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {num_tokens} tokens of KV cache but the whole cache "
                f"holds {self.num_blocks * block_size}; lower max_tokens or shorten the prompt"
            )
        resolved = processed.sampling_params
        num_sequences = resolved.n
        child_ids = [request_id] if num_sequences == 1 else [
            f"{i}_{request_id}" for i in range(num_sequences)
        ]
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, resolved, child_ids
        )
        for i, child_id in enumerate(child_ids):
            child_params = resolved
            if num_sequences > 1:
                seed = None if resolved.seed is None else resolved.seed + i
                child_params = dataclasses.replace(resolved, n=1, best_of=None, seed=seed)
            self.scheduler.add_request(
                Request(
                    child_id,
                    processed.prompt_token_ids,
                    child_params,
                    processed.max_tokens,
                    arrival_time,
                )
            )

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their blocks; unknown ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            children = self.output_processor.abort_request(request_id)
            self.scheduler.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and model forward; return the outputs it produced."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.finished_request_ids:  # let workers drop finished state
                self.executor.execute_model(scheduler_output)
            return []
        runner_output = self.executor.execute_model(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        request_outputs, stopped = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return request_outputs

    def shutdown(self) -> None:
        self.executor.shutdown()

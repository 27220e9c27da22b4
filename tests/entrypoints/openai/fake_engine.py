"""FakeEngine: the engine protocol that the server's app uses (`serving.Engine`), without a
model or an engine-core process.

Its caller's side is the real one: the InputProcessor tokenizes and validates (the 400s name
their `param` as with AsyncLLMEngine), and the OutputProcessor detokenizes, applies stop
strings, gathers n / best_of sequences and forms the DELTA, FINAL_ONLY and abort outputs. In
place of the engine core it produces tokens from a script, deterministically, and it can be
told to refuse requests, hold them (a generation that does not end until aborted), fail the
running ones or die.
"""

import asyncio
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.llm_engine import register_request
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.errors import EngineDeadError
from pagedserve.messages import EngineCoreOutput, PromptLogprobsData, SampleLogprobsData
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

# What the fake "model" writes: words, then multi-byte characters that byte-level tokenizers
# split over several tokens (the detokenizer must hold their bytes back), then more words.
SCRIPT = (
    "Once upon a time, there was a little girl named Lily. She liked to play outside 🌞. "
    "你好，世界！今天天气很好。 Emoji time 🎉🚀 and 🤖; 数学 ∑ π ≈ 3.14. The end"
)


@dataclass
class _Child:
    """One engine-core request (a sequence) of the fake engine."""

    request: Request
    offset: int  # where in the script its tokens start
    logprob: float  # of each of its tokens: children rank by it for best_of
    num_output_tokens: int = 0


class FakeEngine:
    """`serving.Engine` with the real InputProcessor and OutputProcessor, and a script in
    place of the model (see the module docstring).

    Each engine-core request (one per sequence: n, or best_of) gets one token per step:
    `script[(offset + i) % len(script)]`, where the offset is the prompt's length, plus the
    child's seed (or its index) when sampling (temperature > 0): greedy sequences are alike,
    seeded ones reproducible. It finishes with "length" at max_tokens (or at max_model_len),
    with "stop" on a stop token id or EOS (not before min_tokens; EOS not with ignore_eos).
    Every token has logprob -0.1 * (child index + 1), rank 1; the top-k alternatives are the
    script's next distinct tokens, each 1.0 lower. Prompt logprobs come with the first step.

    Knobs: `write(token_ids)` (the script), `refuse_with` (add_request raises it),
    `hold_after` (sequences stop after that many tokens until aborted: a long generation),
    `fail_running(error)` and `die()`.
    Records: `added` and `aborted` request ids; `running()` lists the unfinished ones.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int = 1024,
        vocab_size: int | None = None,
        max_logprobs: int = 20,
        script: str = SCRIPT,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        if vocab_size is None:  # as conftest's tiny models: the tokenizer's, rounded up to 64
            vocab_size = (len(tokenizer) + 63) // 64 * 64
        self.vocab_size = vocab_size
        self.input_processor = InputProcessor(
            tokenizer, max_model_len, vocab_size, (tokenizer.eos_token_id,), max_logprobs
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.script: list[int] = list(tokenizer.encode(script, add_special_tokens=False))
        self.offset_by_prompt = True
        self.streams: dict[str, RequestStream] = {}
        self.children: dict[str, _Child] = {}  # by engine-core request id
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.refuse_with: BaseException | None = None
        self.hold_after: int | None = None
        self.dead_error: EngineDeadError | None = None
        self.num_steps = 0
        self.num_prefix_cache_resets = 0
        self._stepper: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    # The engine protocol of the server (serving.Engine), as AsyncLLMEngine has it.

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def start(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._wake = asyncio.Event()
            self._stepper = asyncio.create_task(self._run(), name="fake-engine-steps")

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if self.refuse_with is not None:
            raise self.refuse_with
        self.start()
        processed, children = register_request(
            self.input_processor,
            self.output_processor,
            request_id,
            prompt,
            params,
            num_blocks=10**6,
            block_size=16,
            priority=priority,
        )
        for index, child in enumerate(children):
            child_params = child.sampling_params
            offset = len(processed.prompt_token_ids) if self.offset_by_prompt else 0
            if child_params.temperature > 0:
                offset += index if child_params.seed is None else child_params.seed
            self.children[child.request_id] = _Child(child, offset, -0.1 * (index + 1))
        stream = RequestStream(request_id, processed.sampling_params.output_kind)  # merges
        self.streams[request_id] = stream
        self.added.append(request_id)
        self._wakeup()
        return stream

    # AsyncLLMEngine's own: they only call add_request and abort_request.
    iterate = AsyncLLMEngine.iterate
    generate = AsyncLLMEngine.generate
    abort = AsyncLLMEngine.abort

    def abort_request(self, request_id: str) -> None:
        final_output = self.output_processor.abort_output(request_id)
        for child_id in self.output_processor.abort_request(request_id):
            self.children.pop(child_id, None)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            self.aborted.append(request_id)
            if final_output is not None:
                stream.queue.put_nowait(final_output)

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    async def reset_prefix_cache(self) -> None:
        await self.check_health()
        self.num_prefix_cache_resets += 1

    def fail_running(self, error: BaseException) -> None:
        """Every running request's stream raises `error`; the engine stays usable."""
        for request_id, stream in list(self.streams.items()):
            for child_id in self.output_processor.abort_request(request_id):
                self.children.pop(child_id, None)
            stream.queue.put_nowait(error)
        self.streams.clear()

    def die(self, message: str = "the fake engine core died") -> None:
        """As the engine core's death: pending requests fail, new ones and /health too."""
        self.dead_error = EngineDeadError(message)
        self.fail_running(EngineDeadError(message))

    # For the tests.

    def write(self, token_ids: list[int]) -> None:
        """From now on, greedy sequences write `token_ids` (and again, and again)."""
        self.script = list(token_ids)
        self.offset_by_prompt = False

    def running(self) -> list[str]:
        """Request ids not finished (nor aborted); none may be left after a request ends."""
        return list(self.output_processor.requests)

    def held(self) -> bool:
        """True when requests run and all of them wait at `hold_after`."""
        return bool(self.children) and not self._runnable()

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()

    # The stand-in for the engine core.

    def _wakeup(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _runnable(self) -> list[_Child]:
        limit = self.hold_after
        return [c for c in self.children.values() if limit is None or c.num_output_tokens < limit]

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            runnable = self._runnable()
            if not runnable:
                self._wake.clear()
                await self._wake.wait()
                continue
            outputs = [self._step(child) for child in runnable]
            request_outputs, stopped = self.output_processor.process_outputs(outputs)
            for child_id in stopped:  # a stop string ended it
                self.children.pop(child_id, None)
            for output in request_outputs:
                stream = self.streams.get(output.request_id)
                if output.finished:
                    self.streams.pop(output.request_id, None)
                if stream is not None:
                    stream.queue.put_nowait(output)
            self.num_steps += 1
            await asyncio.sleep(0)  # one step per loop turn: handlers and disconnects run

    def _step(self, child: _Child) -> EngineCoreOutput:
        request = child.request
        params = request.sampling_params
        position = child.offset + child.num_output_tokens
        token = self.script[position % len(self.script)]
        child.num_output_tokens += 1
        finish_reason, stop_reason = None, None
        num_tokens = request.num_prompt_tokens + child.num_output_tokens
        if token in request.stop_token_ids and child.num_output_tokens > params.min_tokens:
            finish_reason = "stop"
            if token not in params.eos_token_ids or params.ignore_eos:
                stop_reason = token  # a user stop token, not EOS
        elif child.num_output_tokens >= request.max_tokens or num_tokens >= self.max_model_len:
            finish_reason = "length"
        if finish_reason is not None:
            del self.children[request.request_id]
        logprobs = None
        if params.logprobs is not None:
            ids, values = self._ranked(token, child.logprob, params.logprobs, position + 1)
            logprobs = SampleLogprobsData(ids, values, 1)
        prompt_logprobs = None
        if params.prompt_logprobs is not None and child.num_output_tokens == 1:
            rows = [
                self._ranked(t, -1.0, params.prompt_logprobs, i)
                for i, t in enumerate(request.prompt_token_ids[1:])
            ]
            prompt_logprobs = PromptLogprobsData(
                first_position=1,
                token_ids=[ids for ids, _ in rows],
                logprobs=[values for _, values in rows],
                ranks=[1] * len(rows),
            )
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_cached_tokens=0,
            prompt_logprobs=prompt_logprobs,
        )

    def _ranked(
        self, token: int, logprob: float, num_top: int, start: int
    ) -> tuple[list[int], list[float]]:
        """The token, then the top `num_top`: the token itself (rank 1) and the script's next
        distinct tokens from `start`, each 1.0 less likely."""
        top = [token]
        position = start
        while len(top) < num_top and position < start + 4 * len(self.script):
            candidate = self.script[position % len(self.script)]
            if candidate not in top:
                top.append(candidate)
            position += 1
        top = top[:num_top]
        return [token, *top], [logprob, *(logprob - i for i in range(len(top)))]

"""OutputProcessor: detokenize step outputs, apply stop strings, build RequestOutputs."""

import logging
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.logprob_text import LogprobDetokenizer, logprob_entry
from pagedserve.messages import EngineCoreOutput, PromptLogprobsData
from pagedserve.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FailedRequest:
    """A request that an internal error ended while its output was processed."""

    request_id: str
    child_ids: list[str]  # its engine-core requests still running (to abort there)
    error: Exception


@dataclass(slots=True)
class _SequenceState:
    """One of a request's n sequences (one engine-core request)."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs
    # Spells the logprob tokens in context (None without logprobs or without a tokenizer).
    logprob_decoder: LogprobDetokenizer | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_SequenceState]
    child_ids: list[str]  # engine-core request ids, one per sequence
    num_cached_tokens: int = 0
    # [None, then one entry per prompt token], filled chunk by chunk; None when not asked.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once, in the first output
    prompt_logprob_decoder: LogprobDetokenizer | None = None

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)


class OutputProcessor:
    """Keeps the user-facing state of each request: text, logprobs, finish reasons.

    A request with `n > 1` runs as n engine-core requests (`child_request_id`); their outputs
    are gathered here into one RequestOutput with n CompletionOutputs.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}
        self.failed: list[FailedRequest] = []

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
    ) -> None:
        sequences = []
        for index, child_id in enumerate(child_ids):
            detokenizer = None
            if params.detokenize and self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop_strings,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                )
            state = _SequenceState(index, detokenizer)
            if params.logprobs is not None:
                state.logprobs = []
                state.logprob_decoder = self._logprob_decoder(params, prompt_token_ids)
            if params.logprobs is not None or _is_ranked(params):
                state.cumulative_logprob = 0.0
            sequences.append(state)
            self.child_to_parent[child_id] = (request_id, index)
        self.requests[request_id] = _RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            sequences,
            list(child_ids),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        if params.prompt_logprobs is not None and prompt_token_ids:
            decoder = self._logprob_decoder(params, [])
            if decoder is not None:
                decoder.advance(prompt_token_ids[0])  # the first position has no entry
            self.requests[request_id].prompt_logprob_decoder = decoder

    def _logprob_decoder(
        self, params: SamplingParams, context_token_ids: list[int]
    ) -> LogprobDetokenizer | None:
        if self.tokenizer is None:
            return None
        return LogprobDetokenizer(
            self.tokenizer,
            context_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    def abort_output(self, request_id: str) -> RequestOutput | None:
        """The final RequestOutput of a request being aborted (None for an unknown id): its
        unfinished sequences get finish_reason "abort", as vLLM's FinishReason.ABORT, and the
        text held back for stop strings is released. Call `abort_request` next to forget it."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            if not seq.finished:
                seq.finish_reason, seq.stop_reason = "abort", None
        return self._make_output(state)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its engine-core ids still to abort."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        children = [c for c in state.child_ids if c in self.child_to_parent]  # still running
        for child_id in children:
            del self.child_to_parent[child_id]
        return children

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the RequestOutputs to hand out and the
        engine-core request ids that a stop string finished (the scheduler must stop them)."""
        stopped: list[str] = []
        touched: dict[str, _RequestState] = {}
        for output in outputs:
            parent = self.child_to_parent.get(output.request_id)
            if parent is None:
                continue
            state = self.requests[parent[0]]
            seq = state.sequences[parent[1]]
            try:
                if output.prompt_logprobs is not None:
                    self._add_prompt_logprobs(state, output.prompt_logprobs)
                if not output.new_token_ids and output.finish_reason is None:
                    continue  # a prefill chunk: nothing to hand out yet
                state.num_cached_tokens = output.num_cached_tokens
                if self._update_sequence(seq, output):
                    stopped.append(output.request_id)
            except Exception as e:  # one request's bug must not end the others
                self._fail(state.request_id, e)
                touched.pop(state.request_id, None)
                continue
            if seq.finished:
                del self.child_to_parent[output.request_id]
            touched[state.request_id] = state
        request_outputs = []
        for state in touched.values():
            try:
                request_output = self._make_output(state)
            except Exception as e:
                self._fail(state.request_id, e)
                continue
            if request_output is not None:
                request_outputs.append(request_output)
            if state.finished:
                del self.requests[state.request_id]
        return request_outputs, stopped

    def _fail(self, request_id: str, error: Exception) -> None:
        """Forget a request whose output could not be processed (an internal error, logged
        with its traceback); `pop_failed` hands it to the engine, which aborts its engine-core
        requests and ends its stream with RequestFailedError."""
        logger.exception("request %s failed while processing its output", request_id)
        children = self.abort_request(request_id)
        self.failed.append(FailedRequest(request_id, children, error))

    def pop_failed(self) -> list["FailedRequest"]:
        """The requests `process_outputs` failed since the last call (and forgets them)."""
        failed, self.failed = self.failed, []
        return failed

    def _update_sequence(self, seq: _SequenceState, output: EngineCoreOutput) -> bool:
        """Returns True when a stop string ended the sequence."""
        seq.token_ids.extend(output.new_token_ids)
        if output.logprobs is not None and seq.cumulative_logprob is not None:
            seq.cumulative_logprob += output.logprobs.logprobs[0]
        if seq.logprobs is not None and output.logprobs is not None:
            data = output.logprobs
            entry = logprob_entry(
                data.token_ids, data.logprobs, data.sampled_rank, seq.logprob_decoder
            )
            seq.logprobs.append(entry)
        seq.finish_reason, seq.stop_reason = output.finish_reason, output.stop_reason
        if seq.finished:
            self._finish_logprob_text(seq)
        if seq.detokenizer is not None:
            # The EOS or stop token that ended the request is not part of the text (vLLM).
            stop_terminated = output.finish_reason == "stop"
            stop_string = seq.detokenizer.update(
                output.new_token_ids, stop_terminated=stop_terminated
            )
            if stop_string is not None and output.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", stop_string
                self._finish_logprob_text(seq)
                return True
        return False

    @staticmethod
    def _finish_logprob_text(seq: _SequenceState) -> None:
        """Bytes of an unfinished character end the text as U+FFFD: the last token's text
        shows it too, so that the token texts still join to the text."""
        if seq.logprob_decoder is None or not seq.logprobs:
            return
        tail = seq.logprob_decoder.finish()
        last = seq.logprobs[-1].get(seq.token_ids[-1])
        if tail and last is not None:
            last.decoded_token = (last.decoded_token or "") + tail

    def _add_prompt_logprobs(self, state: _RequestState, data: PromptLogprobsData) -> None:
        """Append a chunk's entries, skipping positions already known (the n sequences of a
        request all score the prompt; a preempted request scores it again)."""
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is None:
            return
        assert data.first_position <= len(prompt_logprobs), "prompt logprobs out of order"
        num_known = len(prompt_logprobs) - data.first_position
        for token_ids, logprobs, rank in zip(
            data.token_ids[num_known:],
            data.logprobs[num_known:],
            data.ranks[num_known:],
            strict=True,
        ):
            decoder = state.prompt_logprob_decoder
            prompt_logprobs.append(logprob_entry(token_ids, logprobs, rank, decoder))

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        ranked = _is_ranked(state.params)
        if (kind == RequestOutputKind.FINAL_ONLY or ranked) and not state.finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        sequences = state.sequences
        if ranked:  # best_of > n: the n sequences with the highest cumulative logprob
            sequences = sorted(sequences, key=lambda seq: -(seq.cumulative_logprob or 0.0))
            sequences = sequences[: state.params.n]
        completions = []
        for index, seq in enumerate(sequences):
            start = seq.num_sent_tokens if delta else 0
            text = ""
            if seq.detokenizer is not None:
                text = seq.detokenizer.get_next_output_text(seq.finished, delta)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=seq.token_ids[start:],
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=seq.logprobs[start:] if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            seq.num_sent_tokens = len(seq.token_ids)
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = [] if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
        )


def _is_ranked(params: SamplingParams) -> bool:
    """best_of > n: more sequences run than are returned (only the final output is sent)."""
    return (params.best_of or params.n) > params.n

"""Scheduler: continuous batching under a token budget, with prefix hits and preemption."""

from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, wait

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.messages import EngineCoreOutput
from pagedserve.request import FINISH_REASONS, Request, RequestStatus
from pagedserve.request_queue import create_request_queue, select_victim
from pagedserve.step import GrammarOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedserve.step_plan import LaunchedSteps, StepPlan
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.structured_output.step_bitmask import deferred_grammar_output, schedule_grammar


class Scheduler:
    """Decides, every step, which requests run and how many tokens each feeds the model.

    There are no phases: running requests (oldest first) catch up their uncomputed tokens,
    then waiting requests are admitted, each first taking its prefix-cache hits. A prompt
    longer than the remaining budget is chunked. When a running request cannot get a block,
    a running request is preempted (the newest; with the "priority" policy the worst by
    priority, then arrival: see `request_queue`): its blocks are freed and it is recomputed
    later (its tokens so far are kept). With `preemption_mode` "swap" (vLLM v0's) its blocks
    are copied to CPU swap space instead, and it resumes from its `num_computed_tokens` once
    they can come back (recomputed after all when swap space is full). The step's block copies
    (swaps, and the prefix cache's CPU tier) go to the workers in its SchedulerOutput.
    `num_computed_tokens` advances when tokens are scheduled, as in vLLM v1. Imports no torch.

    Images (vision-language models) are encoded in the step that first feeds one of their
    tokens; a step's images may total max_num_batched_tokens embedding rows (vLLM's encoder
    budget), and a chunk stops before an image past it (`multimodal.fit_encoder_budget`).

    Structured outputs (`structured_output_manager`): a constrained request waits, skipped,
    until its grammar is compiled; each step carries the bitmask of the constrained requests
    that sample; their sampled tokens advance their grammars. Its next mask depends on the
    token in flight: with async scheduling and `defer_grammar` (the engine sets it where the
    executor can split a step) a constrained request is scheduled ahead like any other, and
    its bitmask is filled after the step before has applied its tokens, while the device
    runs the forward (`deferred_grammar_output`, as vLLM V1); without it, a constrained
    request is not scheduled again while its token is in flight.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        self.structured_output_manager = structured_output_manager
        # Outputs made outside a step (a request whose grammar failed to compile), returned
        # by `take_pending_outputs`.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the workers at the next step
        self.num_preemptions_total = 0  # swapped out or not
        self.num_swap_outs_total = 0  # preemptions that swapped the request's blocks out
        self.num_swap_ins_total = 0
        self.num_scheduled_tokens_total = 0  # tokens fed to the model (prefix hits excluded)
        # Unfinished requests whose sampling reads their past output tokens on the host
        # (penalties, bad words): async scheduling waits for each step while there are any.
        self._num_needing_tokens = 0
        self._launched = LaunchedSteps()  # steps scheduled but not yet applied
        self.defer_grammar = False  # see the class docstring
        # Pipeline parallelism's batch queue: several steps in flight, each of requests whose
        # previous token is back; a request with a token in flight waits (no placeholders).
        self.skip_in_flight = False

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def wait_for_grammars(self, timeout: float) -> bool:
        """Block until a waiting request's grammar compile finishes, or `timeout` seconds
        pass; whether one finished (or none was compiling). The engine calls it when a step
        scheduled nothing, so that requests waiting only for their grammars do not make the
        engine loop spin: it would otherwise call `schedule` thousands of times per compile."""
        compiling = [
            state.compiled
            for request in self.waiting
            if (state := request.structured_output) is not None
            and state.grammar is None
            and not state.compiled.done()
        ]
        if not compiling:
            return True
        done, _ = wait(compiling, timeout, return_when=FIRST_COMPLETED)
        return bool(done)

    @property
    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the step in flight returns its
        tokens: no unfinished request's sampling needs its output tokens on the host."""
        return self._num_needing_tokens == 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.use_structured_output:
            if self.structured_output_manager is None:
                raise ValueError("structured outputs need a StructuredOutputManager")
            self.structured_output_manager.init_request(request)
        self.requests[request.request_id] = request
        self._num_needing_tokens += request.needs_output_tokens
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); frees their blocks."""
        assert status.is_finished
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue  # already finished
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = status
            self._free(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: spend `max_num_batched_tokens` on running, then waiting requests."""
        # The encoder budget is vLLM's default, max_num_batched_tokens rows a step.
        budget = self.config.max_num_batched_tokens
        plan = StepPlan(token_budget=budget, encoder_budget=budget)
        self._schedule_running(plan)
        if plan.num_preempted == 0:
            self._schedule_waiting(plan)
        scheduled_requests = plan.launch()
        finished_ids, self._finished_ids = self._finished_ids, set()
        grammar, deferred = schedule_grammar(
            self.structured_output_manager, self.defer_grammar, plan.requests, scheduled_requests
        )
        copies = self.kv_cache.take_block_copies()
        output = SchedulerOutput(
            plan.new_requests,
            scheduled_requests,
            finished_ids,
            grammar,
            grammar_deferred=deferred,
            blocks_to_swap_out=copies.swap_out,
            blocks_to_swap_in=copies.swap_in,
        )
        self.num_scheduled_tokens_total += output.total_num_scheduled_tokens
        if scheduled_requests:
            self._launched.add(output, plan.requests)
        return output

    def deferred_grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask of a step scheduled with `grammar_deferred`, filled now that the step
        before has applied its tokens (call it after that `update_from_output`). A request
        that finished meanwhile (its grammar completed, a stop token, an abort) gets no row:
        its token of this step is dropped."""
        step_requests = self._launched.get(scheduler_output)
        requests, items = [], []
        if step_requests is not None:
            for item in scheduler_output.scheduled_requests:
                request = step_requests[item.request_id]
                if self.requests.get(item.request_id) is request and not request.is_finished:
                    requests.append(request)
                    items.append(item)
        return deferred_grammar_output(self.structured_output_manager, requests, items)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests finished outside a step (their grammar failed to compile)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _schedule_running(self, plan: StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.token_budget > 0:
            request = self.running[i]
            num_new_tokens = min(request.num_uncomputed_tokens, plan.token_budget)
            if (
                num_new_tokens == 0
                or (self.skip_in_flight and request.num_output_placeholders > 0)
                or request.ends_in_flight(self.max_model_len)
                # its next mask needs the token in flight (async scheduling, no deferral)
                or (
                    request.use_structured_output
                    and request.num_output_placeholders > 0
                    and not self.defer_grammar
                )
                or not (
                    num_new_tokens := plan.fit_encoder_budget(
                        request, request.num_computed_tokens, num_new_tokens, False
                    )
                )
            ):
                i += 1
                continue
            while (new_block_ids := self.kv_cache.allocate_slots(request, num_new_tokens)) is None:
                victim = select_victim(self.config.scheduling_policy, self.running)
                if self.running.index(victim) < i:  # priority: one this loop went past
                    i -= 1
                    plan.remove(victim)
                    self.kv_cache.forget_unwritten(victim)
                self.running.remove(victim)
                self._preempt(victim)
                plan.num_preempted += 1
                if victim is request:
                    return
            plan.add(request, num_new_tokens, new_block_ids)
            i += 1

    def _schedule_waiting(self, plan: StepPlan) -> None:
        compiling: list[Request] = []  # skipped: their grammars are not compiled yet
        try:
            self._admit_waiting(plan, compiling)
        finally:
            self.waiting.prepend_requests(compiling)  # their places in the queue

    def _admit_waiting(self, plan: StepPlan, compiling: list[Request]) -> None:
        while (
            self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek_request()
            manager = self.structured_output_manager
            if manager is not None and not manager.is_ready(request):
                compiling.append(self.waiting.pop_request())
                continue
            if request.structured_output is not None and request.structured_output.failed:
                self.waiting.pop_request()
                self._fail_request(request)
                continue
            # A request preempted with a token in flight gets it (update_from_output) before
            # it is admitted again: with one step in flight, preemption stops admission for
            # the step it happens in; with several (skip_in_flight), it waits here.
            if request.num_output_placeholders > 0:
                assert self.skip_in_flight
                return
            # A swapped-out request resumes where it was: its computed tokens come back.
            swapped = self.kv_cache.is_swapped(request)
            hits, num_hit_tokens = (
                ([], request.num_computed_tokens)
                if swapped
                else self.kv_cache.get_computed_blocks(request)
            )
            num_new_tokens = request.num_tokens - num_hit_tokens
            if num_new_tokens > plan.token_budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new_tokens = plan.token_budget
            num_new_tokens = plan.fit_encoder_budget(request, num_hit_tokens, num_new_tokens, True)
            if num_new_tokens == 0:
                return  # its next image waits for the next step's encoder budget
            if swapped:
                new_block_ids = self.kv_cache.swap_in(request, num_new_tokens)
            else:
                new_block_ids = self.kv_cache.allocate_slots(request, num_new_tokens, hits)
            if new_block_ids is None:
                return  # waits for blocks; nobody behind it in the queue jumps it
            self.waiting.pop_request()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if swapped:
                self.num_swap_ins_total += 1
            else:
                self.kv_cache.record_prefix_query(request, num_hit_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            plan.new_requests.append(
                NewRequestData(
                    request.request_id,
                    request.num_prompt_tokens,
                    request.sampling_params,
                    request.prompt_token_ids,
                    request.mm_features,
                )
            )
            plan.add(request, num_new_tokens, new_block_ids)

    def _fail_request(self, request: Request) -> None:
        """End a request the engine cannot serve (its grammar failed to compile: the log has
        why) with finish_reason "abort"."""
        request.status = RequestStatus.FINISHED_ABORTED
        self._free(request)
        self._pending_outputs.append(
            EngineCoreOutput(
                request.request_id, [], finish_reason=FINISH_REASONS[request.status].value
            )
        )

    def _preempt(self, request: Request) -> None:
        if self.structured_output_manager is not None:
            self.structured_output_manager.sync_after_preemption(request)
        if self.config.preemption_mode == "swap" and self.kv_cache.swap_out(request):
            self.num_swap_outs_total += 1
        else:  # recomputed from its tokens (swap space is full, or recompute mode)
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend_request(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply the stop rules and free finished requests."""
        outputs = []
        prompt_logprobs = runner_output.prompt_logprobs
        step_requests = self._launched.pop(scheduler_output)

        def live(request_id: str) -> Request | None:
            """The request this step ran for, unless it finished while the step ran (abort,
            stop string, or with async scheduling a stop token of the step before); a new
            request that reuses the id is not it."""
            request = self.requests.get(request_id)
            if step_requests is not None and step_requests.get(request_id) is not request:
                return None
            return request

        applied = []  # (request, token, logprobs) of the live requests, in batch order
        for request_id, token_id, logprobs in zip(
            runner_output.request_ids,
            runner_output.sampled_token_ids,
            runner_output.logprobs,
            strict=True,
        ):
            if (request := live(request_id)) is not None:
                request.num_output_placeholders = max(request.num_output_placeholders - 1, 0)
                # A request preempted after this step was launched (async scheduling) still
                # keeps the token: its recomputation starts from all its tokens.
                request.append_output_token_ids([token_id])
                applied.append((request, token_id, logprobs))
        manager = self.structured_output_manager
        terminated = set() if manager is None else manager.accept_tokens(applied)
        for request, token_id, logprobs in applied:
            request_id = request.request_id
            status = request.check_stop(token_id, self.max_model_len)
            if status is None and request_id in terminated:  # grammar complete: "stop"
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove_request(request)
                request.status = status
                self._free(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[token_id],
                    logprobs=logprobs,
                    finish_reason=FINISH_REASONS[status].value if status else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    prompt_logprobs=prompt_logprobs.get(request_id),
                )
            )
        sampled_ids = set(runner_output.request_ids) if prompt_logprobs else set()
        for request_id, data in prompt_logprobs.items():  # prefill chunks that sampled nothing
            # Also for a request preempted while the chunk was in flight (async scheduling):
            # swapped out, it resumes after the chunk, which nothing scores again.
            request = live(request_id)
            unfinished = request is not None and not request.is_finished
            if unfinished and request_id not in sampled_ids:
                outputs.append(EngineCoreOutput(request_id, [], None, None, None, 0, data))
        return outputs

    def _free(self, request: Request) -> None:
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        request.num_output_placeholders = 0  # a token still in flight for it is dropped
        if self.structured_output_manager is not None:
            self.structured_output_manager.free_request(request)
        self._num_needing_tokens -= request.needs_output_tokens
        self._finished_ids.add(request.request_id)

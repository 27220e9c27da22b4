"""A pipeline stage's part of a step (vLLM's `IntermediateTensors` path in its GPU model
runner), for the ModelRunner when pipeline_parallel_size > 1.

    stage 0              stage 1 ...            last stage
    embed, layers  ─send─▶ recv, layers ─send─▶ recv, layers, norm, LM head, sample
         ◀──────────── broadcast of the sampled tokens to every rank ────────────┘

Every rank builds the same ModelInput from the same SchedulerOutput, so a receiver knows the
shapes ([num_tokens, hidden_size] hidden states and residual, in the model's dtype) and no
metadata travels. The broadcast of the sampled tokens keeps every rank's copy of the last
sample (the source of the next step's placeholder tokens under async scheduling) equal.

One batch is in flight at a time: the engine core launches step N+1 only after step N's
call returns on every rank, so while one stage computes the others wait. Keeping
pipeline_parallel_size batches in flight (vLLM's `max_concurrent_batches` and the engine
core's batch queue) is the next step.
"""

import torch

from pagedserve.distributed.comm import (
    broadcast_sampled_token_ids,
    pipeline_recv,
    pipeline_send,
)
from pagedserve.models.pp_utils import IntermediateTensors
from pagedserve.step import AsyncModelRunnerOutput, ModelRunnerOutput
from pagedserve.worker.input_batch import ModelInput


def receive_intermediate(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> IntermediateTensors:
    """The previous stage's hidden states and residual, each [num_tokens, hidden_size]."""
    hidden_states, residual = pipeline_recv([(num_tokens, hidden_size)] * 2, dtype, device)
    return IntermediateTensors(hidden_states, residual)


def finish_inner_stage(
    out: IntermediateTensors, model_input: ModelInput
) -> tuple[torch.Tensor | None, AsyncModelRunnerOutput]:
    """A stage other than the last: send its output on, then, when the step samples, join the
    broadcast of the sampled tokens. Returns (the tokens: [num_sampled] int64 on the device,
    or None when the step samples nothing; an empty output: this rank never answers)."""
    pipeline_send(out.as_list())
    sampled = None
    if model_input.sampled_request_ids:
        sampled = torch.empty(
            len(model_input.sampled_request_ids),
            dtype=torch.int64,
            device=model_input.input_ids.device,
        )
        broadcast_sampled_token_ids(sampled)
    return sampled, AsyncModelRunnerOutput(ModelRunnerOutput([], [], []))

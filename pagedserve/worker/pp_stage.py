"""A pipeline stage's part of a step (vLLM's `IntermediateTensors` path in its GPU model
runner), for the ModelRunner when pipeline_parallel_size > 1.

    stage 0              stage 1 ...            last stage
    embed, layers  ─send─▶ recv, layers ─send─▶ recv, layers, norm, LM head, sample
                                                 (its tp rank 0 answers the engine)

Every rank builds the same ModelInput from the same SchedulerOutput, so a receiver knows the
shapes ([num_tokens, hidden_size] hidden states and residual, in the model's dtype) and no
metadata travels. A stage other than the last answers as soon as it has sent: it can take
the next step while the later stages still run this one. The engine core keeps
pipeline_parallel_size steps in flight (its batch queue, vLLM's `max_concurrent_batches`),
each of requests whose previous token is back (no placeholder tokens: a stage other than
the last never sees the sampled tokens).
"""

import torch

from pagedserve.distributed.comm import pipeline_recv, pipeline_send
from pagedserve.models.pp_utils import IntermediateTensors
from pagedserve.step import AsyncModelRunnerOutput, ModelRunnerOutput


def receive_intermediate(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> IntermediateTensors:
    """The previous stage's hidden states and residual, each [num_tokens, hidden_size]."""
    hidden_states, residual = pipeline_recv([(num_tokens, hidden_size)] * 2, dtype, device)
    return IntermediateTensors(hidden_states, residual)


def send_to_next_stage(out: IntermediateTensors) -> AsyncModelRunnerOutput:
    """A stage other than the last: send its output on; an empty output (this rank never
    answers the engine). It does not wait for the step's sampled tokens: the engine feeds
    them with the request's next step, which it schedules only once they are back."""
    pipeline_send(out.as_list())
    return AsyncModelRunnerOutput(ModelRunnerOutput([], [], []))

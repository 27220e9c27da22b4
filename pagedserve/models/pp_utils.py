"""What a model needs to run as one pipeline stage (vLLM's `make_layers`, `PPMissingLayer`,
`IntermediateTensors`, `is_pp_missing_parameter`).

A stage builds only its own decoder layers (`get_pp_indices`); the others, and the
embeddings (not the first stage) or the final norm and LM head (not the last), are
`PPMissingLayer` placeholders without parameters, so that the module names, and the
checkpoint names they match, stay those of the whole model. A stage other than the last
returns `IntermediateTensors` (the hidden states and the residual stream), which the model
runner sends to the next stage; a stage other than the first receives them instead of
embedding tokens.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.distributed.parallel_state import (
    get_pp_layer_partition,
    get_pp_rank,
    get_pp_size,
)
from pagedserve.pp_layers import get_pp_indices


@dataclass(slots=True)
class IntermediateTensors:
    """What one stage hands the next: both [num_tokens, hidden_size], the model's dtype."""

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def as_list(self) -> list[torch.Tensor]:
        """The tensors in the order they travel (`comm.pipeline_send`)."""
        return [self.hidden_states, self.residual]


class PPMissingLayer(nn.Identity):
    """A module that another pipeline stage holds: no parameters, no use on this stage."""


def make_layers(
    num_layers: int, build: Callable[[int], nn.Module]
) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): `build(i)` for this stage's layers i in [start, end), and
    `PPMissingLayer` at the other indices (names stay `layers.{i}` for the checkpoint's).
    Raises ValueError as `get_pp_indices`."""
    start, end = get_pp_indices(num_layers, get_pp_rank(), get_pp_size(), get_pp_layer_partition())
    layers = nn.ModuleList(
        build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return start, end, layers


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The names (each with a trailing ".") of the model's `PPMissingLayer` modules: a
    parameter name that starts with one is another stage's. Computed once per load."""
    return tuple(
        f"{prefix}."
        for prefix, module in model.named_modules()
        if isinstance(module, PPMissingLayer)
    )

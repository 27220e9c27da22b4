"""BeamSearchParams: the parameters of `LLM.beam_search` (vLLM's, also importable from
`pagedserve.sampling_params` as in vLLM)."""

import math
from dataclasses import dataclass

from pagedserve.param_checks import check, is_int, is_number


@dataclass(slots=True)
class BeamSearchParams:
    """Parameters of `LLM.beam_search` (vLLM's `BeamSearchParams`).

    beam_width: beams kept per prompt, and sequences returned. max_tokens: tokens to generate.
    length_penalty: a finished beam scores cumulative logprob / (generated tokens ** it).
    ignore_eos: EOS does not finish a beam. temperature: divides the logits before the
    log-softmax that scores candidates (0 = plain log-softmax, as transformers does).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check(
            is_int(self.beam_width) and self.beam_width >= 1,
            "beam_width",
            f"must be at least 1, got {self.beam_width!r}",
            "BeamSearchParams",
        )
        check(
            is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            f"must be at least 1, got {self.max_tokens!r}",
            "BeamSearchParams",
        )
        check(
            is_number(self.temperature) and self.temperature >= 0.0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
            "BeamSearchParams",
        )
        check(
            is_number(self.length_penalty) and math.isfinite(self.length_penalty),
            "length_penalty",
            f"must be a finite number, got {self.length_penalty!r}",
            "BeamSearchParams",
        )

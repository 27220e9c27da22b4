"""Beam search scoring (pagedserve.engine.beam_search) on a scripted model: any finite
length_penalty gives a result, never an arithmetic error (a 500 in the server)."""

import math

import pytest

from pagedserve.engine.beam_search import beam_search
from pagedserve.outputs import Logprob
from pagedserve.sampling_params import BeamSearchParams

EOS = 3


def scripted_step(beams: list[list[int]]) -> list[dict[int, Logprob]]:
    """Every beam: EOS most likely, then tokens 4 and 5."""
    entry = {EOS: Logprob(-0.5, 1), 4: Logprob(-1.0, 2), 5: Logprob(-2.0, 3), 6: Logprob(-3.0, 4)}
    return [dict(entry) for _ in beams]


@pytest.mark.parametrize("length_penalty", [1e308, -1e308, 1000.0, -1000.0, 0.0])
def test_extreme_length_penalty_scores_without_error(length_penalty: float) -> None:
    params = BeamSearchParams(2, max_tokens=4, length_penalty=length_penalty)
    [output] = beam_search(scripted_step, [[1, 2]], params, [EOS], max_model_len=64)
    assert len(output.sequences) == 2
    assert all(math.isfinite(s.cum_logprob) for s in output.sequences)

"""Beam search on top of one-token generation steps (vLLM's `LLM.beam_search`)."""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedserve.outputs import Logprob
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

# Given the token ids of each running beam (prompt included), return for each the logprobs of
# its next token: a dict token id -> Logprob holding at least the 2 * beam_width most likely.
BeamStepFn = Callable[[list[list[int]]], list[dict[int, Logprob]]]


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam (vLLM's `BeamSearchSequence`): `tokens` include the prompt, `logprobs` hold
    one dict per generated token (the candidates of that step), `text` decodes `tokens`."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (ended in EOS) or "length"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The `beam_width` best sequences of one prompt, best first (vLLM's `BeamSearchOutput`)."""

    sequences: list[BeamSearchSequence]


@dataclass(slots=True)
class _BeamSearchInstance:
    """The running beams and the best finished ones of one prompt."""

    num_prompt_tokens: int
    max_tokens: int  # params.max_tokens, capped so that no beam outgrows max_model_len
    beams: list[BeamSearchSequence]
    finished: list[tuple[float, BeamSearchSequence]] = field(default_factory=list)
    done: bool = False


def step_params(params: BeamSearchParams) -> SamplingParams:
    """The SamplingParams of one beam's one-token request in a step: 2 * beam_width logprobs
    (the candidates), EOS not stopping it (the search decides), no text."""
    return SamplingParams(
        temperature=params.temperature,
        max_tokens=1,
        logprobs=2 * params.beam_width,
        ignore_eos=True,
        detokenize=False,
    )


class BeamSearch:
    """Beam search for some prompts, driven one step at a time by the caller, who runs each
    step's beams as one-token requests (synchronously offline, `beam_search`; with asyncio in
    the server):

        search = BeamSearch(prompts, params, eos_token_ids, max_model_len)
        while beams := search.pending():  # token ids (prompt included) of each running beam
            search.advance(next_logprobs_of(beams))  # one dict per beam, as BeamStepFn's
        outputs = search.outputs()

    The scoring is `beam_search`'s, below."""

    def __init__(
        self,
        prompts: Sequence[list[int]],
        params: BeamSearchParams,
        eos_token_ids: Sequence[int],
        max_model_len: int,
    ) -> None:
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.instances = [
            _BeamSearchInstance(
                len(prompt),
                min(params.max_tokens, max_model_len - len(prompt)),
                [BeamSearchSequence(list(prompt), [])],
            )
            for prompt in prompts
        ]
        self._running: list[_BeamSearchInstance] = []

    def pending(self) -> list[list[int]]:
        """The token ids of every running beam, all prompts' in one list; [] once done."""
        self._running = [instance for instance in self.instances if not instance.done]
        return [beam.tokens for instance in self._running for beam in instance.beams]

    def advance(self, next_logprobs: list[dict[int, Logprob]]) -> None:
        """Apply one step: `next_logprobs[i]` holds the next-token candidates of the i-th beam
        of the last `pending()` (at least its 2 * beam_width most likely, with ranks)."""
        start = 0
        for instance in self._running:
            end = start + len(instance.beams)
            _advance(instance, next_logprobs[start:end], self.params, self.eos)
            start = end
        if start != len(next_logprobs):
            raise ValueError(f"{len(next_logprobs)} logprob entries for {start} beams")

    def outputs(self) -> list[BeamSearchOutput]:
        """The best `beam_width` sequences of each prompt, best first (after the last step)."""
        return [_output(instance, self.eos) for instance in self.instances]


def beam_search(
    step: BeamStepFn,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_ids: Sequence[int],
    max_model_len: int,
) -> list[BeamSearchOutput]:
    """Run beam search for each prompt, all prompts' beams batched into each step.

    Each step scores every running beam's 2 * beam_width most likely next tokens by cumulative
    logprob, as transformers' beam search does (source: transformers/generation/utils.py,
    `_beam_search`):
    - the best `beam_width` candidates that do not end in EOS keep running;
    - a candidate ending in EOS among the best `beam_width` finishes, scored
      cumulative logprob / (generated tokens, EOS included) ** length_penalty;
    - at `max_tokens`, the best `beam_width` candidates finish, EOS or not;
    - the best `beam_width` finished sequences are returned.
    Search stops once no running beam can beat the worst of `beam_width` finished ones
    (transformers' `early_stopping="never"`, whose result equals running to max_tokens; vLLM
    always runs to max_tokens). vLLM differs in its score's length, prompt + generated
    tokens without EOS (transformers before 4.38), and in finishing every EOS candidate.
    """
    search = BeamSearch(prompts, params, eos_token_ids, max_model_len)
    while beams := search.pending():
        search.advance(step(beams))
    return search.outputs()


def _advance(
    instance: _BeamSearchInstance,
    next_logprobs: list[dict[int, Logprob]],
    params: BeamSearchParams,
    eos: frozenset[int],
) -> None:
    width = params.beam_width
    candidates = [
        (beam.cum_logprob + logprob.logprob, beam, token_id, entry)
        for beam, entry in zip(instance.beams, next_logprobs, strict=True)
        for token_id, logprob in entry.items()
        if logprob.rank is not None and logprob.rank <= 2 * width
    ]
    candidates.sort(key=lambda candidate: -candidate[0])
    num_generated = len(instance.beams[0].tokens) - instance.num_prompt_tokens + 1
    last_step = num_generated >= instance.max_tokens
    instance.beams = []
    for rank, (cum_logprob, beam, token_id, entry) in enumerate(candidates):
        ends = token_id in eos
        if not ends and not last_step and len(instance.beams) < width:
            instance.beams.append(_extend(beam, token_id, entry, cum_logprob))
        elif rank < width and (ends or last_step):
            score = _score(cum_logprob, num_generated, params.length_penalty)
            instance.finished.append((score, _extend(beam, token_id, entry, cum_logprob)))
        if rank >= width and len(instance.beams) == width:
            break
    instance.finished.sort(key=lambda finished: -finished[0])
    del instance.finished[width:]
    instance.done = not instance.beams or _cannot_improve(instance, params, num_generated)


def _cannot_improve(
    instance: _BeamSearchInstance, params: BeamSearchParams, num_generated: int
) -> bool:
    """No running beam can beat the worst of `beam_width` finished sequences: cumulative
    logprobs only fall, so the best bound is at the longest length when the length penalty
    is positive, else at the current one (transformers' `early_stopping="never"`)."""
    if len(instance.finished) < params.beam_width:
        return False
    length = instance.max_tokens if params.length_penalty > 0 else num_generated
    best_possible = _score(instance.beams[0].cum_logprob, length, params.length_penalty)
    return best_possible <= instance.finished[-1][0]


def _score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, for any finite length_penalty: a power too
    large for a float is infinite (score -0.0), one too small is 0 (score -inf, or 0.0 for a
    certain sequence)."""
    try:
        denominator = math.pow(length, length_penalty)
    except OverflowError:
        denominator = math.inf
    if denominator == 0.0:
        return -math.inf if cum_logprob < 0 else 0.0
    return cum_logprob / denominator


def _extend(
    beam: BeamSearchSequence, token_id: int, entry: dict[int, Logprob], cum_logprob: float
) -> BeamSearchSequence:
    return BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entry], cum_logprob)


def _output(instance: _BeamSearchInstance, eos: frozenset[int]) -> BeamSearchOutput:
    sequences = [sequence for _, sequence in instance.finished]
    for sequence in sequences:
        ends_in_eos = sequence.tokens[-1] in eos and len(sequence.logprobs) > 0
        sequence.finish_reason = "stop" if ends_in_eos else "length"
    return BeamSearchOutput(sequences)

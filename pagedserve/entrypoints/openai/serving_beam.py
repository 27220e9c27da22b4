"""Beam search in the server (vLLM's `use_beam_search` request extra, completions and chat).

As vLLM's `EngineClient.beam_search`: each step runs every running beam as a one-token engine
request asking for 2 * beam_width logprobs, all of a step's beams at once (their shared
prefixes hit the prefix cache), and the engine's scoring picks the beams
(`pagedserve.engine.beam_search.BeamSearch`, the one `LLM.beam_search` uses). `n` is the beam
width and the number of choices returned, best first.
"""

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from pagedserve.beam_search_params import BeamSearchParams
from pagedserve.engine.beam_search import BeamSearch, step_params
from pagedserve.engine.input_processor import PromptType
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import default_max_tokens, is_default_max_tokens

from .protocol import SamplingFields
from .serving import DisconnectWatcher, Engine, OpenAIError, add_requests, final_outputs

# Request fields that beam search does not apply, with the values that ask for nothing
# (a client may send those by default); any other value is a 400 naming the field.
_NOT_APPLIED: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "seed": (None,),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "min_tokens": (None, 0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "tools": (None, []),
}


def check_beam_search(request: SamplingFields) -> None:
    """400 for a `use_beam_search` request that also asks for something beam search does not
    do (sampling filters, penalties, stop strings, constraints, logprobs, streaming): vLLM
    drops those silently; we say so. Without use_beam_search, a length_penalty is a 400 (it
    would do nothing)."""
    if not request.use_beam_search:
        if request.length_penalty not in (None, 1.0):
            raise OpenAIError(400, "length_penalty applies only with use_beam_search: true",
                              "length_penalty")  # fmt: skip
        return
    for name, no_ops in _NOT_APPLIED.items():
        value = getattr(request, name, None)
        if value not in no_ops:
            raise OpenAIError(
                400, f"{name} is not applied by beam search (use_beam_search); remove it", name
            )
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != request.n:
        raise OpenAIError(400, "with use_beam_search, n is the beam width: leave out best_of",
                          "best_of")  # fmt: skip


def beam_search_params(
    request: SamplingFields, max_tokens: int | None, defaults: dict[str, Any]
) -> BeamSearchParams:
    """The BeamSearchParams of a request (vLLM's `to_beam_search_params`): beam width `n`,
    temperature the request's, else the generation config's, else 1.0 (beam scores are the
    log-softmax of logits / temperature; 1.0 and 0 both mean the plain log-softmax).
    max_tokens None (left to the context) becomes what the longest prompt leaves."""
    temperature = request.temperature
    if temperature is None:
        temperature = defaults.get("temperature", 1.0)
    length_penalty = 1.0 if request.length_penalty is None else request.length_penalty
    try:
        return BeamSearchParams(
            beam_width=request.n,
            # None: a default that the context caps (BeamSearch caps every max_tokens)
            max_tokens=default_max_tokens(2**31 - 1) if max_tokens is None else max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=temperature,
            length_penalty=length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
    except ValueError as e:  # InvalidRequestError naming the field
        raise OpenAIError(400, str(e), getattr(e, "param", None)) from None


async def beam_search_outputs(
    engine: Engine,
    request_id: str,
    prompts: list[PromptType],
    params: BeamSearchParams,
    raw_request: Request,
    priority: int = 0,
    cache_salt: str | None = None,
    truncate_prompt_tokens: int | None = None,
    skip_special_tokens: bool = True,
) -> list[RequestOutput]:
    """Run beam search for each prompt (dicts with `prompt_token_ids`); one RequestOutput per
    prompt whose `outputs` are its beam_width best sequences, best first, as vLLM's server
    returns them: the text leaves out a final EOS, finish_reason "stop" (EOS) or "length".
    Every step's requests carry `priority` and `cache_salt`; `truncate_prompt_tokens` keeps
    the last k prompt tokens (-1: max_model_len), as the engine does for other requests;
    `skip_special_tokens` leaves special tokens out of the text (the request's field).

    Raises OpenAIError 400 if 2 * n exceeds the engine's max_logprobs, InvalidRequestError
    for an explicit max_tokens that does not fit after a prompt, and OpenAIError 499 when
    the client leaves (the step's requests are aborted)."""
    num_candidates = 2 * params.beam_width
    max_logprobs = getattr(getattr(engine, "input_processor", None), "max_logprobs", None)
    if max_logprobs is not None and num_candidates > max_logprobs:
        raise OpenAIError(
            400,
            f"beam search with n={params.beam_width} needs 2 * n = {num_candidates} logprobs "
            f"per step, more than the server's --max-logprobs ({max_logprobs})",
            "n",
        )
    if not all(isinstance(p, Mapping) and "prompt_token_ids" in p for p in prompts):
        raise OpenAIError(400, "beam search needs token ids: the server has no tokenizer",
                          "use_beam_search")  # fmt: skip
    token_ids = [list(prompt["prompt_token_ids"]) for prompt in prompts]  # type: ignore[index]
    if truncate_prompt_tokens is not None:
        token_ids = _truncated(token_ids, truncate_prompt_tokens, engine.max_model_len)
    _check_max_tokens(token_ids, params.max_tokens, engine.max_model_len)
    eos_token_ids = _eos_token_ids(engine)
    search = BeamSearch(token_ids, params, eos_token_ids, engine.max_model_len)
    one_token = step_params(params)
    step = 0
    while beams := search.pending():
        step_prompts: list[PromptType] = [{"prompt_token_ids": beam} for beam in beams]
        streams = add_requests(
            engine, f"{request_id}-step{step}", step_prompts, one_token, priority, cache_salt
        )
        watcher = DisconnectWatcher(raw_request, engine, streams)
        outputs = await final_outputs(engine, streams, watcher)
        search.advance([output.outputs[0].logprobs[0] for output in outputs])  # type: ignore[index]
        step += 1
    tokenizer = engine.get_tokenizer()
    eos = frozenset(eos_token_ids)
    results = []
    for i, (prompt, output) in enumerate(zip(prompts, search.outputs(), strict=True)):
        num_prompt_tokens = len(token_ids[i])
        completions = []
        for index, sequence in enumerate(output.sequences):
            generated = sequence.tokens[num_prompt_tokens:]
            shown = generated
            if generated and generated[-1] in eos and not params.ignore_eos:
                shown = generated[:-1]  # vLLM leaves the EOS out of the text
            text = (
                tokenizer.decode(shown, skip_special_tokens=skip_special_tokens)
                if tokenizer
                else ""
            )
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=generated,
                    cumulative_logprob=sequence.cum_logprob,
                    logprobs=None,
                    finish_reason=sequence.finish_reason or "length",
                    stop_reason=sequence.stop_reason,
                )
            )
        results.append(
            RequestOutput(
                request_id=f"{request_id}-{i}",
                prompt=prompt.get("prompt") if isinstance(prompt, Mapping) else None,
                prompt_token_ids=token_ids[i],
                prompt_logprobs=None,
                outputs=completions,
                finished=True,
            )
        )
    return results


def _check_max_tokens(token_ids: list[list[int]], max_tokens: int, max_model_len: int) -> None:
    """InvalidRequestError (param max_tokens) for an explicit max_tokens that does not fit
    after a prompt, as the engine refuses it for other requests (a default one is capped to
    what the context leaves); a prompt too long by itself is left to the engine's error."""
    if is_default_max_tokens(max_tokens):
        return
    for ids in token_ids:
        num_tokens = len(ids)
        if num_tokens < max_model_len and num_tokens + max_tokens > max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_tokens + max_tokens} exceeds max_model_len ({max_model_len}); "
                f"shorten the prompt or lower max_tokens",
                "max_tokens",
            )


def _truncated(
    token_ids: list[list[int]], truncate_prompt_tokens: int, max_model_len: int
) -> list[list[int]]:
    """The last `truncate_prompt_tokens` tokens of each prompt (-1: max_model_len), as the
    engine's InputProcessor keeps them (the step requests must not truncate: their prompts
    are the growing beams)."""
    num_kept = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if num_kept > max_model_len:
        raise OpenAIError(
            400,
            f"truncate_prompt_tokens ({num_kept}) is larger than max_model_len "
            f"({max_model_len}); lower it",
            "truncate_prompt_tokens",
        )
    return [ids[-num_kept:] for ids in token_ids]


def _eos_token_ids(engine: Engine) -> tuple[int, ...]:
    """The engine's EOS ids (the model's and its generation config's), as the engine stops
    on them."""
    processor = getattr(engine, "input_processor", None)
    if processor is not None:
        return tuple(processor.eos_token_ids)
    tokenizer = engine.get_tokenizer()
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)

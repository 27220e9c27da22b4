"""LLM: the offline API (`generate`, `chat`) over an in-process LLMEngine, as in vLLM."""

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.beam_search import BeamSearchOutput, beam_search, step_params
from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.model_files import default_sampling_params
from pagedserve.entrypoints.chat_media import MediaOptions, load_chat_images
from pagedserve.entrypoints.chat_utils import render_chat
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate text for batches of prompts with continuous batching (vLLM's `LLM`).

    Keyword arguments are the engine options, `EngineArgs`' fields (their defaults and
    meanings: the table in README.md, or `pagedserve.config`). Raises ValueError for unknown
    or out-of-range options.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(
                f"unknown LLM option(s) {sorted(unknown)}; known: {EngineArgs.field_names()}"
            )
        self.llm_engine = LLMEngine.from_engine_args(
            EngineArgs(model=model, **kwargs), usage_context="llm_class"
        )
        self._request_counter = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine.from_engine_args(engine_args, usage_context="llm_class")
        llm._request_counter = itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams that `generate` and `chat` use when given none (vLLM's):
        vLLM's neutral defaults, with those the model's generation_config.json sets
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens)
        unless the engine runs with generation_config="vllm". A max_tokens from there is
        lowered to what the context leaves after each prompt."""
        return default_sampling_params(self.llm_engine.config.model_config.diff_sampling_param)

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache's blocks that no request holds (vLLM's
        `LLM.reset_prefix_cache`): the next prompts find no earlier prefix."""
        self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine's workers (tensor-parallel processes or Ray actors); idempotent.
        `with LLM(...) as llm:` calls it on leaving the block."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        prompts: a string, {"prompt_token_ids": [...]}, or a list of either; for a
            vision-language model (LLaVA) {"prompt": "USER: <image>\\n...", "multi_modal_data":
            {"image": PIL image or a list of them}} (one image per "<image>").
        sampling_params: one for all prompts, or one per prompt (default:
            `get_default_sampling_params()`, the model's generation config's defaults).
        priority: one int per prompt (vLLM's): lower values are scheduled first, and
            non-zero values need `scheduling_policy="priority"`; default all 0.
        Raises ValueError on bad input before any request starts (InvalidRequestError,
        param "priority", for a priority list of another length or a bad value).
        """
        if isinstance(prompts, str | dict):
            prompt_list: list[PromptType] = [prompts]
        elif isinstance(prompts, Iterable) and not isinstance(prompts, bytes | bytearray):
            prompt_list = list(prompts)  # a list, tuple, generator, numpy array, ...
        else:
            raise InvalidRequestError(
                f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}",
                "prompt",
            )
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise InvalidRequestError(
                f"got {len(priorities)} priorities for {len(prompt_list)} prompts; give one "
                f"per prompt",
                "priority",
            )
        return self._run(prompt_list, params_list, use_tqdm, priorities)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's `LLM.beam_search`): every step runs each beam
        as a one-token request asking for 2 * beam_width logprobs; beams share their prefix's
        KV blocks through the prefix cache. Outputs equal transformers' `generate(num_beams=
        beam_width, length_penalty=..., early_stopping="never")`; see `engine.beam_search`.

        Raises ValueError when 2 * beam_width exceeds the engine's max_logprobs.
        """
        engine = self.llm_engine
        num_candidates = 2 * params.beam_width
        max_logprobs = engine.input_processor.max_logprobs
        if num_candidates > max_logprobs:
            raise InvalidRequestError(
                f"beam_width {params.beam_width} needs 2 * beam_width = {num_candidates} "
                f"logprobs per step, more than max_logprobs ({max_logprobs}); lower "
                f"beam_width or raise max_logprobs"
            )
        one_token = step_params(params)

        bar = tqdm(total=params.max_tokens, desc="Beam search steps", disable=not use_tqdm)

        def step(token_ids: list[list[int]]) -> list[dict[int, Logprob]]:
            prompts: list[PromptType] = [{"prompt_token_ids": t} for t in token_ids]
            outputs = self._run(prompts, [one_token] * len(prompts), use_tqdm=False)
            bar.update(1)
            return [output.outputs[0].logprobs[0] for output in outputs]  # type: ignore[index]

        prompt_token_ids = [self._prompt_token_ids(prompt) for prompt in prompts]
        with bar:
            outputs = beam_search(
                step,
                prompt_token_ids,
                params,
                engine.input_processor.eos_token_ids,
                engine.config.model_config.max_model_len,
            )
        tokenizer = self.get_tokenizer()
        for output in outputs:
            for sequence in output.sequences:
                sequence.text = tokenizer.decode(sequence.tokens) if tokenizer else None
        return outputs

    def _prompt_token_ids(self, prompt: PromptType) -> list[int]:
        """Token ids of a beam-search prompt; as generate(), an empty text is a prompt where
        the tokenizer adds BOS, and only a prompt without tokens is refused."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            # Each beam step is a prompt of token ids, which carries no images.
            raise InvalidRequestError(
                "beam_search does not support multi_modal_data yet; use generate",
                "multi_modal_data",
            )
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
        else:
            text = prompt if isinstance(prompt, str) else prompt.get("prompt")
            tokenizer = self.get_tokenizer()
            if not isinstance(text, str) or tokenizer is None:
                raise InvalidRequestError(
                    "beam_search prompts are strings, {'prompt': str} or "
                    "{'prompt_token_ids': [...]}"
                )
            token_ids = list(tokenizer.encode(text))
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token", "prompt")
        return token_ids

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or `chat_template`) and generate (vLLM's
        `LLM.chat`); the messages are rendered as the server renders them
        (`chat_utils.render_chat`).

        messages: one conversation (a list of {"role", "content"} dicts; content a string,
        None, or a list of OpenAI content parts: {"type": "text", "text": ...} and, for a
        vision-language model, {"type": "image_url", "image_url": {"url": ...}} with a
        data:image/...;base64 URL, a file:// URL under allowed_local_media_path or an
        http(s) URL; see `chat_media`) or a list of them. Each image part becomes the
        model's image placeholder in the template's text (a multimodal template gets the
        content as parts, each image {"type": "image"}), and the images go to the engine as
        multi_modal_data.
        chat_template_kwargs: extra variables for the template (e.g. enable_thinking); a
        "tools" key there wins over `tools`, as in vLLM.
        tools: OpenAI's tool list ([{"type": "function", "function": {"name", "description",
        "parameters"}}]), checked as the server checks a request's and rendered by the
        template (vLLM's `tools`); the output is plain text (no tool-call parsing offline).
        Raises ValueError when the tokenizer has no chat template and none is given, for a
        content part other than text and image_url, an image that cannot be loaded, more
        images than limit_mm_per_prompt or an image for a text-only model (each naming the
        part, e.g. messages[0].content[1]), for a malformed tool (naming `tools[i]`), and
        when the template fails on the messages.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        engine = self.llm_engine
        media = MediaOptions.of_model(
            engine.config.model_config, engine.input_processor.mm_processor
        )
        prompts: list[PromptType] = []
        for conversation in conversations:
            conversation, images = load_chat_images(conversation, media)  # type: ignore[arg-type]
            text, token_ids = render_chat(
                tokenizer,
                conversation,
                media.chat_template(tokenizer, chat_template),
                add_generation_prompt,
                continue_final_message,
                chat_template_kwargs,
                # Refuse megabytes before tokenizing them, as generate() and the server do.
                max_model_len=engine.config.model_config.max_model_len,
                tools=tools,
                image_placeholder=media.image_placeholder,
            )
            if images:  # the model's processor expands each placeholder to the image's tokens
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
            else:
                prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params_list, use_tqdm)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, num: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num
        if not isinstance(sampling_params, Iterable) or isinstance(
            sampling_params, str | bytes | dict
        ):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__}"
            )
        params_list = list(sampling_params)
        if len(params_list) != num:
            raise ValueError(
                f"got {len(params_list)} SamplingParams for {num} prompts; "
                "give one, or one per prompt"
            )
        wrong = [p for p in params_list if not isinstance(p, SamplingParams)]
        if wrong:
            raise InvalidRequestError(
                f"sampling_params must be SamplingParams objects, got {type(wrong[0]).__name__}"
            )
        return params_list

    def _run(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids = []
        if priorities is None:
            priorities = [0] * len(prompts)
        mm_processor = engine.input_processor.mm_processor
        try:
            if mm_processor is not None:
                mm_processor.prefetch(_mm_items(prompts))  # the images, in parallel
            for prompt, params, priority in zip(prompts, params_list, priorities, strict=True):
                request_id = str(next(self._request_counter))
                final = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_id, prompt, final, priority=priority)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)  # nothing half-submitted stays behind
            raise
        finally:
            if mm_processor is not None:
                mm_processor.clear_prefetched()
        outputs: dict[str, RequestOutput] = {}
        num_in = num_out = 0  # tokens of the finished requests, for the bar's speeds
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            outputs[output.request_id] = output
                            if use_tqdm:  # vLLM's estimate: finished requests' tokens
                                num_in += len(output.prompt_token_ids)
                                num_out += sum(len(c.token_ids) for c in output.outputs)
                                elapsed = bar.format_dict["elapsed"] or 1e-9
                                bar.set_postfix_str(
                                    f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                                    f"output: {num_out / elapsed:.2f} toks/s",
                                    refresh=False,
                                )
                            bar.update(1)
            except BaseException:
                # A failed step (or Ctrl-C) must not leave this call's requests behind to
                # hang the next generate(): abort them, freeing their blocks, then re-raise.
                engine.abort_request(request_ids)
                raise
        return [outputs[request_id] for request_id in request_ids]


def _mm_items(prompts: list[PromptType]) -> list[tuple[str, Any]]:
    """(text, multi_modal_data) of the prompts that have both, for MultiModalProcessor.prefetch."""
    return [
        (prompt["prompt"], prompt["multi_modal_data"])
        for prompt in prompts
        if isinstance(prompt, Mapping)
        and isinstance(prompt.get("prompt"), str)
        and prompt.get("multi_modal_data") is not None
    ]

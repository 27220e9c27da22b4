"""LLaVA-1.5 offline, end to end on CPU: a tiny random LlavaForConditionalGeneration with a
real processor (sentencepiece-32k + "<image>", CLIPImageProcessorPil) against transformers'
generate; images in the prefix cache and through chunked prefill."""

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from pagedserve import LLM, SamplingParams
from pagedserve.model_config import get_model_max_len
from tests.models.image_urls import data_url, png
from tests.models.tiny_llava import (
    GREEDY,
    IMAGE_TOKEN_ID,
    MAX_TOKENS,
    ONE,
    TEXT_MODEL,
    TWO,
    build_tiny_llava,
    image,
)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llava")
    build_tiny_llava(path)
    return path


def make_llm(model: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(
        dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64
    )
    return LLM(str(model), **(options | kwargs))


def hf_greedy(model_dir: Path, prompt: str, images: list[Image.Image]) -> list[int]:
    """transformers' greedy tokens for the same processor inputs."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(model_dir))
    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]


def generate(llm: LLM, prompt: str, images: list[Image.Image]) -> Any:
    data = {"image": images[0] if len(images) == 1 else images}
    [output] = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY)
    return output


@pytest.fixture(scope="module")
def llm(llava_dir: Path) -> LLM:
    return make_llm(llava_dir)


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_image_embeddings_match_transformers(llava_dir: Path, strategy: str) -> None:
    """Vision tower (second-to-last layer's hidden states) + projector, against
    transformers' get_image_features; "full" keeps the class token's row."""
    from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

    from pagedserve.models.loader import load_model

    config = AutoConfig.from_pretrained(str(llava_dir))
    config.vision_feature_select_strategy = strategy
    ours = load_model(str(llava_dir), config, torch.float32, torch.device("cpu"))
    hf = LlavaForConditionalGeneration.from_pretrained(str(llava_dir)).eval()
    processor = AutoProcessor.from_pretrained(str(llava_dir))
    pixels = processor.image_processor([image(1), image(2)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = hf.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=-2, vision_feature_select_strategy=strategy
        ).pooler_output
        got = ours.embed_multimodal(pixels)  # type: ignore[operator]
    assert got.shape == (2, 4 + (strategy == "full"), 64)
    torch.testing.assert_close(got, torch.stack(list(expected)), atol=1e-5, rtol=1e-5)


def test_engine_reads_the_text_config(llm: LLM) -> None:
    model_config = llm.llm_engine.config.model_config
    assert model_config.hf_text_config is model_config.hf_config.text_config
    assert get_model_max_len(model_config.hf_config) == 256  # text_config's
    assert llm.llm_engine.input_processor.vocab_size == 32064


@pytest.mark.parametrize(("prompt", "seeds"), [(ONE, [1]), (TWO, [1, 2])])
def test_greedy_matches_transformers(
    llava_dir: Path, llm: LLM, prompt: str, seeds: list[int]
) -> None:
    images = [image(s) for s in seeds]
    expected = hf_greedy(llava_dir, prompt, images)
    output = generate(llm, prompt, images)
    assert list(output.outputs[0].token_ids) == expected
    # The prompt counts each image as its 4 placeholder tokens.
    assert len(output.prompt_token_ids) == len(llm.get_tokenizer().encode(prompt)) + 3 * len(seeds)


def test_prompt_logprobs_and_parallel_sampling_with_an_image(llava_dir: Path, llm: LLM) -> None:
    """Every prompt position's logits (image rows included) match transformers' forward;
    n=2 children share the image."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    images = [image(1), image(2)]
    processor = AutoProcessor.from_pretrained(str(llava_dir))
    hf = LlavaForConditionalGeneration.from_pretrained(str(llava_dir)).eval()
    inputs = processor(text=TWO, images=images, return_tensors="pt")
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(**inputs).logits[0].float(), dim=-1)
    ids = inputs["input_ids"][0].tolist()
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, n=2)
    [output] = llm.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, params)
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    for j in range(1, len(ids)):
        got = output.prompt_logprobs[j][ids[j]].logprob
        assert got == pytest.approx(float(logprobs[j - 1, ids[j]]), abs=1e-3), j
    expected = hf_greedy(llava_dir, TWO, images)[:4]
    assert [list(c.token_ids) for c in output.outputs] == [expected, expected]


def test_different_images_give_different_outputs(llm: LLM) -> None:
    first = generate(llm, ONE, [image(1)]).outputs[0].token_ids
    second = generate(llm, ONE, [image(7)]).outputs[0].token_ids
    assert list(first) != list(second)


def test_prefix_cache_hits_the_same_image_only(llava_dir: Path) -> None:
    llm = make_llm(llava_dir, enable_prefix_caching=True, block_size=4)
    prompt = ONE + " It is"  # long enough for several full blocks after the image
    first = generate(llm, prompt, [image(3)])
    assert first.num_cached_tokens == 0
    again = generate(llm, prompt, [image(3)])
    assert again.num_cached_tokens > 0
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    other = generate(llm, prompt, [image(4)])
    # Only the blocks before the image's first token may be shared.
    offset = other.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert other.num_cached_tokens <= offset // 4 * 4


def test_prefix_hit_ending_inside_an_image(llava_dir: Path, llm: LLM) -> None:
    """TWO after ONE with the same first image (tokens 5..8) shares blocks 0 and 1: the
    second request starts at position 8, its image's last token (one row of the image)."""
    cached = make_llm(llava_dir, enable_prefix_caching=True, block_size=4)
    generate(cached, ONE, [image(3)])
    images = [image(3), image(4)]
    got = generate(cached, TWO, images)
    assert got.prompt_token_ids[5:9] == [IMAGE_TOKEN_ID] * 4
    assert got.num_cached_tokens == 8
    expected = generate(llm, TWO, images).outputs[0].token_ids
    assert list(got.outputs[0].token_ids) == list(expected)


def test_preempted_image_requests_recompute_their_images(llava_dir: Path, llm: LLM) -> None:
    """With too few blocks for all, requests are preempted and recomputed (their encoder
    cache rebuilt): outputs as with ample blocks."""
    prompts = [(TWO, [image(s), image(s + 1)]) for s in range(4)]
    batch = [{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in prompts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    small = make_llm(llava_dir, block_size=4, num_gpu_blocks_override=20, max_model_len=64)
    assert [o.outputs[0].token_ids for o in small.generate(batch, params)] == expected
    assert small.llm_engine.scheduler.num_preemptions_total > 0


def test_tensor_parallel_language_model(llava_dir: Path, llm: LLM) -> None:
    """Two CPU ranks: the language model sharded, the vision tower replicated."""
    images = [image(1), image(2)]
    expected = generate(llm, TWO, images).outputs[0].token_ids
    with make_llm(llava_dir, tensor_parallel_size=2) as parallel:
        assert list(generate(parallel, TWO, images).outputs[0].token_ids) == list(expected)


def test_bad_multi_modal_data_is_refused(llm: LLM) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": TWO, "multi_modal_data": {"image": image(1)}}, "do not match"),
        ({"prompt": ONE, "multi_modal_data": {"video": image(1)}}, "modality 'video'"),
        ({"prompt": ONE, "multi_modal_data": {"image": "cat.png"}}, "PIL.Image"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image(1)}}, "text 'prompt'"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=f"multi_modal_data.*{message}"):
            llm.generate(prompt, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    from pagedserve.beam_search_params import BeamSearchParams

    with pytest.raises(ValueError, match="beam_search does not support multi_modal_data"):
        llm.beam_search([{"prompt": ONE, "multi_modal_data": {"image": image(1)}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))  # fmt: skip


def test_a_batch_prepares_its_images_in_parallel(llm: LLM) -> None:
    """LLM.generate prefetches a batch's images on a thread pool: the same token ids and
    features as one by one, a bad prompt in the batch still fails naming it, and nothing
    prefetched stays behind."""
    processor = llm.llm_engine.input_processor.mm_processor
    items = [(ONE, {"image": image(i)}) for i in range(3)] + [(TWO, {"image": image(9)})]
    one_by_one = [processor.process(*item) for item in items[:3]]
    processor.prefetch(items)
    for item, (token_ids, features) in zip(items, one_by_one, strict=False):
        got_ids, got_features = processor.process(*item)
        assert got_ids == token_ids
        assert [f.identifier for f in got_features] == [f.identifier for f in features]
    with pytest.raises(ValueError, match="do not match"):
        processor.process(*items[3])  # its error, kept for its process() call
    processor.clear_prefetched()
    batch = [{"prompt": p, "multi_modal_data": d} for p, d in items]
    with pytest.raises(ValueError, match="multi_modal_data.*do not match"):
        llm.generate(batch, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests() and not processor._prefetched
    outputs = llm.generate(batch[:3], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        list(generate(llm, ONE, [image(i)]).outputs[0].token_ids) for i in range(3)
    ]


def test_async_engine_generates_with_images(llava_dir: Path, llm: LLM) -> None:
    """AsyncLLMEngine (its engine core in another process: the images cross the socket as
    bytes) gives the offline engine's greedy tokens for one and two images, concurrently."""
    import asyncio

    from pagedserve import AsyncLLMEngine
    from pagedserve.engine.arg_utils import EngineArgs

    cases = [(ONE, [image(1)]), (TWO, [image(2), image(3)])]
    expected = [generate(llm, prompt, images).outputs[0].token_ids for prompt, images in cases]
    args = EngineArgs(
        model=str(llava_dir), dtype="float32", device="cpu", max_model_len=256,
        num_gpu_blocks_override=64,
    )  # fmt: skip

    async def run(engine: AsyncLLMEngine, i: int) -> list[int]:
        prompt, images = cases[i]
        data = {"image": images[0] if len(images) == 1 else images}
        request = {"prompt": prompt, "multi_modal_data": data}
        async for output in engine.generate(request, GREEDY, f"r{i}"):
            final = output
        return list(final.outputs[0].token_ids)

    async def main() -> list[list[int]]:
        engine = AsyncLLMEngine.from_engine_args(args)
        try:
            return list(await asyncio.gather(run(engine, 0), run(engine, 1)))
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == [list(tokens) for tokens in expected]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_through_an_image(
    llava_dir: Path, llm: LLM, async_scheduling: bool
) -> None:
    """A 3-token budget splits each image's 4 tokens across steps (prefill chunks start at
    multiples of 3); with async scheduling (CUDA's default) too."""
    images = [image(5), image(6)]
    expected = generate(llm, TWO, images)
    ids = expected.prompt_token_ids
    offsets = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID and ids[i - 1] != t]
    assert offsets and all(offset // 3 != (offset + 3) // 3 for offset in offsets)
    chunked = make_llm(
        llava_dir,
        max_num_batched_tokens=3,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
    )
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": images}}] * 2  # decode + prefill
    outputs = chunked.generate(prompts, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        list(expected.outputs[0].token_ids)
    ] * 2


def test_batch_of_image_requests(llm: LLM) -> None:
    """Requests with images prefilled in one step (one encoder batch) get what each gets
    alone."""
    prompts = [(ONE, [image(1)]), (TWO, [image(2), image(3)]), (ONE, [image(4)])]
    alone = [list(generate(llm, p, ims).outputs[0].token_ids) for p, ims in prompts]
    batch = [
        {"prompt": p, "multi_modal_data": {"image": ims if len(ims) > 1 else ims[0]}}
        for p, ims in prompts
    ]
    together = [list(o.outputs[0].token_ids) for o in llm.generate(batch, GREEDY)]
    assert together == alone


def test_new_checkpoint_layout(llava_dir: Path, tmp_path: Path) -> None:
    """transformers 4.52+ names (model.vision_tower.vision_model., model.language_model.,
    lm_head.) load to the same model as the old layout transformers 5 saves (vision_tower.,
    language_model.model., language_model.lm_head.)."""
    from safetensors.torch import load_file, save_file

    renames = (
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    )
    tensors = load_file(str(llava_dir / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = tensor
    assert len(renamed) == len(tensors) and "lm_head.weight" in renamed
    # A buffer that checkpoints of older transformers versions hold: skipped.
    renamed["model.vision_tower.vision_model.embeddings.position_ids"] = torch.arange(5)[None]
    for path in llava_dir.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    images = [image(1)]
    expected = generate(make_llm(llava_dir), ONE, images).outputs[0].token_ids
    assert list(generate(make_llm(tmp_path), ONE, images).outputs[0].token_ids) == list(expected)


def test_text_only_model_refuses_multi_modal_data() -> None:
    llm = LLM(str(TEXT_MODEL), dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "Hi <image>", "multi_modal_data": {"image": image(0)}}, GREEDY)


def test_text_prompt_without_images(llm: LLM) -> None:
    """A LLaVA prompt with no image runs the text-only path."""
    [output] = llm.generate("USER: Hello ASSISTANT:", GREEDY)
    assert len(output.outputs[0].token_ids) == MAX_TOKENS


def test_registry_runs_llava_natively_only() -> None:
    """LLaVA runs on our code (auto, pagedserve); the transformers backend runs no
    multimodal config, so model_impl="transformers" is refused as for every other one."""
    from transformers import LlavaConfig

    from pagedserve.errors import UnsupportedModelError
    from pagedserve.models.registry import check_model_impl

    config = LlavaConfig(architectures=["LlavaForConditionalGeneration"])
    assert check_model_impl(config, "auto") == "pagedserve"
    assert check_model_impl(config, "pagedserve") == "pagedserve"
    with pytest.raises(UnsupportedModelError, match="multimodal model .* text_config"):
        check_model_impl(config, "transformers")


def test_chat_with_image_parts(llm: LLM, tmp_path: Path) -> None:
    """LLM.chat renders each image_url part as the template's "<image>" and gives the
    offline generate's tokens; a bad part is refused naming it."""
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image(1))}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(image(2))}},
    ]
    [output] = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    assert output.prompt == "USER: <image>\n<image>\nand ASSISTANT:"
    expected = generate(llm, output.prompt, [image(1), image(2)])
    assert output.prompt_token_ids == expected.prompt_token_ids
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids

    # A template that takes string content (as vLLM's template_llava.jinja) gets each image
    # as the processor's "<image>" at the start of the message's text, as vLLM renders it.
    string_template = (
        "{% for message in messages %}{{ message['role'].upper() + ': ' + message['content'] }}"
        " {% endfor %}ASSISTANT:"
    )
    [as_text] = llm.chat(
        [{"role": "user", "content": parts}], GREEDY, chat_template=string_template,
        use_tqdm=False,
    )  # fmt: skip
    assert as_text.prompt == "USER: <image>\n<image>\nand ASSISTANT:"

    (tmp_path / "cat.png").write_bytes(png(image(1)))
    bad = {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'cat.png'}"}}
    with pytest.raises(ValueError, match="without --allowed-local-media-path") as error:
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, bad]}])
    assert error.value.param == "messages[0].content[1]"  # type: ignore[attr-defined]


def test_chat_template_from_the_processor(llava_dir: Path, tmp_path: Path) -> None:
    """A folder whose template is only in the processor's chat_template.json (older llava-hf
    checkpoints; the tokenizer does not read it) still chats."""
    import json
    import shutil

    folder = tmp_path / "llava-json-template"
    shutil.copytree(llava_dir, folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    llm = make_llm(folder)
    assert llm.get_tokenizer().chat_template is None
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    [output] = llm.chat(messages, GREEDY, use_tqdm=False)
    assert output.prompt == "USER: Hi ASSISTANT:"


def test_limit_mm_per_prompt_offline(llava_dir: Path) -> None:
    """limit_mm_per_prompt (vLLM's) refuses a prompt with more images, naming the limit."""
    limited = make_llm(llava_dir, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match=r"2 images, more than limit_mm_per_prompt"):
        limited.generate({"prompt": TWO, "multi_modal_data": {"image": [image(1), image(2)]}})

"""Qwen2.5-VL offline, end to end on CPU: a tiny random Qwen2_5_VLForConditionalGeneration
with the real Qwen tokenizer and Qwen2VLImageProcessorPil against transformers (vision encoder,
M-RoPE positions, greedy generate) for images of different sizes; images in the prefix cache,
chunked prefill and preemption."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from pagedserve import LLM, SamplingParams
from tests.models.image_urls import data_url
from tests.models.tiny_qwen2_5_vl import (
    GREEDY,
    IMAGE_TOKEN_ID,
    MAX_TOKENS,
    ONE,
    TWO,
    build_tiny_qwen2_5_vl,
    image,
    wide_image,
)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl")
    build_tiny_qwen2_5_vl(path)
    return path


@pytest.fixture(scope="module")
def hf_model(qwen_dir: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(qwen_dir)).eval()


def make_llm(model: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(
        dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64
    )
    return LLM(str(model), **(options | kwargs))


@pytest.fixture(scope="module")
def llm(qwen_dir: Path) -> LLM:
    return make_llm(qwen_dir)


def hf_inputs(model_dir: Path, prompt: str, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """What Qwen2_5_VLProcessor gives transformers' model (built from the same tokenizer and
    image processor: the processor itself needs torchvision), with mm_token_type_ids, which
    get_rope_index needs to place the images."""
    from pagedserve.engine.image_prompt_processor import ImagePromptProcessor

    processor = ImagePromptProcessor.from_pretrained(str(model_dir))
    inputs = {k: torch.from_numpy(v) for k, v in processor(prompt, images).items()}
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_TOKEN_ID).int()
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return inputs


def hf_greedy(hf_model: Any, model_dir: Path, prompt: str, images: list[Image.Image]) -> list[int]:
    inputs = hf_inputs(model_dir, prompt, images)
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]


def generate(llm: LLM, prompt: str, images: list[Image.Image], **kwargs: Any) -> Any:
    data = {"image": images[0] if len(images) == 1 else images}
    [output] = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, **kwargs)
    return output


def test_image_embeddings_match_transformers(qwen_dir: Path, hf_model: Any) -> None:
    """Our vision encoder (window and full attention, 2-D RoPE, merger) on three images of two
    sizes in one batch, against transformers' get_image_features."""
    from transformers import AutoConfig, AutoImageProcessor

    from pagedserve.models.loader import load_model

    config = AutoConfig.from_pretrained(str(qwen_dir))
    ours = load_model(str(qwen_dir), config, torch.float32, torch.device("cpu"))
    processor = AutoImageProcessor.from_pretrained(str(qwen_dir))
    inputs = processor([image(1), wide_image(2), image(3)], return_tensors="pt")
    grids = [(int(t), int(h), int(w)) for t, h, w in inputs["image_grid_thw"].tolist()]
    assert grids == [(1, 4, 4), (1, 6, 8), (1, 4, 4)]
    with torch.no_grad():
        expected = hf_model.model.get_image_features(
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        ).pooler_output
        got = ours.embed_multimodal(inputs["pixel_values"], grids)  # type: ignore[operator]
    assert [g.shape for g in got] == [(4, 64), (12, 64), (4, 64)]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_mrope_positions_match_transformers(qwen_dir: Path, hf_model: Any, llm: LLM) -> None:
    """The prompt's 3-D positions and delta (computed once per request) equal
    get_rope_index's; the wide image's rows and columns differ."""
    images = [image(1), wide_image(2)]
    inputs = hf_inputs(qwen_dir, TWO, images)
    expected, delta = hf_model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    processor = llm.llm_engine.input_processor.mm_processor
    assert processor is not None
    ids, features = processor.process(TWO, {"image": images})
    assert [(f.offset, f.length, f.grid_thw) for f in features] == [
        (4, 4, (1, 4, 4)),
        (12, 12, (1, 6, 8)),
    ]
    from pagedserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(hf_model.config)
    positions, got_delta = model.get_mrope_input_positions(ids, features)
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert got_delta == int(delta) < 0  # 16 image tokens span fewer positions
    assert list(positions[1, 12:24]) != list(positions[2, 12:24])


def test_placeholder_runs_of_different_lengths() -> None:
    """Per-image lengths split adjacent runs; a mismatch is a ValueError naming both."""
    from pagedserve.multimodal import placeholder_ranges

    ids = [1, 9, 9, 9, 9, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 3]
    assert placeholder_ranges(ids, 9, 2, [4, 12]) == [(1, 4), (6, 12)]
    assert placeholder_ranges([9] * 6, 9, 2, [2, 4]) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match=r"16 image placeholder tokens for 2 images of \[4, 8\]"):
        placeholder_ranges(ids, 9, 2, [4, 8])
    with pytest.raises(ValueError, match="not contiguous"):
        placeholder_ranges(ids, 9, 2, [2, 14])


@pytest.mark.parametrize(
    ("prompt", "images"),
    [(ONE, [image(1)]), (TWO, [image(1), wide_image(2)]), (TWO, [wide_image(3), image(4)])],
)
def test_greedy_matches_transformers(
    qwen_dir: Path, hf_model: Any, llm: LLM, prompt: str, images: list[Image.Image]
) -> None:
    expected = hf_greedy(hf_model, qwen_dir, prompt, images)
    output = generate(llm, prompt, images)
    assert list(output.outputs[0].token_ids) == expected
    num_image_tokens = sum(4 if im.size == (56, 56) else 12 for im in images)
    assert output.prompt_token_ids.count(IMAGE_TOKEN_ID) == num_image_tokens


def test_prompt_logprobs_match_transformers(qwen_dir: Path, hf_model: Any, llm: LLM) -> None:
    """Every prompt position's logprob (image rows and the text after them, whose M-RoPE
    positions differ from their indices) matches transformers' forward."""
    images = [wide_image(1), image(2)]
    inputs = hf_inputs(qwen_dir, TWO, images)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(**inputs).logits[0].float(), dim=-1)
    ids = inputs["input_ids"][0].tolist()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [output] = llm.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, params)
    assert output.prompt_token_ids == ids and output.prompt_logprobs is not None
    for j in range(1, len(ids)):
        got = output.prompt_logprobs[j][ids[j]].logprob
        assert got == pytest.approx(float(logprobs[j - 1, ids[j]]), abs=1e-4), j


def test_chat_with_image_parts(llm: LLM) -> None:
    """LLM.chat renders each image part as <|vision_start|><|image_pad|><|vision_end|> (the
    template's) and gives the offline generate's tokens."""
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image(1))}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(wide_image(2))}},
    ]
    [output] = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    image_text = "<|vision_start|><|image_pad|><|vision_end|>"
    assert output.prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{image_text}and{image_text}<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = generate(llm, output.prompt, [image(1), wide_image(2)])
    assert output.prompt_token_ids == expected.prompt_token_ids
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids


def test_different_images_give_different_outputs(llm: LLM) -> None:
    first = generate(llm, ONE, [image(1)]).outputs[0].token_ids
    second = generate(llm, ONE, [image(7)]).outputs[0].token_ids
    assert list(first) != list(second)


def test_prefix_cache_with_images(qwen_dir: Path, llm: LLM) -> None:
    """A repeated prompt with the same images starts its prefill past the cached blocks (in
    or after the images) with the right M-RoPE positions: the uncached output."""
    images = [image(3), wide_image(4)]
    expected = list(generate(llm, TWO, images).outputs[0].token_ids)
    cached = make_llm(qwen_dir, enable_prefix_caching=True, block_size=4)
    first = generate(cached, TWO, images)
    assert first.num_cached_tokens == 0
    again = generate(cached, TWO, images)
    assert again.num_cached_tokens > 0
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == expected
    # Another second image: the hit ends where its tokens start (block-aligned offset 12).
    other = generate(cached, TWO, [image(3), wide_image(5)])
    assert other.num_cached_tokens == 12 == other.prompt_token_ids.index(IMAGE_TOKEN_ID, 8)
    assert list(other.outputs[0].token_ids) == list(
        generate(llm, TWO, [image(3), wide_image(5)]).outputs[0].token_ids
    )


def test_prefix_hit_ending_inside_an_image(qwen_dir: Path, llm: LLM) -> None:
    """Two prompts that share text and a first image up to its <|vision_end|>, shifted so
    that the block boundary falls inside that image: the second starts its prefill at the
    image's last row, whose positions are grid positions, not text ones."""
    one = ONE.replace("user\n", "user\nLook")
    two = TWO.replace("user\n", "user\nLook")
    cached = make_llm(qwen_dir, enable_prefix_caching=True, block_size=4)
    generate(cached, one, [image(3)])
    images = [image(3), wide_image(4)]
    got = generate(cached, two, images)
    offset = got.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert offset < got.num_cached_tokens < offset + 4
    expected = generate(llm, two, images).outputs[0].token_ids
    assert list(got.outputs[0].token_ids) == list(expected)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_through_an_image(qwen_dir: Path, llm: LLM, async_scheduling: bool) -> None:
    """A 5-token budget splits both images' tokens across steps; with async scheduling (CUDA's
    default) too; two requests (one decodes while the other prefills)."""
    images = [image(5), wide_image(6)]
    expected = generate(llm, TWO, images)
    chunked = make_llm(
        qwen_dir,
        max_num_batched_tokens=5,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
    )
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": images}}] * 2
    outputs = chunked.generate(prompts, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        list(expected.outputs[0].token_ids)
    ] * 2


def test_batch_and_preemption(qwen_dir: Path, llm: LLM) -> None:
    """Requests with images of different sizes in one encoder batch get what each gets alone;
    with too few blocks they are preempted and recomputed (positions rebuilt) to the same."""
    cases = [(TWO, [image(s), wide_image(s + 1)]) for s in range(3)] + [(ONE, [image(9)])]
    alone = [list(generate(llm, p, ims).outputs[0].token_ids) for p, ims in cases]
    batch = [
        {"prompt": p, "multi_modal_data": {"image": ims if len(ims) > 1 else ims[0]}}
        for p, ims in cases
    ]
    assert [list(o.outputs[0].token_ids) for o in llm.generate(batch, GREEDY)] == alone
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    small = make_llm(qwen_dir, block_size=4, num_gpu_blocks_override=24, max_model_len=64)
    assert [o.outputs[0].token_ids for o in small.generate(batch, params)] == expected
    assert small.llm_engine.scheduler.num_preemptions_total > 0


def test_swap_cpu_tier_chunks_async_and_prefix_hits_together(qwen_dir: Path, llm: LLM) -> None:
    """Images under every KV feature at once: 7-token chunks with async scheduling, prefix
    hits ending inside images (repeated and shifted prompts), a 20-block cache whose requests
    are swapped out and in (their M-RoPE positions rebuilt past the images), and evicted
    blocks back from the CPU tier: each output is the roomy run's."""
    one = ONE.replace("user\n", "user\nLook")
    two = TWO.replace("user\n", "user\nLook")
    batch: list[Any] = [
        {"prompt": TWO, "multi_modal_data": {"image": [image(s), wide_image(s + 1)]}}
        for s in range(3)
    ]
    batch += [
        {"prompt": one, "multi_modal_data": {"image": image(3)}},
        {"prompt": two, "multi_modal_data": {"image": [image(3), wide_image(4)]}},
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    ]
    batch += [batch[0], batch[4]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    tight = make_llm(
        qwen_dir,
        max_model_len=64,
        num_gpu_blocks_override=20,
        block_size=4,
        enable_prefix_caching=True,
        max_num_batched_tokens=7,
        async_scheduling=True,
        preemption_mode="swap",
        swap_space=0.01,
        kv_offload_gb=0.01,
    )
    for _ in range(2):  # the second time, hits in both tiers
        assert [o.outputs[0].token_ids for o in tight.generate(batch, params)] == expected
    assert tight.llm_engine.scheduler.num_swap_outs_total > 0
    assert tight.llm_engine.kv_cache.num_cpu_hit_tokens > 0
    tight.llm_engine.kv_cache.check_invariants()


def test_new_checkpoint_layout(qwen_dir: Path, llm: LLM, tmp_path: Path) -> None:
    """The model.visual. / model.language_model. layout loads to the same model as the
    visual. / model. one that this transformers saves."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(qwen_dir / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        renamed[name] = tensor
    assert "model.visual.merger.ln_q.weight" in renamed and "lm_head.weight" in renamed
    for path in qwen_dir.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    images = [wide_image(1)]
    expected = generate(llm, ONE, images).outputs[0].token_ids
    assert list(generate(make_llm(tmp_path), ONE, images).outputs[0].token_ids) == list(expected)


def test_text_prompt_without_images(qwen_dir: Path, hf_model: Any, llm: LLM) -> None:
    """A prompt with no image runs the text-only path (positions equal on all axes)."""
    prompt = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.get_tokenizer().encode(prompt)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    [output] = llm.generate(prompt, GREEDY)
    assert list(output.outputs[0].token_ids) == out[0, len(ids) :].tolist()


def test_unsupported_inputs_are_refused(qwen_dir: Path, llm: LLM) -> None:
    """Video input is refused naming the modality; a scaled text RoPE at start-up."""
    with pytest.raises(ValueError, match="modality 'video' is not supported"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"video": image(1)}}, GREEDY)
    with pytest.raises(ValueError, match="do not match"):
        llm.generate({"prompt": TWO, "multi_modal_data": {"image": image(1)}}, GREEDY)
    from transformers import AutoConfig

    from pagedserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    config = AutoConfig.from_pretrained(str(qwen_dir))
    config.text_config.rope_parameters = {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "mrope_section": [2, 3, 3]
    }  # fmt: skip
    with pytest.raises(NotImplementedError, match="rope_type 'linear'"):
        Qwen2_5_VLForConditionalGeneration(config)
    config.text_config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(NotImplementedError, match="mrope_section"):
        Qwen2_5_VLForConditionalGeneration(config)


def test_tensor_parallel_language_model(qwen_dir: Path, llm: LLM) -> None:
    """Two CPU ranks: the language model sharded (each rank computes the M-RoPE positions),
    the vision encoder replicated."""
    images = [image(1), wide_image(2)]
    expected = generate(llm, TWO, images).outputs[0].token_ids
    with make_llm(qwen_dir, tensor_parallel_size=2) as parallel:
        assert list(generate(parallel, TWO, images).outputs[0].token_ids) == list(expected)


def test_registry_runs_qwen2_5_vl_natively_only() -> None:
    from transformers import Qwen2_5_VLConfig

    from pagedserve.errors import UnsupportedModelError
    from pagedserve.models.registry import check_model_impl

    config = Qwen2_5_VLConfig(architectures=["Qwen2_5_VLForConditionalGeneration"])
    assert check_model_impl(config, "auto") == "pagedserve"
    with pytest.raises(UnsupportedModelError, match="multimodal model .* text_config"):
        check_model_impl(config, "transformers")

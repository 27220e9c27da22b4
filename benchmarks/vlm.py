"""Vision-language throughput: LLaVA-1.5-7B's architecture (dummy weights), requests of one
image and a text prompt, through the engine and through transformers' static batches.

Issue 18's measurement: 500 requests of one 336x336 image and 64 text tokens, 128 output
tokens (`ignore_eos`), output tok/s of the engine against transformers `generate` on the same
requests in static batches of 32 (left padding, `min_new_tokens` = `max_new_tokens`), both in
this process, both timed from the PIL images (the processor's work is in both). The engine's
vision-encoder time is the sum over its `embed_multimodal` calls, each timed between two
device syncs (the syncs cost both sides nothing they would not do: encoding waits for the
step anyway); transformers' is timed the same way around `get_image_features`.

The folder is written here: llava-hf/llava-1.5-7b-hf's config (CLIP ViT-L/14 at 336 px,
Vicuna-7B: Llama-2-7B's shape, vocabulary 32,064), the sentencepiece-32k tokenizer from
../shared with "<image>" (id 32000) and "<pad>" added, and a PIL CLIP image processor.

  python benchmarks/vlm.py --num-prompts 500 --hf-batch-size 32          # one H200
  python benchmarks/vlm.py --tiny --num-prompts 8 --device cpu --hf-batch-size 4  # smoke
"""

import argparse
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.throughput import _free_gpu_memory  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
TOKENIZER = SHARED / "tokenizers" / "sentencepiece-32k"
WORDS = ["the", "a", "little", "dog", "cat", "ran", "home", "sun", "big", "red", "tree", "bird",
         "sky", "over", "under", "happy"]  # fmt: skip

# llava-hf/llava-1.5-7b-hf config.json (vision: CLIP ViT-L/14-336; text: Vicuna-7B v1.5)
VISION_7B = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                 num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768,
                 hidden_act="quick_gelu", layer_norm_eps=1e-5)  # fmt: skip
TEXT_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
               max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0)  # fmt: skip
VISION_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, image_size=336, patch_size=14)  # fmt: skip
TEXT_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=32064,
                 max_position_embeddings=2048)  # fmt: skip


def write_model(path: Path, tiny: bool, tokenizer_dir: Path = TOKENIZER) -> None:
    """Write the LLaVA-1.5 folder (config, tokenizer, processor; no weights) into `path`;
    the tokenizer is sentencepiece-32k's (`tokenizer_dir`)."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"], "pad_token": "<pad>"})
    image_size = 336
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**(VISION_TINY if tiny else VISION_7B)),
        text_config=LlamaConfig(
            **(TEXT_TINY if tiny else TEXT_7B), bos_token_id=1, eos_token_id=2, pad_token_id=32001
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        dtype="bfloat16" if not tiny else "float32",
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(str(path))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        ),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(str(path))


def make_requests(num: int, text_tokens: int, seed: int, tokenizer: Any) -> list[tuple[str, Any]]:
    """(prompt, PIL image) pairs: a random 336x336 image each and `text_tokens` tokens of
    random words (cut at that many tokens) in LLaVA-1.5's "USER: <image>\\n... ASSISTANT:"."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    requests = []
    for _ in range(num):
        words = " ".join(rng.choice(WORDS, size=text_tokens * 2))
        ids = tokenizer(words, add_special_tokens=False)["input_ids"][:text_tokens]
        text = tokenizer.decode(ids)
        pixels = rng.randint(0, 256, (336, 336, 3), dtype=np.uint8)
        requests.append((f"USER: <image>\n{text} ASSISTANT:", Image.fromarray(pixels)))
    return requests


def timed_on_device(fn: Callable[..., Any], total: list[float], device: str) -> Callable[..., Any]:
    """`fn` with its seconds (between two device syncs) added to total[0]."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        total[0] += time.perf_counter() - start
        return out

    return wrapper


def run_engine(
    args: argparse.Namespace, model: Path, requests: list, warm_up: list
) -> dict[str, Any]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        str(model),
        load_format="dummy",
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        device=args.device,
        seed=0,
    )
    runner_model = llm.llm_engine.engine_core.executor.worker.runner.model
    encoder = [0.0]
    runner_model.embed_multimodal = timed_on_device(
        runner_model.embed_multimodal, encoder, args.device
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in requests]
    # Warm-up on other images (the same ones would hit the prefix cache in the run).
    warm = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in warm_up]
    llm.generate(warm, params, use_tqdm=False)
    encoder[0] = 0.0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.llm_engine.shutdown()
    return dict(seconds=elapsed, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                encoder_seconds=encoder[0])  # fmt: skip


def run_hf(args: argparse.Namespace, model: Path, requests: list) -> dict[str, Any]:
    import torch
    from transformers import AutoProcessor, LlavaConfig, LlavaForConditionalGeneration

    dtype = getattr(torch, args.dtype)
    processor = AutoProcessor.from_pretrained(str(model))
    processor.tokenizer.padding_side = "left"
    config = LlavaConfig.from_pretrained(str(model))
    with torch.device(args.device):
        hf = LlavaForConditionalGeneration._from_config(
            config, dtype=dtype, attn_implementation="sdpa"
        ).eval()
    encoder = [0.0]
    hf.model.get_image_features = timed_on_device(hf.model.get_image_features, encoder, args.device)

    def generate(batch: list) -> int:
        inputs = processor(
            text=[p for p, _ in batch], images=[im for _, im in batch],
            return_tensors="pt", padding=True,
        ).to(args.device)  # fmt: skip
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.no_grad():
            out = hf.generate(
                **inputs, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                do_sample=False, pad_token_id=config.text_config.pad_token_id,
            )  # fmt: skip
        return int(out.shape[0] * (out.shape[1] - inputs["input_ids"].shape[1]))

    generate(requests[: min(2, len(requests))])  # warm-up
    encoder[0] = 0.0
    start = time.perf_counter()
    output_tokens = 0
    for i in range(0, len(requests), args.hf_batch_size):
        output_tokens += generate(requests[i : i + args.hf_batch_size])
    elapsed = time.perf_counter() - start
    return dict(seconds=elapsed, output_tokens=output_tokens, encoder_seconds=encoder[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--text-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (smoke test)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER,
                        help="the sentencepiece-32k folder (../shared/tokenizers/)")  # fmt: skip
    args = parser.parse_args()

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "llava-1.5-7b"
        write_model(model, args.tiny, args.tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        requests = make_requests(args.num_prompts, args.text_len, args.seed, tokenizer)
        warm_up = make_requests(4, args.text_len, args.seed + 1, tokenizer)
        results = {}
        if not args.no_hf:  # first: the engine's memory is not all handed back in-process
            results["transformers (static batches)"] = run_hf(args, model, requests)
            _free_gpu_memory()
        results["pagedserve"] = run_engine(args, model, requests, warm_up)

    n = args.num_prompts
    print(f"LLaVA-1.5-{'tiny' if args.tiny else '7B'} (dummy weights), {n} requests: one "
          f"336x336 image + {args.text_len} text tokens, {args.output_len} out; "
          f"{args.device}, {args.dtype}, commit {git_commit()}")  # fmt: skip
    print(f"{'run':32} {'seconds':>8} {'req/s':>8} {'out tok/s':>10} {'encoder s':>10}")
    for name, r in results.items():
        tok_s = r["output_tokens"] / r["seconds"]
        print(f"{name:32} {r['seconds']:8.2f} {n / r['seconds']:8.2f} {tok_s:10.1f} "
              f"{r['encoder_seconds']:10.3f}")  # fmt: skip
    if len(results) == 2:
        hf, ours = results.values()
        speedup = (ours["output_tokens"] / ours["seconds"]) / (hf["output_tokens"] / hf["seconds"])
        print(f"speed-up (output tok/s): {speedup:.2f}x")
    print(json.dumps({"commit": git_commit(), "args": vars(args), "results": results}, default=str))


if __name__ == "__main__":
    main()

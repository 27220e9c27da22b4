"""End to end: greedy outputs of `LLM.generate` equal transformers' `generate` token for token."""

import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams

SHARED = Path(__file__).resolve().parents[3] / "shared"
TOKENIZER = SHARED / "models" / "stories260k"  # vocab 512; any tokenizer with ids < 512 works

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.2,  # peaked logits: no near-ties for float rounding to flip
)

CONFIGS = {
    "llama_gqa_untied": transformers.LlamaConfig(
        **_COMMON, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "mistral": transformers.MistralConfig(**_COMMON, num_key_value_heads=1, sliding_window=None),
    "qwen2": transformers.Qwen2Config(**_COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": transformers.Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=32),
    "gpt2": transformers.GPT2Config(
        vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.2
    ),
    # Sliding windows of 8 tokens, prompts of up to 40: local layers see part of the context.
    "gemma2": transformers.Gemma2Config(
        **_COMMON, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8
    ),
    "gemma3": transformers.Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 6},  # transformers' default: 5 local, 1 global
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "phi3": transformers.Phi3Config(
        **_COMMON, num_key_value_heads=2, sliding_window=8, pad_token_id=0, bos_token_id=1
    ),
}


def save_tiny_model(config: transformers.PretrainedConfig, path: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, path / name)
    return path


def hf_greedy(model_path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    # Eager attention, the model's reference math (transformers' default SDPA drops Gemma 2's
    # attention soft cap in some versions, e.g. 5.17).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def random_prompts(num: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(2, 40))] for _ in range(num)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_equals_transformers_with_a_tight_cache(name: str, tmp_path: Path) -> None:
    """10 prompts submitted together; 24 blocks of 4 tokens cannot hold them all at once and a
    16-token budget chunks the prompts, so requests wait, chunk and get preempted (unless every
    layer has a sliding window, which bounds what each request holds)."""
    model_path = save_tiny_model(CONFIGS[name], tmp_path / name)
    prompts = random_prompts(10, 512)
    max_tokens = 12
    expected = hf_greedy(model_path, prompts, max_tokens)

    llm = LLM(
        str(model_path),
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=24,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        device="cpu",
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if llm.llm_engine.engine_core.sliding_window is None:
        assert llm.llm_engine.scheduler.num_preemptions_total > 0
        assert llm.llm_engine.kv_cache.num_free_blocks == 24
    else:
        # Every layer windowed (phi3 here): blocks leave the window and go back to the pool,
        # so the cache may never run short; block 0 is the null block.
        assert llm.llm_engine.kv_cache.num_free_blocks == 23
    llm.llm_engine.kv_cache.check_invariants()


@pytest.mark.parametrize("model_name", ["stories260k", "tinystories-656k"])
def test_real_models_greedy_equal_transformers(model_name: str) -> None:
    model_path = SHARED / "models" / model_name
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    texts = [
        "Once upon a time",
        "The little dog",
        "Lily and Tom went to the park. They",
        "One day, a big bird",
        "Sam had a red ball",
        "Mom said",
        "The sun was hot and",
        "Once upon a time, there was a little girl named Lily. She loved to play",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = hf_greedy(model_path, prompts, 30)
    llm = LLM(
        str(model_path),
        dtype="float32",
        block_size=16,
        num_gpu_blocks_override=12,
        max_model_len=128,
        device="cpu",
    )
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outputs = llm.generate(texts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for output, ids in zip(outputs, expected, strict=True):
        assert output.outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True) or (
            output.outputs[0].text.strip()
            == tokenizer.decode(ids, skip_special_tokens=True).strip()
        )


def test_sliding_window_mistral_greedy_equals_transformers(tmp_path: Path) -> None:
    """Mistral with sliding_window=8 (a query sees its 8 last keys) on 30-token prompts that
    share 16 tokens, 20 new tokens each: chunked prefill (16-token budget), prefix caching and
    a cache of 16 blocks of 4, which without the window could not even run two requests at
    once (50 tokens = 13 blocks each). Outputs equal transformers' token for token; blocks
    that leave the window go back to the pool, so a request holds at most
    cdiv(8 - 1 + 16, 4) + 1 = 7 blocks while prefilling and cdiv(8, 4) + 1 = 3 while
    decoding; a second round of the same prompts hits the prefix cache (only the blocks of
    the last window before the hit need to be cached) and gives the same tokens. (CPU, torch
    backend; tests/gpu/test_sliding_window_gpu.py runs it on the Triton kernels.)"""
    config = transformers.MistralConfig(**_COMMON, num_key_value_heads=1, sliding_window=8)
    model_path = save_tiny_model(config, tmp_path / "mistral_sliding_window")
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(16)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(14)] for _ in range(6)]
    expected = hf_greedy(model_path, prompts, 20)

    llm = LLM(
        str(model_path),
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=16,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_prefix_caching=True,
        device="cpu",
    )
    engine = llm.llm_engine
    assert engine.engine_core.sliding_window == 8
    kv_cache = engine.kv_cache
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", {"prompt_token_ids": prompt}, params)
        finished = {}
        peak_prefill = peak_decode = max_running = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            max_running = max(max_running, engine.scheduler.num_running)
            for request in engine.scheduler.running:
                table = kv_cache.req_to_blocks[request.request_id]
                num_held = sum(block is not kv_cache.block_pool.null_block for block in table)
                if request.num_computed_tokens <= len(request.prompt_token_ids):
                    peak_prefill = max(peak_prefill, num_held)
                else:
                    peak_decode = max(peak_decode, num_held)
            kv_cache.check_invariants()
        got = [finished[f"{round_}-{i}"].outputs[0].token_ids for i in range(len(prompts))]
        assert got == expected
        assert peak_prefill <= 7 and peak_decode <= 3 and max_running > 1
        cached = [finished[f"{round_}-{i}"].num_cached_tokens for i in range(len(prompts))]
        # Hits of 16 tokens or more: their first blocks come back as null blocks (the query
        # at 16 reads from 9 on, block 2).
        assert round_ == 0 or max(cached) >= 16
    assert kv_cache.num_free_blocks == 15  # all but the null block


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_sliding_window_prefix_cache_hits(name: str, tmp_path: Path) -> None:
    """Prompts sharing a 24-token prefix (3 windows): the second batch reads the first one's
    blocks from the prefix cache, and every output still equals transformers'."""
    model_path = save_tiny_model(CONFIGS[name], tmp_path / name)
    rng = random.Random(1)
    prefix = [rng.randrange(3, 512) for _ in range(24)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 14, 6)]
    expected = hf_greedy(model_path, prompts, 10)
    llm = LLM(
        str(model_path),
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=64,
        max_model_len=64,
        max_num_batched_tokens=16,
        device="cpu",
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens >= 20 for o in rest)  # 5 full blocks of the prefix


LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.3, 4.1, 5.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
}


@pytest.mark.parametrize(
    ("max_model_len", "prompt_lens"),
    [(32, (3, 9, 14, 20)), (128, (33, 40, 57))],
    ids=["short_factors", "long_factors"],
)
def test_phi3_longrope_greedy(
    max_model_len: int, prompt_lens: tuple[int, ...], tmp_path: Path
) -> None:
    """LongRoPE with an original context of 32 in 128 positions: served within 32 tokens
    (prompt and output) the short factors apply, as in transformers; with max_model_len 128
    the long factors and attention factor, as transformers uses for prompts beyond 32."""
    config = transformers.Phi3Config(
        **_COMMON,
        num_key_value_heads=2,
        original_max_position_embeddings=32,
        rope_scaling=dict(LONGROPE),
        pad_token_id=0,
        bos_token_id=1,
    )
    model_path = save_tiny_model(config, tmp_path / "phi3_longrope")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in prompt_lens]
    max_tokens = 32 - max(prompt_lens) if max_model_len == 32 else 10
    expected = hf_greedy(model_path, prompts, max_tokens)
    llm = LLM(
        str(model_path),
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=96,
        max_model_len=max_model_len,
        max_num_batched_tokens=128,
        device="cpu",
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected

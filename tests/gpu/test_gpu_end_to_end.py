"""GPU end to end: greedy outputs on the GPU equal the CPU's; CUDA-graph replay equals eager."""

import os
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

_HERE = Path(__file__).resolve()
# ../shared/models beside the checkout, or a copy named by PAGEDSERVE_TEST_MODELS (the GPU
# machine gets only the repository).
MODELS = Path(os.environ.get("PAGEDSERVE_TEST_MODELS", _HERE.parents[3] / "shared" / "models"))
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They",
    "One day, a big bird",
    "Sam had a red ball",
    "Mom said",
    "The sun was hot and",
    "Once upon a time, there was a little girl named Lily.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def save_tiny_llama(path: Path, max_position_embeddings: int) -> None:
    """A 2-layer random Llama (8 heads, 2 KV heads, peaked logits) saved as an HF folder."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def generate(model: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, **kwargs)  # type: ignore[arg-type]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", ["stories260k", "tinystories-656k"])
def test_gpu_greedy_equals_cpu(name: str) -> None:
    model = str(MODELS / name)
    if not Path(model).is_dir():
        pytest.skip(f"{model} not found; set PAGEDSERVE_TEST_MODELS")
    cpu = generate(model, device="cpu")
    assert generate(model, device="cuda", attention_backend="triton") == cpu  # async scheduling
    assert generate(model, device="cuda", attention_backend="triton", async_scheduling=False) == cpu
    assert generate(model, device="cuda", attention_backend="triton", enforce_eager=True) == cpu
    assert generate(model, device="cuda", attention_backend="torch") == cpu


def test_cuda_graph_replay_equals_eager(tmp_path: Path) -> None:
    """Greedy tokens with CUDA graphs equal eager mode's, except where the two runs' top
    tokens are a near-tie (|logprob gap| < 1e-3): the graph pads the batch and plans split-KV
    for max_model_len keys, so float rounding may differ in the last bits (vLLM's tests
    compare logprobs the same way)."""
    import torch

    stories = MODELS / "stories260k"  # for its tokenizer files
    if not stories.is_dir():
        pytest.skip(f"{stories} not found; set PAGEDSERVE_TEST_MODELS")
    torch.manual_seed(0)
    save_tiny_llama(tmp_path, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((stories / name).read_bytes())
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 33, 64, 100)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)

    def run(enforce_eager: bool) -> list:
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            device="cuda",
            max_model_len=512,
            enforce_eager=enforce_eager,
            max_num_seqs=16,
            num_gpu_blocks_override=256,
        )
        assert (
            llm.llm_engine.engine_core.executor.worker.runner.cuda_graphs is None
        ) == enforce_eager
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    assert num_equal_but_near_ties(run(enforce_eager=False), run(enforce_eager=True), 1e-3) >= 3


def num_equal_but_near_ties(first: list, second: list, tie: float) -> int:
    """Check that two runs' greedy outputs (with logprobs=2) agree token for token, or
    diverge only where both runs' top two tokens are within `tie` in logprob; returns the
    number of identical outputs."""
    num_identical = 0
    for one, other in zip(first, second, strict=True):
        if one.token_ids == other.token_ids:
            num_identical += 1
            continue
        i = next(
            i for i, (a, b) in enumerate(zip(one.token_ids, other.token_ids, strict=True)) if a != b
        )
        a, b = one.token_ids[i], other.token_ids[i]
        for logprobs in (one.logprobs[i], other.logprobs[i]):
            assert a in logprobs and b in logprobs, "diverged at a token that is not a tie"
            assert abs(logprobs[a].logprob - logprobs[b].logprob) < tie
    return num_identical


@pytest.mark.parametrize("name", ["stories260k", "tinystories-656k"])
def test_fp8_kv_cache_gpu_equals_cpu(name: str) -> None:
    """`kv_cache_dtype="fp8"`: the Triton kernels (CUDA graphs and eager) write the same e4m3
    bytes as the CPU reference and read them back to the same greedy tokens, up to near-ties
    (a last-bit difference in a float32 K before rounding can move one fp8 value a step)."""
    model = str(MODELS / name)
    if not Path(model).is_dir():
        pytest.skip(f"{model} not found; set PAGEDSERVE_TEST_MODELS")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)

    def run(**kwargs: object) -> list:
        llm = LLM(model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                  kv_cache_dtype="fp8", **kwargs)  # type: ignore[arg-type]  # fmt: skip
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    cpu = run(device="cpu")
    assert num_equal_but_near_ties(run(device="cuda", attention_backend="triton"), cpu, 0.05) >= 6
    eager = run(device="cuda", attention_backend="triton", enforce_eager=True)
    assert num_equal_but_near_ties(eager, cpu, 0.05) >= 6


def test_fp8_kv_cache_doubles_gpu_blocks() -> None:
    """On the GPU too, a kv_cache_memory_bytes budget holds twice the blocks in fp8 (bf16
    model; the profiled sizing divides by the same block bytes)."""
    model = str(MODELS / "stories260k")
    if not Path(model).is_dir():
        pytest.skip(f"{model} not found; set PAGEDSERVE_TEST_MODELS")

    def num_blocks(**kwargs: object) -> int:
        llm = LLM(model, dtype="bfloat16", device="cuda", kv_cache_memory_bytes=64 << 20,
                  **kwargs)  # type: ignore[arg-type]  # fmt: skip
        blocks = llm.llm_engine.engine_core.num_blocks
        llm.llm_engine.shutdown()
        return int(blocks)

    bf16 = num_blocks()
    # floor(budget / (bytes / 2)) is 2 * floor(budget / bytes) or one more (13,107 vs 6,553
    # on the H200)
    assert num_blocks(kv_cache_dtype="fp8") in (2 * bf16, 2 * bf16 + 1)


def test_no_triton_compile_after_start_up(tmp_path: Path) -> None:
    """Start-up (graph capture and warm-up) compiles every Triton kernel variant the engine
    uses: a workload of ragged mixed steps (many batch sizes and block-table widths) compiles
    nothing more. A compile in the middle of serving stalls the GPU for about 0.3 s."""
    import random

    import torch

    from pagedserve.attention.kernels.paged_attention import (
        combine_splits_kernel,
        paged_attention_kernel,
    )
    from pagedserve.attention.kernels.store_kv import store_kv_kernel
    from pagedserve.layers.kernels import fused_ops

    kernels = [
        paged_attention_kernel,
        combine_splits_kernel,
        store_kv_kernel,
        fused_ops._rms_norm_kernel,
        fused_ops._silu_and_mul_kernel,
        fused_ops._rotary_kernel,
    ]

    def num_variants() -> int:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    save_tiny_llama(tmp_path, max_position_embeddings=2048)
    llm = LLM(
        str(tmp_path),
        dtype="float16",
        device="cuda",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=64,
        max_num_batched_tokens=512,
    )
    after_start_up = num_variants()
    assert after_start_up > 0
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 700))]}
        for _ in range(100)
    ]
    params = [
        SamplingParams(
            temperature=0, max_tokens=rng.randint(1, 200), ignore_eos=True, detokenize=False
        )
        for _ in prompts
    ]
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    assert num_variants() == after_start_up

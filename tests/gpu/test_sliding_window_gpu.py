"""GPU end to end with sliding windows: the Triton kernels (CUDA graphs, eager, async
scheduling off) give the CPU torch backend's greedy tokens, while the KV manager frees the
blocks that leave the window (Mistral) or keeps them all (Qwen2 with a window on some layers).
Gemma 2 and Gemma 3 (native models: soft caps, alternating window layers) too. The CPU
run itself equals transformers (tests/entrypoints/test_llm_greedy.py, tests/models)."""

import random
from pathlib import Path

import pytest

import pagedserve.assets
from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

# The bundled model's tokenizer (in the repository, so the GPU machine has it too).
STORIES = Path(pagedserve.assets.__file__).parent / "stories260k"


def save_tiny_model(path: Path, kind: str, window: int) -> Path:
    """A 2-layer random model with peaked logits, and the bundled stories260k's tokenizer."""
    import torch
    import transformers

    common = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, sliding_window=window,
    )  # fmt: skip
    if kind == "mistral":
        config = transformers.MistralConfig(**common)
    elif kind == "gemma2":  # windowed and full layers alternate; attention and final soft caps
        config = transformers.Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, tie_word_embeddings=False,
        )  # fmt: skip
    elif kind == "gemma3":  # 5 windowed layers, then a full one with its own RoPE base
        common["num_hidden_layers"] = 6
        config = transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=False
        )
    else:  # Qwen2 with the window on layer 1 only: mixed layers keep every block
        config = transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_bytes((STORIES / name).read_bytes())
    return path


@pytest.mark.parametrize(
    "kind,window,block_size,prompt_len,max_tokens",
    [
        ("mistral", 8, 4, 30, 20),
        ("mistral", 40, 16, 100, 80),
        ("qwen2", 24, 16, 60, 40),
        ("gemma2", 24, 16, 60, 40),
        ("gemma3", 16, 16, 60, 40),
    ],
)
def test_sliding_window_gpu_equals_cpu(
    tmp_path: Path, kind: str, window: int, block_size: int, prompt_len: int, max_tokens: int
) -> None:
    model = str(save_tiny_model(tmp_path / kind, kind, window))
    rng = random.Random(window)
    shared = [rng.randrange(3, 512) for _ in range(prompt_len // 2)]
    prompts = [
        {"prompt_token_ids": shared + [rng.randrange(3, 512) for _ in range(prompt_len // 2)]}
        for _ in range(8)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(**kwargs: object) -> list[list[int]]:
        llm = LLM(
            model, dtype="float32", max_model_len=256, block_size=block_size,
            num_gpu_blocks_override=64, max_num_batched_tokens=64, max_num_seqs=8,
            enable_prefix_caching=True, **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        if kind == "mistral":  # mixed layers keep every block
            assert llm.llm_engine.engine_core.sliding_window == window
        tokens = []
        for _ in range(2):  # the second round hits the prefix cache
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens.append([o.outputs[0].token_ids for o in outputs])
        assert tokens[0] == tokens[1]
        llm.llm_engine.kv_cache.check_invariants()
        return tokens[0]

    cpu = run(device="cpu")
    assert run(device="cuda", attention_backend="triton") == cpu  # CUDA graphs, async
    assert run(device="cuda", attention_backend="triton", enforce_eager=True) == cpu
    assert run(device="cuda", attention_backend="triton", async_scheduling=False) == cpu

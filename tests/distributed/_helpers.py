"""Tiny random models and process-tree helpers shared by the tensor-parallel tests."""

import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import transformers

SHARED_MODELS = Path(__file__).resolve().parents[3] / "shared" / "models"
REAL_MODELS = ("stories260k", "tinystories-656k")  # 8 heads, 4 KV heads: tp 2 and 4 work

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.2,  # peaked logits: no near-ties for float rounding to flip
)

# num_kv_heads vs tp_size: llama_gqa splits its 2 KV heads at tp 2 and replicates them at
# tp 4; llama_mqa (1 KV head) always replicates; qwen3's vocabulary (509) leaves the last
# vocab shard padded; llama_8heads runs at tp 8.
CONFIGS: dict[str, transformers.PretrainedConfig] = {
    "llama_gqa": transformers.LlamaConfig(
        **_COMMON, vocab_size=512, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "llama_mqa": transformers.LlamaConfig(
        **_COMMON, vocab_size=512, num_key_value_heads=1, tie_word_embeddings=True
    ),
    "qwen3": transformers.Qwen3Config(
        **_COMMON, vocab_size=509, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
    ),
    # 8 heads and 4 KV heads: splits 8 ways (KV heads replicated in pairs).
    "llama_8heads": transformers.LlamaConfig(
        **{**_COMMON, "num_attention_heads": 8},
        vocab_size=512,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "gpt2": transformers.GPT2Config(
        vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.2
    ),
    # Sliding windows of 8 (prompts up to 40 tokens). Gemma 3's one KV head is replicated;
    # Phi-3's fused qkv_proj / gate_up_proj are cut into q/k/v and gate/up before sharding.
    "gemma2": transformers.Gemma2Config(
        **_COMMON, vocab_size=512, num_key_value_heads=2, head_dim=16, sliding_window=8
    ),
    "gemma3": transformers.Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 6},
        vocab_size=512,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "phi3": transformers.Phi3Config(
        **_COMMON,
        vocab_size=512,
        num_key_value_heads=2,
        sliding_window=8,
        original_max_position_embeddings=32,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.3, 4.1, 5.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
        },
        pad_token_id=0,
        bos_token_id=1,
    ),
}


def save_tiny_model(name: str | transformers.PretrainedConfig, path: Path) -> Path:
    """Save CONFIGS[name] (or the config given) with seeded random weights as an HF folder
    (no tokenizer)."""
    torch.manual_seed(0)
    config = CONFIGS[name] if isinstance(name, str) else name
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def random_prompts(num: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(2, 40))] for _ in range(num)]


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` runs; return those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if is_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


REAL_TEXTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They",
    "One day, a big bird",
    "Sam had a red ball",
    "Once upon a time, there was a little girl named Lily. She loved to play",
]


def engine_options(model: Path) -> dict[str, Any]:
    """LLM options of the TP comparisons. Tiny models get a cache too small for all prompts
    at once and a 16-token budget, so requests wait, chunk their prefills and get preempted."""
    if model.parent == SHARED_MODELS:
        return dict(
            dtype="float32",
            block_size=16,
            num_gpu_blocks_override=12,
            max_model_len=128,
            device="cpu",
        )
    return dict(
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=24,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        device="cpu",
        skip_tokenizer_init=True,
    )


def prompts_for(model: Path) -> list[Any]:
    if model.parent == SHARED_MODELS:
        return list(REAL_TEXTS)
    vocab_size = transformers.AutoConfig.from_pretrained(model).vocab_size
    return [{"prompt_token_ids": p} for p in random_prompts(10, vocab_size)]


def greedy_outputs(model: Path, **options: Any) -> list[tuple[list[int], float]]:
    """Greedy token ids and their cumulative logprob for each prompt of `prompts_for(model)`;
    the LLM is shut down on return."""
    from pagedserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    with LLM(str(model), **engine_options(model), **options) as llm:
        outputs = llm.generate(prompts_for(model), params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob or 0.0) for o in outputs]


def assert_same_outputs(
    got: list[tuple[list[int], float]], expected: list[tuple[list[int], float]]
) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    for (_, logprob), (_, expected_logprob) in zip(got, expected, strict=True):
        assert abs(logprob - expected_logprob) < 1e-3 * max(1.0, abs(expected_logprob))

"""Our models against HF transformers: paged prefill and decode logits, loading, sharding math."""

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedserve.attention.torch_backend import TorchAttentionBackend
from pagedserve.distributed.parallel_state import set_tensor_parallel_state
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.loader import load_model
from pagedserve.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

from ._metadata import build_step

BLOCK_SIZE = 4
PROMPT_LENS = (5, 11, 8)
ATOL = 1e-4
# ../shared beside the checkout (CI lays it out the same way).
SHARED_MODELS = Path(__file__).resolve().parents[3] / "shared" / "models"
CPU = torch.device("cpu")

_COMMON = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
SLIDING_WINDOW_CONFIGS: dict[str, PretrainedConfig] = {
    # Layer 0 local, layer 1 global; both soft caps bind at these magnitudes.
    "gemma2": Gemma2Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        max_position_embeddings=128,
        sliding_window=8,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
        architectures=["Gemma2ForCausalLM"],
    ),
    # The default pattern (5 local, 1 global), a local RoPE base apart from the global one,
    # and linear scaling on the global layers only.
    "gemma3": Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 6},
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
        sliding_window=8,
        rope_theta=10000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        architectures=["Gemma3ForCausalLM"],
    ),
    "phi3": Phi3Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        sliding_window=8,
        pad_token_id=0,
        architectures=["Phi3ForCausalLM"],
    ),
    # LongRoPE: every prompt passes the original context of 4, so transformers takes the long
    # factors (and the attention factor), as we do for max_model_len > 4.
    "phi3_longrope": Phi3Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        original_max_position_embeddings=4,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
        },
        sliding_window=None,
        pad_token_id=0,
        architectures=["Phi3ForCausalLM"],
    ),
}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama_gqa_untied": LlamaConfig(
        **_COMMON,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    ),
    "llama3_rope_scaling": LlamaConfig(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden_size / num_attention_heads
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        architectures=["LlamaForCausalLM"],
    ),
    "llama_linear_rope": LlamaConfig(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        architectures=["LlamaForCausalLM"],
    ),
    "mistral": MistralConfig(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=None,
        architectures=["MistralForCausalLM"],
    ),
    "mistral_sliding_window": MistralConfig(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=4,  # < every prompt of PROMPT_LENS
        architectures=["MistralForCausalLM"],
    ),
    # transformers 5: a window on layers >= max_window_layers only (here layer 1).
    "qwen2_sliding_window_layer_1": Qwen2Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
        architectures=["Qwen2ForCausalLM"],
    ),
    "qwen2": Qwen2Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        architectures=["Qwen2ForCausalLM"],
    ),
    "qwen3": Qwen3Config(
        **_COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    ),
    "gpt2": GPT2Config(
        vocab_size=200,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        activation_function="gelu_new",
        architectures=["GPT2LMHeadModel"],
    ),
    # Sliding-window models: windows of 8 and prompts up to 12 tokens, so the local layers
    # see only part of the context.
    **SLIDING_WINDOW_CONFIGS,
}


def _randomize(model: nn.Module, seed: int) -> None:
    """Replace HF's tiny init (std 0.02) by O(1) activations, so that attention is far from
    uniform and a wrong position, head or cache slot changes the logits by much more than ATOL."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name or ".ln_" in name:
                param.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            elif param.dim() == 1:  # bias
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(min(param.shape)))


def _make_hf_model(config: PretrainedConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # Eager attention: the model's reference math. transformers' default may be SDPA, which
    # some versions (5.17 for Gemma 2) run without the model's attention soft cap.
    hf_model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    _randomize(hf_model, seed)
    return hf_model.eval()


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, Path]]:
    """Every tiny HF model of CONFIGS, saved once as safetensors."""
    saved = {}
    for case, config in CONFIGS.items():
        hf_model = _make_hf_model(config)
        path = tmp_path_factory.mktemp(case)
        hf_model.save_pretrained(path)
        saved[case] = (hf_model, path)
    return saved


def _bind_kv_caches(model: nn.Module, num_blocks: int) -> None:
    """Give every Attention layer its own cache, filled with garbage to catch stray reads."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, Attention):
            shape = (2, num_blocks, BLOCK_SIZE, module.num_kv_heads, module.head_dim)
            module.kv_cache = 100 * torch.randn(shape, generator=generator)
            module.backend = TorchAttentionBackend()


def _hf_logits(hf_model: nn.Module, token_ids: list[int]) -> torch.Tensor:  # [len, vocab] f32
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([token_ids])).logits[0].float()


def _check_prefill_and_decode(hf_model: nn.Module, model: nn.Module, vocab_size: int) -> None:
    """One batched prefill of 3 prompts, then one batched decode step, against HF."""
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    # Interleaved, shuffled physical blocks (block 0 unused, like a padded block table).
    num_blocks_per_req = [-(-(n + 1) // BLOCK_SIZE) for n in PROMPT_LENS]
    free = (torch.randperm(sum(num_blocks_per_req), generator=generator) + 1).tolist()
    block_ids = [[free.pop() for _ in range(n)] for n in num_blocks_per_req]
    _bind_kv_caches(model, num_blocks=sum(num_blocks_per_req) + 1)

    with torch.inference_mode():
        positions, metadata = build_step([0, 0, 0], list(PROMPT_LENS), block_ids, BLOCK_SIZE)
        input_ids = torch.tensor([t for prompt in prompts for t in prompt])
        logits = model.compute_logits(model(input_ids, positions, metadata))
    assert logits.shape == (sum(PROMPT_LENS), vocab_size) and logits.dtype == torch.float32
    assert logits.std() > 0.5, "logits too flat for the comparison to mean anything"
    for prompt, ours in zip(prompts, logits.split(list(PROMPT_LENS)), strict=True):
        torch.testing.assert_close(ours, _hf_logits(hf_model, prompt), atol=ATOL, rtol=0)

    next_tokens = torch.randint(vocab_size, (len(prompts),), generator=generator).tolist()
    with torch.inference_mode():
        positions, metadata = build_step(list(PROMPT_LENS), [1, 1, 1], block_ids, BLOCK_SIZE)
        logits = model.compute_logits(model(torch.tensor(next_tokens), positions, metadata))
    for prompt, token, ours in zip(prompts, next_tokens, logits, strict=True):
        expected = _hf_logits(hf_model, [*prompt, token])[-1]
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_matches_hf_prefill_and_decode(
    case: str, saved_models: dict[str, tuple[nn.Module, Path]]
) -> None:
    hf_model, path = saved_models[case]
    config = AutoConfig.from_pretrained(path)
    model = load_model(str(path), config, torch.float32, CPU)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    _check_prefill_and_decode(hf_model, model, config.vocab_size)


@pytest.mark.parametrize("name", ["stories260k", "tinystories-656k"])
def test_real_checkpoint_matches_hf(name: str) -> None:
    path = SHARED_MODELS / name
    config = AutoConfig.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(str(path), config, torch.float32, CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    _check_prefill_and_decode(hf_model, model, config.vocab_size)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf_model = _make_hf_model(CONFIGS["llama_gqa_untied"], seed=3)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    config = AutoConfig.from_pretrained(tmp_path)
    model = load_model(str(tmp_path), config, torch.float32, CPU)
    _check_prefill_and_decode(hf_model, model, config.vocab_size)


def test_gpt2_original_checkpoint_names(
    saved_models: dict[str, tuple[nn.Module, Path]], tmp_path: Path
) -> None:
    """OpenAI-era GPT-2 checkpoints: no `transformer.` prefix, plus causal-mask buffers."""
    hf_model, path = saved_models["gpt2"]
    state = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
    state.pop("lm_head.weight", None)
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    config = AutoConfig.from_pretrained(tmp_path)
    model = load_model(str(tmp_path), config, torch.float32, CPU)
    _check_prefill_and_decode(hf_model, model, config.vocab_size)


def test_wrong_positions_change_logits(saved_models: dict[str, tuple[nn.Module, Path]]) -> None:
    """Negative control: the comparison above is sensitive to a RoPE position error. (A
    uniform shift would not do: RoPE scores depend only on relative positions.)"""
    hf_model, path = saved_models["llama_gqa_untied"]
    config = AutoConfig.from_pretrained(path)
    model = load_model(str(path), config, torch.float32, CPU)
    _bind_kv_caches(model, num_blocks=4)
    prompt = list(range(10, 20))
    positions, metadata = build_step([0], [len(prompt)], [[1, 2, 3]], BLOCK_SIZE)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(prompt), positions * 2, metadata))
    assert (logits - _hf_logits(hf_model, prompt)).abs().max() > 100 * ATOL


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    # (Falcon was the example before the transformers backend, which runs it: an encoder is
    # what neither backend runs now.)
    with pytest.raises(UnsupportedModelError) as excinfo:
        get_model_class(["BertModel"])
    for architecture in SUPPORTED_ARCHITECTURES:
        assert architecture in str(excinfo.value)
    config = LlamaConfig(**_COMMON, architectures=["BertModel"])
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        load_model(str(tmp_path), config, torch.float32, CPU)


def test_folder_without_safetensors_names_what_it_found(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"pytorch_model\.bin"):
        load_model(str(tmp_path), CONFIGS["llama_gqa_untied"], torch.float32, CPU)
    with pytest.raises(UnsupportedModelError, match="does not exist"):
        load_model(str(tmp_path / "nope"), CONFIGS["gpt2"], torch.float32, CPU)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    state = _make_hf_model(CONFIGS["llama_gqa_untied"]).state_dict()
    del state["model.layers.1.post_attention_layernorm.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="layers.1.post_attention_layernorm"):
        load_model(str(tmp_path), CONFIGS["llama_gqa_untied"], torch.float32, CPU)


def _layer_windows(model: nn.Module) -> list[int | None]:
    return [m.sliding_window for m in model.modules() if isinstance(m, Attention)]


def test_layer_sliding_windows_follow_transformers() -> None:
    """Mistral: every layer; Qwen2/Qwen3: `layer_types` (layers >= max_window_layers) and
    only with use_sliding_window; a window >= max_position_embeddings is full attention."""
    load = functools.partial(load_model, "unused", dtype=torch.float32, device=CPU)
    assert _layer_windows(load(CONFIGS["mistral_sliding_window"], load_format="dummy")) == [4, 4]
    qwen2 = CONFIGS["qwen2_sliding_window_layer_1"]
    assert qwen2.layer_types == ["full_attention", "sliding_attention"]
    assert _layer_windows(load(qwen2, load_format="dummy")) == [None, 3]
    off = Qwen2Config(
        **_COMMON, num_attention_heads=4, num_key_value_heads=4, sliding_window=3,
        max_window_layers=0, architectures=["Qwen2ForCausalLM"],
    )  # fmt: skip
    assert _layer_windows(load(off, load_format="dummy")) == [None, None]
    every = Qwen3Config(
        **_COMMON, num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True,
        sliding_window=5, max_window_layers=0, architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip
    assert _layer_windows(load(every, load_format="dummy")) == [5, 5]
    wide = MistralConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        sliding_window=128, architectures=["MistralForCausalLM"],
    )  # fmt: skip
    assert _layer_windows(load(wide, load_format="dummy")) == [None, None]


@pytest.mark.parametrize(("max_model_len", "window"), [(8, None), (9, 8), (None, 8)])
def test_window_as_wide_as_the_context_is_dropped(max_model_len: int | None, window: int) -> None:
    """A window of 8 with max_model_len 8 is full attention (the Triton path runs it); with
    9 the local layer keeps it; the global layer never has one."""
    config = SLIDING_WINDOW_CONFIGS["gemma2"]
    model = load_model(
        "unused", config, torch.float32, CPU, load_format="dummy", max_model_len=max_model_len
    )
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    assert windows == [window, None]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            Phi3Config(
                **_COMMON, num_attention_heads=4, partial_rotary_factor=0.75, pad_token_id=0,
                architectures=["Phi3ForCausalLM"],
            ),
            "partial_rotary_factor=0.75",
        ),
        (
            Gemma3TextConfig(
                **_COMMON, num_attention_heads=4, head_dim=16, use_bidirectional_attention=True,
                architectures=["Gemma3ForCausalLM"],
            ),
            "use_bidirectional_attention",
        ),
    ],
    ids=["phi4_mini_partial_rope", "gemma3_bidirectional"],
)  # fmt: skip
def test_unsupported_variants_are_refused(config: PretrainedConfig, match: str) -> None:
    """Variants we would otherwise compute wrongly: partial RoPE, bidirectional attention."""
    with pytest.raises(NotImplementedError, match=match):
        load_model("unused", config, torch.float32, CPU, load_format="dummy")


@pytest.mark.parametrize("case", list(CONFIGS))
def test_dummy_weights_give_finite_logits(case: str) -> None:
    config = CONFIGS[case]
    model = load_model("unused", config, torch.bfloat16, CPU, load_format="dummy")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _bind_kv_caches(model, num_blocks=4)
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = module.kv_cache.to(torch.bfloat16)
    positions, metadata = build_step([0, 0], [3, 5], [[1], [3, 2]], BLOCK_SIZE)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(8), positions, metadata))
    assert logits.shape == (8, config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


# Tensor-parallel sharding math, checked on one process: each rank's layer is built and loaded
# in turn, and the collectives are replaced by the identity so that partial results can be
# combined by hand (concatenation for column-parallel, sum for row-parallel).


@contextmanager
def _as_rank(tp_rank: int, tp_size: int) -> Iterator[None]:
    set_tensor_parallel_state(tp_rank, tp_size)
    try:
        yield
    finally:
        set_tensor_parallel_state(0, 1)


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("pagedserve.layers.linear", "pagedserve.layers.embedding"):
        for fn in ("tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather"):
            monkeypatch.setattr(f"{module}.{fn}", lambda x, dim=-1: x, raising=False)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_qkv_sharding(tp_size: int, no_collectives: None) -> None:
    hidden, head_dim, num_heads, num_kv_heads = 32, 8, 4, 2
    num_rows = {
        "q": num_heads * head_dim,
        "k": num_kv_heads * head_dim,
        "v": num_kv_heads * head_dim,
    }
    full = {s: torch.randn(n, hidden) for s, n in num_rows.items()}
    biases = {s: torch.randn(w.shape[0]) for s, w in full.items()}
    x = torch.randn(5, hidden)
    qs = []
    for rank in range(tp_size):
        with _as_rank(rank, tp_size):
            layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=True)
        for s in "qkv":
            layer.weight.weight_loader(layer.weight, full[s], s)
            layer.bias.weight_loader(layer.bias, biases[s], s)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        qs.append(q)
        kv_head = rank * num_kv_heads // tp_size  # which KV head this rank holds
        rows = slice(kv_head * layer.kv_size, (kv_head + 1) * layer.kv_size)
        torch.testing.assert_close(k, x @ full["k"][rows].T + biases["k"][rows])
        torch.testing.assert_close(v, x @ full["v"][rows].T + biases["v"][rows])
    torch.testing.assert_close(torch.cat(qs, dim=-1), x @ full["q"].T + biases["q"])


def test_merged_and_row_sharding(no_collectives: None) -> None:
    tp_size, hidden, intermediate = 2, 16, 24
    gate, up, down = torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)
    down_bias = torch.randn(16)
    x = torch.randn(3, hidden)
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T + down_bias
    total = torch.zeros(3, hidden)
    for rank in range(tp_size):
        with _as_rank(rank, tp_size):
            gate_up = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
            down_proj = RowParallelLinear(intermediate, hidden, bias=True)
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        down_proj.weight.weight_loader(down_proj.weight, down)
        down_proj.bias.weight_loader(down_proj.bias, down_bias)
        g, u = gate_up(x).chunk(2, dim=-1)
        total += down_proj(torch.nn.functional.silu(g) * u)
    torch.testing.assert_close(total, expected)


def test_vocab_sharding_pads_last_shard(no_collectives: None) -> None:
    tp_size, vocab, dim = 4, 10, 6  # 3 rows per rank; the last rank has 1 real row
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 9, 5, 8])
    hidden = torch.randn(2, dim)
    embedded, logit_shards = torch.zeros(len(ids), dim), []
    for rank in range(tp_size):
        with _as_rank(rank, tp_size):
            embed = VocabParallelEmbedding(vocab, dim)
            head = ParallelLMHead(vocab, dim)
        embed.weight.weight_loader(embed.weight, table)
        head.weight = embed.weight
        embedded += embed(ids)
        logit_shards.append(head.compute_logits(hidden))
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logit_shards, dim=-1)[:, :vocab], hidden @ table.T)


def test_weight_loader_rejects_wrong_shape() -> None:
    layer = QKVParallelLinear(hidden_size=16, head_dim=4, total_num_heads=4, total_num_kv_heads=2)
    with pytest.raises(ValueError, match="shape"):
        layer.weight.weight_loader(layer.weight, torch.randn(8, 15), "k")
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight.weight_loader(layer.weight, torch.randn(8, 16), "o")

"""The 4-bit CUDA GEMV's fused epilogues (w4_gemv_cuda.w4_gemv_silu_and_mul / w4_gemv_rope)
against the GEMV followed by the separate Triton kernel they replace, and the model code that
takes them (LlamaMLP, LlamaAttention) against the unfused path.

The wiring tests run everywhere (a fake layer method stands in for the kernel); the `gpu` tests
need a CUDA GPU of sm_80+ and nvcc. Tolerance: one unit in the last place of x's dtype
relative, 2^-16 absolute: both paths round the GEMV's sums to x's dtype, then compute the
epilogue in fp32 and round once more; only the fp32 exp / division (SiLU) and fma contraction
(rotary) may differ.
"""

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve import envs
from pagedserve.layers.kernels import w4_gemv_cuda
from pagedserve.layers.quantization.base import DequantizingLinearMethod, epilogues_enabled

from .test_gptq_models import CONFIG, PROMPTS, float_model  # noqa: F401 (float_model: a fixture)
from .test_w4_gemv_cuda import RTOL, random_weights


@pytest.fixture(autouse=True)
def _fresh_switch() -> Any:
    """The switch is read once per process: forget it after tests that change it."""
    yield
    epilogues_enabled.cache_clear()


def assert_within_an_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """|actual - expected| <= ulp(x's dtype) |expected| + 2^-16, elementwise."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a, e = actual.float(), expected.float()
    bound = RTOL[expected.dtype] * e.abs() + 2.0**-16
    worst = ((a - e).abs() - bound).max().item()
    assert worst <= 0, f"off by {worst:.3g} beyond the bound"


def test_llama_mlp_takes_the_fused_activation_when_the_layer_gives_one() -> None:
    """LlamaMLP passes the gate_up layer's `forward_silu_and_mul` output straight to down_proj;
    where the layer gives None it runs the layer and SiluAndMul, the same function."""
    from pagedserve.models.llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(CONFIG)
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(3, 128)
    expected = mlp(x)  # unquantized: the layer has no fused path
    calls: list[torch.Tensor] = []

    def fused(inp: torch.Tensor) -> torch.Tensor:
        calls.append(inp)
        gate, up = mlp.gate_up_proj(inp).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    mlp.gate_up_proj.forward_silu_and_mul = fused  # type: ignore[method-assign]
    torch.testing.assert_close(mlp(x), expected)
    assert len(calls) == 1 and calls[0] is x


def test_llama_attention_takes_the_fused_rotary_when_the_layer_gives_one() -> None:
    """LlamaAttention hands the qkv layer the positions, the rotary table, head_dim and the q
    and k columns (q_size + kv_size); the fused output then skips the rotary embedding, and
    attention gets the same q, k, v as on the unfused path."""
    from pagedserve.layers.rotary import get_rope
    from pagedserve.models.llama import LlamaAttention

    torch.manual_seed(0)
    rope = get_rope(CONFIG, 32)
    attention = LlamaAttention(CONFIG, rope)
    assert attention.rope_fusable()
    seen: list[tuple[torch.Tensor, ...]] = []

    class Recorder(torch.nn.Module):  # stands in for the paged attention
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: Any) -> Any:
            seen.append((q, k, v))
            return q

    attention.attn = Recorder()  # type: ignore[assignment]
    attention.o_proj = torch.nn.Identity()  # type: ignore[assignment]
    for p in attention.parameters():
        p.data.normal_()
    x, positions = torch.randn(3, 128), torch.tensor([0, 5, 77])
    attention(positions, x, None)  # type: ignore[arg-type]
    args: list[tuple[Any, ...]] = []

    def fused(inp: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, head_dim: int,
              rot_cols: int) -> torch.Tensor:  # fmt: skip
        args.append((inp, pos, table, head_dim, rot_cols))
        q, k, v = attention.split_qkv(attention.qkv_proj(inp))
        q, k = rope(pos, q, k)
        return torch.cat([q, k, v], dim=-1)

    attention.qkv_proj.forward_rope = fused  # type: ignore[method-assign]
    attention(positions, x, None)  # type: ignore[arg-type]
    assert len(args) == 1
    inp, pos, table, head_dim, rot_cols = args[0]
    assert inp is x and pos is positions and table is rope.cos_sin_cache
    assert (head_dim, rot_cols) == (32, attention.q_size + attention.kv_size) == (32, 192)
    for unfused, with_fused in zip(seen[0], seen[1], strict=True):
        torch.testing.assert_close(with_fused, unfused)


def test_no_fused_path_without_the_cuda_weights_or_when_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The quantized method offers the epilogues only for a layer holding the CUDA kernels'
    weights, and not with PAGEDSERVE_W4_EPILOGUES=0; other methods never do."""
    from pagedserve.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(64, [32, 32])  # unquantized
    x = torch.randn(2, 64)
    assert layer.forward_silu_and_mul(x) is None
    table = torch.zeros(8, 16)
    assert layer.forward_rope(x, torch.zeros(2, dtype=torch.int64), table, 16, 32) is None
    method = DequantizingLinearMethod()
    holder = torch.nn.Module()
    assert method.apply_silu_and_mul(holder, x) is None  # no packed_weights: CPU reference
    holder.packed_weights = object()  # stands in for RepackedWeights
    monkeypatch.setenv(envs.W4_EPILOGUES, "0")
    epilogues_enabled.cache_clear()
    assert method.apply_silu_and_mul(holder, x) is None
    monkeypatch.setenv(envs.W4_EPILOGUES, "2")
    epilogues_enabled.cache_clear()
    with pytest.raises(ValueError, match="PAGEDSERVE_W4_EPILOGUES"):
        method.apply_silu_and_mul(holder, x)
    monkeypatch.delenv(envs.W4_EPILOGUES)
    epilogues_enabled.cache_clear()


def _cuda_or_skip() -> None:
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(("group_size", "asym", "bias"), [(128, False, False), (32, True, True)])
def test_silu_and_mul_epilogue_matches_the_two_kernels(
    dtype: torch.dtype, m: int, group_size: int, asym: bool, bias: bool
) -> None:
    """silu(gate) * up from the GEMV's epilogue equals `fused_ops.silu_and_mul` of the plain
    GEMV's output with the same warps (1, 4, 16 too): N = 2 x 1,408 (88 tiles a half),
    K 1,000 (not a multiple of the 64-row chunk)."""
    _cuda_or_skip()
    from pagedserve.layers.kernels.fused_ops import silu_and_mul

    torch.manual_seed(m)
    k, n = 1000, 2 * 1408
    w = random_weights(k, n, group_size, asym, dtype, "cuda")
    r = w4_gemv_cuda.repack(w)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    assert w4_gemv_cuda.supports_silu_and_mul(w, x)
    fused = w4_gemv_cuda.w4_gemv_silu_and_mul(x, w, r, b)
    # the plain GEMV with the same warps: the same fp32 sums (other warps split K otherwise)
    plain = w4_gemv_cuda.w4_gemv(x, w, r, b, config=w4_gemv_cuda.epilogue_config(n, k))
    assert_within_an_ulp(fused, silu_and_mul(plain))
    for warps in (1, 4, 16):
        config = w4_gemv_cuda.epilogue_config(n, k, warps)
        expected = silu_and_mul(w4_gemv_cuda.w4_gemv(x, w, r, b, config=config))
        fused = w4_gemv_cuda.w4_gemv_silu_and_mul(x, w, r, b, num_warps=warps)
        assert_within_an_ulp(fused, expected)
    with pytest.raises(ValueError, match="num_warps"):
        w4_gemv_cuda.w4_gemv_silu_and_mul(x, w, r, b, num_warps=17)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize(
    ("head_dim", "num_q", "num_kv", "bias"), [(128, 8, 2, False), (64, 6, 3, True)]
)
def test_rope_epilogue_matches_the_two_kernels(
    dtype: torch.dtype, m: int, head_dim: int, num_q: int, num_kv: int, bias: bool
) -> None:
    """The qkv GEMV with its rotary epilogue equals the plain GEMV followed by
    `fused_ops.rotary_embedding` on q and k (Llama 3.1's scaled table, positions up to 4,000);
    the v heads are the plain GEMV's output exactly."""
    _cuda_or_skip()
    from pagedserve.layers.kernels.fused_ops import rotary_embedding
    from pagedserve.layers.rotary import RotaryEmbedding

    torch.manual_seed(head_dim + m)
    k, n = 512, (num_q + 2 * num_kv) * head_dim
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, scaling).cuda()
    w = random_weights(k, n, 128, False, dtype, "cuda")
    r = w4_gemv_cuda.repack(w)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    positions = torch.randint(0, 4000, (m,), device="cuda")
    rot_cols = (num_q + num_kv) * head_dim
    table = rope.cos_sin_cache
    assert w4_gemv_cuda.supports_rope(w, x, positions, table, head_dim, rot_cols)
    fused = w4_gemv_cuda.w4_gemv_rope(x, w, r, positions, table, head_dim, rot_cols, b)
    plain = w4_gemv_cuda.w4_gemv(x, w, r, b, config=w4_gemv_cuda.epilogue_config(n, k))
    q, kk, v = plain.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q, kk = rotary_embedding(positions, q.contiguous(), kk.contiguous(), table, head_dim)
    assert_within_an_ulp(fused[:, :rot_cols], torch.cat([q, kk], dim=-1))
    assert torch.equal(fused[:, rot_cols:], v)


@pytest.mark.gpu
def test_gptq_model_with_and_without_the_epilogues(
    float_model: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tiny bf16 GPTQ Llama (head_dim 32, intermediate 256) decodes through the fused
    epilogues (each called; CUDA graphs) to the same greedy tokens as with them off."""
    _cuda_or_skip()
    from pagedserve import LLM, SamplingParams

    from .gptq_pack import write_gptq_checkpoint

    path = tmp_path / "gptq"
    write_gptq_checkpoint(float_model, path, tmp_path / "dequantized", 4, 32, False, False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    calls = {"silu": 0, "rope": 0}
    silu, rope = w4_gemv_cuda.w4_gemv_silu_and_mul, w4_gemv_cuda.w4_gemv_rope

    def count(name: str, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)

        return counted

    monkeypatch.setattr(w4_gemv_cuda, "w4_gemv_silu_and_mul", count("silu", silu))
    monkeypatch.setattr(w4_gemv_cuda, "w4_gemv_rope", count("rope", rope))
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(envs.W4_EPILOGUES, switch)
        epilogues_enabled.cache_clear()
        with LLM(
            str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64,
            num_gpu_blocks_override=128,
        ) as llm:  # fmt: skip
            done = llm.generate(prompts, params, use_tqdm=False)
            outputs.append([list(o.outputs[0].token_ids) for o in done])
        if switch == "1":
            assert calls["silu"] > 0 and calls["rope"] > 0, calls
            calls_on = dict(calls)
    assert calls == calls_on  # none with the switch off
    assert outputs[0] == outputs[1]

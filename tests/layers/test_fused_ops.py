"""Fused Triton layer ops (GPU, half precision) against the PyTorch ops they replace."""

import pytest
import torch

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden_size", [64, 1024, 4096, 5120])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, hidden_size: int) -> None:
    from pagedserve.layers.kernels.fused_ops import rms_norm

    x = torch.randn(37, hidden_size, dtype=dtype, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(hidden_size, dtype=dtype, device="cuda")

    def reference(s: torch.Tensor) -> torch.Tensor:
        s32 = s.double()
        return (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-6)) * weight.double()

    out, none = rms_norm(x, weight, 1e-6)
    assert none is None and rel_error(out, reference(x)) < 1e-2
    out, summed = rms_norm(x, weight, 1e-6, residual)
    assert summed is not None and torch.equal(summed, x + residual)
    assert rel_error(out, reference(x + residual)) < 1e-2
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma_rms_norm_fused_equals_torch(dtype: torch.dtype) -> None:
    """Gemma's (1 + weight) norm: the kernel (unit_offset) gives the PyTorch path's values,
    which are transformers' Gemma2RMSNorm's, and the Llama order stays as it was."""
    from pagedserve.layers.norm import GemmaRMSNorm, RMSNorm

    for cls in (GemmaRMSNorm, RMSNorm):
        norm = cls(2560, 1e-6).cuda()
        norm.weight.data.normal_(0.0, 0.3)
        norm = norm.to(dtype)
        x = torch.randn(23, 2560, dtype=dtype, device="cuda")
        residual = torch.randn_like(x)
        reference = norm._norm(x + residual)
        out, summed = norm(x, residual)  # fused: a half-precision CUDA tensor
        assert torch.equal(summed, x + residual)
        assert rel_error(out, reference) < 1e-2
        assert (out != reference).float().mean().item() < 0.05  # rounding differences only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [172, 3072, 14336])
def test_silu_and_mul(dtype: torch.dtype, size: int) -> None:
    from pagedserve.layers.kernels.fused_ops import silu_and_mul

    x = torch.randn(19, 2 * size, dtype=dtype, device="cuda")
    gate, up = x.double().chunk(2, dim=-1)
    assert rel_error(silu_and_mul(x), torch.nn.functional.silu(gate) * up) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(32, 8, 128), (20, 20, 64), (16, 8, 128), (8, 4, 80)],
)
def test_rotary_embedding(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    from pagedserve.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, 4096, 500000.0).cuda()
    positions = torch.randint(0, 4096, (41,), device="cuda")
    qkv = torch.randn(41, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device="cuda")
    q, k, _ = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim] * 1 + [num_kv_heads * head_dim], dim=-1
    )
    ref_q, ref_k = (
        rope._rotate(
            q.double(), *rope.cos_sin_cache[positions].double().unsqueeze(1).chunk(2, dim=-1)
        ),
        None,
    )
    ref_k = rope._rotate(
        k.double(), *rope.cos_sin_cache[positions].double().unsqueeze(1).chunk(2, dim=-1)
    )
    out_q, out_k = rope(positions, q, k)  # fused path: in place on the qkv views
    assert rel_error(out_q, ref_q) < 1e-2 and rel_error(out_k, ref_k) < 1e-2

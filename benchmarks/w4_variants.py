"""Experiment: W4A16 decode GEMM variants on Llama-3.1-8B's shapes (one H200 run decides).

Times, with weights rotated over enough copies that none stays in L2 (the real forward
streams every weight from HBM once), CUDA-graph replay:
  bf16      torch F.linear on bf16 weights
  cur       pagedserve's quant_gemm as shipped (M = 1: `quant_tiles.gemv_words`)
  fact      CUDA-core GEMV, scale and zero applied once per group on the partial sums
            (per weight: shift, and|or, subtract, fma)
  mma       tensor cores, weights unpacked straight to bf16 128 + q (exact) with no
            subtract and no scale in the loop; per group: (dot - (128 + z) * sum(x)) * s
and checks each against an fp32 reference. 4-bit, group 128, constant zero point 8 (GPTQ
symmetric), no act-order: the issue-15 target configuration.

  python benchmarks/w4_variants.py [--m 1 --m 64]
"""

# mypy: ignore-errors
# ruff: noqa: E501, B023, B008, SIM108, E731
# (an experiment kept as the record of BENCHMARKS.md's W4A16 variant figures, not a tool)

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quant_gemm import SHAPES
from benchmarks.w4_gemv_cuda import timed

GROUP = 128


@triton.jit(do_not_specialize=["split_k"])
def _fact_kernel(
    x_ptr, qw_ptr, s_ptr, out_ptr, N, K, split_k, zero_value,
    BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, GROUP_SIZE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    corr = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kb in range(pid_k, K // (BLOCK_KP * 8), split_k):
        offs_kp = kb * BLOCK_KP + tl.arange(0, BLOCK_KP)
        words = tl.load(qw_ptr + offs_kp[:, None] * N + offs_n[None, :], mask=mask_n[None, :])
        g = (kb * BLOCK_KP * 8) // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        part = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((BLOCK_KP,), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_ptr + offs_kp * 8 + j).to(tl.float32)
            q = (((words >> (j * 4)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            part += x[:, None] * q
            xs += x
        acc += part * s[None, :]
        corr += s * (zero_value * tl.sum(xs, axis=0))
    res = tl.sum(acc, axis=0) - corr
    tl.store(out_ptr + pid_k * N + offs_n, res, mask=mask_n)


@triton.jit(do_not_specialize=["split_k"])
def _pf_kernel(
    x_ptr, qw_ptr, s_ptr, out_ptr, N, K, split_k, zero_value,
    BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PREFETCH: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """`_fact_kernel` for any BLOCK_KP (scales per word row), optionally loading the next
    block's words before computing on this one (two blocks in flight per program)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    num_kb = K // (BLOCK_KP * 8)
    ar = tl.arange(0, BLOCK_KP)
    w_ptrs = qw_ptr + ar[:, None] * N + offs_n[None, :]
    if PREFETCH:
        words = tl.load(
            w_ptrs + pid_k * BLOCK_KP * N,
            mask=(mask_n & (offs_n * 0 + pid_k < num_kb))[None, :],
            eviction_policy=EVICT,
        )
    for kb in range(pid_k, num_kb, split_k):
        offs_kp = kb * BLOCK_KP + ar
        if PREFETCH:
            nxt = tl.load(
                w_ptrs + (kb + split_k) * BLOCK_KP * N,
                mask=(mask_n & (offs_n * 0 + kb + split_k < num_kb))[None, :],
                eviction_policy=EVICT,
            )
        else:
            words = tl.load(w_ptrs + kb * BLOCK_KP * N, mask=mask_n[None, :], eviction_policy=EVICT)
        g = (offs_kp * 8) // GROUP_SIZE
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0.0)
        part = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((BLOCK_KP,), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_ptr + offs_kp * 8 + j).to(tl.float32)
            q = (((words >> (j * 4)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            part += x[:, None] * q
            xs += x
        acc += (part - zero_value * xs[:, None]) * s.to(tl.float32)
        if PREFETCH:
            words = nxt
    res = tl.sum(acc, axis=0)
    tl.store(out_ptr + pid_k * N + offs_n, res, mask=mask_n)


def pf_gemv(x, qw, s, block_n, block_kp, split_k, num_warps, num_stages, prefetch, evict):
    n = qw.shape[1]
    k = qw.shape[0] * 8
    part = torch.empty(split_k, n, dtype=torch.float32, device=x.device)
    _pf_kernel[(triton.cdiv(n, block_n), split_k)](
        x, qw, s, part, n, k, split_k, 8.0, BLOCK_N=block_n, BLOCK_KP=block_kp,
        GROUP_SIZE=GROUP, PREFETCH=prefetch, EVICT=evict, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return part.sum(0, keepdim=True).to(x.dtype) if split_k > 1 else part.to(x.dtype)


@triton.jit(do_not_specialize=["M", "split_k"])
def _mma_kernel(
    x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, split_k, zero_value,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr, SWAP: tl.constexpr, FP16: tl.constexpr,
):  # fmt: skip
    # bits of 2**e with the value in the mantissa's last bits: bf16 128 + q (q < 128), fp16
    # 1024 + q (q < 1024); both exact
    MAGIC: tl.constexpr = 0x6400 if FP16 else 0x4300
    BASE: tl.constexpr = 1024.0 if FP16 else 128.0
    BLOCK_KP: tl.constexpr = BLOCK_K // 8
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    shifts = tl.arange(0, 8) * 4
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k, K // BLOCK_K, split_k):
        offs_kp = kb * BLOCK_KP + tl.arange(0, BLOCK_KP)
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        words = tl.load(qw_ptr + offs_kp[:, None] * N + offs_n[None, :], mask=mask_n[None, :])
        q = ((words[:, None, :] >> shifts[None, :, None]) & 15) | MAGIC
        w = tl.reshape(q.to(tl.int16), (BLOCK_K, BLOCK_N)).to(x_ptr.dtype.element_ty, bitcast=True)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        g = (kb * BLOCK_K) // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        sx = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
        if SWAP:
            d = tl.dot(tl.trans(w), tl.trans(x))  # [BLOCK_N, BLOCK_M]
            acc += (d - (BASE + zero_value) * sx[None, :]) * s[:, None]
        else:
            d = tl.dot(x, w)
            acc += (d - (BASE + zero_value) * sx[:, None]) * s[None, :]
    if SWAP:
        acc = tl.trans(acc)
    out_offs = pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out_ptr + out_offs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M", "split_k"])
def _il_kernel(
    x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, split_k, zero_value,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr, FP16: tl.constexpr,
    EVICT: tl.constexpr,
):  # fmt: skip
    """Interleaved layout: in each 128-row block, word i holds rows j*16 + i (j = nibble), so
    nibble j of a [16, BLOCK_N] word tile is a contiguous 16-row slice: 8 dots of K = 16, no
    reshape. One block = one group of 128."""
    MAGIC: tl.constexpr = 0x6400 if FP16 else 0x4300
    BASE: tl.constexpr = 1024.0 if FP16 else 128.0
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    ar = tl.arange(0, 16)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k, K // 128, split_k):
        words = tl.load(
            qw_ptr + (kb * 16 + ar)[:, None] * N + offs_n[None, :],
            mask=mask_n[None, :],
            eviction_policy=EVICT,
        )
        s = tl.load(s_ptr + kb * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if SWAP:
            d = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sx = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in tl.static_range(8):
            w = (
                (((words >> (j * 4)) & 15) | MAGIC)
                .to(tl.int16)
                .to(x_ptr.dtype.element_ty, bitcast=True)
            )
            x = tl.load(
                x_ptr + offs_m[:, None] * K + (kb * 128 + j * 16 + ar)[None, :],
                mask=mask_m[:, None],
                other=0.0,
            )
            sx += tl.sum(x.to(tl.float32), axis=1)
            if SWAP:
                d = tl.dot(tl.trans(w), tl.trans(x), d)
            else:
                d = tl.dot(x, w, d)
        if SWAP:
            acc += (d - (BASE + zero_value) * sx[None, :]) * s[:, None]
        else:
            acc += (d - (BASE + zero_value) * sx[:, None]) * s[None, :]
    if SWAP:
        acc = tl.trans(acc)
    out_offs = pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out_ptr + out_offs, acc, mask=mask_m[:, None] & mask_n[None, :])


def il_gemm(x, qw, s, block_m, block_n, split_k, num_warps, num_stages, swap, evict):
    m, k = x.shape
    n = qw.shape[1]
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    _il_kernel[(tiles, split_k)](
        x, qw, s, part, m, n, k, split_k, 8.0, BLOCK_M=block_m, BLOCK_N=block_n, SWAP=swap,
        FP16=x.dtype == torch.float16, EVICT=evict, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return (part.sum(0) if split_k > 1 else part[0]).to(x.dtype)


def il_reference_weight(qw, s):
    """W^T [K, N] fp32 of interleaved words (zero 8)."""
    kp, n = qw.shape
    shifts = torch.arange(0, 32, 4, device=qw.device, dtype=torch.int32)
    q = (qw.view(kp // 16, 16, 1, n) >> shifts.view(1, 1, 8, 1)) & 15  # [b, i, j, n]
    q = q.transpose(1, 2).reshape(kp * 8, n).float()  # row b*128 + j*16 + i
    return (q - 8) * s.float().repeat_interleave(128, 0)


def fact_gemv(x, qw, s, block_n, block_kp, split_k, num_warps, num_stages):
    n = qw.shape[1]
    k = qw.shape[0] * 8
    part = torch.empty(split_k, n, dtype=torch.float32, device=x.device)
    _fact_kernel[(triton.cdiv(n, block_n), split_k)](
        x, qw, s, part, n, k, split_k, 8.0, BLOCK_N=block_n, BLOCK_KP=block_kp,
        GROUP_SIZE=GROUP, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return part.sum(0, keepdim=True).to(x.dtype) if split_k > 1 else part.to(x.dtype)


def mma_gemm(x, qw, s, block_m, block_n, block_k, split_k, num_warps, num_stages, swap):
    m, k = x.shape
    n = qw.shape[1]
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    _mma_kernel[(tiles, split_k)](
        x, qw, s, part, m, n, k, split_k, 8.0, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_SIZE=GROUP, SWAP=swap, FP16=x.dtype == torch.float16, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return (part.sum(0) if split_k > 1 else part[0]).to(x.dtype)


def split_for(tiles: int, k_blocks: int) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(4 * sms // tiles, k_blocks, 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, action="append")
    args = parser.parse_args()
    from pagedserve.layers.kernels.quant_gemm import quant_gemm
    from pagedserve.layers.quantization.packed import PackedWeights

    dev = "cuda"
    torch.manual_seed(0)
    for m in args.m or [1]:
        totals: dict[str, float] = {}
        print(f"M={m}")
        for name, (k, n) in SHAPES.items():
            copies = max(2, (256 << 20) // (k * n // 2))
            qws = [
                torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
                for _ in range(copies)
            ]  # noqa: E501
            ss = [
                (torch.rand(k // GROUP, n, device=dev) * 0.01 + 0.001).to(torch.bfloat16)
                for _ in range(copies)
            ]  # noqa: E501
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            shifts = torch.arange(0, 32, 4, device=dev, dtype=torch.int32)
            q0 = ((qws[0].unsqueeze(1) >> shifts[None, :, None]) & 15).reshape(k, n).float()
            w0 = (q0 - 8) * ss[0].float().repeat_interleave(GROUP, 0)  # W^T [K, N] fp32
            ref = x.float() @ w0
            wbf = [w0.to(torch.bfloat16).t().contiguous()]
            wbf += [
                torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                for _ in range(max(1, copies // 4))
            ]  # noqa: E501
            packs = [
                PackedWeights(qw, None, 8, s, None, None, 4, GROUP)
                for qw, s in zip(qws, ss, strict=True)
            ]  # noqa: E501

            def err(y):
                return float((y.float() - ref).abs().max() / ref.abs().max())

            rows = {}
            t = timed(lambda i: torch.nn.functional.linear(x, wbf[i % len(wbf)]), len(wbf))
            rows["bf16"] = (t, err(torch.nn.functional.linear(x, wbf[0])), "")
            rows["cur"] = (
                timed(lambda i: quant_gemm(x, packs[i]), copies),
                err(quant_gemm(x, packs[0])),
                "",
            )  # noqa: E501
            if m == 1:
                from pagedserve.layers.kernels.quant_gemm import GemmConfig

                for bn, bk, nw in [(32, 256, 4), (64, 512, 4), (64, 1024, 8), (128, 512, 8)]:
                    f = lambda i, c=GemmConfig(1, bn, bk, nw, 3): quant_gemm(x, packs[i], config=c)  # noqa: E501,E731
                    rows[f"cur{bn}/{bk}/{nw}"] = (timed(f, copies), err(f(0)), "")
                for pf, ev in [(False, ""), (True, ""), (True, "evict_first")]:
                    best = None
                    for bn, bkp, nw in [
                        (64, 16, 4),
                        (128, 16, 4),
                        (64, 32, 4),
                        (128, 32, 8),
                        (64, 64, 4),
                        (64, 64, 8),
                        (128, 64, 8),
                        (256, 32, 8),
                        (32, 64, 4),
                    ]:  # noqa: E501
                        sk = split_for(triton.cdiv(n, bn), k // (bkp * 8))
                        f = lambda i, bn=bn, bkp=bkp, sk=sk, nw=nw, pf=pf, ev=ev: pf_gemv(
                            x, qws[i], ss[i], bn, bkp, sk, nw, 1, pf, ev
                        )  # noqa: E501,E731
                        t = timed(f, copies)
                        if best is None or t < best[0]:
                            best = (t, err(f(0)), f"bn={bn} bkp={bkp} w={nw} sk={sk}")
                    rows[f"pf{int(pf)}{ev[:6]}"] = best
            ref_il = x.float() @ il_reference_weight(qws[0], ss[0])
            best = None
            il_cands = [
                (16, 64, 4, True),
                (16, 128, 4, True),
                (16, 32, 4, True),
                (16, 64, 4, False),
                (16, 128, 8, True),
            ]  # noqa: E501
            if m > 16:
                il_cands = [
                    (64, 64, 4, False),
                    (64, 128, 4, False),
                    (64, 128, 8, False),
                    (64, 64, 4, True),
                    (32, 64, 4, False),
                ]  # noqa: E501
            for bm, bn, nw, sw in il_cands:
                for ns in (2, 3):
                    sk = split_for(triton.cdiv(m, bm) * triton.cdiv(n, bn), k // 128)
                    f = lambda i, bm=bm, bn=bn, sk=sk, nw=nw, ns=ns, sw=sw: il_gemm(
                        x, qws[i], ss[i], bm, bn, sk, nw, ns, sw, "evict_first"
                    )  # noqa: E501,E731
                    try:
                        t = timed(f, copies)
                    except Exception as exc:  # noqa: BLE001
                        print(
                            f"  il {bm, bn, nw, ns, sw} failed: {type(exc).__name__}: {str(exc)[:300]}"
                        )  # noqa: E501
                        continue
                    if best is None or t < best[0]:
                        e = float((f(0).float() - ref_il).abs().max() / ref_il.abs().max())
                        best = (t, e, f"bm={bm} bn={bn} w={nw} st={ns} swap={sw} sk={sk}")
            if best is not None:
                rows["il"] = best
            best = None
            cands = [
                (16, 64, 128, 4, 3, True),
                (16, 128, 128, 4, 3, True),
                (16, 64, 128, 4, 4, True),
                (16, 64, 128, 4, 3, False),
                (16, 128, 128, 8, 3, True),
            ]  # noqa: E501
            if m > 16:
                cands = [
                    (64, 64, 128, 4, 3, False),
                    (64, 128, 128, 4, 3, False),
                    (64, 128, 128, 8, 3, False),
                    (64, 64, 128, 4, 4, True),
                    (32, 64, 128, 4, 3, False),
                ]  # noqa: E501
            for bm, bn, bk, nw, ns, sw in cands if m > 1 else []:
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                sk = split_for(tiles, k // bk)
                f = lambda i, bm=bm, bn=bn, bk=bk, sk=sk, nw=nw, ns=ns, sw=sw: mma_gemm(
                    x, qws[i], ss[i], bm, bn, bk, sk, nw, ns, sw
                )  # noqa: E501,E731
                try:
                    t = timed(f, copies)
                except Exception as exc:  # noqa: BLE001
                    print(
                        f"  mma {bm, bn, bk, nw, ns, sw} failed: {type(exc).__name__}: {str(exc)[:200]}"
                    )  # noqa: E501
                    continue
                if best is None or t < best[0]:
                    best = (
                        t,
                        err(f(0)),
                        f"bm={bm} bn={bn} bk={bk} w={nw} st={ns} swap={sw} sk={sk}",
                    )  # noqa: E501
            if best is not None:
                rows["mma"] = best
            for label, (t, e, cfg) in rows.items():
                gbps = (k * n / 2) / (t * 1e-3) / 1e9
                print(
                    f"  {name:8s} {label:14s} {t * 1000:8.1f} us  {gbps:7.0f} GB/s(w4)  err {e:.1e}  {cfg}"
                )  # noqa: E501
                totals[label] = totals.get(label, 0.0) + t
        print("  layer sum (ms): " + "  ".join(f"{k}={v:.4f}" for k, v in totals.items()))


if __name__ == "__main__":
    main()

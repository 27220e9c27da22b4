"""Start-up of a rank's ModelRunner: device and dtype, model loading, KV cache sizing (memory
profiling on a GPU) and allocation, CUDA graph capture and warm-up.

The Worker calls these once, in this order: `load_model(runner)`; `determine_num_blocks(runner)`
(the executor takes the minimum over the ranks); then `initialize_kv_cache(runner, num_blocks)`.
`kv_block_bytes(runner)` and `kv_sliding_window(runner)` may be asked any time after loading.
From then on the runner only runs steps. The functions fill in the runner's `model`,
`model_dtype`, `kv_cache_dtype`, `attention_layers`, `kv_caches` and `cuda_graphs`.
"""

import logging
import time

import torch

from pagedserve.attention.kv_quant import kv_cache_torch_dtype
from pagedserve.config_checks import host_memory_bytes
from pagedserve.layers.attention import Attention
from pagedserve.models.loader import load_model as load_checkpoint
from pagedserve.step import SchedulerOutput
from pagedserve.worker.cpu_kv_cache import CpuKVCache
from pagedserve.worker.cuda_graph import CudaGraphRunner
from pagedserve.worker.dummy_steps import profiling_step, warm_up_steps
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_CPU_DEFAULT_KV_FRACTION = 0.25  # of available RAM
_CPU_DEFAULT_KV_CAP = 2 << 30  # bytes


def resolve_device(name: str) -> torch.device:
    """`DeviceConfig.device` as a torch device: "auto" is "cuda" when a GPU is visible, else
    "cpu"; any other name as torch reads it ("cpu", "cuda", "cuda:1")."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: object, device: torch.device) -> torch.dtype:
    """ "auto" takes the checkpoint's dtype, except half precision on CPU, which runs float32."""
    if name != "auto":
        return _DTYPES[name]
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    if not isinstance(config_dtype, torch.dtype) or config_dtype not in _DTYPES.values():
        config_dtype = torch.float32
    if device.type == "cpu" and config_dtype != torch.float32:
        return torch.float32
    return config_dtype


def load_model(runner: ModelRunner) -> None:
    """Load the checkpoint (this rank's shard) in the resolved dtype onto the runner's device,
    seeded with `ModelConfig.seed`, and give every attention layer the runner's backend.
    Resolves the KV cache dtype too (ValueError where the device cannot run it)."""
    model_config = runner.config.model_config
    runner.model_dtype = resolve_dtype(model_config.dtype, model_config.hf_config, runner.device)
    runner.kv_cache_dtype = kv_cache_torch_dtype(
        runner.config.cache_config.kv_cache_dtype, runner.model_dtype
    )
    _check_kv_cache_dtype(runner)
    torch.manual_seed(model_config.seed)
    # Start-up says what it is doing (loading can take minutes on a large checkpoint).
    logger.info(
        "loading weights of %s (%s, %s)", model_config.model, runner.model_dtype, runner.device
    )
    start = time.perf_counter()
    runner.model = load_checkpoint(
        model_config.model,
        model_config.hf_config,
        runner.model_dtype,
        runner.device,
        model_config.load_format,
        model_config.quantization,
        model_config.model_impl,
        max_model_len=model_config.max_model_len,
        cpu_offload_bytes=_cpu_offload_bytes(runner),
    )
    runner.attention_layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    for layer in runner.attention_layers:
        layer.backend = runner.backend
    num_bytes = sum(t.numel() * t.element_size() for t in runner.model.state_dict().values())
    logger.info(
        "loaded weights in %.1f s (%.1f MiB on this rank)",
        time.perf_counter() - start,
        num_bytes / 2**20,
    )


def _cpu_offload_bytes(runner: ModelRunner) -> int:
    """cpu_offload_gb in bytes; ValueError when it exceeds the host's available memory."""
    num_bytes = int(runner.config.cache_config.cpu_offload_gb * 2**30)
    available = host_memory_bytes()
    if num_bytes and available is not None and num_bytes > available:
        raise ValueError(
            f"cpu_offload_gb={runner.config.cache_config.cpu_offload_gb} is more than this "
            f"host's available memory ({available / 2**30:.1f} GiB)"
        )
    return num_bytes


def _check_kv_cache_dtype(runner: ModelRunner) -> None:
    """The Triton kernels convert e4m3 in hardware only from compute capability 8.9 (Ada,
    Hopper) on; raise ValueError naming the way out on older GPUs."""
    if runner.kv_cache_dtype != torch.float8_e4m3fn or runner.device.type != "cuda":
        return
    if runner.backend.name == "triton" and torch.cuda.get_device_capability(runner.device) < (
        8,
        9,
    ):
        raise ValueError(
            f"kv_cache_dtype {runner.config.cache_config.kv_cache_dtype!r} (float8 e4m3) needs "
            f"a GPU of compute capability 8.9 or newer for the Triton attention kernels, got "
            f"{torch.cuda.get_device_name(runner.device)}; use kv_cache_dtype 'fp8_e5m2', "
            f"attention_backend 'torch', or 'auto'"
        )


def kv_block_bytes(runner: ModelRunner) -> int:
    """Bytes of one KV block over all layers, in the KV cache's dtype (an fp8 block takes
    half the bytes of a 16-bit one, so a memory budget holds twice the blocks)."""
    element_size = torch.tensor([], dtype=runner.kv_cache_dtype).element_size()
    return sum(
        2 * runner.block_size * layer.num_kv_heads * layer.head_dim * element_size
        for layer in runner.attention_layers
    )


def kv_sliding_window(runner: ModelRunner) -> int | None:
    """The sliding window W that EVERY attention layer of the loaded model uses, else None.

    The scheduler may release a request's blocks that fall out of the window only when no
    layer reads further back: a model with mixed local and global layers (Gemma 2/3), or
    whose layers' windows differ, keeps every block (None). Each layer states its window
    (`Attention.sliding_window`, set by the model from its config)."""
    windows = {layer.sliding_window for layer in runner.attention_layers}
    if len(windows) != 1:
        return None
    return windows.pop()


def determine_num_blocks(runner: ModelRunner) -> int:
    """Blocks the KV cache can hold: the override, else the memory given, else sized from
    the device (GPU: profiled; CPU: a quarter of free RAM, capped at 2 GiB and at what
    `max_num_seqs` requests of `max_model_len` tokens can use)."""
    cache_config = runner.config.cache_config
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes // kv_block_bytes(runner)
    if runner.device.type == "cuda":
        return _profile_num_blocks(runner)
    available = _available_ram_bytes()
    budget = min(int(available * _CPU_DEFAULT_KV_FRACTION), _CPU_DEFAULT_KV_CAP)
    max_useful = runner.config.scheduler_config.max_num_seqs * -(
        -runner.config.model_config.max_model_len // runner.block_size
    )
    return max(min(budget // kv_block_bytes(runner), max_useful), 1)


def _profile_num_blocks(runner: ModelRunner) -> int:
    """Run the largest step once, measure peak memory, give the rest to KV blocks."""
    logger.info("profiling memory with a step of %d tokens",
                runner.config.scheduler_config.max_num_batched_tokens)  # fmt: skip
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    num_tokens = runner.config.scheduler_config.max_num_batched_tokens
    max_model_len = runner.config.model_config.max_model_len
    seq_len = min(num_tokens, max_model_len)
    num_reqs = max(num_tokens // seq_len, 1)
    num_profile_blocks = num_reqs * -(-seq_len // runner.block_size)
    _allocate_kv_cache(runner, num_profile_blocks)
    fake = profiling_step(num_reqs, seq_len, runner.block_size)
    runner.execute_model(fake)
    runner.execute_model(SchedulerOutput([], [], {r.request_id for r in fake.new_requests}))
    torch.cuda.synchronize(runner.device)
    block_bytes = kv_block_bytes(runner)
    peak = torch.cuda.max_memory_allocated(runner.device) - num_profile_blocks * block_bytes
    runner.kv_caches = []
    for layer in runner.attention_layers:
        layer.kv_cache = None
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(runner.device)
    kv_bytes = int(total * runner.config.cache_config.gpu_memory_utilization) - peak
    logger.info(
        "profiling: peak %.2f GiB without KV cache; %.2f GiB for KV blocks",
        peak / 2**30,
        kv_bytes / 2**30,
    )
    return max(kv_bytes // block_bytes, 0)


def initialize_kv_cache(runner: ModelRunner, num_blocks: int) -> None:
    """Allocate the KV cache (this pipeline stage's layers only) and its CPU blocks (swap
    space, the prefix cache's CPU tier: `EngineConfig.cpu_block_counts`), then capture CUDA
    graphs for decode batches when they apply (CUDA device, a graph-capturable backend, not
    `enforce_eager`, one pipeline stage), then warm up (CUDA).
    Raises ValueError when the cache does not fit (see `_allocate_kv_cache`)."""
    _allocate_kv_cache(runner, num_blocks)
    num_cpu_blocks = sum(runner.config.cpu_block_counts(kv_block_bytes(runner)))
    if num_cpu_blocks > 0:
        runner.cpu_kv_cache = CpuKVCache(runner.kv_caches, num_cpu_blocks)
    # A pipeline stage's forward takes the previous stage's tensors, which the decode graphs
    # do not: pipeline parallelism runs eager (graphs per stage are future work).
    pipelined = runner.config.parallel_config.pipeline_parallel_size > 1
    if runner.device.type == "cuda" and pipelined:
        logger.info("pipeline parallelism: no CUDA graphs (eager mode)")
    if (
        runner.device.type == "cuda"
        and not runner.config.device_config.enforce_eager
        and runner.backend.name == "triton"
        and not pipelined
        and not runner.config.cache_config.cpu_offload_gb  # hooks around each layer
    ):
        assert runner.model is not None
        runner.cuda_graphs = CudaGraphRunner(
            runner.model,
            runner.config.scheduler_config.max_num_seqs,
            runner.config.model_config.max_model_len,
            runner.block_size,
            runner.device,
            runner.uses_mrope,
        )
        logger.info("capturing CUDA graphs for decode batches (--enforce-eager skips this)")
        start = time.perf_counter()
        _capture(runner, runner.cuda_graphs)
        logger.info("captured CUDA graphs in %.1f s", time.perf_counter() - start)
    if runner.device.type == "cuda":
        start = time.perf_counter()
        warm_up(runner, num_blocks)
        logger.info("warmed up (Triton kernel variants) in %.1f s", time.perf_counter() - start)


def _capture(runner: ModelRunner, graphs: CudaGraphRunner) -> None:
    """Capture the decode graphs. A model that only tries (`cuda_graphs_best_effort`: the
    transformers backend, whose forward is transformers' code) runs eager when its forward
    cannot be captured, with one log line saying why."""
    if not getattr(runner.model, "cuda_graphs_best_effort", False):
        graphs.capture()
        return
    try:
        graphs.capture()
    except RuntimeError as e:
        torch.cuda.synchronize(runner.device)
        runner.cuda_graphs = None
        logger.warning(
            "%s: CUDA graph capture failed, running eager: %s",
            type(runner.model).__name__,
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )


def warm_up(runner: ModelRunner, num_blocks: int) -> None:
    """Run a few throw-away steps of the shapes the engine meets (a prefill, a prefill
    beside decodes, long decodes that split the KV range) so that Triton compiles their
    kernel variants now rather than inside the first requests. The steps write K/V into
    free blocks, which nothing reads before it is written again."""
    long_len = min(runner.config.model_config.max_model_len - 2, 600)
    blocks_per_request = -(-(long_len + 2) // runner.block_size)
    if long_len < 2 or 3 * blocks_per_request > num_blocks:
        return
    for step in warm_up_steps(long_len, runner.block_size, blocks_per_request):
        runner.execute_model(step)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _allocate_kv_cache(runner: ModelRunner, num_blocks: int) -> None:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer, zeroed
    (the torch backend reads padded slots under a mask; zeros keep them finite). Raises
    ValueError, naming the options that set the size, when it does not fit (on the CPU:
    more than the RAM available now, which zeroed pages would otherwise take later)."""
    num_bytes = num_blocks * kv_block_bytes(runner)
    what = (
        f"a KV cache of {num_blocks} blocks ({num_bytes / 2**30:.2f} GiB) does not fit on "
        f"{runner.device}; lower kv_cache_memory_bytes, num_gpu_blocks_override or "
        f"gpu_memory_utilization"
    )
    available = host_memory_bytes()
    if runner.device.type == "cpu" and available is not None and num_bytes > available:
        raise ValueError(f"{what} ({available / 2**30:.2f} GiB RAM available)")
    try:
        _allocate_kv_tensors(runner, num_blocks)
    except torch.OutOfMemoryError as e:
        raise ValueError(f"{what}: {e}") from None
    except RuntimeError as e:
        if "alloc" not in str(e).lower():
            raise
        raise ValueError(f"{what}: {e}") from None


def _allocate_kv_tensors(runner: ModelRunner, num_blocks: int) -> None:
    runner.kv_caches = []
    for layer in runner.attention_layers:
        cache = torch.zeros(
            2,
            num_blocks,
            runner.block_size,
            layer.num_kv_heads,
            layer.head_dim,
            dtype=runner.kv_cache_dtype,
            device=runner.device,
        )
        layer.kv_cache = cache
        runner.kv_caches.append(cache)


def _available_ram_bytes() -> int:
    """MemAvailable (Linux), else a guess of 8 GiB: for sizing the default CPU KV cache."""
    known = host_memory_bytes()
    return 8 << 30 if known is None else known

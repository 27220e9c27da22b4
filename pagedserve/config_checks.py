"""The engine configuration's cross-domain start-up checks (`EngineConfig.__post_init__`):
tensor, expert and pipeline parallel splits against the model, ranks against the GPUs, and
the CPU KV memory against the host's. Import rule: as config.py (a leaf; torch lazily); the
configs are typed Any here because config.py imports this module (no import circle)."""

import os
from typing import Any

from pagedserve.pp_layers import pp_partition


def check_cpu_kv_memory(cache_config: Any, preemption_mode: str, num_ranks: int) -> None:
    """The CPU KV memory (swap space with preemption_mode "swap", and the prefix cache's CPU
    tier), per GPU, times the ranks (pp x tp x data_parallel_size: this host's,
    as with the mp executor; each data-parallel core holds its own), must fit the host memory
    available now (MemAvailable; physical memory where /proc/meminfo is missing). Raises
    ValueError naming the option and the limit; also for "swap" with no swap space."""
    swap = cache_config.swap_space if preemption_mode == "swap" else 0.0
    if preemption_mode == "swap" and swap == 0:
        raise ValueError("preemption_mode 'swap' needs swap_space > 0 GiB, got 0")
    available = host_memory_bytes()
    needed = (swap + cache_config.kv_offload_gb) * num_ranks * (1 << 30)
    if available is None or needed <= available:
        return
    options = " + ".join(
        name for name, gib in (("swap_space", swap), ("kv_offload_gb", cache_config.kv_offload_gb))
        if gib > 0
    )  # fmt: skip
    raise ValueError(
        f"{options} ({needed / num_ranks / 2**30:.2f} GiB per GPU x {num_ranks}) exceed the host "
        f"memory available, {available / 2**30:.2f} GiB; lower {options.replace(' + ', ' or ')}"
    )


def host_memory_bytes() -> int | None:
    """Host memory available now: MemAvailable of /proc/meminfo, else the physical memory
    (os.sysconf), else None (unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_tensor_parallel_size(hf_config: Any, tp_size: int) -> None:
    """Tensor parallelism splits the attention heads (and the KV heads, or replicates them
    when there are fewer than ranks) evenly: check before any worker starts. Raises
    ValueError naming the counts."""
    num_heads = getattr(hf_config, "num_attention_heads", None) or getattr(
        hf_config, "n_head", None
    )
    if not isinstance(num_heads, int) or tp_size == 1:
        return
    if num_heads % tp_size:
        raise ValueError(
            f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size "
            f"({tp_size})"
        )
    intermediate_size = getattr(hf_config, "intermediate_size", None)
    if isinstance(intermediate_size, int) and intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size ({intermediate_size}) is not divisible by tensor_parallel_size "
            f"({tp_size})"
        )
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({tp_size}): "
            f"one must divide the other"
        )


def check_pipeline_parallel(hf_config: Any, parallel_config: Any) -> None:
    """Every pipeline stage gets at least one decoder layer, and the split that
    PAGEDSERVE_PP_LAYER_PARTITION gives (if any) fits the model: checked before any worker
    starts. Raises ValueError naming pipeline_parallel_size and num_hidden_layers."""
    pp_size = parallel_config.pipeline_parallel_size
    num_layers = getattr(hf_config, "num_hidden_layers", None)
    if pp_size == 1 or not isinstance(num_layers, int):
        return
    pp_partition(num_layers, pp_size, parallel_config.pp_layer_partition)


def check_gpu_count(device: str, parallel_config: Any) -> None:
    """On device "cuda" the ranks of this host (pipeline_parallel_size x
    tensor_parallel_size with the 'mp' executor) need a GPU each. Raises ValueError naming
    both sizes and the GPUs visible. ("auto" is checked by the executor, which resolves it.)"""
    world_size = parallel_config.world_size
    if device != "cuda" or world_size == 1 or parallel_config.executor_backend != "mp":
        return
    import torch

    check_gpus_for_ranks(world_size, torch.cuda.device_count(), parallel_config)


def check_gpus_for_ranks(world_size: int, num_gpus: int, parallel_config: Any) -> None:
    """Raise ValueError when `world_size` ranks on one host exceed its `num_gpus` GPUs."""
    if world_size > num_gpus:
        raise ValueError(
            f"pipeline_parallel_size ({parallel_config.pipeline_parallel_size}) x "
            f"tensor_parallel_size ({parallel_config.tensor_parallel_size}) = {world_size} "
            f"ranks need a GPU each, but only {num_gpus} are visible; lower the sizes or make "
            f"more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )


def check_experts_split(hf_config: Any, tp_size: int, expert_parallel: bool) -> None:
    """A mixture-of-experts model's experts split evenly over the ranks: whole experts under
    expert parallelism (num_experts / tp_size each), else each expert's intermediate size
    (moe_intermediate_size, Mixtral's intermediate_size). Checked before any worker starts;
    raises ValueError naming the counts and the other way to split. A dense model (no
    num_experts / num_local_experts) passes whatever the options."""
    num_experts = getattr(hf_config, "num_experts", None) or getattr(
        hf_config, "num_local_experts", None
    )
    if not isinstance(num_experts, int) or num_experts <= 0 or tp_size == 1:
        return
    if expert_parallel:
        if num_experts % tp_size:
            raise ValueError(
                f"num_experts ({num_experts}) is not divisible by tensor_parallel_size "
                f"({tp_size}): expert parallelism (enable_expert_parallel) puts "
                f"num_experts / tensor_parallel_size whole experts on each rank; without it "
                f"each expert is split across the ranks instead"
            )
        return
    intermediate = getattr(hf_config, "moe_intermediate_size", None) or getattr(
        hf_config, "intermediate_size", None
    )
    if isinstance(intermediate, int) and intermediate % tp_size:
        raise ValueError(
            f"the experts' intermediate size ({intermediate}) is not divisible by "
            f"tensor_parallel_size ({tp_size}); enable_expert_parallel places whole experts "
            f"on the ranks instead"
        )

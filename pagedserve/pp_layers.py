"""Which decoder layers each pipeline stage holds (vLLM's `get_pp_indices`). No torch: the
engine's configuration checks the split before any worker starts."""

from pagedserve import envs


def pp_partition(num_layers: int, pp_size: int, override: str | None = None) -> list[int]:
    """The number of decoder layers of each of the `pp_size` stages, summing to `num_layers`.

    Default: an even split; the remainder goes one layer each to the stages before the last,
    from the second-to-last backwards (the last stage also runs the LM head and sampling),
    as vLLM splits: 5 layers over 2 stages are [3, 2]; 7 over 4 are [2, 2, 2, 1].
    `override` ("3,5": `ParallelConfig.pp_layer_partition`, PAGEDSERVE_PP_LAYER_PARTITION as
    the engine's process read it) sets the split instead.
    Raises ValueError when num_layers < pp_size (a stage would have no layer), or when
    `override` does not list pp_size positive integers summing to num_layers.
    """
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size ({pp_size}) is larger than the model's number of decoder "
            f"layers (num_hidden_layers = {num_layers}): every stage needs at least one layer"
        )
    if override is None:
        return pp_partition_even(num_layers, pp_size)
    try:
        partition = [int(part) for part in override.split(",")]
    except ValueError:
        partition = []
    if len(partition) != pp_size or min(partition) < 1 or sum(partition) != num_layers:
        raise ValueError(
            f"{envs.PP_LAYER_PARTITION}={override!r} must list pipeline_parallel_size "
            f"({pp_size}) positive layer counts that sum to num_hidden_layers ({num_layers}), "
            f"e.g. {','.join(map(str, pp_partition_even(num_layers, pp_size)))}"
        )
    return partition


def pp_partition_even(num_layers: int, pp_size: int) -> list[int]:
    """The default split of `pp_partition` (the environment variable ignored)."""
    partition = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        partition[-2 - i] += 1
    return partition


def get_pp_indices(
    num_layers: int, pp_rank: int, pp_size: int, override: str | None = None
) -> tuple[int, int]:
    """[start, end) of the decoder layers that stage `pp_rank` holds (`pp_partition`).
    Raises ValueError as `pp_partition`."""
    partition = pp_partition(num_layers, pp_size, override)
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]

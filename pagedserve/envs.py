"""Environment variables that pagedserve reads (all named PAGEDSERVE_*), in one place."""

import os


def api_key() -> str | None:
    """PAGEDSERVE_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("PAGEDSERVE_API_KEY") or None


def max_n_sequences() -> int:
    """PAGEDSERVE_MAX_N_SEQUENCES: the largest `n` (and `best_of`) one request may ask for,
    default 16384 (vLLM's VLLM_MAX_N_SEQUENCES). Each sequence is an engine request with its
    own state, so an unbounded n lets one request exhaust host memory. Raises ValueError when
    the variable is not a positive integer."""
    return _positive_int("PAGEDSERVE_MAX_N_SEQUENCES", 16384)


def max_stop_strings() -> int:
    """PAGEDSERVE_MAX_STOP_STRINGS: the most stop strings one request may give, default 128.
    They are matched in the API server's process for every token; one automaton keeps the
    cost per token flat, but building it and the request's memory grow with the list.
    (vLLM bounds the OpenAI `stop` list at request parsing; SGLang allows 32.) Raises
    ValueError when the variable is not a positive integer."""
    return _positive_int("PAGEDSERVE_MAX_STOP_STRINGS", 128)


def max_stop_string_chars() -> int:
    """PAGEDSERVE_MAX_STOP_STRING_CHARS: the most characters the stop strings of one request
    may hold together, default 8192. It also bounds the text held back from a stream (the
    longest stop string, less one character). Raises ValueError when not a positive
    integer."""
    return _positive_int("PAGEDSERVE_MAX_STOP_STRING_CHARS", 8192)


def image_fetch_timeout() -> float:
    """PAGEDSERVE_IMAGE_FETCH_TIMEOUT (vLLM's VLLM_IMAGE_FETCH_TIMEOUT): seconds an http(s)
    image URL of a chat message may take to download, default 5."""
    return _positive_float("PAGEDSERVE_IMAGE_FETCH_TIMEOUT") or 5.0


def max_image_bytes() -> int:
    """PAGEDSERVE_MAX_IMAGE_BYTES: the largest image (encoded bytes) a chat message's http(s)
    or file URL may give, default 20 MiB; a larger one is refused before it is decoded."""
    return _positive_int("PAGEDSERVE_MAX_IMAGE_BYTES", 20 * 2**20)


def peak_bandwidth() -> float | None:
    """PAGEDSERVE_PEAK_BANDWIDTH: the device's peak memory bandwidth in bytes/s for the MBU
    figures, overriding the table of known devices (`roofline.DEVICE_PEAKS`); None when
    unset. Raises ValueError when not a positive number."""
    return _positive_float("PAGEDSERVE_PEAK_BANDWIDTH")


def peak_flops() -> float | None:
    """PAGEDSERVE_PEAK_FLOPS: the device's peak dense FLOP/s (of the model's dtype) for the
    MFU figures, overriding `roofline.DEVICE_PEAKS`; None when unset. Raises ValueError when
    not a positive number."""
    return _positive_float("PAGEDSERVE_PEAK_FLOPS")


PP_LAYER_PARTITION = "PAGEDSERVE_PP_LAYER_PARTITION"


def pp_layer_partition() -> str | None:
    """PAGEDSERVE_PP_LAYER_PARTITION (vLLM's VLLM_PP_LAYER_PARTITION): the decoder layers of
    each pipeline stage, comma-separated ("3,5": 3 on stage 0, 5 on stage 1), overriding the
    even split; None when unset. Checked against the model by
    `pp_layers.pp_partition`."""
    return os.environ.get(PP_LAYER_PARTITION) or None


CPU_RESERVED = "PAGEDSERVE_CPU_NUM_OF_RESERVED_CPU"


def cpu_reserved() -> int:
    """PAGEDSERVE_CPU_NUM_OF_RESERVED_CPU (vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU): cores that the
    CPU workers leave to other processes, default 0; the engine-core process of a server sets
    it to 1 for the API server's process when unset. Raises ValueError when not an integer
    >= 0."""
    raw = os.environ.get(CPU_RESERVED) or "0"  # empty: unset
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{CPU_RESERVED} must be an integer >= 0, got {raw!r}")
    return value


DISTRIBUTED_PORT = "PAGEDSERVE_DISTRIBUTED_PORT"


def distributed_port() -> int | None:
    """PAGEDSERVE_DISTRIBUTED_PORT: the local TCP port where rank 0 of a multiprocess
    tensor-parallel group hosts the group's rendezvous; unset: a free port the OS picks. A
    data-parallel engine sets it for each engine core to one of distinct free ports, so that
    the cores' groups, started at once, never pick the same one. Raises ValueError when not
    an integer in 1..65535."""
    raw = os.environ.get(DISTRIBUTED_PORT)
    if not raw:  # empty: unset
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise ValueError(f"{DISTRIBUTED_PORT} must be a port number (1..65535), got {raw!r}")
    return value


def _positive_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if not raw:  # empty: unset
        return None
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number, got {raw!r}")
    return value


def _positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name) or str(default)  # empty: unset
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


GRAMMAR_PROCESS = "PAGEDSERVE_GRAMMAR_PROCESS"


def grammar_process() -> bool:
    """PAGEDSERVE_GRAMMAR_PROCESS: "1" (default) runs structured outputs' grammar matchers in
    a process of their own where the engine fills bitmasks while the device runs the forward
    (async scheduling on a GPU, one rank in the engine's process); "0" keeps them in the
    engine thread. Raises ValueError for another value."""
    return _switch(GRAMMAR_PROCESS)


FP8_KV_F16_DOTS = "PAGEDSERVE_FP8_KV_F16_DOTS"


def fp8_kv_f16_dots() -> bool:
    """PAGEDSERVE_FP8_KV_F16_DOTS: "1" (default) runs the attention dots over an fp8 KV cache
    in fp16 when the queries are bf16 (faster: BENCHMARKS.md, issue 15); "0" in bf16, the
    earlier path, kept to compare. Read once, at import. Raises ValueError for another value."""
    return _switch(FP8_KV_F16_DOTS)


W4_CUDA = "PAGEDSERVE_W4_CUDA"


def w4_cuda() -> bool:
    """PAGEDSERVE_W4_CUDA: "1" (default) serves 4-bit GPTQ / AWQ layers without act-order with
    the CUDA kernels of layers/kernels/w4_gemv_cuda.py where nvcc can build them (faster:
    BENCHMARKS.md, issue 15); "0" keeps the Triton kernels, to compare. Read at weight load.
    Raises ValueError for another value."""
    return _switch(W4_CUDA)


PDL = "PAGEDSERVE_PDL"


def pdl() -> bool:
    """PAGEDSERVE_PDL: "1" (default) launches the W4A16 CUDA GEMV (4-bit decode) with
    programmatic dependent launch on GPUs of compute capability 9.0+ (it starts streaming its
    weights while the kernel before it finishes; the small Triton kernels before it let it start
    early: pagedserve/gdc.py), "0" launches it after the previous kernel has finished, to
    compare. Read once per process, at the first launch on each device. Raises ValueError for
    another value."""
    return _switch(PDL)


W4_EPILOGUES = "PAGEDSERVE_W4_EPILOGUES"


def w4_epilogues() -> bool:
    """PAGEDSERVE_W4_EPILOGUES: "1" (default) lets the W4A16 CUDA GEMV (4-bit decode, up to 8
    rows) finish a Llama-style layer's output itself: silu(gate) * up for gate_up_proj, the
    rotary embedding of q and k for qkv_proj (one kernel each instead of two); "0" runs the
    separate activation / rotary kernels, to compare. Read once per process, at the first
    such layer's call. Raises ValueError for another value."""
    return _switch(W4_EPILOGUES)


def _switch(name: str) -> bool:
    """An on/off variable, on by default: "1" or unset/empty on, "0" off, else ValueError."""
    raw = os.environ.get(name) or "1"  # empty: unset
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"

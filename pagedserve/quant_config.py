"""Which quantization a checkpoint uses, and its parameters as the producing tool wrote them.

`resolve_quantization` picks the method (the `quantization` option, else config.json's
`quantization_config.quant_method`, as vLLM's `ModelConfig._verify_quantization`) and
`get_quantization_config` parses and checks that method's `quantization_config` into a
frozen config (vLLM's `QuantizationConfig.from_config`). Both run when the engine's config is
built, so an unsupported checkpoint fails before any worker starts. The linear methods that
use these configs live in `pagedserve.layers.quantization`.

Import rule: a leaf (torch-free, imports nothing from pagedserve), so that the engine and
`pagedserve.config` can check a checkpoint without model code.
"""

from dataclasses import dataclass
from typing import Any

# The values of `--quantization` (vLLM's names).
QUANTIZATION_METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
# Methods whose loading is implemented; the others fail with NotImplementedError naming them.
IMPLEMENTED_METHODS = ("gptq", "awq")
GPTQ_BITS = (4, 8)
GPTQ_GROUP_SIZES = (-1, 32, 64, 128)
# GPTQModel's names; "gptq" is the v1 zero-point convention AutoGPTQ writes (stored zero =
# zero - 1), "gptq_v2" stores the zero itself.
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
AWQ_BITS = (4,)
AWQ_GROUP_SIZES = (32, 64, 128)
# AutoAWQ's kernel versions; only GEMM's layout (`AWQLinearMethod`) is read. GEMV stores
# qweight [N, K / 8], packed along K: read as GEMM it would give wrong weights.
AWQ_VERSIONS = ("gemm",)


class QuantizationConfig:
    """A checkpoint's quantization parameters (vLLM's `QuantizationConfig`, torch-free)."""

    @classmethod
    def get_name(cls) -> str:
        """The method's name as `--quantization` spells it."""
        raise NotImplementedError


@dataclass(frozen=True)
class PackedIntConfig(QuantizationConfig):
    """Integer weights packed into int32 words, in groups of input rows that share a scale and
    zero (GPTQ, AWQ)."""

    weight_bits: int
    group_size: int

    @property
    def pack_factor(self) -> int:
        """Quantized values per int32 word."""
        return 32 // self.weight_bits


@dataclass(frozen=True)
class GPTQConfig(PackedIntConfig):
    """GPTQ (AutoGPTQ / GPTQModel) weight-only quantization.

    weight_bits: 4 or 8; group_size: input rows per scale/zero group (-1: one group over all
    of K); desc_act: act-order (rows are quantized in a permuted order, so `g_idx` maps each
    input row to an arbitrary group); sym: symmetric (every zero is 2**(bits-1));
    zero_offset: added to each stored zero (1 for the v1 format, where the packer stored
    zero - 1; 0 for gptq_v2).
    """

    desc_act: bool
    sym: bool = True
    zero_offset: int = 1

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        """Parse an HF `quantization_config` dict (keys bits, group_size, desc_act, sym,
        checkpoint_format). Raises ValueError naming an unsupported value and the supported
        ones."""
        bits = config.get("bits")
        if bits not in GPTQ_BITS:
            raise ValueError(f"GPTQ bits={bits!r} is not supported; supported: {GPTQ_BITS}")
        group_size = config.get("group_size", -1)
        if group_size not in GPTQ_GROUP_SIZES:
            raise ValueError(
                f"GPTQ group_size={group_size!r} is not supported; supported: {GPTQ_GROUP_SIZES}"
            )
        checkpoint_format = config.get("checkpoint_format") or "gptq"
        if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(
                f"GPTQ checkpoint_format={checkpoint_format!r} is not supported; "
                f"supported: {GPTQ_CHECKPOINT_FORMATS}"
            )
        if config.get("lm_head"):
            raise NotImplementedError("GPTQ checkpoints with a quantized lm_head are not supported")
        return cls(
            weight_bits=int(bits),
            group_size=int(group_size),
            desc_act=bool(config.get("desc_act", False)),
            sym=bool(config.get("sym", True)),
            zero_offset=1 if checkpoint_format == "gptq" else 0,
        )


@dataclass(frozen=True)
class AWQConfig(PackedIntConfig):
    """AWQ (AutoAWQ, GEMM version) weight-only quantization, as vLLM's `AWQConfig`.

    weight_bits: 4; group_size: input rows per scale/zero group (32, 64 or 128);
    zero_point: always True here (asymmetric: W = (q - zero) * scale)."""

    zero_point: bool = True

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        """Parse an HF `quantization_config` dict (keys bits / w_bit, group_size /
        q_group_size, zero_point, version; both spellings, as vLLM). Raises ValueError naming
        an unsupported bits, group size or version and the supported ones;
        NotImplementedError for zero_point false (AutoAWQ's GEMM layer cannot pack it)."""
        bits = config.get("bits", config.get("w_bit"))
        if bits not in AWQ_BITS:
            raise ValueError(f"AWQ bits={bits!r} is not supported; supported: {AWQ_BITS}")
        group_size = config.get("group_size", config.get("q_group_size"))
        if group_size not in AWQ_GROUP_SIZES:
            raise ValueError(
                f"AWQ group_size={group_size!r} is not supported; supported: {AWQ_GROUP_SIZES}"
            )
        version = str(config.get("version", "gemm")).lower()
        if version not in AWQ_VERSIONS:
            raise ValueError(f"AWQ version={version!r} is not supported; supported: {AWQ_VERSIONS}")
        if not config.get("zero_point", True):
            raise NotImplementedError(
                "AWQ zero_point=false is not supported (AutoAWQ's GEMM layout always has "
                "zero points)"
            )
        return cls(weight_bits=int(bits), group_size=int(group_size))


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` (or llm-compressor's older `compression_config`)
    as a dict, or None for an unquantized checkpoint."""
    for name in ("quantization_config", "compression_config"):
        value = getattr(hf_config, name, None)
        if value is not None:
            if not isinstance(value, dict):
                value = value.to_dict() if hasattr(value, "to_dict") else vars(value)
            return dict(value)
    return None


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """`quant_method` of the checkpoint's quantization_config, lower-cased (None if absent)."""
    quant_config = checkpoint_quant_config(hf_config)
    if quant_config is None:
        return None
    method = quant_config.get("quant_method")
    return str(method).lower() if method is not None else None


def resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The quantization method the engine uses: `requested` (the option), else the
    checkpoint's `quant_method`; then checked with `get_quantization_config`.

    Raises ValueError when `requested` is not a known method, when it contradicts the
    checkpoint's quant_method (naming both), or when the checkpoint's method, bits or group
    size is unsupported (naming the value and the supported ones); NotImplementedError for a
    known method whose loading is not implemented yet.
    """
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {requested!r}")
    found = checkpoint_quant_method(hf_config)
    if found is not None and found not in QUANTIZATION_METHODS:
        raise ValueError(
            f"the checkpoint's quantization_config.quant_method {found!r} is not supported; "
            f"supported: {QUANTIZATION_METHODS}"
        )
    if requested is not None and found is not None and requested != found:
        raise ValueError(
            f"quantization={requested!r} was asked for, but the checkpoint's "
            f"quantization_config.quant_method is {found!r}"
        )
    method = requested or found
    if method is not None:
        get_quantization_config(method, hf_config)
    return method


def get_quantization_config(method: str, hf_config: Any) -> QuantizationConfig:
    """The parsed config of `method` from the checkpoint's quantization_config.

    Raises ValueError for a method the checkpoint does not carry (e.g. `gptq` on an
    unquantized checkpoint) and NotImplementedError for methods not implemented yet (fp8,
    compressed-tensors: never loaded as if unquantized)."""
    if method not in IMPLEMENTED_METHODS:
        raise NotImplementedError(
            f"quantization {method!r} is not implemented yet (implemented: "
            f"{IMPLEMENTED_METHODS}); refusing to load the checkpoint unquantized"
        )
    quant_config = checkpoint_quant_config(hf_config)
    if quant_config is None:
        raise ValueError(
            f"quantization={method!r} needs a checkpoint quantized with it, but config.json "
            f"has no quantization_config"
        )
    if method == "awq":
        return AWQConfig.from_config(quant_config)
    return GPTQConfig.from_config(quant_config)

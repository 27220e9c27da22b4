"""Which quantization a checkpoint uses, and its parameters as the producing tool wrote them.

`resolve_quantization` picks the method (the `quantization` option, else config.json's
`quantization_config.quant_method`, as vLLM's `ModelConfig._verify_quantization`) and
`get_quantization_config` parses and checks that method's `quantization_config` into a
frozen config (vLLM's `QuantizationConfig.from_config`). Both run when the engine's config is
built, so an unsupported checkpoint fails before any worker starts. The linear methods that
use these configs live in `pagedserve.layers.quantization`.

Import rule: a leaf (torch-free, imports nothing from pagedserve but the leaf
`pagedserve.quant_files`), so that the engine and `pagedserve.config` can check a checkpoint
without model code.
"""

import re
from dataclasses import dataclass
from typing import Any

from pagedserve.quant_files import QUANT_CONFIG_FILES, quant_config_source

# The values of `--quantization` (vLLM's names).
QUANTIZATION_METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
# Methods whose loading is implemented; the others fail with NotImplementedError naming them.
IMPLEMENTED_METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
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
FP8_ACTIVATION_SCHEMES = ("static", "dynamic")


def check_supported(what: str, value: Any, supported: tuple[Any, ...]) -> None:
    """Raise ValueError "WHAT=VALUE is not supported; supported: SUPPORTED" unless `value` is
    one of `supported`."""
    if value not in supported:
        raise ValueError(f"{what}={value!r} is not supported; supported: {supported}")


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
        bits: Any = config.get("bits")
        check_supported("GPTQ bits", bits, GPTQ_BITS)
        group_size = config.get("group_size", -1)
        check_supported("GPTQ group_size", group_size, GPTQ_GROUP_SIZES)
        checkpoint_format = config.get("checkpoint_format") or "gptq"
        check_supported("GPTQ checkpoint_format", checkpoint_format, GPTQ_CHECKPOINT_FORMATS)
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
        bits: Any = config.get("bits", config.get("w_bit"))
        check_supported("AWQ bits", bits, AWQ_BITS)
        group_size: Any = config.get("group_size", config.get("q_group_size"))
        check_supported("AWQ group_size", group_size, AWQ_GROUP_SIZES)
        version = str(config.get("version", "gemm")).lower()
        check_supported("AWQ version", version, AWQ_VERSIONS)
        if not config.get("zero_point", True):
            raise NotImplementedError(
                "AWQ zero_point=false is not supported (AutoAWQ's GEMM layout always has "
                "zero points)"
            )
        return cls(weight_bits=int(bits), group_size=int(group_size))


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """FP8 W8A8 (float8_e4m3fn weights and activations), as vLLM's `Fp8Config`.

    checkpoint_fp8: the checkpoint stores fp8 weights with their `weight_scale` (per tensor,
    or per output channel); False is online FP8: float weights are quantized at load with one
    scale per tensor. activation_scheme: "static" (the checkpoint's `input_scale`) or
    "dynamic" (scales computed from each batch); per_token: dynamic scales per token (row)
    instead of one per tensor (vLLM's fp8 method uses per tensor; compressed-tensors' "token"
    strategy per token).
    """

    checkpoint_fp8: bool = True
    activation_scheme: str = "dynamic"
    per_token: bool = False

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        """Parse a `quant_method: fp8` quantization_config (keys activation_scheme,
        ignored_layers / modules_to_not_convert, weight_block_size). Raises ValueError naming
        an unsupported activation scheme or a block-wise `weight_block_size`;
        NotImplementedError for ignored layers other than lm_head."""
        scheme = config.get("activation_scheme")
        check_supported("fp8 activation_scheme", scheme, FP8_ACTIVATION_SCHEMES)
        if config.get("weight_block_size") is not None:
            raise ValueError(
                f"fp8 weight_block_size={config['weight_block_size']!r} (block-wise FP8) is not "
                f"supported; supported: per-tensor or per-channel weight_scale"
            )
        check_ignored(
            "fp8 ignored_layers",
            config.get("ignored_layers") or config.get("modules_to_not_convert") or [],
        )
        return cls(checkpoint_fp8=True, activation_scheme=str(scheme))


def check_ignored(what: str, names: list[str]) -> None:
    """Raise NotImplementedError unless every unquantized layer a checkpoint lists is the
    LM head (never quantized here): per-layer methods are not implemented."""
    for name in names:
        plain = name[3:] if name.startswith("re:") else name
        if plain.rstrip("$").split(".")[-1] != "lm_head":
            raise NotImplementedError(
                f"{what} lists {name!r}: layers left unquantized other than lm_head are not "
                f"supported"
            )


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantizationConfig):
    """llm-compressor's compressed-tensors checkpoints (vLLM's `CompressedTensorsConfig`),
    with one scheme for every quantized Linear: `scheme` is an `Fp8Config` (W8A8-FP8,
    "float-quantized") or a `GPTQConfig` (W4A16 / W8A16, "pack-quantized": the packed
    tensors are converted to GPTQ's layout at load; zero_offset 0)."""

    scheme: QuantizationConfig

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        """Parse `config_groups` (each with targets, weights, input_activations), `format`,
        `ignore`, `sparsity_config`, `kv_cache_scheme` (FP8 only: its scales are read by the
        loader). Raises NotImplementedError naming an unsupported scheme (INT8 W8A8, 2:4
        sparsity, several different schemes, a non-FP8 KV cache) and ValueError naming an
        unsupported bits / group size / format."""
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise NotImplementedError(
                f"compressed-tensors sparsity_config format={sparsity.get('format')!r} "
                f"(e.g. 2:4 sparse) is not supported"
            )
        kv_scheme = config.get("kv_cache_scheme")
        if kv_scheme is not None and (
            kv_scheme.get("num_bits") != 8 or kv_scheme.get("type", "int") != "float"
        ):
            # An FP8 KV scheme only brings per-layer k/v scales (`*_proj.output_scale`), which
            # the loader reads (models/kv_scales.py) and --kv-cache-dtype fp8 uses; other
            # schemes (INT8) would need a different cache format.
            raise NotImplementedError(
                f"compressed-tensors kv_cache_scheme {kv_scheme!r} is not supported; "
                f"supported: FP8 (num_bits 8, type float), with --kv-cache-dtype fp8"
            )
        check_ignored("compressed-tensors ignore", list(config.get("ignore") or []))
        config_groups = config.get("config_groups") or {}
        if not isinstance(config_groups, dict) or not all(
            isinstance(g, dict) for g in config_groups.values()
        ):
            raise ValueError(
                "compressed-tensors config_groups must map group names to schemes (objects), "
                f"got {type(config_groups).__name__}"
            )
        groups = list(config_groups.values())
        schemes = {_ct_scheme(g, g.get("format") or config.get("format")) for g in groups}
        if not schemes:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        _check_targets_cover_every_linear([t for g in groups for t in g.get("targets") or []])
        if len(schemes) != 1:
            raise NotImplementedError(
                f"compressed-tensors with {len(schemes)} different schemes in config_groups "
                f"is not supported (one scheme for every Linear is)"
            )
        return cls(scheme=schemes.pop())


# Linear layers of a decoder layer (our Llama-family models), as compressed-tensors names them.
_DECODER_LINEARS = tuple(
    f"model.layers.0.{name}"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
)


def _check_targets_cover_every_linear(targets: list[str]) -> None:
    """Raise NotImplementedError unless the config groups' `targets` quantize every Linear
    ("Linear", or module names / "re:" patterns that match each of them): the layers they
    leave out keep float weights, and per-layer methods are not implemented."""
    if "Linear" in targets:
        return
    for name in _DECODER_LINEARS:
        if not any(
            re.match(t[3:], name) if t.startswith("re:") else name.endswith(t) for t in targets
        ):
            raise NotImplementedError(
                f"compressed-tensors config_groups targets {targets} leave {name} (and maybe "
                f"other Linear layers) unquantized: only checkpoints with every Linear "
                f"quantized alike are supported"
            )


def _ct_scheme(group: dict[str, Any], fmt: str | None) -> QuantizationConfig:
    """The linear config of one compressed-tensors config group (see
    `CompressedTensorsConfig.from_config` for the errors)."""
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    kind, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    described = f"weights {kind} {bits}-bit {strategy}, input_activations {acts}, format {fmt!r}"
    if group.get("output_activations") is not None:
        raise NotImplementedError(f"compressed-tensors output_activations: {described}")
    if kind == "float" and bits == 8 and acts is not None:
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors W8A8-FP8 needs float-quantized, got {fmt!r}")
        if strategy not in ("tensor", "channel") or acts.get("type") != "float":
            raise NotImplementedError(f"compressed-tensors scheme not supported: {described}")
        act_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
        if (act_strategy, dynamic) not in (("token", True), ("tensor", True), ("tensor", False)):
            raise NotImplementedError(f"compressed-tensors FP8 activations: {described}")
        return Fp8Config(
            activation_scheme="dynamic" if dynamic else "static",
            per_token=act_strategy == "token",
        )
    if kind == "int" and acts is None:
        if fmt != "pack-quantized":
            raise NotImplementedError(
                f"compressed-tensors int weights need pack-quantized: {fmt!r}"
            )
        group_size = weights.get("group_size") if strategy == "group" else -1
        if strategy not in ("group", "channel") or group_size not in GPTQ_GROUP_SIZES:
            raise ValueError(
                f"compressed-tensors weight strategy {strategy!r} group_size {group_size!r} is "
                f"not supported; supported: channel, or group with {GPTQ_GROUP_SIZES[1:]}"
            )
        if bits not in GPTQ_BITS:
            raise ValueError(f"compressed-tensors num_bits={bits!r}; supported: {GPTQ_BITS}")
        actorder = weights.get("actorder")
        return GPTQConfig(
            weight_bits=int(bits),
            group_size=int(group_size),
            desc_act=actorder in ("group", "dynamic"),
            sym=bool(weights.get("symmetric", True)),
            zero_offset=0,
        )
    raise NotImplementedError(f"compressed-tensors scheme not supported: {described}")


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` (or llm-compressor's older `compression_config`,
    or the parameters `quant_files.attach_quant_config_file` read from a file beside
    config.json) as a dict, or None for an unquantized checkpoint."""
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
    source = quant_config_source(hf_config)
    if found is not None and found not in QUANTIZATION_METHODS:
        raise ValueError(
            f"the checkpoint's quant_method {found!r} ({source}) is not supported; "
            f"supported: {QUANTIZATION_METHODS}"
        )
    if requested is not None and found is not None and requested != found:
        raise ValueError(
            f"quantization={requested!r} was asked for, but the checkpoint's quant_method "
            f"is {found!r} ({source})"
        )
    if requested is None and found is None and checkpoint_quant_config(hf_config) is not None:
        raise ValueError(
            f"the checkpoint has quantization parameters ({source}) but no quant_method "
            f"that tells their method; pass quantization= (one of {QUANTIZATION_METHODS})"
        )
    method = requested or found
    if method is not None:
        get_quantization_config(method, hf_config)
    return method


def get_quantization_config(method: str, hf_config: Any) -> QuantizationConfig:
    """The parsed config of `method` from the checkpoint's quantization_config.

    `fp8` on a checkpoint without quantization_config is online FP8 (`Fp8Config` with
    checkpoint_fp8 False: weights quantized at load, dynamic activations), as vLLM. Raises
    ValueError for another method the checkpoint does not carry (e.g. `gptq` on an
    unquantized checkpoint) and NotImplementedError for methods not implemented."""
    if method not in IMPLEMENTED_METHODS:
        raise NotImplementedError(
            f"quantization {method!r} is not implemented yet (implemented: "
            f"{IMPLEMENTED_METHODS}); refusing to load the checkpoint unquantized"
        )
    quant_config = checkpoint_quant_config(hf_config)
    if quant_config is None:
        if method == "fp8":
            return Fp8Config(checkpoint_fp8=False)
        raise ValueError(
            f"quantization={method!r} needs a checkpoint quantized with it, but config.json "
            f"has no quantization_config and there is no {' or '.join(QUANT_CONFIG_FILES)} "
            f"beside it"
        )
    if method == "awq":
        return AWQConfig.from_config(quant_config)
    if method == "fp8":
        return Fp8Config.from_config(quant_config)
    if method == "compressed-tensors":
        return CompressedTensorsConfig.from_config(quant_config)
    return GPTQConfig.from_config(quant_config)

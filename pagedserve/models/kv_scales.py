"""Checkpoint tensors that hold the fp8 KV cache's per-layer scales, loaded into the
`Attention` layer's `k_scale` / `v_scale` buffers (vLLM's `maybe_remap_kv_scale_name` and
compressed-tensors' `get_cache_scale` read the same names).

    model.layers.N.self_attn.k_scale                 (AutoFP8, llm-compressor, vLLM's format)
    model.layers.N.self_attn.k_proj.output_scale     (compressed-tensors' kv_cache_scheme)
    model.layers.N.self_attn.k_proj.k_scale          (NVIDIA ModelOpt)
    model.layers.N.self_attn.kv_scale                (deprecated: one scale for both)

and the same for v. `q_scale` and `prob_scale` (FP8 attention's query and softmax scales) are
read and ignored: the attention here computes in the query's dtype.
"""

import torch
from torch import nn

from pagedserve.layers.attention import Attention

# checkpoint name suffix -> the Attention buffers it fills (None: read and ignored)
_SUFFIXES: dict[str, tuple[str, ...] | None] = {
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
    ".self_attn.k_proj.output_scale": ("k_scale",),
    ".self_attn.v_proj.output_scale": ("v_scale",),
    ".self_attn.k_proj.k_scale": ("k_scale",),
    ".self_attn.v_proj.v_scale": ("v_scale",),
    ".self_attn.q_scale": None,
    ".self_attn.prob_scale": None,
}


def load_kv_scale(model: nn.Module, checkpoint_name: str, tensor: torch.Tensor) -> bool:
    """If `checkpoint_name` is a KV cache scale, copy it into its layer's buffer(s) and return
    True; else return False (the caller loads it as a weight). The layer's `Attention` module
    is `<prefix>.self_attn.attn`.

    Raises ValueError for a scale with more than one value (vLLM, too, supports only
    per-tensor scales for the fp8 KV cache), a scale that is not finite and positive, or
    one whose layer has no attention module.
    """
    suffix = next((s for s in _SUFFIXES if checkpoint_name.endswith(s)), None)
    if suffix is None:
        return False
    buffers = _SUFFIXES[suffix]
    if buffers is None:
        return True
    if tensor.shape.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}: the fp8 KV "
            f"cache supports only per-tensor scales (one value per layer)"
        )
    prefix = checkpoint_name[: -len(suffix)] + ".self_attn.attn"
    try:
        layer = model.get_submodule(prefix)
    except AttributeError:
        layer = None
    if not isinstance(layer, Attention):
        raise ValueError(
            f"checkpoint tensor {checkpoint_name!r} is a KV cache scale, but the model has no "
            f"attention layer {prefix!r}"
        )
    value = torch.reshape(tensor, (1,)).float()  # reads a lazy SafetensorsSlice
    if not (torch.isfinite(value).all() and (value > 0).all()):
        raise ValueError(
            f"checkpoint tensor {checkpoint_name!r} is {value.item()}: a KV cache scale must be "
            f"finite and positive"
        )
    for name in buffers:
        getattr(layer, name).copy_(value)
    return True

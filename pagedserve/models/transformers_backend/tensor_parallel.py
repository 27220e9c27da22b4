"""Tensor parallelism for the transformers backend, from the model's own TP plan.

transformers models declare how their layers split over ranks in
`config.base_model_tp_plan`: module-name patterns under the base model (`*` for a layer index)
-> a style, e.g. Llama's `layers.*.self_attn.q_proj: "colwise"`, `...o_proj: "rowwise"`.
`shard_model` replaces each `nn.Linear` that a plain "colwise" entry names with a
column-parallel linear (this rank's output features, no communication) and each "rowwise" one
with a row-parallel linear (this rank's input features, all-reduced output), as vLLM's
Transformers backend does (`replace_linear_class`). The modeling code is unchanged: it
reshapes projections with `-1` heads (`view(*input_shape, -1, head_dim)`), so each rank's
attention sees its own heads, and the probe forward that runs afterwards builds each layer's
paged `Attention` with the per-rank head counts.

Styles whose result equals the unsplit layer on every rank (a column split whose output is
gathered again, a row split of a replicated input, vocab-parallel embeddings, norms kept whole
on every rank) leave the module replicated: correct, with no memory saved on it (OLMo 2's and
Phi-3's attention projections; GPT-NeoX's embedding in transformers 5.24). Embeddings and the
LM head always stay replicated. Every other style (packed/fused splits, MoE experts, MLA,
local or sequence-parallel styles) is refused, naming the style and the module.

KV heads fewer than ranks (tp_size a multiple of them): the k/v projections are
"colwise" in the plans; each rank then holds the one KV head its query heads use (rank r
holds KV head r // (tp_size / num_kv_heads)), as the native models' QKVParallelLinear does.
"""

import re
from typing import Any

import torch
from torch import nn

from pagedserve.distributed.parallel_state import get_tp_size
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)

# Styles after which every rank holds the unsplit result: the module stays replicated.
_REPLICATED_STYLES = frozenset(
    {
        "replicate",
        "replicated_with_grad_allreduce",  # norms: the all-reduce is of gradients (training)
        "colwise_gather_output",  # a column split gathered back: the full output
        "colwise_rep",  # older transformers' name for the same
        "rowwise_split_input",  # a row split of a replicated input, all-reduced: the same
        "rowwise_rep",  # older transformers' name for the same
        "embedding_rowwise",  # vocab-parallel embedding, all-reduced: the full embedding
    }
)
_SPLIT_STYLES = frozenset({"colwise", "rowwise"})


def tp_plan(hf_config: Any) -> dict[str, str]:
    """The config's `base_model_tp_plan` (pattern under the base model -> style), {} if none."""
    plan = getattr(hf_config, "base_model_tp_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def _pattern(key: str) -> re.Pattern[str]:
    """transformers' plan key as a regex on a module name: `*` stands for a layer index."""
    return re.compile(r"\d+".join(re.escape(part) for part in key.split("*")))


class HFColumnParallelLinear(ColumnParallelLinear):
    """An `nn.Linear` of a transformers model split by output features ("colwise"): rank r
    computes features [r * n, (r + 1) * n) of y = x W^T + b, n = out_features / tp_size.

    forward: x [..., in_features] -> [..., out_features / tp_size], no communication.
    With `kv_replicas` > 1 (a k/v projection of fewer KV heads than ranks) each of
    `out_features / head_size` heads is held by `kv_replicas` consecutive ranks: rank r holds
    head r // kv_replicas. Raises ValueError when the features do not split evenly.
    """

    def __init__(self, linear: nn.Linear, kv_replicas: int = 1) -> None:
        tp_size = get_tp_size()
        self.kv_replicas = kv_replicas
        # With replicated KV heads the rank's share is one head: out_features * replicas
        # split tp_size ways.
        super().__init__(
            linear.in_features, linear.out_features * kv_replicas, bias=linear.bias is not None
        )
        self.output_size = linear.out_features  # total over ranks, heads counted once
        self.in_features = linear.in_features
        self.out_features = linear.out_features * kv_replicas // tp_size

    def weight_loader(
        self,
        param: nn.Parameter,  # this rank's rows of W [out_features / tp_size, in] or of b
        loaded_weight: torch.Tensor,  # the full checkpoint tensor (or a lazy slice of it)
    ) -> None:
        if self.kv_replicas == 1:
            super().weight_loader(param, loaded_weight)
            return
        dim = getattr(param, "output_dim", None)
        if dim is None:
            default_weight_loader(param, loaded_weight)
            return
        size = param.size(dim)
        shard = self.tp_rank // self.kv_replicas
        expected = list(param.shape)
        expected[dim] = self.output_size
        if list(loaded_weight.shape) != expected:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                f"expected {tuple(expected)}"
            )
        param.data.copy_(loaded_weight.narrow(dim, shard * size, size))

    def forward(
        self,
        x: torch.Tensor,  # [..., in_features] float
    ) -> torch.Tensor:  # [..., out_features / tp_size] float
        return super().forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class HFRowParallelLinear(RowParallelLinear):
    """An `nn.Linear` of a transformers model split by input features ("rowwise"): rank r
    multiplies its input shard [..., in_features / tp_size] by columns [r * n, (r + 1) * n)
    of W and the partial sums are all-reduced (the bias added once).

    forward: x [..., in_features / tp_size] -> [..., out_features], the same on every rank.
    Raises ValueError when the input features do not split evenly.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.in_features = linear.in_features // get_tp_size()
        self.out_features = linear.out_features

    def forward(
        self,
        x: torch.Tensor,  # [..., in_features / tp_size] float
    ) -> torch.Tensor:  # [..., out_features] float
        return super().forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


def shard_model(hf_model: nn.Module, base_model_prefix: str) -> None:
    """Split the linears of a transformers causal LM over the tensor-parallel ranks by its
    config's `base_model_tp_plan` (see the module docstring), in place. Does nothing at
    tp_size 1. The new layers take their shards from full checkpoint tensors in their
    `weight_loader`s (only this rank's part of a lazy safetensors slice is read).

    Raises ValueError for a model without a TP plan, for a plan style other than colwise /
    rowwise (or one of the styles that keep the module whole), for a split style on a module
    that is no nn.Linear (fused MoE experts, ...), and for features that do not split evenly,
    each naming the module.
    """
    tp_size = get_tp_size()
    if tp_size == 1:
        return
    config = getattr(hf_model, "config", None)
    name = type(hf_model).__name__
    plan = tp_plan(config)
    if not plan:
        raise ValueError(
            f"{name} has no tensor-parallel plan (base_model_tp_plan in its transformers "
            f"config), so the transformers backend cannot split it: use tensor_parallel_size "
            f"1, or a native model (model_impl 'pagedserve')"
        )
    base = getattr(hf_model, base_model_prefix)
    patterns = [(_pattern(key), key, style) for key, style in plan.items()]
    kv_size, kv_replicas = _kv_replication(config, tp_size)
    modules = dict(base.named_modules())
    names = list(modules) + [n for n, _ in base.named_parameters()]
    for qualified in names:
        style = next((s for p, _, s in patterns if p.fullmatch(qualified)), None)
        if style is None or style in _REPLICATED_STYLES:
            continue
        module = modules.get(qualified)
        if isinstance(module, nn.Embedding) and style == "rowwise":
            continue  # vocab-parallel embedding (older plans): replicated gives its output
        if style not in _SPLIT_STYLES or not isinstance(module, nn.Linear):
            what = type(module).__name__ if module is not None else "a parameter"
            raise ValueError(
                f"{name}'s tensor-parallel plan shards {base_model_prefix}.{qualified} "
                f"({what}) with style {style!r}, which the transformers backend does not "
                f"implement (it runs plain 'colwise'/'rowwise' nn.Linear splits); use "
                f"tensor_parallel_size 1 for this model"
            )
        parent_name, _, child = qualified.rpartition(".")
        parent = modules[parent_name]
        try:
            if style == "rowwise":
                new: nn.Module = HFRowParallelLinear(module)
            else:
                # A k/v projection (of an attention module: it has a head_dim) of fewer KV
                # heads than ranks is replicated per head rather than split inside a head.
                replicas = (
                    kv_replicas
                    if module.out_features == kv_size and hasattr(parent, "head_dim")
                    else 1
                )
                new = HFColumnParallelLinear(module, replicas)
        except ValueError as e:
            raise ValueError(
                f"{name}: {base_model_prefix}.{qualified} ({style}): {e}; tensor_parallel_size "
                f"{tp_size} does not split it evenly"
            ) from None
        # The construction-time checks (probe, incremental check) run before the checkpoint
        # is loaded: start from this rank's shard of the initial weights, not torch.empty.
        with torch.no_grad():
            for param_name, param in module.named_parameters(recurse=False):
                target = getattr(new, param_name)
                target.weight_loader(target, param)
        setattr(parent, child, new)
        modules[qualified] = new


def _kv_replication(config: Any, tp_size: int) -> tuple[int | None, int]:
    """(num_kv_heads * head_dim, tp_size / num_kv_heads) when the config has fewer KV heads
    than ranks, else (None, 1)."""
    num_heads = getattr(config, "num_attention_heads", None)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if not isinstance(num_kv_heads, int) or not isinstance(num_heads, int):
        return None, 1
    if num_kv_heads >= tp_size or tp_size % num_kv_heads:
        return None, 1
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return num_kv_heads * head_dim, tp_size // num_kv_heads

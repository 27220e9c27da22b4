"""VisionLanguageModel: what LLaVA and Qwen2.5-VL share around their language model (vLLM's
`SupportsMultiModal` pattern): token embeddings, the forward and the logits are the language
model's, with the images' rows put into `inputs_embeds` by the model runner
(`worker/encoder_cache.py`), and checkpoint loading that hands the language model its own
tensors and loads the vision side's as they pass.
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.layers.linear import get_weight_loader
from pagedserve.models.llama import _param

_LANGUAGE_PREFIX = "language_model."


class VisionLanguageModel(nn.Module):
    """Base of the vision-language models: subclasses set `language_model` (one of our
    causal LMs, with `model.embed_tokens`, `compute_logits` and `load_weights`)."""

    language_model: Any  # a causal LM of ours (LlamaForCausalLM, Qwen2ForCausalLM, ...)

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, text_hidden] float
        """The language model's token embeddings (placeholders included: their rows are
        replaced by the images' before the forward)."""
        embed_tokens: nn.Module = self.language_model.model.embed_tokens
        embeddings: torch.Tensor = embed_tokens(input_ids)
        return embeddings

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64; [3, num_tokens] with M-RoPE
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, text_hidden] float
    ) -> torch.Tensor:  # [num_tokens, text_hidden] float, final norm applied
        """Without `inputs_embeds` the tokens are embedded as text (a step that feeds no
        image token: decode, or a chunk of text)."""
        hidden_states: torch.Tensor = self.language_model(
            input_ids, positions, attn_metadata, inputs_embeds
        )
        return hidden_states

    def compute_logits(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, text_hidden] float
    ) -> torch.Tensor:  # [num_tokens, vocab_size] float32
        logits: torch.Tensor = self.language_model.compute_logits(hidden_states)
        return logits

    def _load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        our_name: Callable[[str], str],
        is_unused: Callable[[str], bool] = lambda name: False,
    ) -> set[str]:
        """One pass over the checkpoint (tensors are read one at a time): each name mapped by
        `our_name`; "language_model." ones go on to the language model's load_weights, the
        others are loaded here as they pass, except those `is_unused` says are never run.
        Returns the names of our parameters loaded; raises UnsupportedModelError naming a
        tensor we have no parameter for."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def language_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for checkpoint_name, tensor in weights:
                name = our_name(checkpoint_name)
                if name.startswith(_LANGUAGE_PREFIX):
                    yield name[len(_LANGUAGE_PREFIX) :], tensor
                elif name not in params and is_unused(name):
                    continue
                else:
                    param = _param(params, name, checkpoint_name)  # raises, naming the tensor
                    get_weight_loader(param)(param, tensor)
                    loaded.add(name)

        for name in self.language_model.load_weights(language_weights()):
            loaded.add(_LANGUAGE_PREFIX + name)
        return loaded

"""Batched sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of the requests sampled this step (one row each)."""

    temperature: torch.Tensor  # [num_rows] float32; 1.0 on greedy rows (unused there)
    greedy: torch.Tensor  # [num_rows] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [num_rows] int64, vocab_size = off; None when no row uses it
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 = off; None when no row uses it
    min_p: torch.Tensor | None  # [num_rows] float32, 0.0 = off; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded)
    banned_token_ids: dict[int, list[int]]  # row -> stop tokens not allowed yet (min_tokens)
    num_logprobs: list[int | None]  # per row; None = no logprobs

    @property
    def max_num_logprobs(self) -> int | None:
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    # When any row wants logprobs: [num_rows, 1 + max_num_logprobs] ids and logprobs (the
    # sampled token first, then the top-k), and the sampled token's rank (1 = most likely).
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    sampled_ranks: torch.Tensor | None  # [num_rows] int64


class Sampler:
    """Turns the last-position logits of each sampled request into one next token.

    Order of operations (as in vLLM): ban stop tokens before `min_tokens`, divide by the
    temperature, keep the top-k, then the top-p nucleus, then drop tokens below min_p times the
    top probability, and sample with the exponential race (`argmax(p / q)`, q ~ Exp(1)), which
    equals sampling from p and lets each seeded request draw q from its own generator, so that
    its tokens do not depend on the rest of the batch. Logprobs are log-softmax of the logits
    after the min_tokens ban and the temperature (greedy rows: temperature 1), before top-k/p.
    """

    def forward(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size]
        metadata: SamplingMetadata,
    ) -> SamplerOutput:
        logits = logits.float()
        for row, token_ids in metadata.banned_token_ids.items():
            logits[row, token_ids] = _NEG_INF
        greedy_tokens = logits.argmax(dim=-1)
        if metadata.all_greedy:
            sampled = greedy_tokens
            scaled = logits
        else:
            scaled = logits / metadata.temperature[:, None]
            random_tokens = self._sample_random(scaled, metadata)
            sampled = torch.where(metadata.greedy, greedy_tokens, random_tokens)
        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        return self._gather_logprobs(scaled, sampled, metadata.max_num_logprobs)

    def _sample_random(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32, temperature applied
        metadata: SamplingMetadata,
    ) -> torch.Tensor:  # [num_rows] int64
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        if metadata.min_p is not None:
            threshold = metadata.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        q = torch.empty_like(probs).exponential_()
        for row, generator in metadata.generators.items():
            q[row].exponential_(generator=generator)
        return (probs / q).argmax(dim=-1)

    def _gather_logprobs(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32
        sampled: torch.Tensor,  # [num_rows] int64
        num_logprobs: int,
    ) -> SamplerOutput:
        logprobs = logits.log_softmax(dim=-1)
        sampled_logprobs = logprobs.gather(-1, sampled[:, None])  # [num_rows, 1]
        ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([sampled[:, None], top_ids], dim=-1)
        values = torch.cat([sampled_logprobs, top_logprobs], dim=-1)
        return SamplerOutput(sampled, token_ids, values, ranks)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    top_k: torch.Tensor | None,  # [num_rows] int64; vocab_size = off
    top_p: torch.Tensor | None,  # [num_rows] float32; 1.0 = off
) -> torch.Tensor:  # [num_rows, vocab_size], dropped tokens at -inf
    """Mask logits outside each row's top-k and top-p nucleus (the nucleus always keeps the
    most likely token). One sort serves both."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(vocab_size, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(-1, order, sorted_logits)

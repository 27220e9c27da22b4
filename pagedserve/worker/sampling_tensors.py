"""One step's sampling tensors as the sampler reads them: SamplingMetadata, one row per sampled
request, and its optional parts (built by sampling_metadata.SamplingStateManager)."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogitAdjustments:
    """Sparse additions to the logits: each `logit_bias`, and -inf for banned tokens (bad
    words)."""

    rows: torch.Tensor  # [num_adjustments] int64
    token_ids: torch.Tensor  # [num_adjustments] int64
    values: torch.Tensor  # [num_adjustments] float32


@dataclass(slots=True)
class MinTokensBans:
    """The stop tokens of the rows before their `min_tokens`, banned unless that would leave
    the row no token at all (a grammar that is complete allows only its stop tokens: the
    request then ends, as the grammar says, instead of sampling from an all -inf row)."""

    rows: torch.Tensor  # [num_rows_banned] int64, each row once
    entry_rows: torch.Tensor  # [num_bans] int64, the logits row of each ban
    entry_local: torch.Tensor  # [num_bans] int64, its index in `rows`
    token_ids: torch.Tensor  # [num_bans] int64


@dataclass(slots=True)
class AllowedTokens:
    rows: torch.Tensor  # [num_restricted] int64, rows with `allowed_token_ids`
    banned: torch.Tensor  # [num_restricted, vocab_size] bool, True = not allowed


@dataclass(slots=True)
class PenaltyMetadata:
    rows: torch.Tensor  # [num_penalized] int64
    prompt_mask: torch.Tensor  # [num_penalized, vocab_size] bool
    output_counts: torch.Tensor  # [num_penalized, vocab_size] int32
    repetition: torch.Tensor  # [num_penalized] float32
    presence: torch.Tensor  # [num_penalized] float32
    frequency: torch.Tensor  # [num_penalized] float32


@dataclass(slots=True)
class SeedMetadata:
    rows: torch.Tensor  # [num_seeded] int64, random (not greedy) rows with a seed
    seeds: torch.Tensor  # [num_seeded] int64
    positions: torch.Tensor  # [num_seeded] int64, position of the token being sampled


@dataclass(slots=True)
class Truncation:
    """Min-p, top-k and top-p of the random rows that use any of them. A part is None when
    no row uses it (top_k: when no row uses top-k or top-p)."""

    rows: torch.Tensor  # [num_truncated] int64
    min_p: torch.Tensor | None  # [num_truncated] float32, 0.0 = off
    top_k: torch.Tensor | None  # [num_truncated] int64, vocab_size = off
    top_p: torch.Tensor | None  # [num_truncated] float32, 1.0 = off
    max_top_k: int  # largest top-k in use (0 if none)


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling parameters, one row per sampled request. Optional parts are None
    when no row uses them, so that a plain batch pays for nothing else."""

    temperature: torch.Tensor  # [num_rows] float32; 1.0 on greedy rows
    greedy_rows: torch.Tensor | None  # [num_greedy] int64; None when there is none
    all_greedy: bool
    truncation: Truncation | None
    seeds: SeedMetadata | None
    allowed: AllowedTokens | None
    adjustments: LogitAdjustments | None
    min_tokens_bans: MinTokensBans | None
    penalties: PenaltyMetadata | None
    num_logprobs: list[int | None]  # per row; None = no logprobs
    logprob_rows: torch.Tensor | None  # [num_logprob_rows] int64, the rows that want logprobs

    @property
    def max_num_logprobs(self) -> int | None:
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None

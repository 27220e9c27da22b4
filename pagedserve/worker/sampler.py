"""Batched sampler: logit processors, penalties, temperature, min-p/top-k/top-p, seeds, logprobs."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.messages import PromptLogprobsData
from pagedserve.worker.penalties import apply_penalties
from pagedserve.worker.sampling_tensors import MinTokensBans, SamplingMetadata, Truncation

_NEG_INF = float("-inf")
_FLOAT32_MAX = torch.finfo(torch.float32).max
# Top-p looks for its nucleus among this many most likely tokens first (a top-k is much cheaper
# than a sort of the whole vocabulary, on CPUs above all); rows whose nucleus is larger fall
# back to the whole vocabulary.
_NUM_TOP_P_CANDIDATES = 1024
_PROMPT_LOGPROBS_CHUNK = 512  # prompt positions per logits matrix (bounds its memory)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    # For the rows that want logprobs (`SamplingMetadata.logprob_rows`, in that order):
    # [num_logprob_rows, 1 + max_num_logprobs] ids and logprobs (the sampled token first, then
    # the top-k), and the sampled token's rank [num_logprob_rows] (1 = most likely).
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    sampled_ranks: torch.Tensor | None


class Sampler:
    """Turns the last-position logits of each sampled request into one next token.

    Order of operations, as in vLLM v1, every step a tensor operation over the rows that use it:
    1. processors that change the argmax: tokens outside `allowed_token_ids` and bad words
       get -inf; `logit_bias` is added; stop tokens get -inf before `min_tokens` (unless
       nothing else is left: `ban_stop_tokens`); then the repetition, frequency and presence
       penalties. Greedy rows take the argmax here.
    2. the temperature divides the logits; logprobs are log-softmax at this point;
    3. min-p, then top-k, then top-p cut the tail (the most likely token always stays);
    4. inverse-CDF sampling: one uniform number per row picks a token from the cumulative
       probabilities. Seeded rows take it from a counter-based generator keyed by (seed,
       position), so that their tokens depend neither on the rest of the batch nor on its
       order (nor on preemption); other rows from torch's generator.
    One uniform per row, not one per token as in vLLM's exponential race, makes the random
    numbers free: on a CPU, drawing 256 x 32000 exponentials costs more than the rest.
    `forward` changes `logits` in place when they are float32.
    """

    def forward(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size]
        metadata: SamplingMetadata,
    ) -> SamplerOutput:
        logits = logits.float()
        apply_logits_processors(logits, metadata)
        if not metadata.all_greedy:
            logits.div_(metadata.temperature[:, None])  # 1.0 on greedy rows
        logprob_rows = metadata.logprob_rows
        logprobs = None
        if logprob_rows is not None:
            logprobs = logits.index_select(0, logprob_rows).log_softmax(dim=-1)
        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            greedy_rows = metadata.greedy_rows
            if greedy_rows is not None:
                greedy_tokens = logits.index_select(0, greedy_rows).argmax(dim=-1)
            sampled = sample_random(logits, metadata)
            if greedy_rows is not None:
                sampled.index_copy_(0, greedy_rows, greedy_tokens)
        if logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        assert logprob_rows is not None and metadata.max_num_logprobs is not None
        token_ids, values, ranks = gather_logprobs(
            logprobs, sampled.index_select(0, logprob_rows), metadata.max_num_logprobs
        )
        return SamplerOutput(sampled, token_ids, values, ranks)


def apply_logits_processors(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, changed in place
    metadata: SamplingMetadata,
) -> None:
    """Step 1 above: what greedy decoding sees too."""
    if metadata.allowed is not None:
        allowed = metadata.allowed
        selected = logits.index_select(0, allowed.rows).masked_fill_(allowed.banned, _NEG_INF)
        logits.index_copy_(0, allowed.rows, selected)
    if metadata.adjustments is not None:  # bans (-inf) and logit_bias, summed
        adjustments = metadata.adjustments
        logits.index_put_(
            (adjustments.rows, adjustments.token_ids), adjustments.values, accumulate=True
        )
    if metadata.min_tokens_bans is not None:
        ban_stop_tokens(logits, metadata.min_tokens_bans)
    if metadata.penalties is not None:
        penalties = metadata.penalties
        apply_penalties(
            logits,
            penalties.rows,
            penalties.prompt_mask,
            penalties.output_counts,
            penalties.repetition,
            penalties.presence,
            penalties.frequency,
        )


def ban_stop_tokens(logits: torch.Tensor, bans: MinTokensBans) -> None:
    """-inf for the stop tokens of the rows before their `min_tokens`, except in a row where
    that would ban every token: there only stop tokens are left (a complete grammar allows
    nothing else), and they keep their logits, so that the request ends as its grammar says
    rather than sampling garbage from a row of -inf. No device sync."""
    kept = logits[bans.entry_rows, bans.token_ids]
    logits[bans.entry_rows, bans.token_ids] = _NEG_INF
    alive = (logits.index_select(0, bans.rows) > _NEG_INF).any(dim=1)  # [num_rows_banned]
    restored = torch.where(alive[bans.entry_local], torch.full_like(kept, _NEG_INF), kept)
    logits[bans.entry_rows, bans.token_ids] = restored


def sample_random(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, temperature applied; cut in place
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_rows] int64
    # An infinite logit (a penalty or temperature overflowing float32) or a row with every
    # token banned would make the softmax NaN and the sampled id fall outside the vocabulary:
    # keep the logits finite so that every row samples a real token.
    logits.nan_to_num_(nan=0.0, posinf=_FLOAT32_MAX, neginf=-_FLOAT32_MAX)
    probs = sampling_probs(logits, metadata)
    seeds = metadata.seeds
    if seeds is not None and seeds.rows.numel() == probs.shape[0]:
        uniform = seeded_uniform(seeds.seeds, seeds.positions)
    else:
        uniform = torch.rand(probs.shape[0], device=probs.device)
        if seeds is not None:
            uniform.index_copy_(0, seeds.rows, seeded_uniform(seeds.seeds, seeds.positions))
    return inverse_cdf_sample(probs, uniform)


def inverse_cdf_sample(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, rows need not sum to 1
    uniform: torch.Tensor,  # [num_rows] float32 in [0, 1)
) -> torch.Tensor:  # [num_rows] int64
    """The first token whose cumulative probability exceeds uniform * total. A token of
    probability 0 adds nothing to the cumulative sum and is never picked; probabilities are
    resolved to the float32 precision of the cumulative sum (about 1e-7)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    token_ids = torch.searchsorted(cdf, uniform[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)  # the last token of nonzero probability
    return torch.minimum(token_ids, last).squeeze(1)


def sampling_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, temperature applied; cut in place
    metadata: SamplingMetadata,
) -> torch.Tensor:  # [num_rows, vocab_size] float32
    """The distribution each random row samples from: min-p, top-k, top-p, softmax."""
    if metadata.truncation is not None:
        apply_truncation(logits, metadata.truncation)
    return logits.softmax(dim=-1)


def apply_truncation(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, changed in place
    truncation: Truncation,
) -> None:
    """Min-p, then top-k, then top-p, on the rows that use them (ties at a cut stay)."""
    selected = logits.index_select(0, truncation.rows)
    if truncation.min_p is not None:
        apply_min_p(selected, truncation.min_p)
    if truncation.top_k is not None:
        vocab_size = logits.shape[1]
        num_candidates = truncation.max_top_k
        if truncation.top_p is not None:
            num_candidates = max(num_candidates, _NUM_TOP_P_CANDIDATES)
        threshold = _truncation_threshold(
            selected, truncation.top_k, truncation.top_p, min(num_candidates, vocab_size)
        )
        selected.masked_fill_(selected < threshold[:, None], _NEG_INF)
    logits.index_copy_(0, truncation.rows, selected)


def apply_min_p(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, changed in place
    min_p: torch.Tensor,  # [num_rows] float32, 0 = off
) -> None:
    """Drop tokens less likely than min_p times the most likely one. p_i < min_p * p_max is
    l_i < l_max + log(min_p) in logits, which needs no softmax (min_p = 0: log is -inf)."""
    threshold = logits.amax(dim=-1) + min_p.log()
    logits.masked_fill_(logits < threshold[:, None], _NEG_INF)


def _truncation_threshold(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    top_k: torch.Tensor,  # [num_rows] int64, >= vocab_size = off
    top_p: torch.Tensor | None,  # [num_rows] float32, 1.0 = off
    num_candidates: int,  # >= every row's top_k below vocab_size
) -> torch.Tensor:  # [num_rows] float32: the smallest logit kept
    """Top-k keeps each row's k largest logits; top-p then the fewest most likely tokens whose
    probability (over the top-k when there is one) reaches p. Both read the top
    `num_candidates` logits only (a top-k instead of a sort); a row whose nucleus reaches past
    them is redone over the whole vocabulary."""
    top = logits.topk(num_candidates, dim=-1).values  # sorted, most likely first
    ranks = torch.arange(num_candidates, device=logits.device)
    keep = ranks < top_k[:, None]
    if top_p is not None:
        has_top_k = top_k <= num_candidates
        top = top.masked_fill(~keep, _NEG_INF)
        # Probabilities over the top-k when the row has one, else over the whole vocabulary.
        norm = torch.where(has_top_k, top.logsumexp(dim=-1), logits.logsumexp(dim=-1))
        probs = (top - norm[:, None]).exp()
        cumulative = probs.cumsum(dim=-1)
        keep &= (cumulative - probs < top_p[:, None]) | (top_p[:, None] >= 1.0)
        # The most likely token always stays: a top_p that rounds to 0 in float32, or a row
        # whose logits are all -inf (NaN probabilities), would otherwise keep nothing.
        keep[:, 0] = True
    threshold = top.gather(1, keep.sum(dim=-1, keepdim=True) - 1).squeeze(1)
    uncut = top_k >= logits.shape[1]  # rows here for min-p only
    if top_p is not None:
        uncut &= top_p >= 1.0
        if num_candidates < logits.shape[1]:  # does a nucleus reach past the candidates?
            incomplete = ~has_top_k & (top_p < 1.0) & (cumulative[:, -1] < top_p)
            if bool(incomplete.any()):
                rows = incomplete.nonzero().squeeze(1)
                threshold[rows] = _truncation_threshold(
                    logits[rows], top_k[rows], top_p[rows], logits.shape[1]
                )
    return threshold.masked_fill_(uncut, _NEG_INF)


_MASK32 = 0xFFFFFFFF


def seeded_uniform(
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64, the position of the token being sampled
) -> torch.Tensor:  # [num_rows] float32 in [0, 1)
    """Counter-based random numbers: a hash of (seed, position), so that a seeded request
    draws the same number whatever its row, its batch, or a preemption in between. The hash
    chains lowbias32 (a bijection on 32 bits with good avalanche; Wellons' hash-prospector)
    over the seed's two halves and the position; its top 24 bits make the float."""
    x = _mix32(positions & _MASK32)
    x = _mix32(x ^ ((seeds >> 32) & _MASK32))
    x = _mix32(x ^ (seeds & _MASK32))
    x = _mix32(x ^ 0x68E31DA4)
    return (x >> 8).float() * 2.0**-24


def _mix32(x: torch.Tensor) -> torch.Tensor:  # int64 values in [0, 2**32) -> same range
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32  # wraps past 2**63; the low 32 bits are still right
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def gather_logprobs(
    logprobs: torch.Tensor,  # [num_rows, vocab_size] float32
    token_ids: torch.Tensor,  # [num_rows] int64
    num_logprobs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The given token's logprob and rank, and the top-k: ids [num_rows, 1 + k] and logprobs
    [num_rows, 1 + k] (the given token first), ranks [num_rows] (1 = the most likely)."""
    num_logprobs = min(num_logprobs, logprobs.shape[-1])
    token_logprobs = logprobs.gather(-1, token_ids[:, None])
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    ids = torch.cat([token_ids[:, None], top_ids], dim=-1)
    return ids, torch.cat([token_logprobs, top_logprobs], dim=-1), ranks


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,  # [num_positions, hidden_size], position j scores token j + 1
    target_token_ids: list[int],  # [num_positions] the prompt tokens scored
    num_logprobs: int,
    first_position: int,  # prompt index of target_token_ids[0]
) -> PromptLogprobsData:
    """Prompt logprobs from the raw logits (log-softmax in float32, no sampling parameters),
    a chunk of positions at a time."""
    targets = torch.tensor(target_token_ids, dtype=torch.int64, device=hidden_states.device)
    token_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    ranks: list[int] = []
    for start in range(0, len(target_token_ids), _PROMPT_LOGPROBS_CHUNK):
        end = start + _PROMPT_LOGPROBS_CHUNK
        chunk = compute_logits(hidden_states[start:end]).float().log_softmax(dim=-1)
        ids, values, chunk_ranks = gather_logprobs(chunk, targets[start:end], num_logprobs)
        token_ids += ids.tolist()
        logprobs += values.tolist()
        ranks += chunk_ranks.tolist()
    return PromptLogprobsData(first_position, token_ids, logprobs, ranks)

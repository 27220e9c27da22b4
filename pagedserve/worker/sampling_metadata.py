"""Per-request sampling state on the worker, and the per-step SamplingMetadata built from it
(the step's tensors are defined in sampling_tensors.py)."""

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ScheduledRequest
from pagedserve.worker.penalties import TokenCountTable
from pagedserve.worker.sampling_tensors import (
    AllowedTokens,
    LogitAdjustments,
    MinTokensBans,
    PenaltyMetadata,
    SamplingMetadata,
    SeedMetadata,
    Truncation,
)

_NEG_INF = float("-inf")
_T = TypeVar("_T")

# Columns of the per-request tables (row `req_index` per live request, written once at admission).
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _PRESENCE, _FREQUENCY = range(6)
_TOP_K, _SEED, _MIN_TOKENS, _NUM_PROMPT_TOKENS, _NUM_LOGPROBS = range(5)
_GREEDY, _SEEDED, _PENALIZED, _BIASED, _RESTRICTED, _BAD_WORDS, _STOPPABLE = range(7)


@dataclass(slots=True)
class _RequestRecord:
    """Sampling state of one request that does not fit a fixed-width table row."""

    req_index: int
    num_seen_tokens: int  # tokens at positions below this are counted (prompt: at admission)
    penalty_row: int | None  # row in the TokenCountTable
    bias_token_ids: torch.Tensor | None  # [num_biased] int64, CPU
    bias_values: torch.Tensor | None  # [num_biased] float32, CPU
    allowed_token_ids: torch.Tensor | None  # [num_allowed] int64, CPU
    stop_token_ids: torch.Tensor | None  # [num_stop] int64, CPU; banned before min_tokens
    bad_words: list[list[int]]
    recent_output_token_ids: list[int] | None  # the tail bad words need; None without them
    wants_prompt_logprobs: bool

    @property
    def tracks_outputs(self) -> bool:
        return self.penalty_row is not None or self.recent_output_token_ids is not None


class SamplingStateManager:
    """Keeps what sampling needs about every live request, and builds each step's metadata.

    Scalars sit in fixed-width numpy tables, row `req_index` per request, written once at admission;
    a step gathers its rows with one fancy index and decides on the host which optional parts
    to build, so the device never has to report back. Only requests that use logit_bias,
    allowed_token_ids, bad words or min_tokens cost any per-row Python. Token counts for
    penalties live in a TokenCountTable on the device.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.token_counts = TokenCountTable(vocab_size, device)
        self.records: dict[str, _RequestRecord] = {}
        self.num_prompt_logprob_requests = 0
        self._floats = np.zeros((0, 6), np.float32)
        self._ints = np.zeros((0, 5), np.int64)
        self._flags = np.zeros((0, 7), np.bool_)
        self._free_req_indices: list[int] = []

    def add_request(
        self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]
    ) -> None:
        """Register a request; a known one (resumed after preemption) keeps its state."""
        if request_id in self.records:
            return
        req_index = self._take_req_index()
        greedy = params.is_greedy
        self._floats[req_index] = (
            1.0 if greedy else params.temperature,
            params.top_p,
            params.min_p,
            params.repetition_penalty,
            params.presence_penalty,
            params.frequency_penalty,
        )
        num_logprobs = -1 if params.logprobs is None else params.logprobs
        self._ints[req_index] = (
            params.top_k or self.vocab_size,
            params.seed or 0,
            params.min_tokens,
            len(prompt_token_ids),
            num_logprobs,
        )
        record = self._new_record(req_index, params, prompt_token_ids)
        self._flags[req_index] = (
            greedy,
            params.seed is not None,
            record.penalty_row is not None,
            record.bias_token_ids is not None,
            record.allowed_token_ids is not None,
            bool(record.bad_words),
            record.stop_token_ids is not None,
        )
        self.records[request_id] = record
        self.num_prompt_logprob_requests += record.wants_prompt_logprobs

    def _new_record(
        self, req_index: int, params: SamplingParams, prompt_token_ids: list[int]
    ) -> _RequestRecord:
        def ids(values: list[int] | set[int]) -> torch.Tensor:
            return torch.tensor(sorted(values), dtype=torch.int64)

        bias = params.logit_bias or {}
        stop_ids = {t for t in params.all_stop_token_ids if t < self.vocab_size}
        bad_words = list(params.bad_words_token_ids or [])
        return _RequestRecord(
            req_index=req_index,
            num_seen_tokens=len(prompt_token_ids),
            penalty_row=self.token_counts.add(prompt_token_ids) if params.uses_penalties else None,
            bias_token_ids=torch.tensor(list(bias), dtype=torch.int64) if bias else None,
            bias_values=torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None,
            allowed_token_ids=ids(params.allowed_token_ids) if params.allowed_token_ids else None,
            stop_token_ids=ids(stop_ids) if params.min_tokens > 0 and stop_ids else None,
            bad_words=bad_words,
            recent_output_token_ids=[] if bad_words else None,
            wants_prompt_logprobs=params.prompt_logprobs is not None,
        )

    def remove_request(self, request_id: str) -> None:
        record = self.records.pop(request_id, None)
        if record is None:
            return
        if record.penalty_row is not None:
            self.token_counts.free(record.penalty_row)
        self._free_req_indices.append(record.req_index)
        self.num_prompt_logprob_requests -= record.wants_prompt_logprobs

    def record_fed_tokens(self, scheduled_requests: list[ScheduledRequest]) -> None:
        """Count the output tokens fed to the model this step, for penalties and bad words.

        Every output token except the newest is fed once before the next sample, so counting
        fed tokens at positions >= num_prompt_tokens is exact. A request resumed after
        preemption re-feeds its history: positions below `num_seen_tokens` are skipped (and
        the prefix cache may spare re-feeding them at all; they were counted before).
        """
        rows: list[int] = []
        token_ids: list[int] = []
        for scheduled in scheduled_requests:
            record = self.records.get(scheduled.request_id)
            if record is None or not record.tracks_outputs:
                continue
            start = scheduled.num_computed_tokens
            end = start + scheduled.num_new_tokens
            if end <= record.num_seen_tokens:
                continue
            new = scheduled.token_ids[max(record.num_seen_tokens - start, 0) :]
            record.num_seen_tokens = end
            if record.penalty_row is not None:
                rows.extend([record.penalty_row] * len(new))
                token_ids.extend(new)
            if record.recent_output_token_ids is not None:
                tail = record.recent_output_token_ids
                tail.extend(new)
                num_kept = max(len(word) for word in record.bad_words) - 1  # longest prefix
                del tail[: max(len(tail) - num_kept, 0)]
        self.token_counts.count_output_tokens(rows, token_ids)

    def build_metadata(self, request_ids: list[str], seq_lens: list[int]) -> SamplingMetadata:
        """Metadata for sampling `request_ids` (batch order) whose sequences now have
        `seq_lens` tokens (the token sampled now goes to position seq_len)."""
        records = [self.records[r] for r in request_ids]
        req_indices = np.fromiter((r.req_index for r in records), np.int64, len(records))
        floats, ints, flags = (
            self._floats[req_indices],
            self._ints[req_indices],
            self._flags[req_indices],
        )
        greedy = flags[:, _GREEDY]
        random_rows = ~greedy
        num_logprobs = ints[:, _NUM_LOGPROBS]
        logprob_rows = np.flatnonzero(num_logprobs >= 0)
        return SamplingMetadata(
            temperature=self._to_device(floats[:, _TEMPERATURE]),
            greedy_rows=self._to_device(np.flatnonzero(greedy)) if greedy.any() else None,
            all_greedy=bool(greedy.all()),
            truncation=self._truncation(floats, ints, random_rows),
            seeds=self._seeds(ints, flags[:, _SEEDED] & random_rows, seq_lens),
            allowed=self._allowed(records, flags),
            adjustments=self._adjustments(records, flags),
            min_tokens_bans=self._min_tokens_bans(records, ints, flags, seq_lens),
            penalties=self._penalties(records, floats, flags),
            num_logprobs=[n if n >= 0 else None for n in num_logprobs.tolist()],
            logprob_rows=self._to_device(logprob_rows) if logprob_rows.size else None,
        )

    def _truncation(
        self, floats: np.ndarray, ints: np.ndarray, random_rows: np.ndarray
    ) -> Truncation | None:
        uses_min_p = (floats[:, _MIN_P] > 0.0) & random_rows
        uses_top_k = (ints[:, _TOP_K] < self.vocab_size) & random_rows
        uses_top_p = (floats[:, _TOP_P] < 1.0) & random_rows
        rows = np.flatnonzero(uses_min_p | uses_top_k | uses_top_p)
        if rows.size == 0:
            return None
        min_p = np.where(uses_min_p, floats[:, _MIN_P], 0.0)[rows].astype(np.float32)
        top_k = np.where(uses_top_k, ints[:, _TOP_K], self.vocab_size)[rows]
        top_p = np.where(uses_top_p, floats[:, _TOP_P], 1.0)[rows].astype(np.float32)
        return Truncation(
            rows=self._to_device(rows),
            min_p=self._to_device(min_p) if uses_min_p.any() else None,
            top_k=self._to_device(top_k) if (uses_top_k | uses_top_p).any() else None,
            top_p=self._to_device(top_p) if uses_top_p.any() else None,
            max_top_k=int(ints[uses_top_k, _TOP_K].max()) if uses_top_k.any() else 0,
        )

    def _seeds(
        self, ints: np.ndarray, seeded: np.ndarray, seq_lens: list[int]
    ) -> SeedMetadata | None:
        rows = np.flatnonzero(seeded)
        if rows.size == 0:
            return None
        positions = np.asarray(seq_lens, np.int64)[rows]
        return SeedMetadata(
            self._to_device(rows), self._to_device(ints[rows, _SEED]), self._to_device(positions)
        )

    def _allowed(self, records: list[_RequestRecord], flags: np.ndarray) -> AllowedTokens | None:
        rows = np.flatnonzero(flags[:, _RESTRICTED])
        if rows.size == 0:
            return None
        token_ids = [_present(records[row].allowed_token_ids) for row in rows]
        local = torch.repeat_interleave(torch.tensor([len(t) for t in token_ids]))
        banned = torch.ones(rows.size, self.vocab_size, dtype=torch.bool)
        banned[local, torch.cat(token_ids)] = False
        return AllowedTokens(self._to_device(rows), banned.to(self.device, non_blocking=True))

    def _min_tokens_bans(
        self,
        records: list[_RequestRecord],
        ints: np.ndarray,
        flags: np.ndarray,
        seq_lens: list[int],
    ) -> MinTokensBans | None:
        num_outputs = np.asarray(seq_lens, np.int64) - ints[:, _NUM_PROMPT_TOKENS]
        before_min_tokens = flags[:, _STOPPABLE] & (num_outputs < ints[:, _MIN_TOKENS])
        rows = np.flatnonzero(before_min_tokens)
        if rows.size == 0:
            return None
        token_ids = [_present(records[row].stop_token_ids) for row in rows.tolist()]
        counts = torch.tensor([len(ids) for ids in token_ids])
        entry_local = torch.repeat_interleave(counts)
        entry_rows = torch.from_numpy(rows)[entry_local]
        return MinTokensBans(
            self._to_device(rows),
            entry_rows.to(self.device, non_blocking=True),
            entry_local.to(self.device, non_blocking=True),
            torch.cat(token_ids).to(self.device, non_blocking=True),
        )

    def _adjustments(
        self, records: list[_RequestRecord], flags: np.ndarray
    ) -> LogitAdjustments | None:
        rows: list[torch.Tensor] = []
        token_ids: list[torch.Tensor] = []
        values: list[torch.Tensor] = []

        def add(row: int, ids: torch.Tensor, value: torch.Tensor | float) -> None:
            rows.append(torch.full((len(ids),), row, dtype=torch.int64))
            token_ids.append(ids)
            values.append(torch.full((len(ids),), value) if isinstance(value, float) else value)

        for row in np.flatnonzero(flags[:, _BIASED]).tolist():
            record = records[row]
            add(row, _present(record.bias_token_ids), _present(record.bias_values))
        for row in np.flatnonzero(flags[:, _BAD_WORDS]).tolist():
            record = records[row]
            banned = bad_word_bans(record.bad_words, _present(record.recent_output_token_ids))
            if banned:
                add(row, torch.tensor(banned, dtype=torch.int64), _NEG_INF)
        if not rows:
            return None
        return LogitAdjustments(
            *(
                torch.cat(parts).to(self.device, non_blocking=True)
                for parts in (rows, token_ids, values)
            )
        )

    def _penalties(
        self, records: list[_RequestRecord], floats: np.ndarray, flags: np.ndarray
    ) -> PenaltyMetadata | None:
        rows = np.flatnonzero(flags[:, _PENALIZED])
        if rows.size == 0:
            return None
        table_rows = self._to_device(
            np.fromiter((records[row].penalty_row for row in rows), np.int64, rows.size)
        )
        values = self._to_device(floats[rows][:, [_REPETITION, _PRESENCE, _FREQUENCY]])
        return PenaltyMetadata(
            rows=self._to_device(rows),
            prompt_mask=self.token_counts.prompt_mask.index_select(0, table_rows),
            output_counts=self.token_counts.output_counts.index_select(0, table_rows),
            repetition=values[:, 0],
            presence=values[:, 1],
            frequency=values[:, 2],
        )

    def _take_req_index(self) -> int:
        if not self._free_req_indices:
            old = len(self._floats)
            new = max(2 * old, 16)
            self._floats = np.resize(self._floats, (new, 6))
            self._ints = np.resize(self._ints, (new, 5))
            self._flags = np.resize(self._flags, (new, 7))
            self._free_req_indices.extend(range(new - 1, old - 1, -1))
        return self._free_req_indices.pop()

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)


def _present(value: _T | None) -> _T:
    assert value is not None
    return value


def bad_word_bans(bad_words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """vLLM's rule: ban a bad word's last token when the output ends with the tokens before it
    (a one-token bad word is always banned). Only the output counts, not the prompt."""
    banned = []
    for word in bad_words:
        num_prefix = len(word) - 1
        if num_prefix > len(output_token_ids):
            continue
        if num_prefix == 0 or output_token_ids[-num_prefix:] == word[:-1]:
            banned.append(word[-1])
    return banned

"""Token statistics of requests with penalties, kept on the device, and the penalties themselves."""

import torch

_MIN_ROWS = 8
_LOGIT_LIMIT = 1e30  # x 100 (the smallest temperature's 1 / 0.01) stays finite in float32


class TokenCountTable:
    """One row per request that uses a penalty: which tokens its prompt holds, and how often
    each token occurs in its output so far.

    Rows live on the device and are updated incrementally (`count_output_tokens` adds the tokens
    fed each step), so that the sampler never rebuilds them from token lists. Only requests with
    a penalty take a row: memory is rows * vocab_size * 5 bytes, and the table doubles when full.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.free_rows: list[int] = []

    @property
    def num_rows(self) -> int:
        return self.prompt_mask.shape[0]

    def add(self, prompt_token_ids: list[int]) -> int:
        """Take a row for a new request and mark its prompt tokens; returns the row."""
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.prompt_mask[row] = False
        self.output_counts[row] = 0
        ids = torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)
        self.prompt_mask[row, ids] = True
        return row

    def free(self, row: int) -> None:
        self.free_rows.append(row)

    def count_output_tokens(self, rows: list[int], token_ids: list[int]) -> None:
        """Add one occurrence of token_ids[i] to row rows[i] (repeats allowed)."""
        if not rows:
            return
        index = torch.tensor([rows, token_ids], dtype=torch.int64).to(self.device)
        ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
        self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def _grow(self) -> None:
        old = self.num_rows
        new = max(2 * old, _MIN_ROWS)
        prompt_mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        output_counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt_mask[:old] = self.prompt_mask
        output_counts[:old] = self.output_counts
        self.prompt_mask, self.output_counts = prompt_mask, output_counts
        self.free_rows.extend(range(new - 1, old - 1, -1))  # pop() hands out low rows first


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, changed in place
    rows: torch.Tensor,  # [num_penalized] int64, rows of `logits` that have penalties
    prompt_mask: torch.Tensor,  # [num_penalized, vocab_size] bool
    output_counts: torch.Tensor,  # [num_penalized, vocab_size] int32
    repetition: torch.Tensor,  # [num_penalized] float32, 1 = off
    presence: torch.Tensor,  # [num_penalized] float32, 0 = off
    frequency: torch.Tensor,  # [num_penalized] float32, 0 = off
) -> None:
    """vLLM's penalties. Repetition (CTRL, as in transformers): a logit of a token seen in the
    prompt or the output is divided by the penalty when positive, multiplied when not. Then
    OpenAI's: minus frequency * (count in the output), minus presence * (1 if in the output)."""
    selected = logits.index_select(0, rows)
    in_output = output_counts > 0
    factor = torch.where(prompt_mask | in_output, repetition[:, None], 1.0)
    penalized = torch.where(selected > 0, selected / factor, selected * factor)
    penalized -= frequency[:, None] * output_counts + presence[:, None] * in_output
    # A large penalty must not push a finite logit to -inf, even after the temperature
    # (>= 0.01) divides it: -inf marks banned tokens, and a row of only -inf has no token
    # left to sample.
    selected = torch.where(
        selected.isfinite(), penalized.clamp(-_LOGIT_LIMIT, _LOGIT_LIMIT), selected
    )
    logits.index_copy_(0, rows, selected)

"""The min_tokens ban of stop tokens (sampler.ban_stop_tokens) never leaves a row with no
token: where only stop tokens are allowed (a complete grammar), they keep their logits."""

import torch

from pagedserve.worker.sampler import ban_stop_tokens
from pagedserve.worker.sampling_metadata import MinTokensBans

NEG_INF = float("-inf")


def test_stop_tokens_are_banned_unless_nothing_else_is_left() -> None:
    logits = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0],  # other tokens allowed: stop tokens 2, 3 banned
            [NEG_INF, NEG_INF, NEG_INF, 0.5],  # only stop token 3 allowed: it stays
            [0.0, 1.0, 2.0, 3.0],  # no min_tokens ban on this row
        ]
    )
    bans = MinTokensBans(
        rows=torch.tensor([0, 1]),
        entry_rows=torch.tensor([0, 0, 1, 1]),
        entry_local=torch.tensor([0, 0, 1, 1]),
        token_ids=torch.tensor([2, 3, 2, 3]),
    )
    ban_stop_tokens(logits, bans)
    assert logits[0].tolist() == [1.0, 2.0, NEG_INF, NEG_INF]
    assert logits[1].tolist() == [NEG_INF, NEG_INF, NEG_INF, 0.5]
    assert logits[2].tolist() == [0.0, 1.0, 2.0, 3.0]

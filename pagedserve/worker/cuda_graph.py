"""CudaGraphRunner: capture the model forward of decode-only batches once, replay each step."""

import logging

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.parallel_state import get_tp_rank

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture (as vLLM: 1, 2, 4, 8, then every 8), up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class CudaGraphRunner:
    """Replays a CUDA graph of `model(input_ids, positions, attn_metadata)` for decode-only
    batches (one new token per request), padded up to the next captured batch size.

    The graphs read persistent input buffers, which each step overwrites in place. Padding
    requests have query_len 0, seq_len 0 and slot -1: attention neither reads nor writes for
    them, and their rows of the output are ignored. The attention backend plans its launches
    from the metadata at capture time, so the metadata claims `max_model_len` keys: a
    split-KV plan then covers any sequence length the engine can produce.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        mrope: bool = False,
    ) -> None:
        """mrope: the model takes M-RoPE positions [3, num_tokens] (its positions buffer is
        [3, max_bs])."""
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        max_bs = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)  # [max_bs]
        # [max_bs], or [3, max_bs] for M-RoPE
        self.positions = torch.zeros((3, max_bs) if mrope else max_bs, dtype=torch.int64,
                                     device=device)  # fmt: skip
        self.query_start_loc = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)  # [max_bs]
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=torch.arange(batch_size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.full((batch_size,), self.max_model_len, dtype=torch.int32),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so that smaller graphs reuse its memory pool."""
        pool = None
        # Dummy decode: each request sees one key; nothing is written to the cache.
        self.query_start_loc.copy_(torch.arange(self.max_batch_size + 1, dtype=torch.int32))
        self.seq_lens.fill_(1)
        from tqdm.auto import tqdm

        rank = get_tp_rank()
        sizes = tqdm(list(reversed(self.sizes)), desc="Capturing CUDA graphs (decode)",
                     disable=rank != 0)  # fmt: skip
        for batch_size in sizes:
            metadata = self._metadata(batch_size)
            args = (self.input_ids[:batch_size], self.positions[..., :batch_size], metadata)
            for _ in range(2):  # warm up: autotuning and lazy initialisation stay out
                self.model(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch_size] = self.model(*args)
            pool = graph.pool()
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, num_reqs: int, max_query_len: int) -> bool:
        return max_query_len == 1 and num_reqs <= self.max_batch_size

    def run(
        self,
        input_ids: torch.Tensor,  # [num_reqs] int64
        positions: torch.Tensor,  # [num_reqs] int64, or [3, num_reqs] (M-RoPE)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_reqs, hidden_size]
        """Copy one decode step into the buffers, replay the padded graph, return real rows."""
        n = attn_metadata.num_reqs
        batch_size = next(size for size in self.sizes if size >= n)
        width = attn_metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[..., :n].copy_(positions, non_blocking=True)
        self.query_start_loc[: n + 1].copy_(attn_metadata.query_start_loc, non_blocking=True)
        self.query_start_loc[n + 1 : batch_size + 1].fill_(n)
        self.seq_lens[:n].copy_(attn_metadata.seq_lens, non_blocking=True)
        self.seq_lens[n:batch_size].fill_(0)
        self.block_tables[:n, :width].copy_(attn_metadata.block_tables, non_blocking=True)
        self.slot_mapping[:n].copy_(attn_metadata.slot_mapping, non_blocking=True)
        self.slot_mapping[n:batch_size].fill_(-1)
        self.graphs[batch_size].replay()
        return self.outputs[batch_size][:n]

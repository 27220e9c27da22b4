"""The KV cache's bookkeeping on the host: blocks and their reference counts, the LRU free
queue and the prefix-cache hash index (`block_pool`), chained block hashes (`block_hash`),
per-request block tables (`manager.KVCacheManager`, with swapping), the block arithmetic of
a sliding window (`sliding_window`), the CPU blocks of swap space and of the prefix cache's
CPU tier (`cpu_blocks`), and request sizing (`sizing`). The tensors live on the workers.

Import rule: torch-free; imports request and the leaf modules only (never scheduler, engine
or worker), so its tests run in milliseconds.
"""

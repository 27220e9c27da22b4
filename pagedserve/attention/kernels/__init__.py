"""The Triton kernels of the attention backend (`@triton.jit` functions and their launchers):
writing K/V at their slots (`store_kv`) and paged attention over block tables
(`paged_attention`, with split-KV for long decodes).

Import rule: torch and triton only.
"""

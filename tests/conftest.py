"""Shared test setup: skip GPU-marked tests without CUDA; paths of the shared test data."""

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
SHARED_MODELS = SHARED / "models"
SHARED_TOKENIZERS = SHARED / "tokenizers"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        num_gpus = torch.cuda.device_count()
    except ImportError:
        num_gpus = 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and num_gpus == 0:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers such as `multirank`


@pytest.fixture(autouse=True)
def batch_on_cpu(monkeypatch):
    """Tests run the batched (GPU) path of every optimizer on CPU, where it is otherwise
    off; ``tests/test_step_counts.py`` holds the CPU path (matrix by matrix) to it."""
    from dobb.optim import batching

    monkeypatch.setattr(batching, "BATCH_ON_CPU", True)

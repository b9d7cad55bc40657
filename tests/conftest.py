import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers such as `multirank`


@pytest.fixture(autouse=True)
def batch_on_cpu(monkeypatch):
    """Tests run the batched (GPU) path of every matrix optimizer on CPU: one built with
    ``foreach=None`` (the default, matrix by matrix on CPU) gets ``foreach=True`` here.
    ``tests/test_step_counts.py`` passes ``foreach`` itself and holds the two paths together."""
    from dobb.optim.base import MatrixOptimizer

    init = MatrixOptimizer.__init__

    def batched_init(self, params, defaults, *, foreach=None, **options):
        init(self, params, defaults, foreach=True if foreach is None else foreach, **options)

    monkeypatch.setattr(MatrixOptimizer, "__init__", batched_init)

"""The harness's tests run their training on one torch thread (as the study's runs do),
restoring the count after each test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

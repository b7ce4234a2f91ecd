import pytest
import torch


# --- gpu marker (shell helper): skip @pytest.mark.gpu tests where CUDA is absent ------------------------
def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)

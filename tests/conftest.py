import os

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.helpers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir():
    from app.model.default import default_model_dir as find

    return find()

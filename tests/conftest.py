import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    """The built-in task, built once per test session (it is deterministic and cached)."""
    from data import build_task

    d = str(tmp_path_factory.mktemp("data"))
    build_task(d, 1337)
    return d

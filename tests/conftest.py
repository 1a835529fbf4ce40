import os
from typing import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _run_in_a_scratch_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # trial's TestCase.mktemp() makes relative paths under the working
    # directory; keep them out of the checkout.
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(old)

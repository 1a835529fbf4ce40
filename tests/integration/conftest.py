from typing import Any, Iterator

import pytest

from blazar.models.testmodel import GeneratedModel, make_test_model
from tests.integration import strictwire
from tests.integration.harness import Daemon, engine_binary


@pytest.fixture(scope="package", autouse=True)
def _strict_json() -> Iterator[None]:
    """
    Every JSON the suite reads is read strictly (issue 35): C{json.loads},
    whoever calls it (a test, the harness, an SDK), refuses NaN, Infinity
    and numbers beyond a double (L{strictwire.strict_loads}). For this
    package only: the unit tests that run after it in the same session
    (./dev.sh test runs all of tests/) keep Python's own C{json.loads}.
    """
    with strictwire.strict_json_loads():
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """
    A test that passed fails if JSON it read was refused as not strict
    where a library caught the refusal (the openai SDK reads an error body
    under C{except Exception}) and went on.
    """
    try:
        result = yield
    except BaseException:
        strictwire.REFUSED.clear()
        raise
    refused, strictwire.REFUSED[:] = list(strictwire.REFUSED), []
    if refused:
        raise AssertionError("read, refused and the refusal caught:\n" + "\n".join(refused))
    return result


@pytest.fixture(scope="session")
def engine() -> str:
    return engine_binary()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GeneratedModel]:
    """
    Generated GGUFs shared by every daemon: C{tiny} (chat), C{tiny-embed}
    (embeddings), and C{cold} files that each test module may start once.
    """
    root = tmp_path_factory.mktemp("models")
    return {
        "tiny": make_test_model(root / "tiny.gguf"),
        "tiny-embed": make_test_model(root / "tiny-embed.gguf", seed=1, embedding=True),
        "cold": make_test_model(root / "cold.gguf", seed=2),
    }


def daemon_config(engine: str, models: dict[str, GeneratedModel], extra: str = "") -> str:
    models_dir = models["tiny"].path.parent
    return (
        f'models_dir = "{models_dir}"\n'
        # these tests kill engines on purpose: keep the crash breaker out of it
        "ready_timeout = 60\nstop_grace = 5\nbreaker_crashes = 1000\n"
        f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
        '[models."tiny-embed"]\nembedding = true\n' + extra
    )


@pytest.fixture(scope="module")
def daemon(
    engine: str, models: dict[str, GeneratedModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon"), daemon_config(engine, models))
    d.start()
    try:
        yield d
    finally:
        d.close(check_engines=True)


def pytest_terminal_summary(terminalreporter) -> None:
    """
    The reliability suite's counts, when it ran (tests/integration/reliability.py).
    """
    from tests.integration.reliability import TALLY

    if TALLY.ran:
        terminalreporter.write_line(TALLY.line())

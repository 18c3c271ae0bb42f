"""runtime/generation_config.py: the artifact's generation_config.json as SamplingParams defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.errors import ArtifactError
from runtime.generation_config import sampling_defaults
from runtime.sampling_params import SamplingParams


def _write(directory: Path, config: object) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_takes_the_sampling_fields_vllm_takes(tmp_path: Path) -> None:
    # Qwen3's file, plus the fields vLLM reads that unispec does not apply and the ones neither reads
    _write(tmp_path, {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True,
                      "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1,
                      "max_new_tokens": 512, "transformers_version": "4.51.0"})
    defaults = sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    params = SamplingParams(**defaults)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.6, 20, 0.95, 0.0)


def test_nulls_and_do_sample_false_are_ignored_as_vllm_ignores_them(tmp_path: Path) -> None:
    _write(tmp_path, {"do_sample": False, "temperature": 0.7, "top_p": None, "min_p": 0.05})
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "min_p": 0.05}


def test_no_file_or_no_sampling_fields_gives_no_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(tmp_path) == {}
    _write(tmp_path, {"bos_token_id": 1, "eos_token_id": 2})
    assert sampling_defaults(tmp_path) == {}


@pytest.mark.parametrize(("config", "match"), [
    ({"top_k": -1}, r"'top_k' = -1 is not a usable sampling default"),
    ({"top_p": 0}, r"'top_p' = 0 is not"),
    ({"temperature": "hot"}, r"'temperature' = 'hot' is not"),
    (["temperature", 0.6], "must hold a JSON object"),
])
def test_a_bad_file_fails_naming_file_and_field(tmp_path: Path, config: object, match: str) -> None:
    _write(tmp_path, config)
    with pytest.raises(ArtifactError, match=match) as err:
        sampling_defaults(tmp_path)
    assert "generation_config.json" in str(err.value) and "\n" not in str(err.value)


def test_broken_json_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6,')
    with pytest.raises(ArtifactError, match=r"generation_config\.json: not valid JSON"):
        sampling_defaults(tmp_path)

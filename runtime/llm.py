"""The generation API: `LLM(artifact_dir).generate(prompts, params)` (DESIGN.md §7).

    from unispec import LLM, SamplingParams
    llm = LLM("artifacts/eagle3")
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=64))

The LLM reads only the artifact directory: the manifest sizes the pools and the step buffers, the
tokenizer (when the artifact has tokenizer.json) turns strings into ids and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.backends import load_backend
from runtime.engine import Engine, RequestOutput, validate_prompt
from runtime.errors import ArtifactError, InvalidRequestError
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "LLM"]

DEFAULT_KV_MEMORY_BYTES = 256 * 2**20
TOKENIZER_FILE = "tokenizer.json"

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, artifact_dir: str | Path, backend: str = "ort", *, num_blocks: int | None = None,
                 kv_memory_bytes: int | None = None, **backend_options: Any) -> None:
        """`num_blocks` sizes the KV pools directly; otherwise `kv_memory_bytes` (default 256 MiB) does,
        capped at what a full batch of max_model_len requests can use."""
        self.artifact_dir = Path(artifact_dir)
        if not self.artifact_dir.is_dir():
            raise ArtifactError(f"{artifact_dir}: no such directory; pass an artifact written by `unispec export`")
        self.manifest = Manifest.load(self.artifact_dir)
        self.num_blocks = num_blocks if num_blocks is not None else self._blocks_for_budget(kv_memory_bytes)
        if self.num_blocks < 1:
            raise InvalidRequestError(f"num_blocks={self.num_blocks} is invalid; use an int >= 1")
        self.tokenizer = self._load_tokenizer()
        self.backend = load_backend(backend, self.artifact_dir, self.manifest, num_blocks=self.num_blocks,
                                    **backend_options)
        self.engine = Engine(self.backend, eos_token_ids=self.manifest.tokenizer.eos_token_ids,
                             detokenize=self._decode if self.tokenizer is not None else None)

    def _blocks_for_budget(self, kv_memory_bytes: int | None) -> int:
        m = self.manifest
        budget = DEFAULT_KV_MEMORY_BYTES if kv_memory_bytes is None else kv_memory_bytes
        block_bytes = m.kv_bytes_per_token() * m.block_size
        per_row = -(-(m.max_model_len + 2 * m.num_speculative_tokens + 1) // m.block_size)
        blocks = min(budget // block_bytes, m.max_batch_size * per_row)
        if blocks < per_row:
            raise InvalidRequestError(f"kv_memory_bytes={budget} holds {budget // block_bytes} KV blocks; one "
                                      f"max_model_len request needs {per_row} ({per_row * block_bytes} bytes); "
                                      "raise kv_memory_bytes or pass num_blocks")
        return int(blocks)

    def _load_tokenizer(self) -> Any:
        path = self.artifact_dir / TOKENIZER_FILE
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:   # tokenizers raises a bare Exception for malformed files
            raise ArtifactError(f"{path}: cannot be read as a tokenizer ({str(exc).splitlines()[0]}); the "
                                "artifact is damaged, re-export it") from None

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def encode(self, prompt: Prompt, where: str = "prompt") -> list[int]:
        """A prompt as token ids: strings through the tokenizer, id lists as given (then validated)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{where} is a string but this artifact has no {TOKENIZER_FILE}; "
                                          "pass token ids instead")
            ids = self.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
        validate_prompt(ids, self.manifest, where)
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Every prompt and parameter set is checked before anything runs, so one bad request fails the
        call without starting the others.
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and not isinstance(prompts[0], (str, Sequence))):
            prompts = [prompts]                 # one prompt (a string or one id list)
        if not prompts:
            raise InvalidRequestError("prompts is empty; pass a string, a token-id list, or a list of them")
        per_prompt = self._params_for(params, len(prompts))
        encoded = [self.encode(p, f"prompt {i}") for i, p in enumerate(prompts)]
        for p, sp in zip(encoded, per_prompt):
            self.engine.check_request(p, sp)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(encoded, per_prompt)]
        done: dict[Any, RequestOutput] = {}
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    done[out.request_id] = out
        finally:
            for request_id in ids:             # after an error, leave nothing behind for the next call
                if request_id not in done:
                    self.engine.abort(request_id)
        return [done[i] for i in ids]

    @staticmethod
    def _params_for(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidRequestError(f"params must be one SamplingParams or one per prompt ({n}); got "
                                      f"{len(params)} items")
        return params

"""`unispec bench`'s peers, run in the same process on the checkpoint the artifact was exported from.

  transformers generate        AutoModelForCausalLM (float32) .generate: a batch of left-padded prompts,
                               greedy at temperature 0 else sampling (top-k / top-p off, as unispec's
                               defaults); min_new_tokens = max_new_tokens, so eos cannot end a row early
  transformers prompt lookup   the same with prompt_lookup_num_tokens (transformers' draft-free
                               speculative decoding); batch 1 only, as transformers allows
  transformers assisted        assisted generation with the draft checkpoint, only when it is a standalone
                               causal LM (unispec's drafts are heads on the target's hidden states)
  onnxruntime-genai            Llama 3 targets: its model builder (cpu) at the artifact's precision
                               (GenaiPrecision), cached under <cache>/ort-genai/<hash of the checkpoint's
                               files>-<precision>, then its Generator API

A peer that cannot run is an `Unavailable` runner: every cell gets a row with its reason.
Generated tokens are counted row by row up to and including a row's first eos.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from runtime.manifest import Manifest
from unispec.bench_common import BenchConfig, Pass, PeerUnavailable, Runner, first_line

__all__ = ["GenaiPrecision", "HfRunner", "OrtGenaiRunner", "Unavailable", "build_genai_model", "genai_build_command",
           "genai_model_dir", "genai_precision", "machine_info", "peer_runners", "thread_limits"]

HEAD_METHODS_WHY = "its draft is a head on the target's hidden states, not a causal LM transformers can load"
GENAI_ARCHS = ("llama3",)
GENAI_LM_HEAD = "/lm_head/MatMul"          # the builder's node name of the output head (excluded to keep it float)
VERSIONED = ("unispec", "onnxruntime", "onnxruntime-genai", "torch", "transformers", "numpy")


class Unavailable:
    """A peer that cannot run here: every cell becomes a row saying why."""

    def __init__(self, name: str, why: str) -> None:
        self.name, self.why = name, why

    def run(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> Pass:
        raise PeerUnavailable(self.why)

    def close(self) -> None:
        pass


def peer_runners(config: BenchConfig, manifest: Manifest, checkpoint: Path | None) -> tuple[list[Runner], list[str]]:
    """The peers config.peers asks for, in report order, and notes for the report."""
    notes = [f"{config.threads} intra-op threads for ONNX Runtime (unispec), torch and onnxruntime-genai",
             _kernel_isa()]
    missing = _checkpoint_problem(checkpoint)
    runners: list[Runner] = []
    if "transformers" in config.peers:
        runners += _hf_runners(manifest, checkpoint, missing)
    if "ort-genai" in config.peers:
        runner = _genai_runner(config, manifest, checkpoint, missing)
        runners.append(runner)
        if isinstance(runner, OrtGenaiRunner):
            notes.append(f"onnxruntime-genai built {runner.precision.describe()}")
    if runners and not missing:
        notes.append(f"peers load {checkpoint}")
    return runners, notes


def _checkpoint_problem(checkpoint: Path | None) -> str | None:
    if checkpoint is None:
        return "no checkpoint: the artifact's manifest records none (exported before unispec recorded it); " \
               "pass --checkpoint DIR"
    if not (checkpoint / "config.json").is_file():
        return f"checkpoint {checkpoint} has no config.json (moved or deleted?); pass --checkpoint DIR"
    return None


def _hf_runners(manifest: Manifest, checkpoint: Path | None, missing: str | None) -> list[Runner]:
    names = ("transformers generate", "transformers prompt lookup", "transformers assisted")
    if missing:
        return [Unavailable(n, missing) for n in names]
    try:
        model = _load_hf(checkpoint)
    except PeerUnavailable as exc:
        return [Unavailable(n, str(exc)) for n in names]
    lookup = manifest.num_speculative_tokens or 10
    runners: list[Runner] = [HfRunner(names[0], model, manifest),
                             HfRunner(names[1], model, manifest, prompt_lookup=lookup)]
    draft_why = _standalone_draft_problem(manifest)
    if draft_why is not None:
        runners.append(Unavailable(names[2], draft_why))
    else:
        try:
            runners.append(HfRunner(names[2], model, manifest, assistant=_load_hf(Path(manifest.draft_checkpoint))))
        except PeerUnavailable as exc:
            runners.append(Unavailable(names[2], str(exc)))
    return runners


def _standalone_draft_problem(manifest: Manifest) -> str | None:
    """None when the artifact's draft checkpoint is a causal LM transformers can load as an assistant."""
    if manifest.method == "none":
        return "no draft: the artifact is target-only (method none)"
    if manifest.draft_checkpoint is None or not Path(manifest.draft_checkpoint, "config.json").is_file():
        return f"{manifest.method}: {HEAD_METHODS_WHY}"
    config = json.loads(Path(manifest.draft_checkpoint, "config.json").read_text())
    architectures = config.get("architectures") or [""]
    if not str(architectures[0]).endswith("ForCausalLM"):
        return f"{manifest.method} ({architectures[0] or 'no architectures'}): {HEAD_METHODS_WHY}"
    return None


def _load_hf(checkpoint: Path) -> Any:
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
    except ImportError:
        raise PeerUnavailable("transformers is not installed (pip install 'unispec[bench]')") from None
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    except Exception as exc:                   # an architecture transformers does not know, a bad file, ...
        raise PeerUnavailable(f"transformers cannot load {checkpoint}: {first_line(str(exc))}") from None


class HfRunner:
    """transformers `generate` on a left-padded batch (also prompt lookup and assisted generation)."""

    def __init__(self, name: str, model: Any, manifest: Manifest, *, prompt_lookup: int | None = None,
                 assistant: Any = None) -> None:
        self.name, self.model = name, model
        self.eos = set(manifest.tokenizer.eos_token_ids)
        self.pad = min(self.eos) if self.eos else 0
        self.vocab_size = manifest.vocab_size
        self.extra: dict[str, Any] = {}
        if prompt_lookup is not None:
            self.extra["prompt_lookup_num_tokens"] = prompt_lookup
        if assistant is not None:
            self.extra["assistant_model"] = assistant

    def run(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> Pass:
        import torch

        if self.extra and len(prompts) > 1:
            raise PeerUnavailable("transformers runs prompt lookup / assisted generation at batch 1 only")
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])              # [B, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])          # [B, width]
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        torch.manual_seed(0)
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, pad_token_id=self.pad,
                                      eos_token_id=sorted(self.eos) or None, **sampling, **self.extra)
        wall = time.perf_counter() - started
        return Pass(wall_s=wall, tokens=count_generated(out[:, width:].tolist(), self.eos))

    def close(self) -> None:
        self.model = self.extra = None


def count_generated(rows: Sequence[Sequence[int]], eos: set[int]) -> int:
    """Generated tokens per row up to and including its first eos (what follows is padding), summed."""
    return sum(next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in rows)


# --- onnxruntime-genai --------------------------------------------------------------------------------------

def _genai_runner(config: BenchConfig, manifest: Manifest, checkpoint: Path | None, missing: str | None) -> Runner:
    name = "onnxruntime-genai (cpu)"
    why = missing or _genai_problem(manifest, checkpoint)
    if why is not None:
        return Unavailable(name, why)
    try:
        precision = genai_precision(manifest.quantization)
        model_dir = build_genai_model(checkpoint, config.cache_dir / "ort-genai", precision)
        return OrtGenaiRunner(name, model_dir, manifest, config.threads, precision)
    except PeerUnavailable as exc:
        return Unavailable(name, str(exc))


def _genai_problem(manifest: Manifest, checkpoint: Path) -> str | None:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return "onnxruntime-genai is not installed (pip install 'unispec[bench]')"
    if manifest.target_arch not in GENAI_ARCHS:
        return f"compared on Llama 3 targets only; this target is {manifest.target_arch}"
    config = json.loads((checkpoint / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim % 8:
        return f"its builder needs head_dim a multiple of 8; this target has {head_dim}"
    absent = [f for f in ("tokenizer.json", "tokenizer_config.json") if not (checkpoint / f).is_file()]
    if absent:
        return f"its builder needs {' and '.join(absent)} in {checkpoint}"
    return None


def checkpoint_digest(checkpoint: Path) -> str:
    """Content hash of the checkpoint's files (big weight files by size, head and tail) + the builder version."""
    digest = hashlib.sha256(version("onnxruntime-genai").encode())
    for path in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= 64 * 2**20:
                digest.update(f.read())
            else:
                digest.update(f.read(8 * 2**20))
                f.seek(size - 8 * 2**20)
                digest.update(f.read())
    return digest.hexdigest()[:20]


@dataclass(frozen=True, kw_only=True)
class GenaiPrecision:
    """The builder's weights for a peer: fp32, or weight-only int4 / int8 MatMulNBits, symmetric, blocks of
    `block_size` along K, activations at `accuracy_level` (4: int8), the output head quantized iff `lm_head`.
    Both round to nearest per block, but the builder's MLAS quantizer maps a block's largest magnitude to
    -2^(bits-1) (scale amax / 8 for int4) where unispec's maps it to 2^(bits-1) - 1 (amax / 7): the same
    bytes per weight and the same kernel, not the same codes."""

    precision: str = "fp32"                 # the builder's -p: fp32 | int4 | int8
    block_size: int | None = None
    accuracy_level: int | None = None
    lm_head: bool = False

    @property
    def tag(self) -> str:
        """What the cache key adds to the checkpoint's hash: every option the built weights depend on."""
        if self.precision == "fp32":
            return "fp32"
        return f"{self.precision}-b{self.block_size}-sym-acc{self.accuracy_level}-head{'q' if self.lm_head else 'f'}"

    def builder_args(self) -> list[str]:
        """-p and --extra_options (onnxruntime_genai.models.builder's names as of 0.18)."""
        if self.precision == "fp32":
            return ["-p", "fp32"]
        extra = [f"block_size={self.block_size}", f"accuracy_level={self.accuracy_level}", "is_symmetric=true"]
        if not self.lm_head:
            extra.append(f"nodes_to_exclude={GENAI_LM_HEAD}")     # the builder quantizes every MatMul otherwise
        return ["-p", self.precision, "--extra_options", *extra]

    def describe(self) -> str:
        if self.precision == "fp32":
            return "fp32"
        return (f"{self.precision} (MatMulNBits, block {self.block_size}, symmetric, accuracy level "
                f"{self.accuracy_level}, lm_head {self.precision if self.lm_head else 'float32'}) as the artifact")


def genai_precision(quantization: Mapping[str, Any] | None) -> GenaiPrecision:
    """The peer's precision for an artifact's `quantization` manifest field (the target's; a quantized drafter
    alone leaves the target float). PeerUnavailable where the builder would not make the same weights."""
    # imported here, not at the top: importing engines.ort loads the whole lowering
    from engines.ort.quant import DEFAULT_ACCURACY_LEVEL

    if quantization is None or quantization.get("method") == "none":
        return GenaiPrecision()
    method, bits = quantization.get("method"), quantization.get("bits")
    if method != "rtn" or bits not in (4, 8) or not quantization.get("symmetric", False):
        described = " ".join(f"{k}={v}" for k, v in quantization.items() if k != "draft")
        raise PeerUnavailable(f"its build matches float32 and --quantize int4/int8 targets; this one is {described}")
    return GenaiPrecision(precision=f"int{bits}", block_size=int(quantization["block_size"]),
                          accuracy_level=DEFAULT_ACCURACY_LEVEL, lm_head=bool(quantization.get("lm_head")))


def genai_model_dir(checkpoint: Path, cache: Path, precision: GenaiPrecision) -> Path:
    """Where the build of `checkpoint` at `precision` is kept: one folder per checkpoint content and precision."""
    return cache / f"{checkpoint_digest(checkpoint)}-{precision.tag}"


def genai_build_command(checkpoint: Path, out: Path, precision: GenaiPrecision) -> list[str]:
    """The builder's command line (pure): `checkpoint` into `out` at `precision`, for its CPU provider."""
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
            "-e", "cpu", "-c", str(out / "hf-cache"), *precision.builder_args()]


def build_genai_model(checkpoint: Path, cache: Path, precision: GenaiPrecision = GenaiPrecision()) -> Path:
    """The builder's CPU model of `checkpoint` at `precision`, built once and kept in `cache`."""
    out = genai_model_dir(checkpoint, cache, precision)
    if (out / "genai_config.json").is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        done = subprocess.run(genai_build_command(checkpoint, tmp, precision), capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()] or ["(no output)"]
            raise PeerUnavailable(f"its model builder failed ({precision.precision}): {lines[-1].strip()}")
        shutil.rmtree(tmp / "hf-cache", ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class OrtGenaiRunner:
    """onnxruntime-genai's Generator on a left-padded batch (its pad token marks the padding)."""

    def __init__(self, name: str, model_dir: Path, manifest: Manifest, threads: int,
                 precision: GenaiPrecision = GenaiPrecision()) -> None:
        import onnxruntime_genai as og

        self.name, self.og, self.precision = name, og, precision
        config = og.Config(str(model_dir))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        genai = json.loads((model_dir / "genai_config.json").read_text())["model"]
        eos = genai.get("eos_token_id", list(manifest.tokenizer.eos_token_ids))
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.pad = int(genai.get("pad_token_id", min(self.eos, default=0)))
        self.vocab_size = manifest.vocab_size

    def run(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> Pass:
        import numpy as np

        width = max(map(len, prompts))
        ids = np.array([[self.pad] * (width - len(p)) + p for p in prompts], dtype=np.int32)   # [B, width]
        params = self.og.GeneratorParams(self.model)
        sampling = dict(do_sample=True, temperature=temperature, top_k=self.vocab_size, top_p=1.0, random_seed=0) \
            if temperature > 0 else dict(do_sample=False)
        params.set_search_options(max_length=width + max_tokens, min_length=width + max_tokens,
                                  batch_size=len(prompts), **sampling)
        started = time.perf_counter()
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        wall = time.perf_counter() - started
        rows = [list(map(int, generator.get_sequence(i)))[width:] for i in range(len(prompts))]
        return Pass(wall_s=wall, tokens=count_generated(rows, self.eos))

    def close(self) -> None:
        self.model = None


# --- environment -----------------------------------------------------------------------------------------------

@contextmanager
def thread_limits(threads: int) -> Iterator[None]:
    """torch's intra-op threads for the peers (ONNX Runtime sessions get theirs at creation); restored after."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def machine_info(threads: int) -> dict[str, Any]:
    versions = {}
    for package in VERSIONED:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            continue
    return {"platform": platform.platform(), "processor": _cpu_model() or platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "threads": threads, "python": platform.python_version(),
            "versions": versions}


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def _kernel_isa() -> str:
    """Which build of unispec's native CPU kernels this process runs (plugins/ort_cpu/variants.py)."""
    from plugins import ort_cpu

    try:
        return f"native CPU kernels: {ort_cpu.isa()} build (UNISPEC_ORT_CPU_ISA picks another)"
    except ort_cpu.IsaError as exc:
        return f"native CPU kernels: {exc}"

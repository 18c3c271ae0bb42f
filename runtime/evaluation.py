"""What an export costs in quality (issue 35): one artifact's target against a reference export of the same
target (int4 against float32, say), position by position over held-out text, and each pair's acceptance.

Teacher forcing through the runtime's own Engine, KV cache and commit: each window of L + 1 held-out tokens
is a request whose prompt is its first L tokens, fed one token per step (prefill_chunk = 1), so every step
runs the target at one position per row and the row's logits are that position's next-token distribution.

    window  t0 t1 ... tL      prompt = t0 .. t(L-1), max_tokens = 1
    step c  feeds t_c  ─▶ target-only graph ─▶ logits [V] = log p(· | t0 .. t_c) ─▶ scored against t(c+1)

The graphs output only log-probability summaries (the emitted token's, the top N), which hold neither
log p(true token) nor the whole distribution KL needs, so each artifact runs a view of itself: its
target-only graph (a `none` artifact's step graph) with the logits that SpecAccept verifies with also
made an output, described by a `none` manifest of the same target. The edited graph is written to a
scratch folder beside hard links of the files its tensors live in (ONNX Runtime refuses external data
behind a symlink; copies on another filesystem); the artifact itself is only read.

Per position: top-1 agreement (argmax of the artifact == argmax of the reference), each side's negative
log-likelihood of the true token (perplexity = exp of their mean) and KL(reference || artifact).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import TYPE_CHECKING

import numpy as np

from runtime import manifest as io
from runtime.backends.ort import GRAPH_KEY, OrtBackend
from runtime.engine import Engine
from runtime.errors import ArtifactError, InvalidRequestError
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Plan
from runtime.sequence import acceptance_summary
from runtime.tokenizer import TOKENIZER_FILE

if TYPE_CHECKING:
    import onnx

__all__ = ["EVAL_LOGITS", "Acceptance", "Quality", "check_pair", "compare_acceptance", "compare_quality",
           "logits_view", "text_windows"]

EVAL_LOGITS = "unispec_eval_logits"        # f32 [batch, 1, V]: the view's extra output
Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class Quality:
    """The artifact's target against the reference's over the same held-out positions."""

    positions: int
    windows: int
    window: int                       # scored positions per window (its tokens but the first)
    top1_agreement: float             # share of positions where both argmaxes are the same token
    perplexity: float                 # exp(mean -log p(true next token)), the artifact
    reference_perplexity: float       # the same, the reference
    mean_kl: float                    # mean KL(reference || artifact), nats


@dataclass(frozen=True, kw_only=True)
class Acceptance:
    """Greedy speculative decoding of the same prompts by each artifact's own pair."""

    prompts: int
    max_tokens: int
    mean_accepted_length: float       # tokens per decode step over every prompt, the artifact
    reference_mean_accepted_length: float

    @property
    def ratio(self) -> float:
        return self.mean_accepted_length / self.reference_mean_accepted_length


# --- the pair ------------------------------------------------------------------------------------------------

def check_pair(artifact_dir: Path, m: io.Manifest, reference_dir: Path, ref: io.Manifest) -> None:
    """One-line ArtifactError unless both artifacts hold the same target (architecture, vocabulary, KV
    geometry, tokenizer); dtype, quantization and bounds may differ."""
    mine, theirs = _target_facts(artifact_dir, m), _target_facts(reference_dir, ref)
    for field_name, value in mine.items():
        if value != theirs[field_name]:
            raise ArtifactError(f"{artifact_dir} and --reference {reference_dir} hold different targets ({field_name}"
                                f": {_shown(value)} vs {_shown(theirs[field_name])}); pass two exports of the same "
                                "target checkpoint")


def _target_facts(directory: Path, m: io.Manifest) -> dict[str, object]:
    tokenizer = directory / TOKENIZER_FILE
    return {"target_arch": m.target_arch, "vocab_size": m.vocab_size,
            "target KV pools": [(p.name, p.num_layers, p.width) for p in _target_pools(m)],
            "bos / eos ids": (m.tokenizer.bos_token_id, m.tokenizer.eos_token_ids),
            TOKENIZER_FILE: tokenizer.read_bytes() if tokenizer.is_file() else None}


def _shown(value: object) -> str:
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    return "none" if value is None else str(value)


def _target_pools(m: io.Manifest) -> tuple[io.PoolSpec, ...]:
    return tuple(p for p in m.pools if p.name != io.DRAFT_KV_POOL)


# --- the view: the target-only graph with its logits as an output -----------------------------------------

def logits_view(artifact_dir: Path, m: io.Manifest, scratch: Path) -> io.Manifest:
    """Write the target-only graph (its portable and ORT files) with EVAL_LOGITS added into `scratch`, beside
    links of the files its tensors live in; returns the `none` manifest that describes `scratch` as an artifact."""
    import onnx

    if m.num_speculative_tokens and m.target_only is None:
        raise ArtifactError(f"{artifact_dir} has no target-only graph (exported before adaptive speculation), "
                            "which eval runs; re-export it with this unispec")
    graph = io.TARGET_ONLY if m.target_only is not None else io.STEP
    files = {key: name for key, name in m.graphs[graph].items() if key in (io.PORTABLE, GRAPH_KEY)}
    data_files = set()
    for name in files.values():
        proto = onnx.load(str(artifact_dir / name), load_external_data=False)
        _add_logits_output(proto, m.vocab_size, artifact_dir / name)
        onnx.save(proto, str(scratch / name))
        data_files |= _external_files(proto.graph)
    for name in data_files - set(files.values()):
        _link_or_copy(artifact_dir / name, scratch / name)
    only = m.target_only or m
    logits = io.TensorSpec(name=EVAL_LOGITS, dtype="float32", shape=("batch", 1, m.vocab_size))
    return dataclasses.replace(m, method="none", num_speculative_tokens=0, draft_arch=None, drafter="none",
                               pools=_target_pools(m), inputs=only.inputs, outputs=(*only.outputs, logits),
                               graphs={io.STEP: files}, target_only=None, engine=None)


def _add_logits_output(proto: onnx.ModelProto, vocab_size: int, where: Path) -> None:
    """EVAL_LOGITS = float32 of SpecAccept's first input, the logits [B, K+1, V] the target verifies with."""
    from onnx import TensorProto, helper

    accept = [n for n in proto.graph.node if n.op_type == "SpecAccept"]
    if len(accept) != 1:
        raise ArtifactError(f"{where}: expected one SpecAccept node (whose input is the target's logits), found "
                            f"{len(accept)}; re-export the artifact with this unispec")
    proto.graph.node.append(helper.make_node("Cast", [accept[0].input[0]], [EVAL_LOGITS], to=TensorProto.FLOAT))
    proto.graph.output.append(helper.make_tensor_value_info(EVAL_LOGITS, TensorProto.FLOAT,
                                                            ["batch", 1, vocab_size]))


def _external_files(graph: onnx.GraphProto) -> set[str]:
    """The files a graph's tensors keep their data in (the weights file, a graph's own .data), subgraphs too."""
    from onnx import AttributeProto, TensorProto

    tensors = [*graph.initializer, *(a.t for n in graph.node for a in n.attribute if a.type == AttributeProto.TENSOR)]
    files = {entry.value for t in tensors if t.data_location == TensorProto.EXTERNAL
             for entry in t.external_data if entry.key == "location"}
    for attribute in (a for n in graph.node for a in n.attribute):
        for subgraph in ([attribute.g] if attribute.type == AttributeProto.GRAPH else attribute.graphs):
            files |= _external_files(subgraph)
    return files


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:                       # another filesystem (or no hard links there)
        shutil.copyfile(source, target)


class _TeacherForcing(Engine):
    """An Engine over a logits view that keeps each row's logits of every step, by (request id, position)."""

    def __init__(self, backend: OrtBackend) -> None:
        super().__init__(backend, prefill_chunk=1, speculation="never")
        self.logits: dict[tuple[Hashable, int], np.ndarray] = {}

    def on_step_outputs(self, plan: Plan, outputs: dict[str, np.ndarray]) -> None:
        logits = outputs[EVAL_LOGITS]                                                    # [B, 1, V]
        for i, (seq, n) in enumerate(plan.items()):
            self.logits[seq.request_id, seq.cache_len + n - 1] = logits[i, -1].copy()  # predicts position + 1


# --- quality -------------------------------------------------------------------------------------------------

def text_windows(ids: Sequence[int], window: int, max_positions: int) -> list[list[int]]:
    """Windows of `window` + 1 tokens (`window` scored positions each, at most `max_positions` in all), evenly
    spaced over `ids` as export/train's held-out windows are: 32 windows of 128 positions over the bundled
    models' held-out stream are exactly those their model cards' held-out loss is measured on. A text shorter
    than one window is one shorter window."""
    window = min(window, max_positions, len(ids) - 1)
    if window < 1:
        raise InvalidRequestError(f"the text holds {len(ids)} tokens; give at least 2 (a longer --text)")
    count = max(1, min(max_positions // window, len(ids) // (window + 1)))
    stride = (len(ids) - window - 1) // count
    return [list(ids[i * stride:i * stride + window + 1]) for i in range(count)]


class _Scores:
    """Sums over scored positions: agreements, each side's NLL of the true token, KL(reference || artifact)."""

    def __init__(self) -> None:
        self.positions = self.agreements = 0
        self.nll = self.reference_nll = self.kl = 0.0

    def add(self, logits: np.ndarray, reference: np.ndarray, truth: np.ndarray) -> None:
        """logits, reference [N, V]; truth [N] the token that followed."""
        logp, ref_logp = _log_softmax(logits), _log_softmax(reference)                   # [N, V] float64
        rows = np.arange(len(truth))
        self.positions += len(truth)
        self.agreements += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        self.nll -= float(logp[rows, truth].sum())
        self.reference_nll -= float(ref_logp[rows, truth].sum())
        self.kl += float((np.exp(ref_logp) * (ref_logp - logp)).sum())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_quality(artifact_dir: Path, m: io.Manifest, reference_dir: Path, ref: io.Manifest,
                    windows: Sequence[Sequence[int]], *, progress: Progress | None = None) -> Quality:
    """Score every window's positions under both targets (teacher forcing, greedy argmax, NLL, KL)."""
    longest = max(map(len, windows))
    for directory, manifest in ((artifact_dir, m), (reference_dir, ref)):
        if longest > manifest.max_model_len:
            raise InvalidRequestError(f"{directory}: windows of {longest} tokens exceed its max_model_len of "
                                      f"{manifest.max_model_len}; pass a --window below that")
    group = min(m.max_batch_size, ref.max_batch_size, m.max_tokens_per_step, ref.max_tokens_per_step)
    scores = _Scores()
    with TemporaryDirectory(prefix="unispec-eval-") as scratch:
        engines = [_teacher(directory, manifest, Path(scratch) / name, group, longest)
                   for directory, manifest, name in ((artifact_dir, m, "artifact"), (reference_dir, ref, "ref"))]
        for start in range(0, len(windows), group):
            _score_group(engines, windows, range(start, min(start + group, len(windows))), scores)
            if progress is not None:
                progress(f"scored {scores.positions} positions")
    return Quality(positions=scores.positions, windows=len(windows), window=longest - 1,
                   top1_agreement=scores.agreements / scores.positions,
                   perplexity=float(np.exp(scores.nll / scores.positions)),
                   reference_perplexity=float(np.exp(scores.reference_nll / scores.positions)),
                   mean_kl=scores.kl / scores.positions)


def _teacher(directory: Path, m: io.Manifest, scratch: Path, rows: int, longest: int) -> _TeacherForcing:
    scratch.mkdir()
    view = logits_view(directory, m, scratch)
    return _TeacherForcing(OrtBackend(scratch, view, num_blocks=rows * view.blocks_per_row(longest)))


def _score_group(engines: list[_TeacherForcing], windows: Sequence[Sequence[int]], group: range,
                 scores: _Scores) -> None:
    """Both engines step in turn over the group's windows; positions both have scored leave at once, so at
    most a step's rows of logits wait (both schedule alike: same windows, rows within both bounds)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for engine in engines:
        for i in group:
            engine.add_request(list(windows[i][:-1]), greedy, request_id=i)
    mine, theirs = engines
    while mine.has_unfinished() or theirs.has_unfinished():
        for engine in engines:
            engine.step()
        ready = sorted(mine.logits.keys() & theirs.logits.keys())
        if ready:
            scores.add(np.stack([mine.logits.pop(key) for key in ready]),                # [N, V]
                       np.stack([theirs.logits.pop(key) for key in ready]),
                       np.array([windows[i][position + 1] for i, position in ready]))


# --- acceptance ----------------------------------------------------------------------------------------------

def compare_acceptance(artifact_dir: Path, reference_dir: Path, prompts: Sequence[str | Sequence[int]], *,
                       max_tokens: int, progress: Progress | None = None) -> Acceptance:
    """Greedy speculative decoding (every step speculative) of the same prompts by each artifact."""
    from runtime.llm import LLM

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    lengths = []
    for directory in (artifact_dir, reference_dir):
        llm = LLM(directory, speculation="always")
        outputs = llm.generate(list(prompts), greedy)
        accepted = [a for o in outputs for a in o.metrics.accepted_per_step]          # every decode step
        lengths.append(acceptance_summary(accepted, llm.manifest.num_speculative_tokens)[0])
        if progress is not None:
            progress(f"generated {len(outputs)} prompts with {directory}")
    return Acceptance(prompts=len(prompts), max_tokens=max_tokens, mean_accepted_length=lengths[0],
                      reference_mean_accepted_length=lengths[1])

"""Every spec function exports to ONNX (opset 24, IR 10) with dynamic B, K, V, S, and ONNX Runtime
returns the same tokens as torch for the same noise over 300 random cases per graph; no graph holds what
TensorRT cannot build (Bitwise ops, an If nested in an If branch: engines/tensorrt/onnx_check.py).

Each graph is exported once per module (a few seconds each); the cases then vary every dynamic dim.
Cases include ties (integer logits), temperature-0 rows, every filter on and off, drafts of -1,
drafts equal to the argmax (so prefixes get accepted), random and all-allowed bitmasks, thinking rows and
none. The verdict graphs are also exported lazy (model.ort.onnx's body: Ifs skip what no row needs).
"""

from __future__ import annotations

import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from engines.tensorrt.onnx_check import find_problems
from plugins.spec_accept.acceptance import NOISE_CHANNELS, NOISE_DRAFT, sample_draft, verify
from plugins.spec_accept.bitmask import num_bitmask_words, pack_bitmask
from plugins.spec_accept.ragged import (
    gather_last_accepted,
    last_accepted_index,
    merge_drafts,
    merge_positions,
    shift_tokens,
)

CASES = 300
Dim = torch.export.Dim


class _SampleAndMatch(torch.nn.Module):
    lazy = False         # the lazy subclasses: model.ort.onnx's body (an all-allowed mask, no thinking row)

    def forward(self, logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase,
                token_bitmask):
        return verify(logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase,
                      token_bitmask, lazy=self.lazy)


class _LazySampleAndMatch(_SampleAndMatch):
    lazy = True


class _RejectionAndDraft(torch.nn.Module):
    lazy = False

    def forward(self, logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase,
                token_bitmask, draft_probs, draft_logits):
        num_accepted, next_tokens = verify(logits, draft_tokens, temperature, top_k, top_p, min_p, noise,
                                           in_thinking_phase, token_bitmask, draft_probs, lazy=self.lazy)
        tokens, q = sample_draft(draft_logits, temperature, top_k, top_p, min_p, noise[:, 0, NOISE_DRAFT])
        return num_accepted, next_tokens, tokens, q


class _LazyRejectionAndDraft(_RejectionAndDraft):
    lazy = True


class _Ragged(torch.nn.Module):
    def forward(self, tokens, positions, row_offsets, draft_tokens, num_accepted, next_tokens,
                chunk_next_tokens):
        num_drafts = draft_tokens.shape[1]
        merged, merged_offsets = merge_drafts(tokens, row_offsets, draft_tokens)
        shifted = shift_tokens(merged, merged_offsets, num_accepted, next_tokens, num_drafts, chunk_next_tokens)
        merged_positions = merge_positions(positions, row_offsets, num_drafts)
        return (merged, merged_offsets, merged_positions, shifted,
                last_accepted_index(merged_offsets, num_accepted, num_drafts),
                gather_last_accepted(merged_positions, merged_offsets, num_accepted, num_drafts))


def _verify_case(rnd: random.Random, gen: torch.Generator, rows: int, k: int, vocab: int) -> dict:
    if rnd.random() < 0.3:
        logits = torch.randint(-3, 3, (rows, k + 1, vocab), generator=gen).float()     # many ties
    else:
        logits = torch.randn(rows, k + 1, vocab, generator=gen) * rnd.choice([0.5, 2.0, 8.0])
    drafts = torch.where(torch.rand(rows, k, generator=gen) < 0.7, logits[:, :k].argmax(-1),
                         torch.randint(0, vocab, (rows, k), generator=gen))
    drafts[torch.rand(rows, generator=gen) < 0.2] = -1
    allowed = torch.rand(rows, k + 1, vocab, generator=gen) < rnd.choice([1.0, 0.7, 0.1])
    bitmask = pack_bitmask(allowed)
    if rnd.random() < 0.25:     # what a step without a grammar passes (spec_glue.allow_all)
        bitmask = torch.full_like(bitmask, -1)
    thinking = torch.rand(rows, generator=gen) < 0.5
    if rnd.random() < 0.25:
        thinking[:] = False
    pick = lambda off, on: torch.where(torch.rand(rows, generator=gen) < 0.4, off, on)  # noqa: E731
    return {
        "logits": logits,
        "draft_tokens": drafts,
        "temperature": pick(torch.zeros(rows), torch.rand(rows, generator=gen) * 2),
        "top_k": pick(torch.zeros(rows, dtype=torch.int64), torch.randint(1, vocab + 3, (rows,), generator=gen)),
        "top_p": pick(torch.ones(rows), torch.rand(rows, generator=gen)),
        "min_p": pick(torch.zeros(rows), torch.rand(rows, generator=gen) * 0.5),
        "noise": torch.rand(rows, k + 1, NOISE_CHANNELS, generator=gen),
        "in_thinking_phase": thinking,
        "token_bitmask": bitmask,
    }


def _rejection_case(rnd: random.Random, gen: torch.Generator, rows: int, k: int, vocab: int) -> dict:
    case = _verify_case(rnd, gen, rows, k, vocab)
    case["draft_probs"] = torch.softmax(torch.randn(rows, k, vocab, generator=gen) * 2, dim=-1)
    case["draft_probs"][torch.rand(rows, k, vocab, generator=gen) < 0.3] = 0.0
    case["draft_logits"] = torch.randn(rows, vocab, generator=gen) * 2
    return case


def _ragged_case(rnd: random.Random, gen: torch.Generator, rows: int, k: int, vocab: int) -> dict:
    lengths = torch.randint(1, 6, (rows,), generator=gen)
    num_tokens = int(lengths.sum())
    return {
        "tokens": torch.randint(0, vocab, (num_tokens,), generator=gen),
        "positions": torch.randint(0, 100, (num_tokens,), generator=gen),
        "row_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "draft_tokens": torch.randint(-1, vocab, (rows, k), generator=gen),
        "num_accepted": torch.randint(0, k + 1, (rows,), generator=gen),
        "next_tokens": torch.randint(0, vocab, (rows,), generator=gen),
        "chunk_next_tokens": torch.randint(-1, vocab, (rows,), generator=gen),
    }


def _dynamic_shapes(case: dict) -> dict:
    rows, k, vocab, words = Dim("B", min=1), Dim("K", min=1, max=64), Dim("V", min=1), Dim("W", min=1)
    shapes = {"logits": {0: rows, 1: k + 1, 2: vocab}, "draft_tokens": {0: rows, 1: k},
              "temperature": {0: rows}, "top_k": {0: rows}, "top_p": {0: rows}, "min_p": {0: rows},
              "noise": {0: rows, 1: k + 1}, "in_thinking_phase": {0: rows},
              "token_bitmask": {0: rows, 1: k + 1, 2: words}, "draft_probs": {0: rows, 1: k, 2: vocab},
              "draft_logits": {0: rows, 1: vocab}, "tokens": {0: Dim("S", min=1)},
              "positions": {0: Dim("S", min=1)}, "row_offsets": {0: Dim("B1", min=2)},
              "num_accepted": {0: rows}, "next_tokens": {0: rows}, "chunk_next_tokens": {0: rows}}
    if "row_offsets" in case:   # the ragged graph: B+1 offsets, B rows elsewhere
        shapes["row_offsets"] = {0: rows + 1}
    return {name: shapes[name] for name in case}


def _export(module: torch.nn.Module, case: dict, path) -> ort.InferenceSession:
    shapes = _dynamic_shapes(case)
    if getattr(module, "lazy", False):
        # as plugins/onnx_common.export_reference exports the op's bodies: Dim.DYNAMIC, for torch guards
        # a slice inside an If branch on V != 2, which a named Dim's full range would refuse
        shapes = {name: dict.fromkeys(axes, Dim.DYNAMIC) for name, axes in shapes.items()}
    torch.onnx.export(module, tuple(case.values()), str(path), dynamo=True, opset_version=24,
                      input_names=list(case), dynamic_shapes=shapes, verbose=False)
    model = onnx.load(str(path))
    assert model.ir_version == 10
    assert {o.domain: o.version for o in model.opset_import}[""] == 24
    ops = {node.op_type for node in model.graph.node}
    assert not {"RandomUniform", "RandomUniformLike", "Multinomial"} & ops   # randomness is an input
    if not getattr(module, "lazy", False):      # the lazy body is for ONNX Runtime only
        assert find_problems(model) == []      # no Bitwise op, no If nested in an If branch (TensorRT)
    assert all(d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim)  # nothing frozen
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


GRAPHS = {
    "sample-and-match": (_SampleAndMatch, _verify_case),
    "rejection-and-draft": (_RejectionAndDraft, _rejection_case),
    "ragged": (_Ragged, _ragged_case),
    "sample-and-match, lazy": (_LazySampleAndMatch, _verify_case),
    "rejection-and-draft, lazy": (_LazyRejectionAndDraft, _rejection_case),
}


# `make test` runs two graphs (ORT's lazy rejection body, ragged); all five in `make test-all`
FAST_GRAPHS = ("ragged", "rejection-and-draft, lazy")


@pytest.fixture(scope="module", params=[name if name in FAST_GRAPHS else pytest.param(name, marks=pytest.mark.slow)
                                        for name in GRAPHS])
def exported(request, tmp_path_factory):
    module, make_case = GRAPHS[request.param]
    example = make_case(random.Random(0), torch.Generator().manual_seed(0), rows=3, k=3, vocab=40)
    session = _export(module().eval(), example, tmp_path_factory.mktemp("spec") / f"{request.param}.onnx")
    return module(), make_case, session


def test_onnx_runtime_gives_the_same_tokens_as_torch(exported) -> None:
    module, make_case, session = exported
    rnd, gen = random.Random(1), torch.Generator().manual_seed(1)
    num_partial = num_full = 0    # rows with 0 < accepted < K, rows with every draft accepted
    for index in range(CASES):
        # vocabularies past truncation.NUCLEUS_CANDIDATES too (traced at 40): the candidate and exact paths
        rows, k = rnd.randint(1, 6), rnd.randint(1, 7)
        vocab = rnd.randint(2, 200) if index % 4 else rnd.randint(257, 700)
        case = make_case(rnd, gen, rows, k, vocab)
        assert case.get("token_bitmask", torch.empty(0, num_bitmask_words(vocab))).shape[-1] == \
            num_bitmask_words(vocab)
        want = module(*case.values())
        if "logits" in case:
            num_partial += int(((want[0] > 0) & (want[0] < k)).sum())
            num_full += int((want[0] == k).sum())
        got = session.run(None, {name: value.numpy() for name, value in case.items()})
        assert len(got) == len(want)
        for output, (w, g) in enumerate(zip(want, got)):
            if w.dtype == torch.float32:   # the draft distribution q: float64 math rounded to float32
                np.testing.assert_allclose(g, w.numpy(), rtol=1e-6, atol=1e-7, err_msg=f"case {index}")
            else:
                assert np.array_equal(g, w.numpy()), f"case {index} output {output}: ORT {g} torch {w.numpy()}"
    if "logits" in case:   # the cases exercise accepted prefixes and bonus tokens, not only rejections
        assert num_partial > 50 and num_full > 50, (num_partial, num_full)

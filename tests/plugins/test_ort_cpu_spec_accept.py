"""unispec.cpu::SpecAccept and unispec.cpu::SampleDraft, the native ONNX Runtime CPU kernels of the
speculative math: the same tokens as the torch reference (plugins/spec_accept) for the same noise, over
every verdict (greedy, rejection with sampled and argmax drafts, relaxed), every truncation (top-k, top-p with
a nucleus inside and outside the 256 candidates, min-p), grammar masks, rows without drafts, K = 0; bad feeds
are one-line errors."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from plugins import ort_cpu
from plugins.spec_accept.acceptance import RELAXED_DELTA, RELAXED_TOP_N, choose_drafts, sample_draft
from plugins.spec_accept.bitmask import pack_bitmask
from plugins.spec_accept.reference import spec_accept

SPEC_INPUTS = (("logits", TensorProto.FLOAT, 3), ("draft_tokens", TensorProto.INT64, 2),
               ("temperature", TensorProto.FLOAT, 1), ("top_k", TensorProto.INT64, 1),
               ("top_p", TensorProto.FLOAT, 1), ("min_p", TensorProto.FLOAT, 1), ("noise", TensorProto.FLOAT, 3),
               ("in_thinking_phase", TensorProto.BOOL, 1), ("token_bitmask", TensorProto.INT32, 3),
               ("draft_probs", TensorProto.FLOAT, 3))
DRAFT_INPUTS = (("logits", TensorProto.FLOAT, 3), ("argmax", TensorProto.INT64, 2),
                ("temperature", TensorProto.FLOAT, 1), ("top_k", TensorProto.INT64, 1), ("top_p", TensorProto.FLOAT, 1),
                ("min_p", TensorProto.FLOAT, 1), ("uniform", TensorProto.FLOAT, 2))


def session(op: str, inputs, outputs, **attrs) -> ort.InferenceSession:
    node = helper.make_node(op, [n for n, _, _ in inputs], [n for n, _, _ in outputs], domain=ort_cpu.DOMAIN, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, [None] * r) for n, t, r in inputs],
                              [helper.make_tensor_value_info(n, t, [None] * r) for n, t, r in outputs])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(ort_cpu.DOMAIN, 1)],
                              ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def spec_session(k: int) -> ort.InferenceSession:
    return session("SpecAccept", SPEC_INPUTS, (("num_accepted", TensorProto.INT64, 1), ("next_tokens", TensorProto.INT64, 1)),
                   num_drafts=k, relaxed_top_n=RELAXED_TOP_N, relaxed_delta=RELAXED_DELTA)


def case(seed: int, *, batch: int, k: int, vocab: int, sharpness: float = 3.0, grammar: bool = False,
         flat_row: bool = False, tied: bool = False) -> dict[str, torch.Tensor]:
    """A step's verdict inputs: drafts drawn from a draft distribution near the target's (so some are
    accepted), mixed sampling parameters, some -1 slots, argmax (one-hot q) and sampled drafts. `tied`:
    logits on a coarse grid, so the nucleus boundary falls among many equal probabilities."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=g) * sharpness
    if flat_row:                                         # a nucleus wider than the 256 candidates
        logits[0] = torch.randn(k + 1, vocab, generator=g) * 0.01
    if tied:
        logits = torch.round(logits)
    draft_logits = logits[:, :k] + torch.randn(batch, k, vocab, generator=g)
    q = torch.softmax(draft_logits, dim=-1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, k) if k else \
        torch.zeros(batch, 0, dtype=torch.int64)
    onehot_rows = torch.rand(batch, generator=g) < 0.3     # argmax drafts with q = onehot(draft)
    for b in range(batch):
        if onehot_rows[b] and k:
            drafts[b] = draft_logits[b].argmax(-1)
            q[b] = torch.nn.functional.one_hot(drafts[b], vocab).float()
    if k:
        drafts[torch.rand(batch, k, generator=g) < 0.1] = -1
        q[0, 0] = torch.where(torch.arange(vocab) == drafts[0, 0].clamp(min=0), 0.0, q[0, 0])   # q(d) = 0
    temperature = torch.where(torch.rand(batch, generator=g) < 0.25, torch.zeros(batch),
                              torch.rand(batch, generator=g) * 1.2 + 0.05)
    top_k = torch.where(torch.rand(batch, generator=g) < 0.4, torch.randint(1, min(vocab, 300), (batch,), generator=g),
                        torch.zeros(batch, dtype=torch.int64))
    top_p = torch.where(torch.rand(batch, generator=g) < 0.5, torch.rand(batch, generator=g) * 0.5 + 0.5,
                        torch.ones(batch))
    min_p = torch.where(torch.rand(batch, generator=g) < 0.3, torch.rand(batch, generator=g) * 0.2, torch.zeros(batch))
    if flat_row:
        temperature[0], top_k[0], top_p[0], min_p[0] = 1.0, 0, 0.95, 0.0
    allowed = torch.ones(batch, k + 1, vocab, dtype=torch.bool)
    if grammar:
        allowed = torch.rand(batch, k + 1, vocab, generator=g) < 0.5
        allowed[0, 0] = False                             # a mask that allows nothing is ignored
    return {"logits": logits, "draft_tokens": drafts, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "min_p": min_p, "noise": torch.rand(batch, k + 1, 3, generator=g),
            "in_thinking_phase": torch.rand(batch, generator=g) < 0.4, "token_bitmask": pack_bitmask(allowed),
            "draft_probs": q}


def run_native(feeds: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    k = feeds["draft_tokens"].shape[1]
    return tuple(spec_session(k).run(None, {name: value.numpy() for name, value in feeds.items()}))


def run_reference(feeds: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    k = feeds["draft_tokens"].shape[1]
    accepted, tokens = spec_accept(*feeds.values(), num_drafts=k, relaxed_top_n=RELAXED_TOP_N,
                                   relaxed_delta=RELAXED_DELTA)
    return accepted.numpy(), tokens.numpy()


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("vocab,grammar,flat_row,tied", [(50, False, False, False), (300, False, True, False),
                                                         (700, True, False, False), (2000, False, True, False),
                                                         (1000, False, False, True)])
def test_the_verdict_equals_the_reference(k: int, vocab: int, grammar: bool, flat_row: bool, tied: bool) -> None:
    accepted_any = False
    for seed in range(12):
        feeds = case(seed, batch=6, k=k, vocab=vocab, grammar=grammar, flat_row=flat_row, tied=tied)
        native, reference = run_native(feeds), run_reference(feeds)
        np.testing.assert_array_equal(native[0], reference[0], err_msg=f"num_accepted, seed {seed}")
        np.testing.assert_array_equal(native[1], reference[1], err_msg=f"next_tokens, seed {seed}")
        accepted_any |= bool((native[0] > 0).any())
    assert accepted_any or k == 0              # the cases exercise accepted drafts, not only rejections


def test_bad_feeds_are_one_line_errors() -> None:
    feeds = case(0, batch=2, k=2, vocab=40)
    feeds["draft_tokens"][0, 0] = 40
    with pytest.raises(Exception, match="SpecAccept: a draft token outside the vocabulary"):
        run_native(feeds)
    feeds = case(0, batch=2, k=2, vocab=40)
    feeds["noise"] = feeds["noise"][:, :2]
    with pytest.raises(Exception, match="SpecAccept: noise must be"):
        run_native(feeds)


def draft_session() -> ort.InferenceSession:
    return session("SampleDraft", DRAFT_INPUTS, (("tokens", TensorProto.INT64, 2), ("q", TensorProto.FLOAT, 3)))


@pytest.mark.parametrize("temperatures", [[0.0, 0.7, 1.3, 0.0, 0.9], [0.0] * 5, [0.7] * 5])
@pytest.mark.parametrize("vocab,flat_row,tied", [(500, False, False), (2000, True, False), (1000, False, True)])
def test_the_sampled_draft_equals_the_reference(temperatures: list[float], vocab: int, flat_row: bool,
                                                tied: bool) -> None:
    g = torch.Generator().manual_seed(1)
    batch, positions = len(temperatures), 3
    logits = torch.randn(batch, positions, vocab, generator=g) * 3
    if flat_row:                                         # a nucleus wider than the 256 candidates
        logits[1] = torch.randn(positions, vocab, generator=g) * 0.01
    if tied:                                             # many equal probabilities at the nucleus boundary
        logits = torch.round(logits)
    logits[:, :, 400:450] = float("-inf")                # tokens outside a drafter's vocabulary
    argmax = logits.argmax(-1)
    params = {"temperature": torch.tensor(temperatures), "top_k": torch.tensor([0, 0, 40, 5, 0]),
              "top_p": torch.tensor([1.0, 0.95, 0.8, 1.0, 1.0]), "min_p": torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05])}
    uniform = torch.rand(batch, positions, generator=g)
    tokens, q = draft_session().run(None, {"logits": logits.numpy(), "argmax": argmax.numpy(),
                                           **{name: value.numpy() for name, value in params.items()},
                                           "uniform": uniform.numpy()})
    want_tokens, want_q = choose_drafts(logits, argmax, *params.values(), uniform)
    np.testing.assert_array_equal(tokens, want_tokens.numpy())
    np.testing.assert_array_equal(q, want_q.numpy())
    sampled = params["temperature"] > 0
    if sampled.any():       # the sampled rows really sample: the draws follow q, not the argmax
        per_position = [value[:, None].expand(-1, positions) for value in params.values()]
        direct, direct_q = sample_draft(logits, *per_position, uniform)
        np.testing.assert_array_equal(tokens[sampled.numpy()], direct[sampled].numpy())
        kept = (direct_q > 0).sum(-1)                    # [B, P]: q is truncated like the target
        assert (kept[2] <= 40).all() and (kept[4] < vocab - 50).all()     # top-k 40; min-p cuts the tail


def test_a_misshapen_draft_feed_is_a_one_line_error() -> None:
    logits = torch.randn(2, 3, 40)
    feeds = {"logits": logits.numpy(), "argmax": logits.argmax(-1).numpy(), "temperature": np.zeros(2, np.float32),
             "top_k": np.zeros(3, np.int64), "top_p": np.ones(2, np.float32), "min_p": np.zeros(2, np.float32),
             "uniform": np.zeros((2, 3), np.float32)}
    with pytest.raises(Exception, match="SampleDraft: argmax and uniform must be"):
        draft_session().run(None, feeds)

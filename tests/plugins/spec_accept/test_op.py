"""SpecAccept: the custom op runs acceptance.verify (its reference, the math exists once), and the exported
two-output `unispec::SpecAccept` node runs in ONNX Runtime with the same tokens, with and without the
optional grammar bitmask, and with the optional draft distributions (rejection sampling): three
overloads, the functions differ in their inputs."""

from __future__ import annotations

import pytest
import torch

from plugins.spec_accept.acceptance import NOISE_CHANNELS, RELAXED_DELTA, RELAXED_TOP_N, verify
from plugins.spec_accept.bitmask import pack_bitmask
from plugins.spec_accept.op import spec_accept
from tests.plugins.harness import (
    assert_ort_matches,
    assert_plugin_graph,
    attributes,
    export_with_plugins,
    session,
    unispec_nodes,
)

RELAXED = dict(relaxed_top_n=RELAXED_TOP_N, relaxed_delta=RELAXED_DELTA)


def accept_inputs(seed: int, rows: int, k: int, vocab: int) -> dict[str, torch.Tensor]:
    """Half the rows greedy, drafts mostly the argmax (prefixes get accepted), a -1 row, thinking rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows, k + 1, vocab), generator=g).float() + torch.rand(rows, k + 1, vocab,
                                                                                             generator=g)
    drafts = torch.where(torch.rand(rows, k, generator=g) < 0.8, logits[:, :k].argmax(-1),
                         torch.randint(0, vocab, (rows, k), generator=g))
    drafts[0] = -1
    greedy = torch.arange(rows) % 2 == 0
    return {
        "logits": logits, "draft_tokens": drafts,
        "temperature": torch.where(greedy, 0.0, 0.9), "top_k": torch.where(greedy, 0, 7),
        "top_p": torch.where(greedy, 1.0, 0.95), "min_p": torch.where(greedy, 0.0, 0.02),
        "noise": torch.rand(rows, k + 1, NOISE_CHANNELS, generator=g),
        "in_thinking_phase": torch.rand(rows, generator=g) < 0.5,
        "token_bitmask": pack_bitmask(torch.rand(rows, k + 1, vocab, generator=g) < 0.8),
        # q of sampled drafts: peaked like the target, a few tokens with q = 0 (a draft there is deterministic)
        "draft_probs": torch.softmax(logits[:, :k] * 2 + torch.randn(rows, k, vocab, generator=g), dim=-1)
        * (torch.rand(rows, k, vocab, generator=g) > 0.1),
    }


SMALL = accept_inputs(0, rows=3, k=2, vocab=40)
LARGE = accept_inputs(1, rows=6, k=5, vocab=300)


@pytest.mark.parametrize("inputs", [SMALL, LARGE], ids=["small", "large"])
def test_eager_op_is_verify(inputs) -> None:
    args = list(inputs.values())
    for with_mask in (True, False):
        for with_probs in (True, False):
            optional = (args[8] if with_mask else None, args[9] if with_probs else None)
            got = spec_accept(*args[:8], *optional, num_drafts=args[1].shape[1], **RELAXED)
            want = verify(*args[:8], *optional, **RELAXED)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    other = spec_accept(*args, num_drafts=args[1].shape[1], relaxed_top_n=1, relaxed_delta=0.0)  # reach verify
    assert all(torch.equal(a, b) for a, b in zip(other, verify(*args, relaxed_top_n=1, relaxed_delta=0.0)))


class Verdicts(torch.nn.Module):
    """Structured, unstructured and rejection verdicts side by side, for K drafts (static in real step graphs)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase,
                token_bitmask, draft_probs):
        args = (logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase)
        k = self.k
        structured = spec_accept(*args, token_bitmask, num_drafts=k, **RELAXED)
        free = spec_accept(*args, num_drafts=k, **RELAXED)
        rejection = spec_accept(*args, token_bitmask, draft_probs, num_drafts=k, **RELAXED)
        return (*structured, *free, *rejection)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_accept") / "verdicts.onnx"
    return export_with_plugins(Verdicts(2), SMALL, path), path


def test_graph_holds_three_overloads_by_optional_inputs(exported) -> None:
    model, _ = exported
    assert_plugin_graph(model, "SpecAccept", num_nodes=3, num_functions=3)
    structured, free, rejection = unispec_nodes(model)
    assert (len(structured.input), len(free.input), len(rejection.input)) == (9, 8, 10)
    assert len(structured.output) == 2
    assert attributes(free)["relaxed_top_n"] == RELAXED_TOP_N
    assert attributes(free)["relaxed_delta"] == pytest.approx(RELAXED_DELTA)
    functions = {f.overload: f for f in model.functions}
    assert (len(functions[structured.overload].input), len(functions[free.overload].input)) == (9, 8)


@pytest.mark.parametrize("inputs", [SMALL, LARGE], ids=["small", "large"])
def test_onnx_runtime_gives_the_same_tokens(exported, inputs) -> None:
    _, path = exported
    got = assert_ort_matches(session(path), Verdicts(inputs['draft_tokens'].shape[1]), inputs)
    assert (got[0] > 0).any(), "some drafts are accepted, so the comparison covers accepted prefixes"
    assert (got[4] > 0).any(), "... by rejection sampling too"


def test_every_k_from_two_shares_the_function_traced_at_two(exported, tmp_path) -> None:
    """A K = 5 graph's nodes keep num_drafts = 5 and call the K = 2 graph's functions (no trace of their own),
    and ONNX Runtime runs them at K = 5 with torch's tokens."""
    from plugins.spec_accept.onnx import traced_at

    assert [traced_at({"num_drafts": k})["num_drafts"] for k in (0, 1, 2, 3, 7)] == [0, 1, 2, 2, 2]
    two, _ = exported
    five = export_with_plugins(Verdicts(5), LARGE, tmp_path / "k5.onnx")
    assert {attributes(n)["num_drafts"] for n in unispec_nodes(five)} == {5}
    assert [n.overload for n in unispec_nodes(five)] == [n.overload for n in unispec_nodes(two)]
    assert [f.SerializeToString() for f in five.functions] == [f.SerializeToString() for f in two.functions]
    got = assert_ort_matches(session(tmp_path / "k5.onnx"), Verdicts(5), LARGE)
    assert (got[0] > 0).any()


@pytest.mark.slow      # 23 s; every `none` artifact of the fast suite runs the K = 0 function too
def test_k_zero_gets_its_own_function_and_runs_in_onnx_runtime(tmp_path) -> None:
    """Plain decoding (K = 0): the function is traced at K = 0; ONNX Runtime mishandles empty axes otherwise."""
    inputs = accept_inputs(2, rows=4, k=0, vocab=50)
    inputs["draft_tokens"] = inputs["draft_tokens"][:, :0]
    inputs["draft_probs"] = inputs["draft_probs"][:, :0]
    model = export_with_plugins(Verdicts(0), inputs, tmp_path / "k0.onnx")
    assert {attributes(n)["num_drafts"] for n in unispec_nodes(model)} == {0}
    got = assert_ort_matches(session(tmp_path / "k0.onnx"), Verdicts(0), inputs)
    assert (got[0] == 0).all()


def test_num_drafts_must_match_the_drafts() -> None:
    args = list(SMALL.values())
    with pytest.raises(ValueError, match="num_drafts=3"):
        spec_accept(*args, num_drafts=3, **RELAXED)

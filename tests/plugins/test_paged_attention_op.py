"""PagedAttention as a custom op: eager == reference, and the exported `unispec::PagedAttention` node runs in
ONNX Runtime through its attached reference function (two attribute sets -> two overloads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugins.paged_attention.op import paged_attention
from plugins.paged_attention.reference import paged_attention as reference
from tests.plugins.harness import (
    assert_ort_matches,
    assert_plugin_graph,
    attributes,
    export_with_plugins,
    session,
    unispec_nodes,
)

ATTRIBUTE_SETS = [dict(scale=0.3), dict(scale=0.3, causal=False), dict(scale=0.25, sliding_window=3, softcap=5.0)]


def paged_inputs(seed: int, new: list[int], cached: list[int], *, past: int, q_heads: int, kv_heads: int,
                 head_dim: int, v_dim: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, b = sum(new), len(new)
    return {
        "q": torch.randn(s, q_heads, head_dim, generator=g),
        "k": torch.randn(s, kv_heads, head_dim, generator=g),
        "v": torch.randn(s, kv_heads, v_dim, generator=g),
        "k_cache": torch.randn(b, past, kv_heads, head_dim, generator=g),
        "v_cache": torch.randn(b, past, kv_heads, v_dim, generator=g),
        "row_offsets": torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()]),
        "positions": torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]),
        "cache_lengths": torch.tensor(cached),
    }


SMALL = paged_inputs(0, [2, 1, 4], [4, 0, 6], past=8, q_heads=4, kv_heads=2, head_dim=8, v_dim=6)
LARGE = paged_inputs(1, [1, 5, 3, 2, 6], [9, 2, 0, 13, 7], past=16, q_heads=6, kv_heads=3, head_dim=4, v_dim=10)


@pytest.mark.parametrize("attrs", ATTRIBUTE_SETS)
def test_eager_op_is_the_reference(attrs) -> None:
    for inputs in (SMALL, LARGE):
        assert torch.equal(paged_attention(*inputs.values(), **attrs), reference(*inputs.values(), **attrs))


class TwoLayers(torch.nn.Module):
    """A full-attention and a sliding-window + softcap call (like Gemma's layer types), then full again."""

    def forward(self, q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths):
        args = (q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths)
        full = paged_attention(*args, scale=0.3)
        local = paged_attention(*args, scale=0.25, sliding_window=3, softcap=5.0)
        again = paged_attention(q * 0.5, *args[1:], scale=0.3)   # other inputs, or the exporter merges it
        return full + 2 * local - again


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("paged_attention") / "two_layers.onnx"
    return export_with_plugins(TwoLayers(), SMALL, path), path


def test_graph_holds_one_node_per_call_and_one_function_per_attribute_set(exported) -> None:
    model, _ = exported
    assert_plugin_graph(model, "PagedAttention", num_nodes=3, num_functions=2)
    nodes = unispec_nodes(model)
    assert [attributes(n)["sliding_window"] for n in nodes] == [0, 3, 0]
    assert [attributes(n)["causal"] for n in nodes] == [1, 1, 1]
    assert attributes(nodes[1])["softcap"] == pytest.approx(5.0)
    assert nodes[0].overload == nodes[2].overload != nodes[1].overload
    assert list(nodes[0].input) == list(SMALL)     # the node takes the op's inputs as they are


@pytest.mark.parametrize("inputs", [SMALL, LARGE], ids=["small", "large"])
def test_onnx_runtime_matches_torch(exported, inputs) -> None:
    _, path = exported
    assert_ort_matches(session(path), TwoLayers(), inputs)


def test_polygraphy_inspect_shows_the_plugin_node(exported) -> None:
    _, path = exported
    polygraphy = Path(sys.executable).parent / "polygraphy"
    done = subprocess.run([str(polygraphy), "inspect", "model", str(path), "--show", "layers", "attrs"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Other Opsets: {'unispec': 1}" in done.stdout
    assert done.stdout.count("[Op: PagedAttention]") == 3
    assert ".plugin_namespace = unispec" in done.stdout and ".sliding_window = 3" in done.stdout

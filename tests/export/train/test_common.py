import pytest
import torch

from export.train.common import (
    Schedule,
    Windows,
    differentiable_ops,
    fixed_windows,
    invert_adapter,
    train_loop,
)


def _adapter(source):
    """Renames, a transpose, a slice of a fused tensor and a stack: what the real adapters do."""
    return {"a": source["x.weight"].T, "gate": source["fused"][:2], "up": source["fused"][2:],
            "experts": torch.stack([source["e.0"], source["e.1"]]), "ids": source["ids"]}


def test_invert_adapter_writes_trained_values_back_to_their_checkpoint_places() -> None:
    template = {"x.weight": torch.randn(3, 4), "fused": torch.randn(4, 5), "e.0": torch.randn(2, 2),
                "e.1": torch.randn(2, 2), "ids": torch.arange(6), "unused": torch.randn(3)}
    trained = {key: torch.randn_like(t) if t.is_floating_point() else t for key, t in _adapter(template).items()}
    written = invert_adapter(_adapter, template)(trained)
    for key, value in _adapter(written).items():
        assert torch.equal(value, trained[key]), key
    assert torch.equal(written["unused"], template["unused"]) and written["ids"] is template["ids"]


def test_differentiable_ops_swaps_the_custom_ops_and_restores_them() -> None:
    from export.archs.deepseek_v3 import mla
    from export.archs.llama3 import model as llama
    from export.train.common import batched_paged_attention
    from plugins.paged_attention import op, reference
    from plugins.paged_mla import op as mla_op
    from plugins.paged_mla import reference as mla_reference

    assert llama.paged_attention is op.paged_attention and mla.paged_mla is mla_op.paged_mla
    with differentiable_ops():
        assert llama.paged_attention is batched_paged_attention and mla.paged_mla is mla_reference.paged_mla
        assert mla_reference.paged_attention is batched_paged_attention
    assert llama.paged_attention is op.paged_attention and mla.paged_mla is mla_op.paged_mla
    assert mla_reference.paged_attention is reference.paged_attention
    with pytest.raises(RuntimeError), differentiable_ops():
        raise RuntimeError("restored even on errors")
    assert llama.paged_attention is op.paged_attention


def test_windows_are_seeded_and_the_loop_lowers_a_loss() -> None:
    ids = torch.arange(1000)
    assert torch.equal(Windows(ids, 9, 3).batch(4), Windows(ids, 9, 3).batch(4))
    batch = Windows(ids, 9, 3).batch(4)
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 8, dtype=torch.int64))
    assert fixed_windows(ids, 10, 5).shape == (5, 10)
    weight = torch.nn.Parameter(torch.tensor([3.0]))
    losses = train_loop([weight], Schedule(steps=40, batch_size=1, seq_len=1, lr=0.1, warmup=2),
                        lambda step: (weight ** 2).sum(), log=lambda line: None, name="toy")
    assert losses[-1] < losses[0] / 10


@pytest.mark.parametrize(("per_row", "causal", "window", "group"), [(5, False, 0, 2), (1, True, 0, 1), (7, True, 3, 4)])
def test_batched_paged_attention_matches_the_reference(per_row, causal, window, group) -> None:
    from export.train.common import batched_paged_attention
    from plugins.paged_attention.reference import paged_attention

    gen = torch.Generator().manual_seed(per_row)
    batch, slots, kv_heads, dim = 3, 9, 2, 8
    n = batch * per_row
    q = torch.randn(n, kv_heads * group, dim, generator=gen)
    k, v = torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen)
    k_cache, v_cache = (torch.randn(batch, slots, kv_heads, dim, generator=gen) for _ in range(2))
    cache_lengths = torch.tensor([0, 4, 9])
    positions = (cache_lengths[:, None] + torch.arange(per_row)[None]).reshape(-1)
    args = (q, k, v, k_cache, v_cache, torch.arange(batch + 1) * per_row, positions, cache_lengths)
    kwargs = dict(scale=dim ** -0.5, causal=causal, sliding_window=window)
    torch.testing.assert_close(batched_paged_attention(*args, **kwargs), paged_attention(*args, **kwargs))

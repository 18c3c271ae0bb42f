"""model.ort.onnx's fusions: the exported graph's op-by-op spellings of RoPE, of residual norms and of reshaping
round trips, rewritten into fewer nodes for ONNX Runtime (onnxscript's pattern rewriter does the matching).

At the bundled sizes a step is dispatch-bound (about a microsecond per node on one core), so every node that
does no arithmetic worth its dispatch costs time; at real sizes they are a few percent. The rules:

- **RoPE** (rotate-half form, per query/key of [S, H, D]): `x·cos + concat(-x[..., D/2:], x[..., :D/2])·sin`
  with `cos = unsqueeze(Cos(concat(f, f)), 1)` (and `sin` alike), 7 nodes + the shared tables, becomes ONNX's
  `RotaryEmbedding` (opset 23) over x viewed as [S, H, 1, D] (batch S, H heads, sequence 1) with the
  half-width tables `unsqueeze(Cos(f), 1)`: Unsqueeze, RotaryEmbedding, Squeeze. The match is structural and
  exact: the tables must be built from one `f` concatenated with itself (so both halves are equal, which the
  fused op assumes), the slices must cut x's last axis at D/2, x must be rank 3 with static H and D. Anything
  else (interleaved or partial rotation, scaled tables) keeps its nodes.
- **Residual add + RMSNormalization** -> com.microsoft `SkipSimplifiedLayerNormalization`, whose fourth output
  is the sum (float32, norm over the last axis, a [hidden] scale).
- **Unsqueeze after / Squeeze before a Reshape to a constant shape** fold into the Reshape.
- **Stack then flatten** (an Eagle3 or DFlash head's fc reads the captured target layers `stack(taps, 1)`
  viewed as [S, C·H]): Unsqueeze(tap, 1) of each [S, H] tap, Concat on axis 1, Reshape to [S, C·H] is one
  Concat of the taps on their last axis, which lays each row out the same way (2 to 5 taps).
- **Concat then Split back** (a layer's K and V are concatenated into its KV delta row, and the attention's
  inputs split out of that again): a Split whose parts are exactly a Concat's inputs is dropped, its outputs
  replaced by those inputs.

model.onnx (TensorRT) is never changed.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from engines.ort.graph_edit import ONNX_DOMAINS


def get_numpy_value(value: ir.Value | None) -> Any:
    """The value as a numpy array when it is a constant (an initializer or a Constant node's output), else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def is_singleton_value(value: ir.Value | None, wanted: Any) -> bool:
    """Whether `value` is a one-element constant equal to `wanted` (or for which `wanted(v)` is true)."""
    array = get_numpy_value(value)
    if array is None or array.size != 1:
        return False
    item = array.reshape(-1)[0].item()
    return bool(wanted(item)) if callable(wanted) else item == wanted


class _RotateHalfRope(pattern.RewriteRuleClassBase):
    """x·cos + rotate_half(x)·sin over x [S, H, D] -> Squeeze(RotaryEmbedding(Unsqueeze(x, 2)), 2)."""

    def pattern(self, op: Any, x: Any, cos: Any, sin: Any, start1: Any, end1: Any, axes1: Any, start2: Any,
                end2: Any, axes2: Any) -> Any:
        # the tables are shared by every layer's RoPE, so they are not part of the pattern (its nodes must be
        # used by the match alone): check() reads how they were built
        second = op.Slice(x, start2, end2, axes2, _allow_other_inputs=True)   # x[..., D/2:] (steps checked)
        first = op.Slice(x, start1, end1, axes1, _allow_other_inputs=True)    # x[..., :D/2]
        rotated = op.Concat(op.Neg(second), first, axis=-1)
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context: Any, x: ir.Value, cos: ir.Value, sin: ir.Value, start1: ir.Value, end1: ir.Value,
              axes1: ir.Value, start2: ir.Value, end2: ir.Value, axes2: ir.Value, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        shape = x.shape
        if shape is None or len(shape) != 3 or not all(isinstance(d, int) for d in shape[1:]):
            return result.fail("x is not [S, H, D] with static H and D")
        dim = shape[2]
        half = dim // 2
        last = (2, -1)
        if not (is_singleton_value(axes1, lambda a: a in last) and is_singleton_value(axes2, lambda a: a in last)
                and is_singleton_value(start1, 0) and is_singleton_value(end1, half)
                and is_singleton_value(start2, half) and is_singleton_value(end2, lambda e: e >= dim)):
            return result.fail("the slices do not cut the last axis in halves")
        steps = [node.inputs[4] for node in context.nodes if node.op_type == "Slice" and len(node.inputs) > 4]
        if not all(step is None or is_singleton_value(step, 1) for step in steps):
            return result.fail("a slice with steps")
        cos_half, sin_half = _half_table(cos, "Cos", half), _half_table(sin, "Sin", half)
        if cos_half is None or sin_half is None or cos_half[0] is not sin_half[0]:
            return result.fail("the tables are not unsqueeze(Cos|Sin(concat(f, f)), 1) of one f [S, D/2]")
        if x.dtype != ir.DataType.FLOAT:
            return result.fail("not float32")
        return result

    def rewrite(self, op: Any, x: ir.Value, cos: ir.Value, sin: ir.Value, **_: Any) -> Any:
        freqs, axes = _half_table(cos, "Cos", x.shape[2] // 2)
        axis2 = op.Constant(value_ints=[2])
        cos_half = op.Unsqueeze(op.Cos(freqs), axes)                   # [S, 1, D/2]: (batch, sequence, D/2)
        sin_half = op.Unsqueeze(op.Sin(freqs), axes)                   # (repeated per layer: CSE merges them)
        rotated = op.RotaryEmbedding(op.Unsqueeze(x, axis2), cos_half, sin_half, interleaved=0)  # [S, H, 1, D]
        return op.Squeeze(rotated, axis2)


def _half_table(table: ir.Value, function: str, half: int) -> tuple[ir.Value, ir.Value] | None:
    """(f, axes) when `table` is Unsqueeze(function(Concat(f, f, axis=-1)), axes=[1]) with f float32 [S, half]."""
    unsqueeze = table.producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or not is_singleton_value(unsqueeze.inputs[1], 1):
        return None
    trig = unsqueeze.inputs[0].producer()
    if trig is None or trig.op_type != function or trig.domain not in ONNX_DOMAINS:
        return None
    concat = trig.inputs[0].producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2 \
            or concat.inputs[0] is not concat.inputs[1] or concat.attributes.get_int("axis", 0) not in (-1, 1):
        return None
    freqs = concat.inputs[0]
    if freqs.shape is None or len(freqs.shape) != 2 or freqs.shape[1] != half or freqs.dtype != ir.DataType.FLOAT:
        return None
    return freqs, unsqueeze.inputs[1]


class _ConcatThenSplit(pattern.RewriteRuleClassBase):
    """Split(Concat(a, b), into the parts a and b) -> a, b (the Concat stays when something else reads it)."""

    def pattern(self, op: Any, joined: Any) -> Any:
        return op.Split(joined, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=2)

    def check(self, context: Any, joined: ir.Value, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        split = context.nodes[0]
        parts = _concatenated(joined)
        if parts is None:
            return result.fail("not a Concat of two inputs with static sizes along its axis")
        (a, b), axis = parts
        if split.attributes.get_int("axis", 0) % len(a.shape) != axis:
            return result.fail("Split along another axis than Concat")
        sizes = [a.shape[axis], b.shape[axis]]
        if len(split.inputs) > 1 and split.inputs[1] is not None:
            wanted = get_numpy_value(split.inputs[1])
            if wanted is None or [int(v) for v in wanted.reshape(-1)] != sizes:
                return result.fail("the split sizes are not the concatenated parts")
        elif split.attributes.get_int("num_outputs", 0) != 2 or sizes[0] != sizes[1]:
            return result.fail("an even split of unequal parts")
        return result

    def rewrite(self, op: Any, joined: ir.Value, **_: Any) -> Any:
        (a, b), _ = _concatenated(joined)
        return op.Identity(a), op.Identity(b)


def _concatenated(value: ir.Value) -> tuple[tuple[ir.Value, ir.Value], int] | None:
    """((a, b), axis) when `value` is Concat(a, b) along an axis where both sizes are static ints."""
    concat = value.producer()
    if concat is None or concat.op_type != "Concat" or concat.domain not in ONNX_DOMAINS or len(concat.inputs) != 2:
        return None
    a, b = concat.inputs
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape) or not a.shape:
        return None
    axis = concat.attributes.get_int("axis", 0) % len(a.shape)
    if not isinstance(a.shape[axis], int) or not isinstance(b.shape[axis], int):
        return None
    return (a, b), axis


class _StackThenFlatten(pattern.RewriteRuleClassBase):
    """Reshape(Concat(Unsqueeze(t_i, 1)..., axis=1), [S, C*H]) of C taps [S, H] -> Concat(t_i..., axis=-1).
    The subclasses fix C (a pattern has a fixed number of inputs)."""

    def check(self, context: Any, axes: ir.Value, shape: ir.Value, **taps: ir.Value) -> pattern.MatchResult:
        result = pattern.MatchResult()
        values = [taps[name] for name in sorted(taps)]
        first = values[0].shape
        if first is None or len(first) != 2 or not isinstance(first[1], int):
            return result.fail("taps are not [S, H] with a static H")
        if any(v.shape is None or list(v.shape) != list(first) or v.dtype != values[0].dtype for v in values):
            return result.fail("taps differ in shape or type")
        if not is_singleton_value(axes, lambda a: a in (1, -2)):
            return result.fail("not unsqueezed at axis 1")
        wanted = get_numpy_value(shape)
        if wanted is None or wanted.size != 2 or int(wanted[1]) != len(values) * first[1] \
                or int(wanted[0]) not in (-1, 0, *([first[0]] if isinstance(first[0], int) else [])):
            return result.fail("not flattened to [S, C*H]")
        return result

    def rewrite(self, op: Any, axes: ir.Value, shape: ir.Value, **taps: ir.Value) -> Any:
        return op.Concat(*(taps[name] for name in sorted(taps)), axis=-1)


class _StackThenFlatten2(_StackThenFlatten):
    def pattern(self, op: Any, t0: Any, t1: Any, axes: Any, shape: Any) -> Any:
        return op.Reshape(op.Concat(op.Unsqueeze(t0, axes), op.Unsqueeze(t1, axes), axis=1), shape,
                          _allow_other_attributes=True)


class _StackThenFlatten3(_StackThenFlatten):
    def pattern(self, op: Any, t0: Any, t1: Any, t2: Any, axes: Any, shape: Any) -> Any:
        return op.Reshape(op.Concat(op.Unsqueeze(t0, axes), op.Unsqueeze(t1, axes), op.Unsqueeze(t2, axes),
                                    axis=1), shape, _allow_other_attributes=True)


class _StackThenFlatten4(_StackThenFlatten):
    def pattern(self, op: Any, t0: Any, t1: Any, t2: Any, t3: Any, axes: Any, shape: Any) -> Any:
        return op.Reshape(op.Concat(op.Unsqueeze(t0, axes), op.Unsqueeze(t1, axes), op.Unsqueeze(t2, axes),
                                    op.Unsqueeze(t3, axes), axis=1), shape, _allow_other_attributes=True)


class _StackThenFlatten5(_StackThenFlatten):
    def pattern(self, op: Any, t0: Any, t1: Any, t2: Any, t3: Any, t4: Any, axes: Any, shape: Any) -> Any:
        return op.Reshape(op.Concat(op.Unsqueeze(t0, axes), op.Unsqueeze(t1, axes), op.Unsqueeze(t2, axes),
                                    op.Unsqueeze(t3, axes), op.Unsqueeze(t4, axes), axis=1),
                          shape, _allow_other_attributes=True)


class _ReshapeThenUnsqueeze(pattern.RewriteRuleClassBase):
    """Unsqueeze(Reshape(x, shape), axes) -> Reshape(x, shape with 1s inserted at axes), shape a constant."""

    def pattern(self, op: Any, x: Any, shape: Any, axes: Any) -> Any:
        return op.Unsqueeze(op.Reshape(x, shape, _allow_other_attributes=True), axes)

    def check(self, context: Any, x: ir.Value, shape: ir.Value, axes: ir.Value, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if _unsqueezed_shape(shape, axes) is None:
            return result.fail("shape or axes not constant, or a 0 in shape")
        return result

    def rewrite(self, op: Any, x: ir.Value, shape: ir.Value, axes: ir.Value, **_: Any) -> Any:
        return op.Reshape(x, op.Constant(value_ints=_unsqueezed_shape(shape, axes)))


class _SqueezeThenReshape(pattern.RewriteRuleClassBase):
    """Reshape(Squeeze(y, axes), shape) -> Reshape(y, shape) when shape is a constant without 0s (which would
    copy a dimension of the squeezed tensor): a reshape to such a shape depends on the element count alone."""

    def pattern(self, op: Any, y: Any, axes: Any, shape: Any) -> Any:
        return op.Reshape(op.Squeeze(y, axes), shape, _allow_other_attributes=True)

    def check(self, context: Any, y: ir.Value, axes: ir.Value, shape: ir.Value, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        value = get_numpy_value(shape)
        if value is None or (value == 0).any():
            return result.fail("shape not constant, or a 0 in it")
        return result

    def rewrite(self, op: Any, y: ir.Value, shape: ir.Value, **_: Any) -> Any:
        return op.Reshape(y, shape)


def _unsqueezed_shape(shape: ir.Value, axes: ir.Value) -> list[int] | None:
    values, where = get_numpy_value(shape), get_numpy_value(axes)
    if values is None or where is None or (values == 0).any():
        return None
    out = [int(v) for v in values.reshape(-1)]
    rank = len(out) + where.size
    for axis in sorted(int(a) % rank for a in where.reshape(-1)):
        out.insert(axis, 1)
    return out


class _SkipRmsNorm(pattern.RewriteRuleClassBase):
    """s = a + b; RMSNormalization(s, w) -> com.microsoft SkipSimplifiedLayerNormalization(a, b, w), whose
    fourth output is s (the residual stream goes on from it)."""

    def pattern(self, op: Any, a: Any, b: Any, scale: Any) -> Any:
        total = op.Add(a, b)
        return op.RMSNormalization(total, scale, _allow_other_attributes=True, _outputs=["normed"]), total

    def check(self, context: Any, a: ir.Value, b: ir.Value, scale: ir.Value, normed: ir.Value,
              **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        norm = normed.producer()
        if a.shape is None or b.shape is None or a.shape != b.shape or len(a.shape) not in (2, 3):
            return result.fail("a and b are not tensors of one [.., hidden] shape")
        hidden = a.shape[-1]
        if not isinstance(hidden, int) or scale.shape is None or list(scale.shape) != [hidden]:
            return result.fail("scale is not [hidden]")
        if norm.attributes.get_int("axis", -1) % len(a.shape) != len(a.shape) - 1 \
                or norm.attributes.get_int("stash_type", 1) != 1:
            return result.fail("not a float32 norm over the last axis")
        if a.dtype != ir.DataType.FLOAT or b.dtype != ir.DataType.FLOAT or scale.dtype != ir.DataType.FLOAT:
            return result.fail("not float32")
        return result

    def rewrite(self, op: Any, a: ir.Value, b: ir.Value, scale: ir.Value, normed: ir.Value, **_: Any) -> Any:
        epsilon = normed.producer().attributes.get_float("epsilon", 1e-5)
        out, _, _, total = op.SkipSimplifiedLayerNormalization(a, b, scale, epsilon=epsilon, _domain="com.microsoft",
                                                              _outputs=4)
        return out, total


RULES = pattern.RewriteRuleSet([_RotateHalfRope.rule(), _ConcatThenSplit.rule(), _ReshapeThenUnsqueeze.rule(),
                                _SqueezeThenReshape.rule(), _SkipRmsNorm.rule(),
                                *(flatten.rule() for flatten in (_StackThenFlatten2, _StackThenFlatten3,
                                                                 _StackThenFlatten4, _StackThenFlatten5))])


def fuse(model: ir.Model) -> dict[str, int]:
    """Apply the rules in place; how many RoPEs, stacked taps and residual norms were fused and Splits
    dropped (the Identity nodes the rules leave are removed by onnxscript's optimizer, which lower_graph
    runs next)."""
    from onnxscript.rewriter import rewrite

    before = _counts(model)
    rewrite(model, RULES)
    after = _counts(model)
    # only the stack rule removes Reshapes (the other rules that touch one put one back)
    return {"rope": after.get("RotaryEmbedding", 0) - before.get("RotaryEmbedding", 0),
            "stack": before.get("Reshape", 0) - after.get("Reshape", 0),
            "split": before.get("Split", 0) - after.get("Split", 0),
            "skip_norm": after.get("SkipSimplifiedLayerNormalization", 0)
            - before.get("SkipSimplifiedLayerNormalization", 0)}


def drop_unread_statistics(model: ir.Model) -> None:
    """SkipSimplifiedLayerNormalization's mean and inverse-deviation outputs (1, 2) when nothing reads them:
    named, ONNX Runtime allocates and writes both on every run (its fused norms ran ~2x the time of the same
    op with them omitted, as onnxruntime-genai's graphs have it). Run last: a pass that adds nodes names every
    unnamed value again."""
    outputs = {value.name for value in model.graph.outputs}
    for node in model.graph:
        if node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == "com.microsoft":
            for value in node.outputs[1:3]:
                if not value.uses() and value.name not in outputs:
                    value.name = ""


def _counts(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts

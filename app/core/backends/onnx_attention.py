"""A ViT graph's attention blocks, as torch exports them, replaced by ONNX Runtime's fused `Attention` operator.

The exporter writes each block's attention as some thirty small operators: the fused qkv projection, a reshape and
permutation into heads, slices, the scaled `q @ k^T`, softmax, `@ v`, and the permutation back. ONNX Runtime's
own graph optimiser does not recognise that form, so it runs them one by one, and on the CPU the transposes and the
many small matrix products cost a tenth of the bundled model's forward. The contrib operator `Attention`
(com.microsoft) computes the same from the block's input, the qkv weight and bias, in one kernel.

A block is replaced only where the graph holds exactly that form: the qkv projection (a MatMul by a constant
(D, 3D) weight, plus a constant bias) reshaped to (B, N, 3, heads, D / heads) and permuted to (3, B, heads, N,
D / heads), and between that and the reshape back to (B, N, D) nothing but slicing, reshaping, transposing, scaling
by constants, the two matrix products and one softmax. A mask, a bias on the scores, a norm on q and k or any
other operator leaves the block as it is. tests/app/core/backends/test_onnx_runtime.py checks the fused graph's
probabilities and embeddings against torch's, for every variant of the model.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

PLAIN = {"Slice", "Squeeze", "Unsqueeze", "Shape", "Concat", "Reshape", "Transpose", "Gather", "Constant"}
BETWEEN = PLAIN | {"Mul", "MatMul", "Softmax"}  # the operators an attention block may hold

Constant = Callable[[str], "np.ndarray | None"]  # a tensor's value where the graph holds it as a constant, else None


def fuse_attention(model: onnx.ModelProto) -> int:
    """Replace each plain attention block of `model` (in place) by one `Attention` node; the number replaced."""
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    constants |= {
        n.output[0]: n.attribute[0].t
        for n in graph.node
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value"
    }
    producer = {out: n for n in graph.node for out in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)

    def value(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(constants[name]) if name in constants else None

    replaced: dict[int, onnx.NodeProto] = {}  # id of the reshape back -> its Attention node
    removed: set[int] = set()
    for permute in graph.node:
        if permute.op_type != "Transpose" or list(helper.get_attribute_value(permute.attribute[0])) != [2, 0, 3, 1, 4]:
            continue
        fused = block(permute, producer, consumers, value)
        if fused is None:
            continue
        head_nodes, back, node = fused
        if removed & {id(n) for n in head_nodes}:
            continue
        removed |= {id(n) for n in head_nodes}
        replaced[id(back)] = node
    if not replaced:
        return 0
    kept = []
    for n in graph.node:
        if id(n) in replaced:
            kept.append(replaced[id(n)])
        elif id(n) not in removed:
            kept.append(n)
    del graph.node[:]
    graph.node.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(replaced)


def block(
    permute: onnx.NodeProto,
    producer: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
    constant: Constant,
) -> tuple[list[onnx.NodeProto], onnx.NodeProto, onnx.NodeProto] | None:
    """The nodes of the attention block that starts at `permute` (its qkv projection included), the reshape back
    to (B, N, D) that ends it, and the `Attention` node that replaces them; None where it is not the plain form."""
    view = producer.get(permute.input[0])
    bias_add = producer.get(view.input[0]) if view is not None and view.op_type == "Reshape" else None
    if bias_add is None or bias_add.op_type != "Add":
        return None
    projection = producer.get(bias_add.input[0])
    if projection is None or projection.op_type != "MatMul" or view is None:
        return None
    weight, bias, shape = constant(projection.input[1]), constant(bias_add.input[1]), constant(view.input[1])
    if weight is None or bias is None or shape is None or weight.ndim != 2 or shape.shape != (5,):
        return None
    dim = weight.shape[0]
    heads = int(shape[3])
    if weight.shape != (dim, 3 * dim) or bias.shape != (3 * dim,) or shape[2] != 3 or heads * int(shape[4]) != dim:
        return None
    # the block: everything downstream of the permutation up to the first reshape whose output feeds a MatMul by a
    # constant (the output projection)
    inside: list[onnx.NodeProto] = []
    frontier, seen = [permute.output[0]], set()
    back = None
    while frontier:
        name = frontier.pop()
        for n in consumers.get(name, []):
            if id(n) in seen:
                continue
            seen.add(id(n))
            if n.op_type not in BETWEEN:
                return None
            inside.append(n)
            if n.op_type == "Reshape" and is_reshape_back(n, consumers, constant, dim):
                if back is not None and back is not n:
                    return None
                back = n
                continue
            frontier.extend(n.output)
    if back is None:
        return None
    names = {out for n in inside for out in n.output} | {permute.output[0]}
    for n in inside:  # every input made inside the block, by the permutation, or a constant
        for name in n.input:
            if name and name not in names and constant(name) is None:
                return None
        for out in n.output:  # nothing but the block itself reads what the block makes, but for its output
            if n is not back and any(c not in inside for c in consumers.get(out, [])):
                return None
    kinds = [n.op_type for n in inside]
    if kinds.count("Softmax") != 1 or kinds.count("MatMul") != 2:
        return None
    softmax = next(n for n in inside if n.op_type == "Softmax")
    axis = next((helper.get_attribute_value(a) for a in softmax.attribute if a.name == "axis"), -1)
    if axis not in (-1, 3):
        return None
    scale = 1.0
    for n in inside:
        if n.op_type == "Mul":
            factors = [constant(name) for name in n.input]
            known = [f for f in factors if f is not None]
            if len(known) != 1 or known[0].size != 1:
                return None
            scale *= float(known[0].reshape(()))
    node = helper.make_node(
        "Attention",
        [projection.input[0], projection.input[1], bias_add.input[1]],
        [back.output[0]],
        name=f"{back.name}/Attention",
        domain="com.microsoft",
        num_heads=heads,
        scale=scale,
    )
    return [projection, bias_add, view, permute, *inside], back, node


def is_reshape_back(
    n: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]], constant: Constant, dim: int
) -> bool:
    """`n` reshapes the heads back to (B, N, `dim`) for the output projection: a MatMul by a constant reads it."""
    readers = consumers.get(n.output[0], [])
    shape = constant(n.input[1])
    return (
        shape is not None
        and shape.shape == (3,)
        and int(shape[2]) == dim
        and len(readers) == 1
        and readers[0].op_type == "MatMul"
        and readers[0].input[0] == n.output[0]
        and constant(readers[0].input[1]) is not None
    )

"""Compiled mode's one graph pass: mutations of graph inputs back in place.

Entry point: :func:`reinplace_input_mutations`.

AOTAutograd functionalizes a graph: an optimizer step's ``p.add_(u)`` becomes
``p2 = add(p, u)`` plus a ``copy_(p, p2)`` at the end, so a compiled AdamW step allocates
a new tensor per parameter and state tensor and copies each back: several times eager's
ops, memory and host time. This pass turns an out-of-place op back into its in-place
variant when the tensor it would overwrite holds a graph input that the graph mutates
anyway (its final ``copy_``) and nothing reads that value afterwards; the final
``copy_`` of a value already in the input's buffer is dropped. So the graph runs the ops
eager runs (``_foreach_mul_``, ``_foreach_addcdiv_``...). A custom op that mutates its
arguments (an NKI kernel's ``nki_op``) writes the input's buffer in place likewise, instead
of a clone (``_mutate_bases_in_place``).

Sound under one assumption, checked on every call (``inputs_distinct``): no other input
shares storage with a mutated input (AOTAutograd gives aliased mutated inputs a synthetic
base, so this holds for its graphs; the runner falls back to the graph as traced if not).
"""
from __future__ import annotations

import operator

import torch

aten = torch.ops.aten


def _inplace_variant(op):
    """``aten.X.overload`` -> ``aten.X_.overload`` with the same arguments, or None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten" or op.is_view:
        return None  # a view's in-place variant changes metadata (``t_``, ``detach_``): never
    packet = getattr(aten, op._schema.name.split("::")[1] + "_", None)
    inplace = getattr(packet, op._overloadname, None) if packet is not None else None
    if inplace is None or torch.Tag.inplace_view in inplace.tags:
        return None
    ours, theirs = op._schema.arguments, inplace._schema.arguments
    if [a.name for a in ours] != [a.name for a in theirs] or theirs[0].alias_info is None or not theirs[0].alias_info.is_write:
        return None
    return inplace


def _same_meta(a, b) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.stride() == vb.stride() and va.device == vb.device)


def _flat(args):
    for arg in args:
        if isinstance(arg, (list, tuple)):
            yield from _flat(arg)
        else:
            yield arg


def reinplace_input_mutations(gm: torch.fx.GraphModule) -> list:
    """Rewrite ``gm`` in place (see the module docstring). Returns the placeholders whose
    buffers the graph now writes in place (empty: nothing changed)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    final_copy = {}  # mutated placeholder -> its final copy_ node
    for node in nodes:
        if node.op == "call_function" and node.target is aten.copy_.default and node.args[0].op == "placeholder":
            final_copy[node.args[0]] = node
    if not final_copy:
        return []

    def last_read(value) -> int:
        """Where ``value`` is read last. A placeholder's final copy_ writes it without
        reading its old value, unless the copy's source is that value itself (what an
        in-place rewrite makes of it: the final value already sits in the buffer, and
        must stay there to the end)."""
        copy = final_copy.get(value)
        return max((position[user] for user in value.users if user is not copy or copy.args[1] is value), default=-1)

    buffer_of = {placeholder: placeholder for placeholder in final_copy}  # value -> input buffer holding it
    written = {}  # placeholders written in place, in order (a dict: an ordered set)
    for node in nodes:
        if node.op != "call_function":
            continue
        if node.target is _AUTO_FUNCTIONALIZED:
            _mutate_bases_in_place(node, buffer_of, last_read, position, written)
            continue
        inplace = _inplace_variant(node.target)
        if inplace is None or not node.args:
            continue
        is_list = isinstance(node.args[0], (list, tuple))
        targets = list(node.args[0]) if is_list else [node.args[0]]
        others = list(_flat(node.args[1:])) + list(_flat(node.kwargs.values()))
        buffers = [buffer_of.get(t) for t in targets]
        if any(b is None for b in buffers) or len(set(buffers)) != len(buffers):
            continue
        if any(last_read(t) != position[node] or t in others for t in targets):
            continue  # the value it would overwrite is read later, or by this op again
        if is_list:
            items = [u for u in node.users if u.target is operator.getitem]
            if len(items) != len(node.users) or any(not _same_meta(item, targets[item.args[1]]) for item in items):
                continue
            node.target = inplace  # returns nothing: each result is its target, in its buffer
            for item in items:
                target = targets[item.args[1]]
                item.replace_all_uses_with(target)
                graph.erase_node(item)
                buffer_of[target] = buffers[item.args[1]]
        else:
            if not _same_meta(node, targets[0]):
                continue
            node.target = inplace  # returns its target: the result lives in the same buffer
            buffer_of[node] = buffers[0]
        written.update(dict.fromkeys(buffers))
    for placeholder, copy in final_copy.items():
        source = copy.args[1]
        if buffer_of.get(source) is placeholder and not copy.users:
            graph.erase_node(copy)  # the value is already in the input's buffer
    if written:
        graph.lint()
        gm.recompile()
    return list(written)


_AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized_v2


def _mutate_bases_in_place(node, buffer_of, last_read, position, written) -> None:
    """A custom op that mutates its arguments (``torch.library.custom_op(mutates_args=...)``,
    ``torch_neuronx.nki_op``), functionalized as ``auto_functionalized_v2``: it clones each
    base it writes, runs the op on the clones, and the graph copies them back. A base that
    holds a graph input the graph mutates anyway, and that nothing reads afterwards, is not
    cloned (``_only_clone_these_bases``, as Inductor's reinplacing does): the op writes the
    input's buffer, and the final ``copy_`` of the value already there is dropped."""
    bases = list(node.kwargs.get("_all_bases", ()))
    if not bases or node.kwargs.get("_only_clone_these_bases") is not None:
        return
    others = [value for key, value in node.kwargs.items() if key != "_all_bases"]
    others = list(_flat(others)) + list(_flat(node.args[1:]))
    returns = node.args[0]._schema.returns if isinstance(node.args[0], torch._ops.OpOverload) else None
    if returns is None:
        return
    outputs = len(returns) if len(returns) > 1 else 1  # the op's results come first, then the bases
    in_place = []
    for index, base in enumerate(bases):
        buffer = buffer_of.get(base)
        if buffer is None or bases.count(base) > 1 or base in others or last_read(base) != position[node]:
            continue
        in_place.append((index, buffer))
    if not in_place:
        return
    done = {index for index, _ in in_place}
    node.kwargs = dict(node.kwargs, _only_clone_these_bases=tuple(i for i in range(len(bases)) if i not in done))
    for user in node.users:
        if user.target is operator.getitem and user.args[1] - outputs in done:
            buffer_of[user] = dict(in_place)[user.args[1] - outputs]
    written.update(dict.fromkeys(buffer for _, buffer in in_place))


def inputs_distinct(args, mutated_positions) -> bool:
    """No input shares storage with an input the graph writes in place."""
    mutated = set()
    for index in mutated_positions:
        value = args[index]
        if not isinstance(value, torch.Tensor):
            return False
        mutated.add(value.untyped_storage().data_ptr())
    if len(mutated) != len(mutated_positions):
        return False
    positions = set(mutated_positions)  # (a compiled optimizer step writes ~100 inputs)
    for index, value in enumerate(args):
        if index not in positions and isinstance(value, torch.Tensor):
            if value.untyped_storage().data_ptr() in mutated:
                return False
    return True

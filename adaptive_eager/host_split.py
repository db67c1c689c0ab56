"""A compiled graph's host part, split off so that its device part can replay.

Entry point: :func:`split_host_part` (a graph module -> :class:`HostSplit`, or None).

Some graphs compute on host tensors: a compiled AdamW step keeps its ``step`` counters on
the CPU (PyTorch's default, ``capturable=False``), so its graph increments them and
computes the bias corrections from them with CPU ops, whose 0-dim results the device ops
take as arguments. The device never sees those CPU ops, so a replay of the device ops
alone (``replay.py``) would reuse the first call's corrections. Split, the graph runs as
two: the *host part* (every op on host values, in program order: the increments happen
as written) returns the host values the device part reads, and the *device part* takes
them as inputs beside the graph's own. Host-tensor inputs are what a template can bind:
a replay snapshots them again, as the per-op path does at every call.

The split is legal, and made, only when running the host part first changes nothing:
host ops read only host values, none of them draws random numbers, no device op reads a
host tensor that a later host op overwrites, no device op writes a host value, and the
graph returns no host value.
"""
from __future__ import annotations

import operator

import torch
import torch.fx


class HostSplit:
    """``host(*inputs)`` -> the host values the device part reads; ``device(*inputs,
    *host values)`` -> the graph's outputs."""

    def __init__(self, host: torch.fx.GraphModule, device: torch.fx.GraphModule, hoisted: int) -> None:
        self.host = host
        self.device = device
        self.hoisted = hoisted


def _is_host(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cpu"
    if isinstance(value, (list, tuple)):
        return all(_is_host(item) for item in value)
    return value is None or isinstance(value, (int, float, bool))


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(_has_tensor(item) for item in value)


def _mutated_inputs(node) -> list:
    """The input nodes an op writes in place (its schema's mutable arguments)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written.extend(v for v in values if isinstance(v, torch.fx.Node))
    return written


def _host_nodes(graph) -> set | None:
    """The nodes computed on the host, or None when a split would not be legal."""
    host: set = set()
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                host.add(node)
            continue
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if inputs and all(n in host for n in inputs) and _is_host(value) and (
                _has_tensor(value) or node.target is operator.getitem or _mutated_inputs(node)):
            if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
                return None  # a random host op: leave it where it is
            host.add(node)
    return host


def split_host_part(gm: torch.fx.GraphModule) -> HostSplit | None:
    """The host part and the device part of ``gm``, or None (no host op, or not legal)."""
    graph = gm.graph
    host = _host_nodes(graph)
    if not host or all(node.op == "placeholder" for node in host):
        return None
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "output":
            if any(n in host for n in node.all_input_nodes):
                return None  # the graph returns a host value
        elif node.op == "call_function" and node not in host:
            if any(n in host for n in _mutated_inputs(node)):
                return None  # a device op writes a host value
        elif node in host and node.op == "call_function":
            for written in _mutated_inputs(node):
                if any(user not in host and order[user] < order[node] for user in written.users):
                    return None  # a device op reads the value before this host op overwrites it
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    read = [n for n in graph.nodes if n in host and n.op == "call_function"
            and any(user not in host for user in n.users)]
    host_graph = torch.fx.Graph()
    env: dict = {}
    for node in placeholders:
        env[node] = host_graph.placeholder(node.name)
    for node in graph.nodes:
        if node in host and node.op == "call_function":
            env[node] = host_graph.node_copy(node, lambda n: env[n])
    host_graph.output(tuple(env[n] for n in read))
    device_graph = torch.fx.Graph()
    env = {}
    for node in placeholders:
        env[node] = device_graph.node_copy(node, lambda n: env[n])
    for node in read:
        env[node] = device_graph.placeholder(f"host_{node.name}")
        env[node].meta = dict(node.meta)
    for node in graph.nodes:
        if node.op != "placeholder" and node not in host:
            env[node] = device_graph.node_copy(node, lambda n: env[n])
    return HostSplit(torch.fx.GraphModule(gm, host_graph), torch.fx.GraphModule(gm, device_graph), len(read))

"""Nodes cut out of autograd, so a scheduler can run them in any legal order.

Owns `NodeRun`: one forward of one node (`epoverlap.model.nodes.NodeSpec`) for one microbatch:
detached inputs, forward under autograd, backward run on the node's own outputs only, grads
returned for its inputs, state dropped after backward. No autograd edge ever crosses a node
boundary. A pipeline send/recv node's backward is a transfer, not autograd: its
`NodeSpec.backward` turns the output grads into the input grads.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from epoverlap.model.nodes import NodeSpec


def _is_grad_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


class NodeRun:
    """One forward + backward of one node for one microbatch.

    `fn` is what runs the forward: the spec's callable, or what a run factory made of it (for
    example a CUDA-graph replay of some of its segments); it takes and returns the same names.
    """

    def __init__(self, spec: NodeSpec, fn: Optional[Callable[..., dict]] = None):
        self.spec = spec
        self.fn = spec.fn if fn is None else fn
        self._inputs: Optional[dict] = None
        self._outputs: Optional[dict] = None

    def forward(self, values: dict) -> dict:
        """Run the node on `values` (value name -> value); return value name -> output."""
        local_inputs = {local: as_node_leaf(values[name])
                        for local, name in self.spec.inputs.items()}
        with torch.enable_grad():
            local_outputs = self.fn(**local_inputs)
        if set(local_outputs) != set(self.spec.outputs):
            raise RuntimeError(f"node {self.spec.label()} returned {sorted(local_outputs)}, "
                               f"declared {sorted(self.spec.outputs)}")
        self._inputs, self._outputs = local_inputs, local_outputs
        return {self.spec.outputs[local]: as_node_leaf(value)
                for local, value in local_outputs.items()}

    def backward(self, grads: dict) -> dict:
        """Backprop the node given grads of its outputs (value name -> grad, missing = none).

        Returns value name -> grad for each differentiable input; frees the node's state.
        """
        if self._outputs is None:
            raise RuntimeError(f"backward of node {self.spec.label()} before its forward")
        if self.spec.backward is not None:
            return self._transfer_backward(grads)
        tensors, seeds = [], []
        for local, value in self._outputs.items():
            grad = grads.get(self.spec.outputs[local])
            if _is_grad_tensor(value) and grad is not None:
                tensors.append(value)
                seeds.append(grad)
        if tensors:
            torch.autograd.backward(tensors, seeds)
        input_grads = {self.spec.inputs[local]: value.grad
                       for local, value in self._inputs.items()
                       if _is_grad_tensor(value)}
        self._inputs = self._outputs = None
        return input_grads

    def _transfer_backward(self, grads: dict) -> dict:
        spec = self.spec
        local_grads = {local: grads[name] for local, name in spec.outputs.items()
                       if grads.get(name) is not None}
        input_grads = spec.backward(**local_grads)
        self._inputs = self._outputs = None
        return {spec.inputs[local]: grad for local, grad in input_grads.items()}


def as_node_leaf(value: Any) -> Any:
    """A value crossing a node boundary: a tensor that requires grad becomes a fresh leaf
    (detached, requiring grad), so no autograd edge crosses the boundary; anything else as is.
    Applied to a node's inputs as it runs and to its outputs as they leave."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach().requires_grad_(True)
    return value

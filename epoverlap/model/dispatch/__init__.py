"""The MoE token dispatch: a dispatcher is how rows are sized times how they are routed.

Modules by concern: `base` (the interface, `TokenDispatcher`, and `DispatchMeta`), `sizing`
(host splits, padded capacity, budget: one class each), `routing` (per expert, per rank, per
host: the strategy a dispatcher holds), `by_host` (the two stages of the hierarchical dispatch,
sized with their routing), `rows` (the row moves and block orders they share, and the layer in
waves), `factory` (`make_dispatcher`, which puts one together from the configuration's
`DispatchMode`). The budget's buffer size and overflow record is `model.budget.DispatchBudget`.
"""

from epoverlap.model.dispatch.base import DispatchMeta, TokenDispatcher
from epoverlap.model.dispatch.factory import make_dispatcher

__all__ = ["DispatchMeta", "TokenDispatcher", "make_dispatcher"]

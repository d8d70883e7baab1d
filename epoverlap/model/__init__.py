"""The model: embedding, decoder layers (attention, router, dispatcher, experts), loss, exposed
as node callables (`NodeSpec`) that know nothing of schedules.

Owns `transformer` (the model, or one pipeline stage of it, and its layers' nodes), `moe`
(router, experts), `dispatch` (the dispatch modes as strategy classes behind one interface),
`budget` (the budget dispatch's buffer size), `linear` (GEMMs whose weight grads can be deferred),
`dropout` (dropout masks from each microbatch's seed, whatever the schedule),
`nodes` (the node protocol a scheduler sees) and `stages` (which layers each pipeline stage and
model chunk holds; pure arithmetic). May import: config, errors, parallel.comm, epoverlap.kernels.
It takes its config slices, never the whole `RunConfig`: its own sections (`ModelConfig`,
`MoEConfig`) and `ModelOptions`, what it reads of the others (made by
`RunConfig.model_options`; tests/model/test_config_slices.py holds it to that).
"""

"""The model: embedding, decoder layers (attention, router, dispatcher, experts), loss, exposed
as node callables (`NodeSpec`) that know nothing of schedules.

Owns `transformer` (the model and its layers' nodes), `moe` (router, dropless dispatcher,
experts), `linear` (GEMMs whose weight grads can be deferred) and `nodes` (the node protocol a
scheduler sees). May import: config, errors, parallel.comm, epoverlap_kernels.
"""

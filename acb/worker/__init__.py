"""The device side of a step: the model runner (``runner``), the KV tensors (``kv_store``,
``offload``), sampling, CUDA graphs and compile (``cuda_graphs``, ``compiling``), the fast
paths that pick acb's forward (``fast_paths``), the draft model of speculative decoding
(``draft``) and the memory sizing (``sizing``). It gets a plan, returns tokens: it never
imports the engine."""

"""Paged attention: the step's attention metadata and its builder (``metadata``,
``block_tables``), the forward context that carries it to a forward (``context``), the backend
selector and kernel registry (``selector``), the backends (``native``, ``torch_backend``,
``triton_backend``) and the attention function that dispatches to them (``paged``: the one
transformers calls, and the one acb's fused forwards call), the routing of a model's attention
to it (``routing``), and int8 KV pages (``kv_quant``). Above ``core`` and ``kernels``; below the
model and the runner."""

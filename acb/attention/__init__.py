"""Paged attention: the step's attention metadata and its builder (``metadata``,
``block_tables``), the backend selector and the paged attention function transformers calls
(``paged``), the routing of a model's attention to it (``routing``), and int8 KV pages
(``kv_quant``). Above ``core`` and ``kernels``; below the model and the runner."""

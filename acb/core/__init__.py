"""The request-side core, plain Python (no torch): the public values (``config``,
``sampling_params``, ``outputs``, ``errors``, ``handle``) and what carries the outputs to their
consumers (``mailbox``), the step contract and every payload it carries (``step``), the
scheduler and its parts (``sequence``, ``run_queues``, ``admission``, ``intake``,
``preemption``, ``page_tables``), the KV page allocator with its prefix hashes and events
(``kv_cache``, ``kv_events``), and the text side (``detokenizer``, ``tools`` and
``tool_parsers``, ``reasoning``). Everything above builds on it; it imports nothing above itself."""

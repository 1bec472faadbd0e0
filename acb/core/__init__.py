"""The request-side core, plain Python (no torch): the public values (``config``, ``outputs``,
``errors``, ``handle``), the step contract and every payload it carries (``step``), the
scheduler and its parts (``sequence``, ``run_queues``, ``admission``, ``intake``,
``preemption``, ``page_tables``), the KV page allocator with its prefix hashes and events
(``kv_cache``, ``kv_events``), and the text-side parsers (``detokenizer``, ``tools``,
``reasoning``). Everything above builds on it; it imports nothing above itself."""

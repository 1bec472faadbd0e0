"""The engine: ``Engine`` (the public API and lifecycle), its step loop (``step_loop``), what it
is assembled from (``assembly``), the request table, inputs, the live requests' state and the
output processor that fills their mailboxes, structured outputs, adapters, ``generate_batch``
(``sync``) and ``generate_with_tools`` / ``stream_with_tools`` (``tool_calls``)."""

"""The engine: ``Engine`` (the public API and lifecycle), its step loop (``step_loop``), what it
is assembled from (``assembly``), the request table, inputs, the live requests' state and the
output processor that fills their mailboxes, structured outputs, adapters and ``generate_batch``
(``sync``)."""

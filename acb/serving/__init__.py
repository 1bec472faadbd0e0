"""The applications on top: the ``acb`` command line (``cli``) and the ``acb serve`` HTTP server
(``server``), built on :mod:`acb.integrations`."""

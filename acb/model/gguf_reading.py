"""A GGUF file's header parsed once per load, and parsed quickly.

A first load of a GGUF file asks for its header four times: transformers' ``AutoConfig`` and
``AutoTokenizer`` each parse it (``load_gguf_checkpoint``), and acb's readers (``gguf_int8``'s
two passes, ``gguf_native``) each make a ``gguf.GGUFReader``. The ``gguf`` package parses the
header one value at a time through slices of a ``numpy.memmap``, and a memmap's slices are slow
(each goes through ``memmap.__getitem__`` and ``__array_finalize__``): Gemma 3's 262,144-word
vocabulary took 15.6 s a parse on a 2-core AVX2 EPYC, four parses ~62 s of a 126 s int8
conversion. transformers also rebuilds the tensor name table (``gguf.get_tensor_name_map``) for
every module it walks (~800 times for SmolLM2).

:func:`parsed_once` fixes both for the load it wraps: while it is active, ``gguf.GGUFReader(path)``
(read-only) returns one reader per file, parsed over a plain ``numpy.ndarray`` view of the same
memory map (the same fields and tensors, 6.0 s for Gemma 3's header), and
``gguf.get_tensor_name_map`` returns one table per architecture and layer count. Both are the
``gguf`` module's own names, replaced for the duration only (transformers imports them when it
is called), and put back when the last such load ends; the readers are then dropped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

_lock = threading.Lock()
_active = 0
_readers: dict[str, object] = {}
_originals: tuple | None = None


@functools.cache
def _plain_reader_class():
    import numpy as np
    from gguf.gguf_reader import GGUFReader

    class PlainReader(GGUFReader):
        """``GGUFReader`` parsing over a plain ndarray view of its memory map (no copy: the view
        keeps the map alive)."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value) -> None:
            self._plain = np.asarray(value)

    return PlainReader


def reader(path: str | os.PathLike):
    """A read-only ``gguf.GGUFReader`` over ``path`` (the one :func:`parsed_once` shares while
    it is active)."""
    key = os.path.realpath(path)
    with _lock:
        shared = _readers.get(key) if _active else None
    if shared is not None:
        return shared
    made = _plain_reader_class()(str(path))
    with _lock:
        if _active:
            made = _readers.setdefault(key, made)
    return made


@contextlib.contextmanager
def parsed_once():
    """While active (in any thread), each GGUF file's header is parsed once, fast (see the module).
    ImportError naming the install where the ``gguf`` package is missing."""
    global _active, _originals
    try:
        import gguf
    except ImportError:
        raise ImportError("reading a GGUF file needs the gguf package: pip install 'acb[gguf]' "
                          "(or pip install 'gguf>=0.10')") from None

    with _lock:
        if _active == 0:
            _originals = (gguf.GGUFReader, gguf.get_tensor_name_map)
            original_reader, original_map = _originals

            def shared_reader(path, mode="r"):
                return reader(path) if mode == "r" else original_reader(path, mode)

            gguf.GGUFReader = shared_reader
            gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_map)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = _originals
                _originals = None
                _readers.clear()

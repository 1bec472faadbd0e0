"""The engine's loaded LoRA adapters by name: their slots, their users, their unloading.

Runs on the event loop's thread only, torch-free. A request naming an adapter takes a
reference when it registers (``acquire``) and gives it back when it leaves the request
table (``release``); ``Engine.unload_adapter`` refuses new requests for the adapter at
once and waits until its last user has left before the slot is freed, so a running row
never loses its weights (see docs/adapters.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..core.errors import InvalidRequestError
from ..core.kv_cache import adapter_root


@dataclass(slots=True, eq=False)
class Adapter:
    """One adapter: its slot in the stacked weights, the digest of its weights (``lora_id``:
    its prefix-cache key, as ``acb.prefix_page_hashes`` takes it) and its live users."""

    name: str
    slot: int
    rank: int
    lora_id: int
    users: int = 0
    unloading: bool = False
    drained: Any = None  # an anyio Event while an unload waits for the users to leave
    root: int | None = field(init=False)  # acb.core.kv_cache.adapter_root(lora_id)

    def __post_init__(self) -> None:
        self.root = adapter_root(self.lora_id)


class AdapterRegistry:
    """Name -> :class:`Adapter` for the loaded adapters, and the free slots; ``load`` and
    ``unload`` put an adapter's weights into the engine's ``bank`` (``acb.model.lora.LoraBank``;
    None with the reason in ``refusal`` where the engine cannot run adapters)."""

    def __init__(self, max_adapters: int, bank: Any = None, refusal: str | None = None) -> None:
        self.bank = bank
        self.refusal = refusal
        self.loaded: dict[str, Adapter] = {}
        self._by_slot: dict[int, Adapter] = {}
        self._reserved: dict[str, int] = {}  # names being loaded -> their slot
        self._free = list(range(max_adapters - 1, -1, -1))

    def names(self) -> list[str]:
        """The adapters requests may name now, in load order."""
        return [a.name for a in self.loaded.values() if not a.unloading]

    def install_hooks(self) -> None:
        """Put the LoRA hooks on the model (no bank: nothing), before the runner's model watch
        takes the model as its reference."""
        if self.bank is not None:
            self.bank.install_hooks()

    def remove_hooks(self) -> None:
        if self.bank is not None:
            self.bank.remove_hooks()

    def reserve(self, name: str) -> int:
        """A free slot for ``name``, held while it loads; InvalidRequestError naming
        ``adapter`` if the name is taken or every slot is."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"adapter_name must be a non-empty str, got {name!r}", param="adapter")
        if name in self.loaded or name in self._reserved:
            raise InvalidRequestError(f"adapter {name!r} is already loaded (or loading); unload it first",
                                      param="adapter")
        if not self._free:
            raise InvalidRequestError(f"cannot load adapter {name!r}: all {len(self._by_slot) + len(self._reserved)} "
                                      "slots are in use (EngineConfig.max_adapters); unload one first",
                                      param="adapter")
        slot = self._free.pop()
        self._reserved[name] = slot
        return slot

    def unreserve(self, name: str) -> None:
        """A load failed: its slot is free again."""
        self._free.append(self._reserved.pop(name))

    def add(self, name: str, rank: int, lora_id: int) -> Adapter:
        """The reserved ``name`` is loaded: requests may name it."""
        adapter = Adapter(name, self._reserved.pop(name), rank, lora_id)
        self.loaded[name] = self._by_slot[adapter.slot] = adapter
        return adapter

    def resolve(self, name: str) -> Adapter:
        """The adapter a request names, or InvalidRequestError naming ``adapter``."""
        adapter = self.loaded.get(name)
        if adapter is None or adapter.unloading:
            state = "is being unloaded" if adapter is not None else "is not loaded"
            raise InvalidRequestError(f"adapter {name!r} {state}; loaded adapters: {self.names() or 'none'}",
                                      param="adapter")
        return adapter

    def acquire(self, name: str) -> Adapter:
        """A request that names ``name`` registers: one more user."""
        adapter = self.resolve(name)
        adapter.users += 1
        return adapter

    def release(self, slot: int) -> None:
        """A request that ran the adapter in ``slot`` left the table."""
        adapter = self._by_slot[slot]
        adapter.users -= 1
        if adapter.users == 0 and adapter.drained is not None:
            adapter.drained.set()

    def begin_unload(self, name: str, event_factory) -> Adapter:
        """New requests for ``name`` are refused from now on; the adapter's ``drained``
        event is set when its last user leaves (at once if it has none)."""
        adapter = self.resolve(name)
        adapter.unloading = True
        adapter.drained = event_factory()
        if adapter.users == 0:
            adapter.drained.set()
        return adapter

    def remove(self, adapter: Adapter) -> None:
        """The adapter's weights are off the step: its slot is free."""
        del self.loaded[adapter.name]
        del self._by_slot[adapter.slot]
        self._free.append(adapter.slot)

    # ------------------------------------------------------------------ loading and unloading
    async def load(self, source: Any, name: str, model: Any, between_steps: Callable[[Callable], Awaitable]) -> None:
        """Read and check ``source`` and write it into a free slot on a worker thread, then
        switch the slot on between two steps (``between_steps`` runs a function on the
        step thread). Errors name what is wrong; the engine serves on."""
        if self.bank is None:
            raise ValueError(f"load_adapter: {self.refusal}")
        slot = self.reserve(name)
        try:
            adapter, views = await anyio.to_thread.run_sync(self._read, source, name, model, slot)
            with anyio.CancelScope(shield=True):  # the slot is switched on: finish registering it
                await between_steps(lambda: self.bank.activate(slot, views))
                self.add(name, adapter.rank, adapter.lora_id)
        except BaseException:
            if name in self._reserved:
                self.unreserve(name)
            raise

    def _read(self, source: Any, name: str, model: Any, slot: int) -> tuple[Any, dict]:
        from ..model.lora_source import read

        adapter = read(source, name, model, self.bank.max_rank)
        return adapter, self.bank.write(slot, adapter)

    async def unload(self, name: str, between_steps: Callable[[Callable], Awaitable]) -> None:
        """Refuse new requests for ``name`` now, wait for the requests that run it (queued
        or running) to end, then switch its slot off between two steps and free it.
        Cancelled while waiting, the adapter stays loaded."""
        adapter = self.begin_unload(name, anyio.Event)
        try:
            await adapter.drained.wait()
        except BaseException:
            adapter.unloading, adapter.drained = False, None
            raise
        with anyio.CancelScope(shield=True):
            await between_steps(lambda: self.bank.deactivate(adapter.slot))
            self.remove(adapter)

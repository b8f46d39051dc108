"""Host-side owner of the state slots of models with linear-attention layers.

Such a layer keeps a fixed-size state per sequence instead of K/V pages
(``models.layers.linear_attention.HybridCache``). A sequence takes a slot when it starts
running and gives it back when it finishes or is preempted; a model step reads and writes only
its sequences' slots (``StepBatch.state_slots``). A slot is never reset here: a sequence that
(re)starts at position 0 starts from a zero state in the step itself.
"""

from __future__ import annotations


class StateSlots:
    """``num_slots`` slots (at most one per running sequence), lowest free one first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def take(self) -> int:
        """A free slot; the scheduler runs at most ``num_slots`` sequences, so one is free."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are in use")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not in use")
        self._free.append(slot)
        self._free.sort(reverse=True)

"""Units and the row of the --dry-run memory plans (hpcrl.launch.memory_plan, memory_sync)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
MIB = 1024**2


@dataclass(frozen=True)
class Item:
    name: str
    dtype: str
    gib: float
    note: str = ""

    def row(self) -> str:
        """The item as one line of a memory plan."""
        return f"    {self.name:<14} {self.dtype:<5} {self.gib:8.2f} GiB" + (
            f"  {self.note}" if self.note else ""
        )


def count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"

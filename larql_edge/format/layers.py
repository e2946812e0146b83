"""Layer ranges as users write them (``A-B``, inclusive; ``A`` alone is one layer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class LayerRange:
    start: int
    end: int  # inclusive, as in "0-8"

    def __post_init__(self):
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"bad layer range {self.start}-{self.end}")

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer <= self.end

    def __iter__(self):
        return iter(range(self.start, self.end + 1))

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"

    @classmethod
    def parse(cls, text: str) -> "LayerRange":
        t = text.strip()
        try:
            if "-" in t:
                a, b = t.split("-", 1)
                return cls(int(a), int(b))
            return cls(int(t), int(t))
        except ValueError:
            raise ValueError(f"bad layer range {text!r}: expected A-B (inclusive), e.g. 0-8") from None


def split_even(num_layers: int, parts: int) -> list[LayerRange]:
    """``num_layers`` split into ``parts`` contiguous ranges, sizes differing by at most one."""
    if parts <= 0 or parts > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} shards")
    base, extra = divmod(num_layers, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append(LayerRange(start, start + n - 1))
        start += n
    return out


def gaps(covered: set[int], num_layers: int) -> list[LayerRange]:
    """The maximal runs of layers in ``[0, num_layers)`` that ``covered`` lacks."""
    out: list[LayerRange] = []
    run: int | None = None
    for layer in range(num_layers):
        if layer not in covered:
            run = layer if run is None else run
        elif run is not None:
            out.append(LayerRange(run, layer - 1))
            run = None
    if run is not None:
        out.append(LayerRange(run, num_layers - 1))
    return out

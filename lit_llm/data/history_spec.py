"""``History.default_spec``: TorchRL's spec of History data, or a small stand-in when TorchRL is not installed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["HistorySpec", "history_default_spec"]


@dataclass(frozen=True)
class HistorySpec:
    """The spec of a History: its class, shape and one example value per field (TorchRL's ``Composite`` of
    ``NonTensor`` specs, reduced to what lit_llm uses).

    Attributes:
        data_cls: the History class.
        shape: the History's shape (``-1``: a variable number of messages).
        example_data: field name -> example value (``"foo"`` for ``str`` fields without a default, as TorchRL).
    """

    data_cls: type
    shape: tuple[int, ...]
    example_data: dict[str, Any]

    def zero(self) -> Any:
        """A History of the spec's shape (``-1`` dimensions taken as 1) holding the example values."""
        from tensordict import lazy_stack

        shape = tuple(1 if d == -1 else d for d in self.shape)
        item = self.data_cls(**self.example_data)
        for size in reversed(shape):
            item = lazy_stack([item.clone() for _ in range(size)])
        return item

    def is_in(self, value: Any) -> bool:
        """Whether ``value`` is a History whose shape matches (``-1`` matches any size)."""
        if not isinstance(value, self.data_cls) or value.ndim != len(self.shape):
            return False
        return all(d == -1 or d == n for d, n in zip(self.shape, value.shape))


def _example(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return "foo" if field.type in (str, "str") else None


def history_default_spec(cls: type, shape: tuple[int, ...]) -> Any:
    """TorchRL's ``Composite`` when ``torchrl`` imports, else a :class:`HistorySpec` (same fields and shape)."""
    examples = {name: _example(f) for name, f in cls.__dataclass_fields__.items()}
    try:
        from torchrl.data import Composite, NonTensor
    except ImportError:
        return HistorySpec(cls, shape, examples)
    specs = {k: NonTensor(example_data=v, shape=shape) for k, v in examples.items()}
    return Composite(specs, shape=shape[:-1], data_cls=cls)

"""TensorData: the wire's tensor (float32 or int64), dense or sparse CSR, backed by NumPy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

if TYPE_CHECKING:
    import torch

TensorDtype = Literal["float32", "int64"]
_NP_DTYPES: dict[str, Any] = {"float32": np.float32, "int64": np.int64}


def _indices(values: Sequence[int] | np.ndarray) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise ValueError("sparse indices must be 64-bit integers") from None
    return array


class TensorData:
    """A dense or CSR tensor; `data` is the flattened value list, as on the wire.

    Torch is imported lazily so the SDK installs and imports without it.
    """

    __slots__ = ("_array", "_cols", "_crow", "dtype", "shape")

    def __init__(
        self,
        data: Sequence[float] | Sequence[int] | np.ndarray,
        dtype: TensorDtype,
        shape: Sequence[int] | None = None,
        sparse_crow_indices: Sequence[int] | np.ndarray | None = None,
        sparse_col_indices: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        if dtype not in _NP_DTYPES:
            raise ValueError(f"dtype must be 'float32' or 'int64', got {dtype!r}")
        try:
            array = np.asarray(data, dtype=_NP_DTYPES[dtype]).reshape(-1)
        except OverflowError:
            raise ValueError(f"values do not fit {dtype}") from None
        if (sparse_crow_indices is None) != (sparse_col_indices is None):
            raise ValueError("sparse_crow_indices and sparse_col_indices go together")
        self._array = array
        self.dtype: TensorDtype = dtype
        self.shape: list[int] | None = [int(s) for s in shape] if shape is not None else None
        self._crow = None if sparse_crow_indices is None else _indices(sparse_crow_indices)
        self._cols = None if sparse_col_indices is None else _indices(sparse_col_indices)
        if self.shape is not None and any(s < 0 for s in self.shape):
            raise ValueError(f"shape {self.shape} has a negative dimension")
        if self._crow is not None and self._cols is not None:
            if self.shape is None or len(self.shape) != 2:
                raise ValueError("a sparse CSR tensor needs a 2-D shape")
            crow, cols = self._crow, self._cols
            if crow.size != self.shape[0] + 1:
                raise ValueError("sparse_crow_indices must have shape[0] + 1 entries")
            if cols.size != array.size:
                raise ValueError("sparse_col_indices must have one entry per value")
            # Checked here so that to_numpy never indexes out of bounds.
            if crow[0] != 0 or crow[-1] != array.size or bool((np.diff(crow) < 0).any()):
                raise ValueError("sparse_crow_indices must rise from 0 to the number of values")
            if cols.size and (int(cols.min()) < 0 or int(cols.max()) >= self.shape[1]):
                raise ValueError(f"sparse_col_indices must lie in [0, {self.shape[1]})")
        # math.prod: NumPy's product of a hostile shape wraps around 64 bits.
        elif self.shape is not None and math.prod(self.shape) != array.size:
            raise ValueError(f"shape {self.shape} does not hold {array.size} values")

    @property
    def is_sparse(self) -> bool:
        return self._crow is not None

    @property
    def sparse_crow_indices(self) -> list[int] | None:
        return None if self._crow is None else cast("list[int]", self._crow.tolist())

    @property
    def sparse_col_indices(self) -> list[int] | None:
        return None if self._cols is None else cast("list[int]", self._cols.tolist())

    @property
    def data(self) -> list[Any]:
        out: list[Any] = self._array.tolist()
        return out

    @property
    def values(self) -> np.ndarray:
        """The flat value array (the listed values only, for a sparse tensor)."""
        return self._array

    @property
    def dense_shape(self) -> list[int]:
        """The shape of `to_numpy()`, known without building it."""
        return self.shape if self.shape is not None else [self._array.size]

    def to_numpy(self, pad_value: float = 0) -> np.ndarray:
        if self._crow is None or self._cols is None:
            return self._array.reshape(self.dense_shape)
        assert self.shape is not None
        dense = np.full(self.shape, pad_value, dtype=self._array.dtype)
        # Row of each listed value, from the row pointers (rows with no values repeat 0 times).
        rows = np.repeat(np.arange(self.shape[0]), np.diff(self._crow))
        dense[rows, self._cols] = self._array
        return dense

    def tolist(self) -> list[Any]:
        return cast("list[Any]", self.to_numpy().tolist())

    def to_torch(self, pad_value: float = 0) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.to_numpy(pad_value).copy())

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        array = np.asarray(array)
        if array.dtype.kind in "iub":
            dtype: TensorDtype = "int64"
        elif array.dtype.kind == "f":
            dtype = "float32"
        else:
            raise ValueError(f"cannot send a {array.dtype} array: only float32 and int64")
        return cls(array.reshape(-1), dtype, list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        import torch

        if tensor.dtype in (torch.bfloat16, torch.float16):
            tensor = tensor.float()
        return cls.from_numpy(tensor.detach().cpu().numpy())

    @classmethod
    def from_torch_sparse(cls, tensor: torch.Tensor, pad_value: float = 0) -> TensorData:
        """CSR form of a 2-D tensor, cells equal to `pad_value` left out; dense if not smaller."""
        return cls.from_numpy_sparse(
            tensor.detach().cpu().float().numpy()
            if tensor.is_floating_point()
            else tensor.detach().cpu().numpy(),
            pad_value,
        )

    @classmethod
    def from_numpy_sparse(cls, array: np.ndarray, pad_value: float = 0) -> TensorData:
        dense = cls.from_numpy(array)
        if array.ndim != 2:
            return dense
        mask = array != pad_value
        if 2 * int(mask.sum()) + array.shape[0] + 1 >= array.size:
            return dense
        rows, cols = np.nonzero(mask)
        crow = np.zeros(array.shape[0] + 1, dtype=np.int64)
        np.add.at(crow, rows + 1, 1)
        return cls(
            array[rows, cols],
            dense.dtype,
            list(array.shape),
            np.cumsum(crow),
            cols,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"data": self.data, "dtype": self.dtype, "shape": self.shape}
        if self.is_sparse:
            out["sparse_crow_indices"] = self.sparse_crow_indices
            out["sparse_col_indices"] = self.sparse_col_indices
        return out

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> TensorData:
        return cls(
            body["data"],
            body["dtype"],
            body.get("shape"),
            body.get("sparse_crow_indices"),
            body.get("sparse_col_indices"),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorData):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and list(self.to_numpy().shape) == list(other.to_numpy().shape)
            and bool(np.array_equal(self.to_numpy(), other.to_numpy()))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        kind = "sparse" if self.is_sparse else "dense"
        return f"TensorData({kind}, dtype={self.dtype}, shape={self.shape})"

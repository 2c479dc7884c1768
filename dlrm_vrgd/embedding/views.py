"""One row space as one tensor: the weights and optimizer state of every table of one embedding
dim, addressed by global row, wherever the lookup keeps them.

A TBE keeps all its tables' weights in one flat buffer per placement (``weights_dev`` on the
GPU, ``weights_host`` on the CPU, ``weights_uvm`` in managed memory), table ``t`` starting at
element ``weights_physical_offsets[t]``, and its Adagrad sums likewise (``momentum1_*``: one
per row for EXACT_ROWWISE_ADAGRAD, one per weight element, laid out as the weights, for
EXACT_ADAGRAD): that is how FBGEMM's ``split_embedding_weights`` reads them. A
:class:`RowSpaceView` addresses a :class:`~dlrm_vrgd.embedding.capture.RowSpace` through those
buffers: a gather, an add or a write of any set of global rows is one index op for the whole
space, on the buffers' own device, with no loop over tables and no host sync.

Where the space's tables sit back to back in their buffer (every TBE this project builds, and the
pure-PyTorch tables), the view is a plain ``size x D`` tensor. Otherwise (tables of another dim
between them) row ``g`` of table ``i`` starts at element ``base[i] + g·D``, with one ``base`` per
table kept on the device, and the ops go through element indices (``U x D`` of them): slower, but
still one op per space.

Tables held in float16 (``model.embedding_precision: fp16``) are read as float32 and written
back by :func:`stochastic_round`: rounded up or down with the probabilities that make the
expected weight the float32 one, as FBGEMM's fused kernels write them. A step smaller than half
an fp16 ulp of its weight (a relative 4.9e-4) then moves the weight on average instead of never;
GSNR's damped rows (steps down to ``γ`` of the plain one) depend on it. The rounding draws are a
hash of ``(salt, element)``, not of a generator's state: the optimizer salts them with its seed
and step, so a resumed run writes what the uninterrupted one did.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dlrm_vrgd.embedding.capture import RowSpace

_MASK53 = (1 << 53) - 1


def _mix(x: Tensor) -> Tensor:
    """SplitMix64's finalizer on int64 (wrapping arithmetic; logical shifts by masking)."""

    def shr(v: Tensor, k: int) -> Tensor:
        return (v >> k) & ((1 << (64 - k)) - 1)

    x = x + -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
    x = (x ^ shr(x, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ shr(x, 27)) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ shr(x, 31)


def uniform_hash(keys: Tensor, salt: int) -> Tensor:
    """A float64 in ``[0, 1)`` per int64 key, a fixed function of ``(salt, key)``."""
    # the salt's mix stays a host scalar (a 0-dim CPU operand of a device op: nothing read back)
    mixed = _mix(_mix(keys.to(torch.int64) ^ _mix(torch.tensor(salt, dtype=torch.int64))))
    return ((mixed >> 11) & _MASK53).to(torch.float64) * 2.0**-53


def stochastic_round(values: Tensor, dtype: torch.dtype, keys: Tensor, salt: int) -> Tensor:
    """``values`` (float32) in ``dtype`` (float16 or bfloat16), each rounded to the neighbour
    below or above with probability given by its distance to the other (so the expected result
    is the value), the draws :func:`uniform_hash` of ``keys`` (one int64 per value) and ``salt``.
    Float32 and exactly representable values pass unchanged; infinities and NaN as a cast does."""
    if dtype == torch.float32:
        return values
    near = values.to(dtype)
    above = near.float() > values
    # the infinities filled on the device (``new_tensor`` would copy from the host and wait)
    low = torch.where(above, torch.nextafter(near, near.new_full((), -math.inf)), near)
    high = torch.nextafter(low, low.new_full((), math.inf))
    span = high.float() - low.float()
    p = ((values - low.float()) / span).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    up = uniform_hash(keys, salt).to(p.device) < p.double()
    out = torch.where(up, high, low)
    return torch.where(torch.isfinite(values) & torch.isfinite(span), out, near)


class RowSpaceView:
    """Weights (``size x D``) and optimizer states of one row space: row-wise (``size``),
    element-wise (``size x D``, ``elementwise``: full Adagrad) or none (SGD).

    Args:
        space: the row space (its tables and their global row offsets).
        weights: the flat buffer holding the space's tables (1-D, any device and float dtype).
        weight_starts: element of ``weights`` where each table of the space starts.
        states: the flat buffer of the states (1-D), or None (SGD).
        state_starts: element of ``states`` where each table's states start.
        elementwise: one state per weight element (row ``g`` of a table at ``start + g·D``),
            not one per row.

    Reads return float32; writes round to the buffers' dtype.
    """

    def __init__(
        self,
        space: RowSpace,
        weights: Tensor,
        weight_starts: list[int],
        states: Tensor | None = None,
        state_starts: list[int] | None = None,
        elementwise: bool = False,
    ) -> None:
        if len(weight_starts) != len(space.tables):
            raise ValueError(f"{len(weight_starts)} starts for {len(space.tables)} tables")
        self.space = space
        self.dim = space.dim
        self.device = weights.device
        flat = weights.detach().reshape(-1)
        self._weights_flat = flat
        #: The draws of this step's stochastic rounding (float16 tables; set by the optimizer).
        self.salt = 0
        offsets = space.offsets
        w_base = [start - offsets[i] * self.dim for i, start in enumerate(weight_starts)]
        #: ``size x D`` view where the tables are back to back, else None
        self.weights: Tensor | None = None
        if len(set(w_base)) == 1:
            first = weight_starts[0]
            self.weights = flat[first : first + space.size * self.dim].view(space.size, self.dim)
        self._w_base = torch.tensor(w_base, dtype=torch.int64, device=self.device)
        self._cols = torch.arange(self.dim, device=self.device)
        self._bounds = torch.tensor(offsets[1:-1], dtype=torch.int64, device=self.device)
        #: Whether the states are element-wise (``size x D``) rather than row-wise (``size``).
        self.elementwise = elementwise
        #: ``size`` (or ``size x D``, element-wise) view where the tables are back to back
        self.states: Tensor | None = None
        self._states_flat: Tensor | None = None
        self._s_base: Tensor | None = None
        if states is not None:
            starts = state_starts if state_starts is not None else [0] * len(space.tables)
            s_flat = states.detach().reshape(-1)
            per_row = self.dim if elementwise else 1
            s_base = [start - offsets[i] * per_row for i, start in enumerate(starts)]
            self._states_flat = s_flat
            if len(set(s_base)) == 1:
                part = s_flat[starts[0] : starts[0] + space.size * per_row]
                self.states = part.view(space.size, self.dim) if elementwise else part
            self._s_base = torch.tensor(s_base, dtype=torch.int64, device=self.device)

    @staticmethod
    def contiguous(space: RowSpace, weights: Tensor, states: Tensor | None) -> RowSpaceView:
        """The view of ``weights`` (``size x D``) and ``states`` (``size``, or ``size x D``:
        element-wise) held as they are."""
        elementwise = states is not None and states.dim() == 2
        per_row = space.dim if elementwise else 1
        return RowSpaceView(
            space,
            weights,
            [o * space.dim for o in space.offsets[:-1]],
            states,
            [o * per_row for o in space.offsets[:-1]],
            elementwise,
        )

    @property
    def has_states(self) -> bool:
        return self._states_flat is not None

    def table_index(self, rows: Tensor) -> Tensor:
        """Position in ``space.tables`` of each global row (on the device, no host sync)."""
        return torch.bucketize(rows, self._bounds, right=True)

    def _elements(self, rows: Tensor) -> Tensor:
        """Flat element indices ``U x D`` of ``rows`` (tables not back to back)."""
        start = self._w_base[self.table_index(rows)] + rows * self.dim
        return start[:, None] + self._cols

    def gather(self, rows: Tensor) -> Tensor:
        """A float32 copy of the weights of global ``rows`` (``U x D``)."""
        if self.weights is not None:
            return self.weights.index_select(0, rows).float()
        return self._weights_flat[self._elements(rows)].float()

    @property
    def dtype(self) -> torch.dtype:
        """How the weights are stored (float32, or float16 tables)."""
        return self._weights_flat.dtype

    def rounded(self, values: Tensor, rows: Tensor) -> Tensor:
        """``values`` (float32, of global ``rows``) as a write stores them, in float32 again."""
        if self.dtype == torch.float32:
            return values
        return self._stored(rows, values).float()

    def _stored(self, rows: Tensor, values: Tensor) -> Tensor:
        """``values`` in the buffers' dtype: stochastically rounded (keyed by global row and
        column, :func:`stochastic_round`) below float32."""
        if self.dtype == torch.float32:
            return values.to(torch.float32)
        keys = rows[:, None] * self.dim + torch.arange(self.dim, device=rows.device)
        return stochastic_round(values.float(), self.dtype, keys, self.salt)

    def add_(self, rows: Tensor, values: Tensor) -> None:
        """Add ``values`` (``U x D``) to the weights of global ``rows`` (unique); below float32
        the sum is taken in float32 and written stochastically rounded."""
        if self.dtype != torch.float32:
            self.put_(rows, self.gather(rows) + values)
        elif self.weights is not None:
            self.weights.index_add_(0, rows, values.float())
        else:
            flat = values.float().reshape(-1)
            self._weights_flat.index_add_(0, self._elements(rows).reshape(-1), flat)

    def put_(self, rows: Tensor, values: Tensor) -> None:
        """Write ``values`` (``U x D``) as the weights of global ``rows`` (unique)."""
        values = self._stored(rows, values)
        if self.weights is not None:
            self.weights.index_copy_(0, rows, values)
        else:
            self._weights_flat.index_copy_(0, self._elements(rows).reshape(-1), values.reshape(-1))

    def _state_index(self, rows: Tensor) -> Tensor:
        """Flat indices of the states of ``rows``: ``U``, or ``U x D`` element-wise."""
        assert self._s_base is not None
        if self.elementwise:
            start = self._s_base[self.table_index(rows)] + rows * self.dim
            return start[:, None] + self._cols
        return self._s_base[self.table_index(rows)] + rows

    def gather_states(self, rows: Tensor) -> Tensor | None:
        """A float32 copy of the states of ``rows`` (``U``, or ``U x D`` element-wise); None
        for SGD."""
        if self._states_flat is None:
            return None
        if self.states is not None:
            return self.states.index_select(0, rows).float()
        return self._states_flat[self._state_index(rows)].float()

    def put_states_(self, rows: Tensor, values: Tensor) -> None:
        """Write ``values`` (``U``, or ``U x D`` element-wise) as the states of global ``rows``
        (unique)."""
        if self._states_flat is None:
            raise ValueError("this row space has no optimizer state (SGD)")
        values = values.to(self._states_flat.dtype)
        if self.states is not None:
            self.states.index_copy_(0, rows, values)
        else:
            index = self._state_index(rows)
            self._states_flat.index_copy_(0, index.reshape(-1), values.reshape(-1))

"""A calibration run: the training computation with its rounding perturbed at every operation, seeded.

    from probes.testing import perturbed_rounding
    with perturbed_rounding(seed=1):              # the base run again, e.g. eager_noise/
        train(model_copy, StatisticsSubscriber("eager_noise"))
    # probes compare eager_out compiled_out --noise eager_noise

Two backends (eager and inductor, eager and ORTModule, fused and unfused kernels) compute the same
operations with different rounding: each result may differ by an ulp or so, at every operation, in the
forward and the backward, every step, and training amplifies those differences. Two eager runs are
bit-identical, so a second eager run measures none of it. This run measures it: while the handle is
active, every floating-point result of the training computation on this thread is multiplied by
``1 + u * ulps * eps`` (``u`` uniform in [-1, 1] from a generator seeded with ``seed``, ``eps`` the
dtype's machine epsilon) and rounded back to its dtype, so it moves by up to about ``ulps`` ulps, as a
result rounded another way would.

What is perturbed (``perturbs``): the outputs of the operations the autograd engine records or runs, i.e.
the forward with grad enabled and every backward pass, in float32, bfloat16, float16 and float8. What is
left exact: operations that only move or select values (copies, views, indexing, concatenation, max/min,
relu, masks: ``EXACT``), which round the same on every backend; outputs written into an existing tensor
(in-place and ``out=`` operations: the optimizers' updates) or sharing an input's memory; operations run
with grad disabled outside a backward pass (the optimizer step, evaluation, the probes' own statistics);
float64 values (the probes' statistics are float64; a float64 run differs between backends by about
1e-16, far below any tolerance). The random numbers come from a private generator: the global RNG
(dropout, data order) is untouched, so the run differs from the base only by the perturbations.

The handle covers this thread only (and the backward passes it runs), is a context manager, and undoes
itself on exit, exceptions included: nothing of it outlives the block. It works where PyTorch runs the
operations (an eager run); a compiled graph or an ORTModule session runs outside PyTorch's dispatcher and
would not be perturbed: make the calibration run eagerly. ``handle.perturbed`` counts the outputs perturbed;
leaving a block that perturbed none warns.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from exporters.adapters import torch_internals
from exporters.handles import Handle

__all__ = ["EXACT", "PerturbedRounding", "perturbed_rounding"]

# Operations whose result is exact on every backend (they move, select or create values; no rounding).
EXACT = frozenset({
    # copies and dtype conversions (correctly rounded, the same everywhere), creation
    "clone", "_to_copy", "copy", "_copy_from", "_copy_from_and_resize", "lift_fresh_copy", "contiguous",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "scalar_tensor", "arange", "eye",
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "normal",
    "uniform",
    # moving and selecting elements
    "cat", "stack", "index", "_unsafe_index", "index_select", "gather", "take", "embedding", "masked_select",
    "where", "masked_fill", "fill", "constant_pad_nd", "repeat", "flip", "roll", "tril", "triu", "scatter",
    "slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter", "unfold",
    "expand_copy", "permute_copy", "view_copy", "_reshape_copy", "slice_copy", "select_copy", "transpose_copy",
    "t_copy", "squeeze_copy", "unsqueeze_copy", "split_copy", "split_with_sizes_copy", "unbind_copy",
    "diagonal_copy", "alias_copy", "as_strided_copy",
    # comparisons that return one of their inputs
    "max", "min", "amax", "amin", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "relu", "threshold",
    "threshold_backward", "hardtanh", "abs", "neg", "sign", "sgn", "sort", "topk", "kthvalue", "median",
    "max_pool2d_with_indices", "max_pool3d_with_indices",
})
# The dtypes perturbed, each with the dtype the perturbation is computed in (holding all its values).
_WIDER = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}
_WIDER.update({dtype: torch.float32 for dtype in (getattr(torch, name, None) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")) if isinstance(dtype, torch.dtype)})


def perturbs(func: Any) -> bool:
    """Whether an aten operator's fresh outputs are perturbed now (see the module docstring)."""
    if torch_internals.writes_or_aliases(func) or torch_internals.operator_name(func) in EXACT:
        return False
    return torch.is_grad_enabled() or torch_internals.current_backward() is not None


class PerturbedRounding(Handle):
    """The active perturbation: ``remove()`` (or the end of its ``with`` block) ends it; ``perturbed`` counts
    the outputs perturbed so far. Made by ``perturbed_rounding``."""

    def __init__(self, seed: int, ulps: float) -> None:
        self.seed = seed
        self.ulps = ulps
        self.perturbed = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._entered = torch_internals.enter_dispatch_mode(_mode_class()(self))
        super().__init__(self._entered.remove)

    def __repr__(self) -> str:
        return f"PerturbedRounding(seed={self.seed}, ulps={self.ulps}, perturbed={self.perturbed}, active={self.active})"

    def remove(self) -> None:
        was_active = self.active
        if was_active:
            self._entered.remove()  # first: a refused removal (another thread, a mode entered later) changes nothing
        super().remove()
        if was_active and self.perturbed == 0:
            warnings.warn("probes: perturbed_rounding perturbed no operation: the calibration run must run its "
                          "training eagerly in PyTorch (a compiled graph or an ORTModule session is not perturbed), "
                          "in float32, bfloat16 or float16, with grad enabled", RuntimeWarning, stacklevel=2)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
            generator.manual_seed(self.seed)
        return generator

    def perturb(self, tensor: torch.Tensor) -> None:
        """Moves each value of a fresh output by up to about ``ulps`` ulps of its dtype, in place."""
        wide = _WIDER[tensor.dtype]
        noise = torch.rand(tensor.shape, generator=self._generator(tensor.device), dtype=wide, device=tensor.device)
        noise.mul_(2.0 * self.ulps * torch.finfo(tensor.dtype).eps).add_(1.0 - self.ulps * torch.finfo(tensor.dtype).eps)
        tensor.copy_(tensor.to(wide).mul_(noise))  # rounded back to the tensor's dtype by copy_
        self.perturbed += 1


def _storages(values: Any) -> set[int]:
    """The data pointers of the dense tensors among ``values`` (lists and tuples looked into)."""
    found = set()
    for value in values:
        if isinstance(value, torch.Tensor) and value.layout is torch.strided:
            found.add(value.untyped_storage().data_ptr())
        elif isinstance(value, (list, tuple)):
            found |= _storages(value)
    return found


def _mode_class() -> type:
    base = torch_internals.dispatch_mode_class()

    class _Mode(base):  # type: ignore[misc, valid-type]
        """Runs each operation, then perturbs its fresh floating-point outputs (inside it, the mode is off)."""

        def __init__(self, owner: PerturbedRounding) -> None:
            super().__init__()
            self.owner = owner

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            if not perturbs(func):
                return result
            outputs = result if isinstance(result, (list, tuple)) else (result,)
            inputs = None
            for output in outputs:
                if type(output) is torch.Tensor and output.dtype in _WIDER and output.layout is torch.strided \
                        and output.numel():
                    if inputs is None:
                        inputs = _storages((*args, *kwargs.values()))
                    if output.untyped_storage().data_ptr() not in inputs:
                        self.owner.perturb(output)
            return result

    return _Mode


def perturbed_rounding(*, seed: int = 0, ulps: float = 1.0) -> PerturbedRounding:
    """Perturbs the rounding of every floating-point operation of the training computation on this thread
    until the handle is removed (a ``with`` block): the base run again under it is a calibration run whose
    difference from the base measures how far valid rounding differences carry (docs/compare.md, Noise floor).

        with perturbed_rounding(seed=1):
            train(model, StatisticsSubscriber("eager_noise", override_output_dir=True))

    ``seed``: the perturbations' generator (another seed, another calibration run). ``ulps``: how far a
    value moves, at most, in ulps of its dtype (about; 1 models one rounding done another way).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"perturbed_rounding: seed must be an int, got {seed!r}")
    if isinstance(ulps, bool) or not isinstance(ulps, (int, float)) or not 0 < ulps <= 1024:
        raise ValueError(f"perturbed_rounding: ulps must be a number in (0, 1024], got {ulps!r}")
    return PerturbedRounding(seed, float(ulps))

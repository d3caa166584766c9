"""The per-layer checksums of :mod:`detection.stepcheck.abft`: one class per kind of layer.

Each :class:`LayerCheck` reads its module's actual output in a forward hook (and may note a
forward ratio there), keeps what the backward identity needs, and on the output's gradient adds
to the expected value of a reduction of each of its parameters' local gradients. The comm hook
then compares that reduction of the bucket's gradient with the expectation
(:meth:`detection.stepcheck.abft.LinearChecksums.on_local_gradient`).

Kinds and identities (``M`` rows: every position of the batch; ``dy`` the output's gradient):

* ``nn.Linear`` — forward ``y.sum(-1) = x @ W.sum(0) + b.sum()``; gradient ``dW.sum(0) =
  x.T @ dy.sum(-1)``, ``db.sum() = dy.sum()`` (module docstring of :mod:`detection.stepcheck.abft`);
* ``nn.Embedding`` — forward ``y.sum(-1) = W.sum(1)[idx]`` (a gather: only a corrupted copy
  moves it); gradient ``dW.sum(0) = dy.sum(0)`` over the positions not at ``padding_idx``;
* ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, ``nn.BatchNorm*`` (affine) — gradient
  per channel ``dw = Σ dy ⊙ x̂`` and ``db = Σ dy`` (``w``, ``b``: the affine weight and bias),
  compared element by element, with ``x̂`` recomputed from the saved input by the same
  functional normalisation without affine (batch statistics in training mode, the running
  ones in eval). The parameters hold a few numbers per channel, so the check is a
  recomputation, as cheap as a checksum. No forward check: one would cost the normalisation.

Tolerance of a gradient comparison: ``|got - expected| / (u · √M · Σ|terms|)``, with ``u`` the
unit roundoff of the gradient's dtype, the sum of the terms' magnitudes taken in the same pass;
for a normalisation weight the magnitude also carries ``Σ|dy|``, which bounds the rounding of
the recomputed ``x̂`` (``|Δx̂| ≲ u``). Every ratio is then divided by its rounding bound
(:func:`detection.stepcheck.abft_bound.tolerance` of its lengths and dtypes), so it reads in
units of that bound: at most 1 for clean arithmetic, from the first step, with nothing learnt.
A layer kind not listed (or an ``Embedding`` with ``max_norm``, ``sparse`` or
``scale_grad_by_freq``, a ``SyncBatchNorm``) is not checked.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from detection import native
from detection.stepcheck.abft_bound import compute_unit, tolerance

__all__ = [
    "TINY",
    "Expectation",
    "LayerCheck",
    "LinearCheck",
    "WeightPass",
    "make_checks",
    "scheduled",
    "unit",
]

TINY = 1e-30
_STOCK_BN_FORWARD = nn.BatchNorm1d.forward  # the _BatchNorm forward, channel at dim 1


def _full_precision(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The checksums' own products in float32 even inside the loop's autocast (whose lists
    hold ``matmul``, and on CUDA ``addmv`` and ``mv``): an expectation rounded to bf16 would
    add its own rounding to the residual it is meant to bound."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def unit(dtype: torch.dtype) -> float:
    """Unit roundoff of ``dtype`` (float32's for a non-float)."""
    return float(torch.finfo(dtype).eps) / 2.0 if dtype.is_floating_point else 2.0**-24


class _Owner(Protocol):
    @property
    def is_open(self) -> bool: ...

    def note(self, index: int, column: int, ratio: torch.Tensor) -> None: ...


@dataclass
class Expectation:
    """The expected reduction of one parameter's local gradient, summed over the step's
    backward passes, with the magnitude of its terms and the rounding unit."""

    value: torch.Tensor
    magnitude: torch.Tensor
    rows: int
    u: float
    width: int = 1  # the checksum's sums across the other dimension (abft_bound)
    u_c: float = 0.0  # the unit of the inputs' rounding in the forward (abft_bound)
    u_a: float = 0.0  # the unit the layer's backward accumulates in, beyond float32's

    def add(
        self,
        value: torch.Tensor,
        magnitude: torch.Tensor,
        rows: int,
        u: float,
        width: int = 1,
        u_c: float = 0.0,
        u_a: float = 0.0,
    ) -> None:
        self.value = self.value + value
        self.magnitude = self.magnitude + magnitude
        self.rows += rows
        self.u = max(self.u, u)
        self.width = max(self.width, width)
        self.u_c = max(self.u_c, u_c)
        self.u_a = max(self.u_a, u_a)

    def factor(self) -> float:
        """What :meth:`scale` multiplies the magnitude by — ``u·√rows`` times the rounding
        bound of :func:`~detection.stepcheck.abft_bound.tolerance` — : a caller that compares
        several expectations with the same factor scales them in one op."""
        rows = max(self.rows, 1)
        bound = tolerance(rows, self.width, self.u, self.u_c, self.u_a)
        return self.u * math.sqrt(rows) * bound

    def scale(self) -> torch.Tensor:
        return self.magnitude * self.factor()


class LayerCheck:
    """One checked module. Subclasses implement :meth:`forward` (returns what the backward
    needs, or ``None`` to leave this call unchecked), :meth:`backward` and :meth:`reduce`."""

    def __init__(self, index: int, name: str, module: nn.Module, shared: bool, owner: _Owner):
        self.index = index
        self.name = name
        self.module = module
        self.shared = shared  # a parameter also used by another module: no gradient check
        self.owner = owner
        self._expected: dict[bool, Expectation] = {}
        self._unchecked = False  # a call this step could not be followed: skip the gradient
        self.u_c = 0.0  # the rounding unit of the inputs of the call being checked
        self.begin()

    def install(self) -> Any:
        return self.module.register_forward_hook(self._hook)

    def begin(self) -> None:
        self._expected = {}
        self._unchecked = False
        self.active = True  # checked this step (the owner's schedule may leave it out)

    def checked_parameters(self) -> Iterator[tuple[torch.Tensor, bool]]:
        if self.shared:
            return
        for attr, is_weight in (("weight", True), ("bias", False)):
            param = getattr(self.module, attr, None)
            if isinstance(param, torch.Tensor):
                yield param, is_weight

    def _hook(self, _module: nn.Module, inputs: Any, output: Any) -> None:
        if not self.owner.is_open or not self.active or not isinstance(output, torch.Tensor):
            return
        if output.numel() == 0:  # an empty batch adds nothing to either identity
            return
        first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else output
        # taken here, inside the loop's autocast (the checksums' own products leave it)
        u_c = self.u_c = compute_unit(output.device.type, first.dtype)
        with torch.no_grad(), _full_precision(output.device.type):
            saved = self.forward(inputs, output)
        if not output.requires_grad or self.shared:
            return
        if saved is None:
            self._unchecked = True
            return
        output.register_hook(self._grad_hook(saved, u_c))

    def _grad_hook(self, saved: Any, u_c: float) -> Callable[[torch.Tensor], None]:
        def hook(dy: torch.Tensor) -> None:
            if self.owner.is_open:
                self.u_c = u_c  # the backward's products are of the forward's rounded inputs
                with torch.no_grad(), _full_precision(dy.device.type):
                    self.backward(saved, dy.detach())

        return hook

    def note_forward(self, ratio: torch.Tensor) -> None:
        self.owner.note(self.index, 0, ratio)

    def expect(
        self,
        is_weight: bool,
        value: torch.Tensor,
        magnitude: torch.Tensor,
        rows: int,
        dtype: torch.dtype,
        width: int = 1,
    ) -> None:
        # a GEMM accumulates in float32; the other kernels' reductions (a normalisation's or an
        # embedding's backward) may in the gradient's own dtype (a CPU's bf16 LayerNorm does)
        u_a = 0.0 if isinstance(self, LinearCheck) else unit(dtype)
        current = self._expected.get(is_weight)
        if current is None:
            self._expected[is_weight] = Expectation(
                value, magnitude, rows, unit(dtype), width, self.u_c, u_a
            )
        else:
            current.add(value, magnitude, rows, unit(dtype), width, self.u_c, u_a)

    def expected(self, is_weight: bool) -> Expectation | None:
        return None if self._unchecked else self._expected.get(is_weight)

    def forward(self, inputs: Any, output: torch.Tensor) -> Any:
        raise NotImplementedError

    def backward(self, saved: Any, dy: torch.Tensor) -> None:
        raise NotImplementedError

    def reduce(self, gradient: torch.Tensor, is_weight: bool) -> torch.Tensor:
        raise NotImplementedError


class LinearCheck(LayerCheck):
    """``nn.Linear``: forward row checksum and weight/bias gradient checksums."""

    def __init__(self, index: int, name: str, module: nn.Module, shared: bool, owner: _Owner):
        self._consts: dict[tuple[torch.device, int], tuple[torch.Tensor, ...]] = {}
        super().__init__(index, name, module, shared, owner)

    def begin(self) -> None:
        super().begin()
        # once per step (the weights change only at the update): W.sum(0), ‖W‖_F, b.sum()
        # (None without a bias) and √K·|b|.sum() + TINY; or the native kernel's copy. Taken for
        # every Linear checked this step at once (:class:`WeightPass`), at the first forward.
        self._cols: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None
        self._cols = None
        self._sums: torch.Tensor | None = None
        self.weight_pass: WeightPass | None = None

    def constants(
        self, device: torch.device, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A float32 ones vector of ``n``, a zero and a ``TINY`` scalar on ``device``, made
        once and never written: operands that fold a row sum or a product into one op."""
        key = (device, n)
        kept = self._consts.get(key)
        if kept is None:
            with torch.inference_mode(False):
                kept = (
                    torch.ones(n, dtype=torch.float32, device=device),
                    torch.zeros((), dtype=torch.float32, device=device),
                    torch.full((), TINY, dtype=torch.float32, device=device),
                )
            self._consts[key] = kept
        return kept[0], kept[1], kept[2]

    def _native_sums(self) -> torch.Tensor | None:
        """On a CPU, the native kernel's ``K + 3`` floats ``(W.sum(0), ‖W‖_F, b.sum(),
        |b|.sum())`` (:func:`detection.native.col_sums`); ``None`` where it does not run."""
        module = self.module
        assert isinstance(module, nn.Linear)
        w = module.weight.detach()
        b = None if module.bias is None else module.bias.detach()
        if w.device.type != "cpu" or not native.available():
            return None
        w = w.float()
        b = None if b is None else b.float()
        if native.abft_ok(w) and (b is None or native.abft_ok(b)):
            return native.col_sums(w, b)
        return None

    def _weight_sums(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | torch.Tensor:
        """``(W.sum(0), ‖W‖_F, b.sum(), √K·|b|.sum() + TINY)``, once a step; on a CPU the
        native kernel's ``K + 3`` floats (:func:`detection.native.col_sums`)."""
        if self._sums is not None:
            return self._sums
        if self._cols is None:
            sums = self._native_sums()
            if sums is not None:
                self._sums = sums
                return sums
            if self.weight_pass is None:  # checked outside a step's schedule: on its own
                WeightPass([self]).run()
            else:
                self.weight_pass.run()
        assert self._cols is not None
        return self._cols

    def forward(self, inputs: Any, output: torch.Tensor) -> Any:
        x = inputs[0]
        k = x.shape[-1]
        x2 = x.detach().reshape(-1, k)
        sums = self._weight_sums()
        xf = x2.float()
        n = output.shape[-1]
        u = unit(output.dtype)
        t = tolerance(k, n, u, self.u_c)  # the rounding bound, in units of u·√K·m (abft_bound)
        if isinstance(sums, torch.Tensor):
            y2 = output.detach().reshape(-1, n).float()
            c = u * math.sqrt(k) * t
            if native.abft_ok(xf, y2):
                # on a CPU: one pass over x and y, the same ratio; nothing read back to Python
                c_bound = c * math.sqrt(y2.shape[1])
                ratio, x_frobenius = native.linear_forward(xf, y2, sums, c_bound, c, TINY)
                self.note_forward(ratio)
                return x2, x_frobenius
            b_sum: torch.Tensor | None = sums[k + 1]
            col, w_norm = sums[:k], sums[k]
            bias_term = sums[k + 2] * math.sqrt(k) + TINY
        else:
            col, w_norm, b_sum, bias_term = sums
        # y.sum(-1) - Σb: on float32 one matrix-vector product with ones (-Σb its input)
        y2 = output.detach().reshape(-1, n)
        if y2.dtype == torch.float32:
            ones, zero, _ = self.constants(y2.device, n)
            start = (zero if b_sum is None else b_sum).expand(y2.shape[0])
            rows = torch.addmv(start, y2, ones, beta=-1.0)
        else:  # a float32 sum of the narrow output, without a float32 copy of it
            rows = y2.sum(-1, dtype=torch.float32)
            if b_sum is not None:
                rows = rows.sub_(b_sum)
        # (y.sum(-1) - Σb - x @ W.sum(0)) / (u·t) in one call, t the derived rounding bound:
        # u·t·√K·(‖x_row‖₂·√N‖W‖_F + |b|.sum()) + u·t·TINY is then
        # √K·√N·‖x_row‖₂·‖W‖_F + (√K·|b|.sum() + TINY): one addcmul of the step's bias term
        residual = torch.addmv(rows, xf, col, beta=1.0 / (u * t), alpha=-1.0 / (u * t))
        row_norms = torch.linalg.vector_norm(xf, dim=-1)
        scale = torch.addcmul(bias_term, row_norms, w_norm, value=math.sqrt(k) * math.sqrt(n))
        # max |residual| / scale: vector_norm(inf) takes the magnitudes and propagates a NaN
        self.note_forward(torch.linalg.vector_norm(residual.div_(scale), math.inf))
        # ‖x‖_F = ‖(‖x_i‖₂)_i‖₂: the backward's bound from the row norms, not a second read of x
        return x2, torch.linalg.vector_norm(row_norms)

    def backward(self, saved: tuple[torch.Tensor, torch.Tensor], dy: torch.Tensor) -> None:
        x2, x_frobenius = saved
        xf = x2.float()
        d2 = dy.reshape(-1, dy.shape[-1]).float()
        rows, n = d2.shape
        # One whole-tensor norm bounds both: ‖x‖_F·√N·‖dy‖_F ≥ every |x|.T @ |dy|.sum(-1)
        # (‖dy_row‖₁ ≤ √N·‖dy_row‖₂, then Cauchy-Schwarz over the rows), and
        # √(N·M)·‖dy‖_F ≥ ‖dy‖₁ for the bias. On a CPU the row sums and the norm are one pass;
        # elsewhere one norm call (a launch fewer than a dot product and its square root,
        # which is what a GPU pays for on a layer of a few thousand elements).
        if native.abft_ok(d2):
            r, dy_norm = native.row_sums(d2)
        else:
            r = d2.sum(-1)
            dy_norm = torch.linalg.vector_norm(d2)
        _, zero, _ = self.constants(d2.device, 0)
        weight_magnitude = torch.addcmul(zero, x_frobenius, dy_norm, value=math.sqrt(n))
        self.expect(True, torch.mv(xf.t(), r), weight_magnitude, rows, dy.dtype, n)
        self.expect(False, r.sum(), dy_norm * math.sqrt(n * rows), rows, dy.dtype, n)

    def reduce(self, gradient: torch.Tensor, is_weight: bool) -> torch.Tensor:
        if not is_weight:
            return gradient.sum()
        if gradient.dim() == 2 and native.abft_ok(gradient):
            return native.col_sums(gradient)[: gradient.shape[1]]
        return gradient.sum(0)


class WeightPass:
    """The weight-side terms of every Linear checked on one step, taken together at the first
    forward that needs them: a column sum and a bias sum per layer, and for all of them one
    multi-tensor norm of the weights, one of the biases (L1) and one scaling of those, where
    each layer took six ops of its own. On a GPU each op is a kernel launch, so the count is
    the cost; the values are those each layer would take alone."""

    def __init__(self, layers: list[LinearCheck]) -> None:
        self.layers = layers
        self._done = False

    def run(self) -> None:
        if self._done:
            return
        self._done = True
        todo = [layer for layer in self.layers if layer._cols is None and layer._sums is None]
        if not todo:
            return
        weights: list[torch.Tensor] = []
        biases: list[torch.Tensor] = []
        roots: list[float] = []  # √K of each layer with a bias
        for layer in todo:
            module = layer.module
            assert isinstance(module, nn.Linear)
            weights.append(module.weight.detach())
            if module.bias is not None:
                biases.append(module.bias.detach())
                roots.append(math.sqrt(module.in_features))
        with torch.no_grad(), _full_precision(weights[0].device.type):
            # float32 accumulation of any weight dtype, without a float32 copy of it
            norms = torch._foreach_norm(weights, 2, dtype=torch.float32)
            bias_terms: list[torch.Tensor] = []
            if biases:
                bias_terms = list(torch._foreach_norm(biases, 1, dtype=torch.float32))
                torch._foreach_mul_(bias_terms, roots)
                torch._foreach_add_(bias_terms, TINY)
            terms = iter(bias_terms)
            for layer, w, w_norm in zip(todo, weights, norms, strict=True):
                module = layer.module
                assert isinstance(module, nn.Linear)
                col = w.sum(0, dtype=torch.float32)
                if module.bias is None:
                    layer._cols = (col, w_norm, None, layer.constants(w.device, 0)[2])
                else:
                    b_sum = module.bias.detach().sum(dtype=torch.float32)
                    layer._cols = (col, w_norm, b_sum, next(terms))


class EmbeddingCheck(LayerCheck):
    """``nn.Embedding``: forward row sums of the gathered rows, gradient column sums."""

    def begin(self) -> None:
        super().begin()
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # W.sum(1), √d·‖W_v‖₂

    def forward(self, inputs: Any, output: torch.Tensor) -> Any:
        index = inputs[0].reshape(-1)
        d = output.shape[-1]
        module = self.module
        assert isinstance(module, nn.Embedding)
        if self._rows is None:
            w = module.weight.detach().float()
            # Σ_d |W_vd| ≤ √d·‖W_v‖₂: a row norm, no |W| temporary (once per step)
            self._rows = (w.sum(1), torch.linalg.vector_norm(w, dim=1) * math.sqrt(d))
        rows, rows_abs = self._rows
        y2 = output.detach().reshape(-1, d).float()
        residual = (y2.sum(-1) - rows[index]).abs()
        u = unit(output.dtype)
        scale = rows_abs[index] * (u * math.sqrt(d) * tolerance(d, d, u, self.u_c)) + TINY
        self.note_forward((residual / scale).amax())
        return index

    def backward(self, saved: torch.Tensor, dy: torch.Tensor) -> None:
        d2 = dy.reshape(-1, dy.shape[-1]).float()
        padding = getattr(self.module, "padding_idx", None)
        if padding is not None:
            d2 = d2 * saved.ne(padding).unsqueeze(1)
        # the comm hook's column sums run over the vocabulary's rows, of which at most M are not
        # zero (adding a zero is exact): a width of M
        self.expect(True, d2.sum(0), d2.abs().sum(0), d2.shape[0], dy.dtype, d2.shape[0])

    def reduce(self, gradient: torch.Tensor, is_weight: bool) -> torch.Tensor:
        return gradient.sum(0)


class NormCheck(LayerCheck):
    """Affine normalisations: ``dw = Σ dy ⊙ x̂`` and ``db = Σ dy`` per channel."""

    def forward(self, inputs: Any, output: torch.Tensor) -> Any:
        x = inputs[0].detach()
        m = self.module
        if isinstance(m, nn.LayerNorm | nn.RMSNorm):
            return (x, -1, True)
        channels = m.num_channels if isinstance(m, nn.GroupNorm) else m.num_features
        if isinstance(m, nn.GroupNorm) or type(m).forward is _STOCK_BN_FORWARD:
            dim = 1
        else:  # a subclass that moves the channels (tokens x features): the one matching dim
            dims = [i for i, n in enumerate(x.shape) if n == channels]
            if len(dims) != 1:
                return None
            dim = dims[0]
        if x.dim() < 2 or x.shape[dim] != channels:
            return None
        return (x, dim, bool(m.training))

    def _normalised(self, x: torch.Tensor, dim: int, training: bool) -> torch.Tensor:
        m = self.module
        xf = x.float()
        if isinstance(m, nn.LayerNorm):
            return F.layer_norm(xf, m.normalized_shape, None, None, m.eps)
        if isinstance(m, nn.RMSNorm):
            return F.rms_norm(xf, m.normalized_shape, None, m.eps)
        xm = xf.movedim(dim, 1)
        if isinstance(m, nn.GroupNorm):
            out = F.group_norm(xm, m.num_groups, None, None, m.eps)
            return out.movedim(1, dim)
        assert isinstance(m, nn.modules.batchnorm._BatchNorm)
        if training or m.running_mean is None or m.running_var is None:
            out = F.batch_norm(xm, None, None, None, None, True, 0.0, m.eps)
        else:
            rm, rv = m.running_mean.float(), m.running_var.float()
            out = F.batch_norm(xm, rm, rv, None, None, False, 0.0, m.eps)
        return out.movedim(1, dim)

    def backward(self, saved: tuple[torch.Tensor, int, bool], dy: torch.Tensor) -> None:
        x, dim, training = saved
        weight = self.module.weight
        assert isinstance(weight, torch.Tensor)
        width = weight.numel()
        xh = self._normalised(x, dim, training)
        if dim != -1:
            xh, dy = xh.movedim(dim, -1), dy.movedim(dim, -1)
        d2 = dy.reshape(-1, width).float()
        xh2 = xh.reshape(-1, width)
        if native.abft_ok(d2, xh2):  # on a CPU: the four channel sums in one pass
            sums = native.norm_grad(d2, xh2)
            self.expect(True, sums[0], sums[1], d2.shape[0], dy.dtype)
            self.expect(False, sums[2], sums[3], d2.shape[0], dy.dtype)
            return
        p = d2 * xh2
        # Σ|·| per channel as one L1 norm each: no |·| temporaries (an op each on a GPU)
        mag_b = torch.linalg.vector_norm(d2, 1, dim=0)
        mag_w = torch.linalg.vector_norm(p, 1, dim=0).add_(mag_b)
        self.expect(True, p.sum(0), mag_w, d2.shape[0], dy.dtype)
        self.expect(False, d2.sum(0), mag_b, d2.shape[0], dy.dtype)

    def reduce(self, gradient: torch.Tensor, is_weight: bool) -> torch.Tensor:
        return gradient.reshape(-1)


def _kind(module: nn.Module) -> type[LayerCheck] | None:
    if isinstance(module, nn.Linear):
        return LinearCheck
    if isinstance(module, nn.Embedding):
        plain = module.max_norm is None and not module.sparse and not module.scale_grad_by_freq
        return EmbeddingCheck if plain else None
    if isinstance(module, nn.LayerNorm | nn.RMSNorm | nn.GroupNorm):
        return NormCheck if isinstance(getattr(module, "weight", None), torch.Tensor) else None
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, nn.SyncBatchNorm
    ):
        return NormCheck if module.affine else None
    return None


def scheduled(index: int, step: int, every: int) -> bool:
    """Whether layer ``index`` is checked on ``step`` when each layer is checked once every
    ``every`` steps: a rotation every rank computes alike from the step number, a fault that
    recurs on a layer is seen within ``every`` steps. ``every <= 1``: every layer, every step."""
    return every <= 1 or index % every == step % every


def make_checks(module: nn.Module, owner: _Owner) -> list[LayerCheck]:
    """One check per checkable submodule of ``module``, in ``named_modules`` order."""
    counts: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    checks: list[LayerCheck] = []
    for name, sub in module.named_modules():
        kind = _kind(sub)
        if kind is None:
            continue
        shared = any(counts.get(id(p), 0) > 1 for p in sub.parameters(recurse=False))
        checks.append(kind(len(checks), name, sub, shared, owner))
    return checks

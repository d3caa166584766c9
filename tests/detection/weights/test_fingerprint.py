"""Weight fingerprints: bitwise equal to the definition, and sensitive to every bit flip."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import pytest
import torch

from detection import native
from detection.weights import fingerprint_kernels as fk
from detection.weights import plan as fp_plan
from detection.weights.fingerprint import (
    Fingerprint,
    fingerprint_from_tensor,
    fingerprint_on_device,
    weight_fingerprint,
)
from detection.weights.fingerprint_kernels import FingerprintError, Kernel
from detection.weights.plan import FingerprintPlan

MASK = (1 << 64) - 1
SIGNED_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def multiplier(i: int) -> int:
    return splitmix64(i) | 1


def reference(tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None = None) -> Fingerprint:
    """The definition, in Python integers: unsigned words, global 0-based positions, each
    weighted by splitmix64(position) | 1."""
    a = b = 0
    i = 0
    for k, t in enumerate(tensors):
        if offsets is not None:
            i = offsets[k]
        size = t.element_size()
        for signed in t.reshape(-1).view(SIGNED_VIEW[size]).tolist():
            w = signed % (1 << (8 * size))
            a += w
            b += multiplier(i) * w
            i += 1
    return Fingerprint(a & MASK, b & MASK)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, subnormals, negative zeros included)."""
    size = torch.empty((), dtype=dtype).element_size()
    view = SIGNED_VIEW[size]
    info = torch.iinfo(view)
    raw = torch.randint(info.min, info.max, shape, dtype=view, generator=gen)
    return raw.view(dtype)


def flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of ``t`` with bit ``bit`` of flat element ``index`` flipped."""
    out = t.clone()
    words = out.reshape(-1).view(SIGNED_VIEW[out.element_size()])
    bits = 8 * out.element_size()
    unsigned = (int(words[index]) + (1 << bits)) % (1 << bits)
    flipped = unsigned ^ (1 << bit)
    words[index] = flipped - (1 << bits) if flipped >= 1 << (bits - 1) and bits > 8 else flipped
    return out


@pytest.fixture(autouse=True)
def _restore_kernel() -> Iterator[None]:
    before = fk.get_kernel()
    yield
    fk.set_kernel(before)


@pytest.fixture
def torch_kernels_only() -> Iterator[None]:
    """``auto`` as on a host without :mod:`detection.native` (no C compiler, or
    ``SDCGUARD_NATIVE=0``): the choice among torch's kernels."""
    was = native.is_enabled()
    native.set_enabled(False)
    yield
    native.set_enabled(was)


SHAPES = [(), (0,), (1,), (2,), (3,), (7,), (3, 5), (2, 3, 4), (1023,), (1025,), (4097,), (64, 65)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_kernel_equals_the_python_reference_for_many_shapes(dtype: torch.dtype) -> None:
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(7)
    for shape in SHAPES:
        t = random_bits(shape, dtype, gen)
        assert weight_fingerprint([t]) == reference([t]), shape
    tensors = [random_bits(shape, dtype, gen) for shape in SHAPES]
    assert weight_fingerprint(tensors) == reference(tensors)


def test_fingerprinting_never_modifies_the_tensors() -> None:
    """(The fused kernel is checked in its own test, to compile one layout only.)"""
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(13)
    tensors = [random_bits((257,), dtype, gen) for dtype in DTYPES]
    before = [t.reshape(-1).view(SIGNED_VIEW[t.element_size()]).clone() for t in tensors]
    weight_fingerprint(tensors)
    for t, old in zip(tensors, before, strict=True):
        assert torch.equal(t.reshape(-1).view(SIGNED_VIEW[t.element_size()]), old), t.dtype


def test_eager_kernel_is_exact_across_chunks_and_with_wrapping_sums() -> None:
    """Longer than one eager chunk, with values large enough that B wraps modulo 2**64."""
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(3)
    big = random_bits((2 * fk.CHUNK + 3,), torch.float32, gen)
    tensors = [random_bits((5,), torch.float16, gen), big, random_bits((9,), torch.float64, gen)]
    unsigned = big.view(torch.int32).double() % 2**32
    assert float(unsigned.sum()) * 2**32 > 2**64  # B really wraps (multipliers are ~2**63)
    assert weight_fingerprint(tensors) == reference(tensors)


def test_fused_kernel_equals_the_reference_on_a_mixed_layout() -> None:
    """One compiled layout covering every path of the packed kernel: all word sizes, odd
    lengths, views that start between 8-byte boundaries, a transposed view, 0-d and empty
    tensors, and a tensor long enough that every aggregate wraps."""
    fk.set_kernel(Kernel.FUSED)
    gen = torch.Generator().manual_seed(11)
    base32 = random_bits((70_001,), torch.float32, gen)
    base16 = random_bits((1_003,), torch.bfloat16, gen)
    tensors = [
        base32[1:],  # starts on a half lane: one loose head word
        random_bits((), torch.float32, gen),
        random_bits((0,), torch.float32, gen),
        base16[3:1000],  # three loose words to the next lane, odd tail
        random_bits((5, 7), torch.float16, gen),
        random_bits((9,), torch.float64, gen),
        random_bits((6, 5), torch.float32, gen).t(),  # not contiguous
        random_bits((1,), torch.bfloat16, gen),
        random_bits((13,), torch.uint8, gen),
        torch.rand((11,), generator=gen) > 0.5,  # bool: one byte per element
        random_bits((3,), torch.int8, gen),
    ]
    expected = reference(tensors)
    before = [t.reshape(-1).view(SIGNED_VIEW[t.element_size()]).clone() for t in tensors]
    on_device = fingerprint_on_device(tensors)
    assert fingerprint_from_tensor(on_device) == expected
    for t, old in zip(tensors, before, strict=True):  # read-only
        assert torch.equal(t.reshape(-1).view(SIGNED_VIEW[t.element_size()]), old)
    fk.set_kernel(Kernel.EAGER)
    assert torch.equal(fingerprint_on_device(tensors), on_device)


def test_element_types_outside_the_fused_kernel_take_the_eager_one() -> None:
    fk.set_kernel(Kernel.FUSED)
    gen = torch.Generator().manual_seed(12)
    tensors = [random_bits((7,), torch.complex64, gen), random_bits((5,), torch.float32, gen)]
    assert weight_fingerprint(tensors) == reference(tensors)


@pytest.mark.parametrize(
    ("dtype", "positions"),
    [(torch.float32, [0, 1, 500, 998, 999]), (torch.float16, [0, 999]), (torch.float64, [0, 999])],
    ids=["float32", "float16", "float64"],
)
def test_every_single_bit_flip_changes_the_fingerprint(
    dtype: torch.dtype, positions: list[int]
) -> None:
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(5)
    head = random_bits((400,), dtype, gen)
    tail = random_bits((600,), dtype, gen)
    clean = weight_fingerprint([head, tail])
    bits = 8 * head.element_size()
    rng = random.Random(5)
    samples = [(p, b) for p in positions for b in range(bits)]
    samples += [(rng.randrange(1000), rng.randrange(bits)) for _ in range(50)]
    for index, bit in samples:
        if index < 400:
            flipped = [flip(head, index, bit), tail]
        else:
            flipped = [head, flip(tail, index - 400, bit)]
        got = weight_fingerprint(flipped)
        assert got != clean, (index, bit)
        assert got.a != clean.a, (index, bit)  # A alone catches any single flip
        assert got == reference(flipped)


def test_a_pair_of_flips_that_cancels_in_a_is_caught_by_b() -> None:
    fk.set_kernel(Kernel.EAGER)
    words = torch.zeros(4096, dtype=torch.int32)
    words[10] = 0  # bit 30 clear: flipping it adds 2**30
    words[4000] = 1 << 30  # bit 30 set: flipping it subtracts 2**30
    t = words.view(torch.float32)
    flipped = flip(flip(t, 10, 30), 4000, 30)
    clean, hit = weight_fingerprint([t]), weight_fingerprint([flipped])
    assert hit.a == clean.a  # the pair cancels in A ...
    change = ((multiplier(10) - multiplier(4000)) * 2**30) % 2**64
    assert (hit.b - clean.b) % 2**64 == change != 0  # ... not in B


def _add_to_word(t: torch.Tensor, index: int, delta: int) -> None:
    words = t.reshape(-1).view(torch.int32)
    value = (int(words[index]) + delta + 2**31) % 2**32 - 2**31
    words[index] = value


@pytest.mark.parametrize("kernel", [Kernel.EAGER, Kernel.FUSED, Kernel.NATIVE])
def test_plus_x_minus_two_x_plus_x_over_three_adjacent_words_changes_it(kernel: Kernel) -> None:
    """The second difference of (i + 1) is zero, so this pattern cancelled in both aggregates
    of the old definition; pseudo-random multipliers catch it at any place and any bit."""
    fk.set_kernel(kernel)
    gen = torch.Generator().manual_seed(21)
    t = random_bits((4099,), torch.float32, gen)
    tensors = [t[:1000], t[1000:]]
    clean = fingerprint_from_tensor(fingerprint_on_device(tensors))
    for start, x in [(0, 1), (998, 1 << 20), (2000, 3), (4096, 1 << 29)]:
        hit = t.clone()
        for k, factor in enumerate((1, -2, 1)):
            _add_to_word(hit, start + k, factor * x)
        got = fingerprint_from_tensor(fingerprint_on_device([hit[:1000], hit[1000:]]))
        assert got.a == clean.a, start  # the pattern sums to zero: A cannot see it
        assert got.b != clean.b, start
        assert got == reference([hit[:1000], hit[1000:]])


def test_equal_opposite_flips_at_the_same_offset_of_two_buckets_change_the_sum() -> None:
    """Gradient fingerprints are per bucket at global offsets: the buckets' sum is the whole
    gradient's fingerprint, and a +d / -d pair at the same local offset no longer cancels."""
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(22)
    first, second = random_bits((300,), torch.float32, gen), random_bits((300,), torch.float32, gen)

    def summed(x: torch.Tensor, y: torch.Tensor) -> Fingerprint:
        total = fingerprint_on_device([x], offsets=[0]) + fingerprint_on_device([y], offsets=[300])
        return fingerprint_from_tensor(total)

    clean = summed(first, second)
    assert clean == weight_fingerprint([first, second])  # concatenation is addition
    hit1, hit2 = first.clone(), second.clone()
    _add_to_word(hit1, 17, 1 << 25)
    _add_to_word(hit2, 17, -(1 << 25))
    got = summed(hit1, hit2)
    assert got.a == clean.a
    assert got.b != clean.b
    assert got == reference([hit1, hit2])


def test_offsets_place_tensors_at_global_positions() -> None:
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(23)
    x, y = random_bits((7,), torch.float32, gen), random_bits((5,), torch.bfloat16, gen)
    assert weight_fingerprint([x, y]) == fingerprint_from_tensor(
        fingerprint_on_device([y, x], offsets=[7, 0])
    )
    assert weight_fingerprint([y]) != fingerprint_from_tensor(fingerprint_on_device([y], start=7))
    assert fingerprint_from_tensor(fingerprint_on_device([x, y], start=40)) == reference(
        [x, y], [40, 47]
    )
    with pytest.raises(FingerprintError, match="offsets"):
        fingerprint_on_device([x], offsets=[0, 1])


def test_the_chunked_path_beyond_the_table_equals_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lists past the multiplier table compute multipliers on the fly, chunk by chunk."""
    fk.set_kernel(Kernel.EAGER)
    monkeypatch.setattr(fk, "TABLE_MAX", 16)
    monkeypatch.setattr(fk, "CHUNK", 64)
    gen = torch.Generator().manual_seed(24)
    tensors = [random_bits((200,), torch.float32, gen), random_bits((9,), torch.float16, gen)]
    assert weight_fingerprint(tensors) == reference(tensors)


def test_the_float64_blind_spot_is_the_documented_one() -> None:
    """The module docstring's 64-bit case: two opposite sign-bit flips of float64 values
    cancel in both aggregates (2**63 times an even difference of odd multipliers is 0 mod
    2**64); lower bits and same-direction pairs are caught."""
    fk.set_kernel(Kernel.EAGER)
    t = torch.linspace(1.0, 2.0, 8, dtype=torch.float64)
    clean = weight_fingerprint([t])
    assert weight_fingerprint([flip(flip(t, 1, 63), 3, 63)]) == clean
    assert weight_fingerprint([flip(flip(t, 1, 63), 4, 63)]) == clean
    assert weight_fingerprint([flip(flip(t, 1, 61), 3, 61)]) != clean  # lower bits are caught


def test_the_same_flat_data_split_differently_gives_the_same_fingerprint() -> None:
    fk.set_kernel(Kernel.EAGER)
    flat = random_bits((1000,), torch.float32, torch.Generator().manual_seed(9))
    whole = weight_fingerprint([flat])
    assert weight_fingerprint([flat[:1], flat[1:999], flat[999:]]) == whole
    assert weight_fingerprint([flat[:500].reshape(20, 25), flat[500:], flat[:0]]) == whole
    assert weight_fingerprint(list(flat.split(7))) == whole
    assert weight_fingerprint([flat[:500].reshape(25, 20)]) == weight_fingerprint([flat[:500]])


def test_a_different_order_of_tensors_changes_it() -> None:
    """Positions count: swapping two different tensors keeps A and changes B."""
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(2)
    x, y = random_bits((10,), torch.float32, gen), random_bits((10,), torch.float32, gen)
    xy, yx = weight_fingerprint([x, y]), weight_fingerprint([y, x])
    assert xy.a == yx.a
    assert xy.b != yx.b


def test_fingerprint_on_device_is_two_int64_words_equal_to_weight_fingerprint() -> None:
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(4)
    tensors = [random_bits((33,), torch.float32, gen), random_bits((4, 4), torch.bfloat16, gen)]
    value = fingerprint_on_device(tensors)
    assert value.dtype == torch.int64
    assert value.shape == (2,)
    assert value.device == tensors[0].device
    assert fingerprint_from_tensor(value) == weight_fingerprint(tensors) == reference(tensors)


def test_parameters_with_grad_are_fingerprinted_without_autograd() -> None:
    fk.set_kernel(Kernel.EAGER)
    layer = torch.nn.Linear(5, 3)
    value = fingerprint_on_device(layer.parameters())
    assert not value.requires_grad
    assert fingerprint_from_tensor(value) == reference([layer.weight.detach(), layer.bias.detach()])


def test_no_tensors_gives_zeros() -> None:
    assert weight_fingerprint([]) == Fingerprint(0, 0)
    assert torch.equal(fingerprint_on_device([]), torch.zeros(2, dtype=torch.int64))


def test_hex_round_trip_and_strict_parsing() -> None:
    f = Fingerprint(0x0123456789ABCDEF, MASK)
    assert f.hex() == "0123456789abcdef" + "f" * 16
    assert Fingerprint.from_hex(f.hex()) == f
    for bad in ["", "0" * 31, "0" * 33, "g" + "0" * 31, "+" + "0" * 31, " " + "0" * 31]:
        with pytest.raises(ValueError, match="32 hex characters"):
            Fingerprint.from_hex(bad)


def test_fingerprint_from_tensor_reads_negative_words_as_unsigned() -> None:
    value = torch.tensor([-1, -(2**63)], dtype=torch.int64)
    assert fingerprint_from_tensor(value) == Fingerprint(MASK, 2**63)
    with pytest.raises(ValueError, match="2 int64 values"):
        fingerprint_from_tensor(torch.zeros(3, dtype=torch.int64))


def test_unsupported_element_sizes_and_mixed_devices_are_refused() -> None:
    with pytest.raises(FingerprintError, match="16-byte"):
        weight_fingerprint([torch.zeros(2, dtype=torch.complex128)])
    with pytest.raises(FingerprintError, match="several devices"):
        fingerprint_on_device([torch.zeros(2), torch.zeros(2, device="meta")])


def test_kernel_choice_is_validated() -> None:
    fk.set_kernel("eager")
    assert fk.get_kernel() is Kernel.EAGER
    with pytest.raises(ValueError, match="bogus"):
        fk.set_kernel("bogus")


def test_a_plan_equals_the_one_shot_fingerprint_and_follows_the_live_tensors() -> None:
    fk.set_kernel(Kernel.EAGER)
    gen = torch.Generator().manual_seed(25)
    layer = torch.nn.Linear(7, 5)
    counter = torch.zeros((), dtype=torch.int64)
    tensors = [layer.weight, layer.bias, counter, random_bits((4,), torch.bfloat16, gen)]
    plan = FingerprintPlan(tensors, start=3)
    assert torch.equal(plan(), fingerprint_on_device(tensors, start=3))
    assert fingerprint_from_tensor(plan()) == reference(tensors, [3, 38, 43, 44])
    with torch.no_grad():
        layer.weight.view(-1)[4] += 1.0  # in place: the same storage
    counter += 1
    assert torch.equal(plan(), fingerprint_on_device(tensors, start=3))
    layer.bias.data = torch.randn(5, generator=gen)  # replaced storage: the plan rebuilds
    assert torch.equal(plan(), fingerprint_on_device(tensors, start=3))
    transposed = [random_bits((3, 4), torch.float32, gen).t()]  # not contiguous: no cached view
    assert torch.equal(FingerprintPlan(transposed)(), fingerprint_on_device(transposed))
    assert torch.equal(FingerprintPlan([])(), torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("kernel", [Kernel.EAGER, Kernel.AUTO])
def test_a_plan_follows_a_tensor_re_viewed_over_the_same_memory(kernel: Kernel) -> None:
    """The address alone does not say a build still reads the right words: a transposed, a
    narrowed or a reshaped view keeps it. Each is fingerprinted as the one-shot call does."""
    fk.set_kernel(kernel)
    gen = torch.Generator().manual_seed(26)
    square = random_bits((6, 6), torch.float32, gen)
    other = random_bits((5,), torch.float32, gen)
    tensors = [square, other]
    plan = FingerprintPlan(tensors)
    assert torch.equal(plan(), fingerprint_on_device(tensors))
    pointer = square.data_ptr()
    for view in (square.data.t(), square.data.view(-1)[:20], square.data.view(4, 9)):
        square.data = view
        assert square.data_ptr() == pointer
        assert torch.equal(plan(), fingerprint_on_device(tensors)), tuple(view.shape)
    for typed in (torch.int32, torch.float16):  # re-typed views: the same size, then twice it
        square.data = square.data.view(typed)
        assert torch.equal(plan(), fingerprint_on_device(tensors)), typed


def test_a_plan_first_taken_under_inference_mode_works_outside_it() -> None:
    """A plan keeps one int64 buffer between calls; built under ``torch.inference_mode()`` (a
    user's evaluation pass) it must still take the fingerprint outside it, where an inference
    tensor would refuse the in-place update."""
    fk.set_kernel(Kernel.EAGER)
    norm = torch.nn.BatchNorm1d(4)
    tensors = [
        b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if b is not None
    ]
    assert len(tensors) == 3
    plan = FingerprintPlan(tensors, start=10)
    with torch.inference_mode():
        inside = plan()
    assert torch.equal(inside, fingerprint_on_device(tensors, start=10))
    norm(torch.randn(8, 4))  # a training forward moves the statistics
    assert torch.equal(plan(), fingerprint_on_device(tensors, start=10))
    assert not torch.equal(plan(), inside)


@pytest.mark.parametrize("start", [1_000, 25_557_032], ids=["in-table", "beyond-table"])
def test_a_small_plan_under_the_fused_kernel_takes_the_table_and_compiles_nothing(
    start: int,
) -> None:
    """A model's buffers (a few hundred elements) are fingerprinted three times a step: under
    ``fused`` their plan reads multipliers it holds instead of paying a compiled call's
    dispatch, with the same result — also when they are numbered after a large model's
    parameters, beyond the shared table (where the old plan fell back to a kernel per call)."""
    assert start + 300 < fk.TABLE_MAX or start > fk.TABLE_MAX
    fk.set_kernel(Kernel.FUSED)
    gen = torch.Generator().manual_seed(26)
    tensors = [
        random_bits((256,), torch.float32, gen),
        torch.zeros((), dtype=torch.int64) + 7,
        random_bits((33,), torch.bfloat16, gen),
    ]
    offsets = [start, start + 256, start + 257]
    layouts = set(fk.FUSED_STATE.layouts)
    plan = FingerprintPlan(tensors, start=start)
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    assert fk.FUSED_STATE.layouts == layouts  # no layout was compiled for it
    tensors[0][3] += 1.0
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)


@pytest.mark.parametrize("start", [123, (1 << 22) + 5], ids=["in-table", "beyond-table"])
def test_a_large_cpu_plan_under_the_fused_kernel_takes_the_compiled_table(
    monkeypatch: pytest.MonkeyPatch, start: int
) -> None:
    """A list the fused kernel would take, on a CPU without a native 64-bit vector multiply
    (AVX2): the plan compiles one pass per tensor over the words and the multipliers it holds
    instead of recomputing splitmix64 per word — the same bits as the definition for every word
    size, with wrapping sums, placed from an offset (inside the shared table: a view of it;
    beyond it: computed for these positions), and following in-place updates of the live
    tensors."""
    assert (start < fk.TABLE_MAX) == (start == 123)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    fk.set_kernel(Kernel.FUSED)
    gen = torch.Generator().manual_seed(27)
    tensors = [
        random_bits((fk.PLAN_EAGER_MAX + 17,), torch.float32, gen),  # above the eager table
        random_bits((9, 11), torch.bfloat16, gen),
        torch.zeros((), dtype=torch.int64) - 3,  # a negative 8-byte word: read unsigned
        torch.rand((13,), generator=gen) > 0.5,  # bool: one byte per element
        random_bits((0,), torch.float32, gen),
        random_bits((5,), torch.float64, gen),
    ]
    offsets, at = [], start
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    fused_layouts = set(fk.FUSED_STATE.layouts)
    plan = FingerprintPlan(tensors, start=start)
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    assert plan._ordered is not None  # the compiled table, not a fallback
    assert plan._layout in fp_plan._KERNELS.layouts
    assert fk.FUSED_STATE.layouts == fused_layouts  # and not the fused kernel
    tensors[0][fk.PLAN_EAGER_MAX] += 1.0
    tensors[2] += 5
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    fk.set_kernel(Kernel.EAGER)
    assert torch.equal(plan(), fingerprint_on_device(tensors, start=start))


def _large_list(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        random_bits((fk.FUSED_MIN_ELEMENTS + 3,), torch.float32, gen),
        random_bits((7, 5), torch.bfloat16, gen),
    ]


@pytest.mark.parametrize("capability", ["AVX512", "SVE256"])
def test_a_large_cpu_plan_keeps_the_fused_kernel_where_vectors_multiply_64_bit_lanes(
    torch_kernels_only: None, monkeypatch: pytest.MonkeyPatch, capability: str
) -> None:
    """Where the vector unit multiplies 64-bit lanes natively, recomputing splitmix64 per word
    outruns reading an 8-byte multiplier: the plan holds no table and compiles none, its list
    runs on the fused kernel (its layout admitted there), and the bits are the definition's,
    following in-place updates."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(fp_plan, "_KERNELS", fp_plan._TableKernels())
    # the process's budget of fused layouts, whatever earlier tests in it compiled
    monkeypatch.setattr(fk.FUSED_STATE, "layouts", set())
    monkeypatch.setattr(fk.FUSED_STATE, "refused", set())
    fk.set_kernel(Kernel.AUTO)
    tensors = _large_list(29)
    offsets = [0, tensors[0].numel()]
    plan = FingerprintPlan(tensors)
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    assert plan._ordered is None  # no compiled table
    assert plan._words is None  # and no eager one
    assert fk.layout_of(tensors) in fk.FUSED_STATE.layouts  # the fused kernel's
    assert not fp_plan._KERNELS.layouts  # nothing compiled for a table
    tensors[0][5] += 1.0
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)


def test_with_the_fused_kernel_full_an_avx512_plan_takes_the_compiled_table(
    torch_kernels_only: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused kernel compiles at most ``_MAX_FUSED_LAYOUTS`` layouts a process; a plan that
    finds no room there keeps the compiled table rather than the slow chunked eager kernel."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(fp_plan, "_KERNELS", fp_plan._TableKernels())
    taken = {("another layout", i) for i in range(fk.MAX_FUSED_LAYOUTS)}
    monkeypatch.setattr(fk.FUSED_STATE, "layouts", taken)
    monkeypatch.setattr(fk.FUSED_STATE, "refused", set())
    fk.set_kernel(Kernel.AUTO)
    tensors = _large_list(30)
    plan = FingerprintPlan(tensors)
    assert fingerprint_from_tensor(plan()) == reference(tensors, [0, tensors[0].numel()])
    assert plan._ordered is not None  # the compiled table
    assert fk.layout_of(tensors) not in fk.FUSED_STATE.layouts


def test_an_avx512_plan_whose_fused_kernel_fails_to_compile_takes_the_eager_table(
    torch_kernels_only: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No C++ compiler on an AVX-512 host, under ``auto``: the fused kernel's first call logs
    a warning and still answers (eager), and from then on the plan reads its own eager table
    (one widening and one product a call) rather than the chunked kernel; the same bits."""

    def broken(*args: object, **kwargs: object) -> object:
        def call(*a: object, **k: object) -> torch.Tensor:
            raise RuntimeError("no C++ compiler")

        return call

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fk.FUSED_STATE, "layouts", set())
    monkeypatch.setattr(fk.FUSED_STATE, "failed", set())
    monkeypatch.setattr(fk.FUSED_STATE, "refused", set())
    monkeypatch.setattr(fk.FUSED_STATE, "_compiled", {})  # no kernel compiled before this test
    fk.set_kernel(Kernel.AUTO)
    tensors = _large_list(31)
    offsets = [0, tensors[0].numel()]
    plan = FingerprintPlan(tensors)
    with caplog.at_level("WARNING", logger="detection.weights.fingerprint"):
        first = plan()
    assert any("torch.compile failed" in r.getMessage() for r in caplog.records)
    assert fingerprint_from_tensor(first) == reference(tensors, offsets)
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    assert plan._words is not None  # the eager table now
    tensors[0][2] += 1.0
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)


@pytest.mark.parametrize(("kernel", "raises"), [(Kernel.AUTO, False), (Kernel.FUSED, True)])
def test_a_compiled_table_that_fails_to_compile_falls_back_or_raises(
    torch_kernels_only: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kernel: Kernel,
    raises: bool,
) -> None:
    """A compiler that fails (no C++ toolchain on the host) on a CPU where the plan compiles a
    table (AVX2): under ``auto`` the plan logs a warning and takes the eager table with the same
    result; under ``fused``, where the user asked for the compiled kernel, it raises
    :class:`FusedKernelUnavailable`."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")

    def broken(*args: object, **kwargs: object) -> object:
        def call(*a: object, **k: object) -> torch.Tensor:
            raise RuntimeError("no C++ compiler")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fp_plan, "_KERNELS", fp_plan._TableKernels())
    gen = torch.Generator().manual_seed(28)
    big = random_bits((fk.FUSED_MIN_ELEMENTS + 1,), torch.float32, gen)
    tensors = [big, random_bits((3,), torch.bfloat16, gen)]
    fk.set_kernel(kernel)
    plan = FingerprintPlan(tensors)
    if raises:
        with pytest.raises(fk.FusedKernelUnavailable, match="no C\\+\\+ compiler"):
            plan()
        return
    with caplog.at_level("WARNING", logger="detection.weights.fingerprint"):
        got = plan()
    assert any("torch.compile failed" in r.getMessage() for r in caplog.records)
    assert plan._ordered is None  # the eager table now
    assert plan._words is not None
    fk.set_kernel(Kernel.EAGER)
    assert torch.equal(got, fingerprint_on_device(tensors))
    assert fp_plan._KERNELS.failed  # the layout is not tried again


@pytest.mark.parametrize(
    ("capability", "scalar"),
    [("AVX2", True), ("DEFAULT", True), ("AVX512", False), ("SVE256", False)],
)
def test_cpu_kernels_compile_scalar_code_where_vectors_lack_a_64_bit_multiply(
    monkeypatch: pytest.MonkeyPatch, capability: str, scalar: bool
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    options = fk.cpu_compile_options()
    assert options["cpp_wrapper"] is True
    assert (options.get("cpp.simdlen") == 1) is scalar

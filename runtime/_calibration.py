"""Calibration: time every admissible variant at sample sizes on the real device.

Nearest-hint in log2 space is a guess; the table this measures replaces it with what
the device did (``Dispatcher`` reads it). Inputs are synthesized from the manifest's
input specs (templates, such as the weights a backend was given, are reused where their
shape fits) and rotated through several sets, so repeated calls do not read warm caches.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._dtypes import dtype_of
from ._errors import InvalidOptionError
from ._expressions import compile_function
from ._manifest import Calibration, CalibrationEntry, Manifest, TensorInput

# A timer gets a zero-argument call (plus the variant index and the sample point it runs,
# for timers that log or fake) and returns its median seconds per call.
Timer = Callable[[Callable[[], Any], int, tuple[int, ...]], float]
SizesSpec = Sequence[int] | Sequence[Sequence[int]] | Sequence[Mapping[str, int]]


def normalize_sizes(
    manifest: Manifest, sizes: SizesSpec, what: str = "calibrate size"
) -> list[tuple[int, ...]]:
    """Sample points as tuples in symbol order, from ints (one symbol), tuples or dicts."""
    names = manifest.symbol_names
    if not names:
        raise InvalidOptionError(f"{what}s need a graph with dynamic sizes; this one has none")
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise InvalidOptionError(f"{what}s must be a non-empty list, got {sizes!r}")
    points = []
    for item in sizes:
        if isinstance(item, int) and not isinstance(item, bool):
            if len(names) != 1:
                raise InvalidOptionError(
                    f"{what} {item} is one int, but the graph has symbols {names}: "
                    "give a dict or a tuple per sample"
                )
            point: tuple[Any, ...] = (item,)
        elif isinstance(item, Mapping):
            if sorted(item) != sorted(names):
                raise InvalidOptionError(f"{what} {item!r} must name exactly {names}")
            point = tuple(item[n] for n in names)
        elif isinstance(item, Sequence) and len(item) == len(names):
            point = tuple(item)
        else:
            raise InvalidOptionError(f"{what} {item!r} does not match symbols {names}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in point):
            raise InvalidOptionError(f"{what} {item!r} must be non-negative ints")
        points.append(point)
    return list(dict.fromkeys(points))


def synthesize_inputs(
    manifest: Manifest, point: Sequence[int], templates: Sequence[Any] | None
) -> list[Any]:
    """Inputs for the graph at ``point``: templates reused where they fit, else random.
    A template the graph writes in place is copied: a warm-up or timing run never writes
    the caller's tensor (a model's counter buffer, a KV cache held in its buffers). The
    random values come from generators of its own: the caller's random state is never
    advanced (and a CUDA graph being captured in another thread, which registers the
    default generator, never sees an increment from here)."""
    values = dict(zip(manifest.symbol_names, point, strict=True))
    generators: dict[torch.device, torch.Generator] = {}
    args: list[Any] = []
    for index, spec in enumerate(manifest.inputs):
        template = templates[index] if templates is not None else None
        if not isinstance(spec, TensorInput):
            value = spec.value
            args.append(value if isinstance(value, int) else int(eval_size(value, values)))
            continue
        shape = [d if isinstance(d, int) else int(eval_size(d, values)) for d in spec.shape]
        if isinstance(template, torch.Tensor) and list(template.shape) == shape:
            args.append(template if spec.mutation == "none" else _copy_of(template))
            continue
        dtype = dtype_of(spec.dtype)
        device = torch.device(spec.device)
        if dtype.is_floating_point or dtype.is_complex:
            generator = generators.get(device)
            if generator is None:
                generator = generators[device] = torch.Generator(device=device)
                generator.manual_seed(0)
            args.append(torch.randn(shape, dtype=dtype, device=device, generator=generator))
        else:
            args.append(torch.zeros(shape, dtype=dtype, device=device))
    return args


def _copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same sizes, strides and storage offset (the compiled code may
    rely on them)."""
    offset = tensor.storage_offset()
    extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    with torch.no_grad():
        storage = torch.empty(offset + extent * (tensor.numel() > 0), dtype=tensor.dtype,
                              device=tensor.device)  # fmt: skip
        return storage.as_strided(tensor.size(), tensor.stride(), offset).copy_(tensor)


def eval_size(expression: str, values: Mapping[str, int]) -> int:
    names = sorted(values)
    function = compile_function((expression,), names, name="size")
    return int(function(*(values[n] for n in names))[0])


def default_timer(device: str, warmup: int, reps: int) -> tuple[Timer, str]:
    """Median seconds per call: CUDA events with L2 flushed between calls, or wall time."""
    if device.startswith("cuda"):
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            # The measure the benchmarks use: L2 flushed before each run, device events.
            def bench_timer(call: Callable[[], Any], variant: int, point: tuple[int, ...]) -> float:
                ms = do_bench(call, warmup=warmup, rep=reps, return_mode="median")
                return float(ms) / 1e3

            return bench_timer, f"triton.testing.do_bench median ({warmup} ms warm-up, {reps} ms)"
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)

        def cuda_timer(call: Callable[[], Any], variant: int, point: tuple[int, ...]) -> float:
            for _ in range(warmup):
                call()
            samples = []
            for _ in range(reps):
                flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            return float(statistics.median(samples))

        method = f"cuda events, median of {reps} after {warmup} warm-up, 256 MB L2 flush"
        return cuda_timer, method

    def wall_timer(call: Callable[[], Any], variant: int, point: tuple[int, ...]) -> float:
        for _ in range(warmup):
            call()
        samples = []
        for _ in range(reps):
            began = time.perf_counter()
            call()
            samples.append(time.perf_counter() - began)
        return float(statistics.median(samples))

    return wall_timer, f"wall clock, median of {reps} after {warmup} warm-up"


def _rotating(function: Callable[..., Any], pool: Sequence[Sequence[Any]]) -> Callable[[], Any]:
    """A zero-argument call of ``function`` that takes the next input set each time."""
    position = [0]

    def call() -> Any:
        position[0] = (position[0] + 1) % len(pool)
        return function(*pool[position[0]])

    return call


def measure(
    manifest: Manifest,
    points: Sequence[tuple[int, ...]],
    variant_callable: Callable[[int], Callable[..., Any]],
    admissible: Callable[[int, Sequence[int]], bool],
    *,
    timer: Timer,
    device_name: str,
    method: str,
    templates: Sequence[Any] | None = None,
    rotate: int = 4,
    rounds: int = 3,
    min_gain: float = 0.0,
) -> Calibration:
    """Time each admissible variant at each point; inputs rotate through ``rotate`` sets.

    A whole timing window can run slow on a GPU (seen on an H200: 5-30% and up to 2x, in
    any variant, for a second or more), which flips a comparison. So a round times every
    point once, the variants take turns, and each entry keeps its median over ``rounds``
    rounds: one entry's timings lie a whole round apart, and a slow stretch spoils one.
    """
    if not (isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1):
        raise InvalidOptionError(f"calibrate rounds must be an int >= 1, got {rounds!r}")
    if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not min_gain >= 0:
        raise InvalidOptionError(f"calibrate min_gain must be a number >= 0, got {min_gain!r}")
    functions: dict[int, Callable[..., Any]] = {}
    order: dict[tuple[int, ...], list[int]] = {}
    for point in points:
        order[point] = [v.index for v in manifest.variants if admissible(v.index, point)]
        for index in order[point]:
            if index not in functions:
                functions[index] = variant_callable(index)
    samples: dict[tuple[int, ...], dict[int, list[float]]] = {p: {} for p in order}
    for round_index in range(rounds):
        for point, indices in order.items():
            if not indices:
                continue
            # fresh inputs per round: holding every point's pool would cost their sum
            pool = [synthesize_inputs(manifest, point, templates) for _ in range(max(1, rotate))]
            start = round_index % len(indices)
            for index in indices[start:] + indices[:start]:
                with torch.no_grad():
                    seconds = timer(_rotating(functions[index], pool), index, tuple(point))
                if not (seconds > 0 and math.isfinite(seconds)):
                    raise InvalidOptionError(
                        f"the timer returned {seconds!r} seconds; expected > 0"
                    )
                samples[point].setdefault(index, []).append(seconds)
    entries = [
        CalibrationEntry(point, {i: float(statistics.median(s)) for i, s in times.items()})
        for point, times in samples.items()
        if times
    ]
    return Calibration(device_name, method, tuple(entries), min_gain=float(min_gain))
